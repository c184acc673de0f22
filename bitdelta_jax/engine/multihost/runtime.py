"""Multi-process (multi-host) JAX: initialisation from CLI options, a start-up broadcast.

JAX's multi-controller runtime is the distributed engine: every process runs the same
jitted steps over one global mesh (`bitdelta_jax.sharding.make_mesh` sees all processes'
devices after `initialize`), and XLA's collectives move the data. This module only adds:

* `add_arguments` / `DistributedConfig.from_args`: ``--coordinator HOST:PORT
  --num-processes N --process-id I`` (and ``--mesh``), for ``bitdelta serve`` / ``demo``.
* `initialize`: ``jax.distributed.initialize`` with bounded timeouts; on CPU it selects the
  gloo collectives (needed for cross-process computations on CPU devices).
* `broadcast_json`: one JSON value from process 0 to every process, through a collective
  (the server hands out its plan channel with it at start-up, `bitdelta_jax.engine.multihost.leader.lead`).
* `WorkerLost`: what process 0 raises when a step fails or does not finish in time (the
  watchdog is `bitdelta_jax.engine.multihost.leader.LeaderRunner`), so requests fail with a clear error instead
  of hanging when a worker dies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np


class WorkerLost(RuntimeError):
  """A distributed step failed or timed out: a worker process is likely dead or hung."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator: str | None = None
  num_processes: int = 1
  process_id: int = 0
  mesh: str | None = None
  init_timeout_s: int = 120
  heartbeat_timeout_s: int = 60
  step_timeout_s: float = 120.0

  def __post_init__(self):
    if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
      raise ValueError(
        f"process id {self.process_id} must be in [0, {self.num_processes}) (--num-processes)"
      )
    if self.num_processes > 1 and not self.coordinator:
      raise ValueError("--num-processes > 1 needs --coordinator HOST:PORT")

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  @classmethod
  def from_args(cls, args: argparse.Namespace) -> DistributedConfig:
    return cls(
      coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
      mesh=getattr(args, "mesh", None), step_timeout_s=args.step_timeout,
    )


def add_arguments(parser: argparse.ArgumentParser, *, mesh: bool = True) -> None:
  """Adds ``--coordinator``, ``--num-processes``, ``--process-id``, ``--step-timeout`` (and
  ``--mesh``) to a CLI parser."""
  g = parser.add_argument_group("distributed")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="HOST:PORT of process 0's jax.distributed coordinator (needed when N > 1)")
  g.add_argument("--num-processes", type=int, default=1, metavar="N",
                 help="how many processes (hosts) share one global device mesh (1)")
  g.add_argument("--process-id", type=int, default=0, metavar="I",
                 help="this process's index in [0, N); 0 runs the HTTP front, the others follow "
                      "its step plans (0)")
  g.add_argument("--step-timeout", type=float, default=120.0,
                 help="seconds before a distributed step is declared lost (worker death)")
  if mesh:
    g.add_argument("--mesh", default=None, help="device mesh, e.g. data=2,model=4 (default: "
                   "all devices on model)")


def initialize(cfg: DistributedConfig) -> bool:
  """Starts the multi-controller runtime; False (nothing done) for a single process.

  Must run before anything touches a JAX backend.
  """
  if not cfg.multi_process:
    return False
  import jax

  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except Exception:  # noqa: BLE001 - an older jax without the option: GPU/TPU still work
    pass
  jax.distributed.initialize(
    coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
    process_id=cfg.process_id, initialization_timeout=cfg.init_timeout_s,
    heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
  )
  return True


def broadcast_json(obj=None, *, max_bytes: int = 1 << 16):
  """Process 0's ``obj`` on every process (others pass anything; it is ignored)."""
  import jax
  from jax.experimental import multihost_utils

  buf = np.zeros(max_bytes + 4, np.uint8)
  if jax.process_index() == 0:
    raw = json.dumps(obj).encode()
    if len(raw) > max_bytes:
      raise ValueError(f"plan of {len(raw)} bytes exceeds max_bytes={max_bytes}")
    buf[:4] = np.frombuffer(np.uint32(len(raw)).tobytes(), np.uint8)
    buf[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  n = int(out[:4].view(np.uint32)[0])
  return json.loads(out[4:4 + n].tobytes().decode())
