"""Multi-process (multi-host) JAX: initialisation from CLI options, a start-up broadcast.

JAX's multi-controller runtime is the distributed engine: every process runs the same
jitted steps over one global mesh (`bitdelta_jax.sharding.make_mesh` sees all processes'
devices after `initialize`), and XLA's collectives move the data. This module only adds:

* `add_arguments` / `DistributedConfig.from_args`: ``--coordinator HOST:PORT
  --num-processes N --process-id I`` (and ``--mesh``), for ``bitdelta serve`` / ``demo``.
* `initialize`: ``jax.distributed.initialize`` with bounded timeouts; on CPU it selects the
  gloo collectives (needed for cross-process computations on CPU devices).
* `start_watchdog` / `barrier`: a start-up that tolerates stragglers. Hosts reach their first
  collective minutes apart (warm and cold step caches, slow disks) while gloo gives a peer 30 s
  to create a communicator, so every process meets the others at a barrier of the coordination
  service (no collective) after joining, after building the model and after compiling, before
  anything runs on the mesh. A process that has not passed the last of them within
  ``start_timeout_s`` prints one line naming the stage it waited in and exits 1 (the native
  timeouts are set past it, so no runtime check failure gets there first).
* `broadcast_json`: one JSON value from process 0 to every process, through a collective
  (the server hands out its plan channel with it at start-up, `bitdelta_jax.engine.multihost.leader.lead`).
* `WorkerLost`: what process 0 raises when a step fails or does not finish in time (the
  watchdog is `bitdelta_jax.engine.multihost.leader.LeaderRunner`), so requests fail with a clear error instead
  of hanging when a worker dies.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import threading
import time

import numpy as np


class WorkerLost(RuntimeError):
  """A distributed step failed or timed out: a worker process is likely dead or hung."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator: str | None = None
  num_processes: int = 1
  process_id: int = 0
  mesh: str | None = None
  heartbeat_timeout_s: int = 60
  step_timeout_s: float = 120.0
  # every process must have joined, built its model and compiled its steps within this long
  start_timeout_s: float = 600.0

  def __post_init__(self):
    if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
      raise ValueError(
        f"process id {self.process_id} must be in [0, {self.num_processes}) (--num-processes)"
      )
    if self.num_processes > 1 and not self.coordinator:
      raise ValueError("--num-processes > 1 needs --coordinator HOST:PORT")
    if not self.start_timeout_s > 0:
      raise ValueError(f"--start-timeout must be > 0, got {self.start_timeout_s}")

  @property
  def native_timeout_s(self) -> int:
    """The runtime's own join / barrier timeouts: past the start-up watchdog's, so that a
    missing peer is this module's one-line error, not the runtime's check failure."""
    return int(self.start_timeout_s) + 60

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  @classmethod
  def from_args(cls, args: argparse.Namespace) -> DistributedConfig:
    return cls(
      coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
      mesh=getattr(args, "mesh", None), step_timeout_s=args.step_timeout,
      start_timeout_s=getattr(args, "start_timeout", None) or 600.0,
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
  g.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                 help="seconds every process has to join, build its model and compile its "
                      "steps; a process still waiting for the others then exits with one line "
                      "naming the stage (600)")
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
  start_watchdog(cfg.start_timeout_s, cfg.process_id)
  _watchdog.stage = f"joining the {cfg.num_processes} processes at {cfg.coordinator}"
  global _barrier_timeout_ms
  _barrier_timeout_ms = 1000 * cfg.native_timeout_s
  jax.distributed.initialize(
    coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
    process_id=cfg.process_id, initialization_timeout=cfg.native_timeout_s,
    heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
  )
  return True


# -- start-up: a watchdog and barriers ---------------------------------------------------------
class _Watchdog:
  """Exits the process (1, one line on stderr) unless `disarm` comes within ``timeout_s``."""

  def __init__(self, timeout_s: float, process_id: int):
    self.timeout_s, self.process_id = timeout_s, process_id
    self.stage = "starting"
    self._done = threading.Event()
    threading.Thread(target=self._watch, name="start-watchdog", daemon=True).start()

  def _watch(self) -> None:
    if self._done.wait(self.timeout_s):
      return
    print(f"error: process {self.process_id}: start-up did not finish within "
          f"{self.timeout_s:g} s (--start-timeout); this process was {self.stage}. Start every "
          "process with the same --coordinator and --num-processes, or allow longer with "
          "--start-timeout", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)

  def disarm(self) -> None:
    self._done.set()


_watchdog: _Watchdog | None = None
_barrier_ids = itertools.count()
_barrier_timeout_ms = 660_000


def start_watchdog(timeout_s: float, process_id: int) -> None:
  """Arms the start-up watchdog (once per process; `barrier` with ``last`` disarms it)."""
  global _watchdog
  if _watchdog is None:
    _watchdog = _Watchdog(timeout_s, process_id)


def barrier(what: str, *, last: bool = False) -> None:
  """Waits until every process has reached the barrier of the same ordinal (``what`` names it
  in errors and logs); no collective runs, so a peer may arrive minutes later. Every process
  must call the same barriers in the same order. ``last``: start-up is over (the watchdog is
  disarmed once everyone is here)."""
  import jax
  from jax._src import distributed  # the coordination-service client jax.distributed holds

  if jax.process_count() == 1:
    return
  if _watchdog is not None:
    _watchdog.stage = f"waiting for the others to have {what}"
  t = time.monotonic()
  distributed.global_state.client.wait_at_barrier(f"bitdelta/{next(_barrier_ids)}",
                                                  _barrier_timeout_ms)
  waited = time.monotonic() - t
  if waited > 1.0:
    import logging

    logging.getLogger(__name__).info("waited %.1f s for every process to have %s", waited, what)
  if last and _watchdog is not None:
    _watchdog.disarm()


def fault_delay(stage: str) -> None:
  """Sleeps ``$BITDELTA_FAULT_START_DELAY_S`` seconds when ``$BITDELTA_FAULT_STAGE`` is
  ``stage``: how the tests make one process a straggler."""
  from pallas_kernels import settings

  if settings.get("BITDELTA_FAULT_STAGE") == stage:
    time.sleep(settings.get("BITDELTA_FAULT_START_DELAY_S"))


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
