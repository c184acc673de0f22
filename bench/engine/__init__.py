"""The serving engine: start-up and compiles, decode steps, plans, liveness, long outputs, memory."""
