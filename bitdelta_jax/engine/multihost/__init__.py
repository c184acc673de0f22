"""One engine over several processes: process 0 schedules and sends each runner call as a plan
(`codec`, over `channel`) before running it; every other process runs the same call
(`leader`: `LeaderRunner`, `run_follower`); `runtime` starts `jax.distributed` and names a lost
worker (`WorkerLost`)."""
