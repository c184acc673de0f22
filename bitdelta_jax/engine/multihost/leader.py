"""Multi-process serving: process 0 schedules, every process runs the same runner calls.

    # process 0 (the device thread of `bitdelta_jax.engine.engine.Engine`, HTTP in front of it)
    gen.runner = LeaderRunner(gen.runner, sender, timeout_s=cfg.step_timeout_s)
    # processes 1..N-1 (no HTTP)
    run_follower(cfg)

JAX's multi-controller runtime needs every process to dispatch the same computations over the
global mesh in the same order. The one engine is split at that line: the scheduler
(`bitdelta_jax.engine.generator.Generator`) runs on process 0 only and hands its runner one
call at a time (a step over a `PagedBatch`, a page copy, a slot write or clear). On process 0
that runner is a `LeaderRunner`: it encodes each call as compact bytes
(`bitdelta_jax.engine.multihost.codec`), sends them to every follower over TCP
(`bitdelta_jax.engine.multihost.channel`), and then makes the call itself; each follower decodes the plan and
makes the same call on its own `PagedRunner`. So n choices, log probabilities, echo, penalties,
bias, grammar masks, prefix caching and preemption all work across processes: they are host
decisions that end up as arrays of the batch. Process 0 reads sampled tokens from its own shard
of the replicated outputs (no extra collective).

Start-up: process 0 opens the plan listener on an ephemeral port and hands its port, a random
token and the model options it derived from the variant manifests to every process through one
collective (`bitdelta_jax.engine.multihost.runtime.broadcast_json`); the followers connect with the token.

A lost worker: every call (send + execution, waiting for its results) runs under a timeout on
process 0. A timeout or a runtime error (gloo reports a closed peer connection within
milliseconds, the socket a reset) raises `WorkerLost`; the runner is then *lost* for good:
later calls fail at once with the same message, the engine fails in-flight requests with it,
the HTTP front answers 503 and /health says ``degraded``. (A thread stuck in a collective
cannot be cancelled; it is a daemon.) An idle engine sends a ``ping`` plan every few seconds,
so a worker that dies while nothing runs is noticed then. `serving.cli.run_server` turns on
``jax_enable_recoverability`` so that the coordination service does not terminate process 0
when a worker stops sending heartbeats. A call of a shape not run before compiles, so it gets
``first_call_timeout_s`` (at least 300 s) instead of the step timeout.

Variants: followers read the same delta directories (a filesystem shared by all hosts, or
identical copies at the same paths). Every process loads a variant with
`bitdelta_jax.sharding.load_variant_sharded` from the directory, each reading only its own
devices' slices; process 0's host tier then holds a `VariantRef`, not the delta's arrays.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bitdelta_jax.engine.multihost import codec as step_plan
from bitdelta_jax.engine.multihost.runtime import WorkerLost

log = logging.getLogger("bitdelta_jax.engine.multihost.leader")


@dataclasses.dataclass(frozen=True)
class VariantRef:
  """A variant by path, what process 0's delta cache holds in multi-process mode (every
  process reads the slices it needs from ``path``). ``values()`` is empty so the host tier
  counts it as 0 bytes."""

  path: str
  adapter: bool = False

  def values(self) -> tuple:
    return ()


def resolve(ref: VariantRef):
  """What a runner's ``load_variant`` takes for ``ref``: LoRA factors (small: each process
  reads the adapter whole) or the delta directory (read shard by shard)."""
  from bitdelta_jax.delta.variant import VariantDir

  # the kind came with the plan: a delta's directory is not read here (the sharded load does)
  return VariantDir.known(ref.path, "lora" if ref.adapter else "delta").slot_payload(
    by_shards=True)


def apply(runner, op: str, fields: dict) -> None:
  """Makes the runner call that plan ``(op, fields)`` describes (a follower's side)."""
  if op == "run":
    batch, base_only = step_plan.batch_of(fields)
    runner.run(batch, base_only)
  elif op == "copy":
    runner.copy_pages(fields["src"], fields["dst"])
  elif op == "load":
    runner.load_variant(int(fields["slot"]),
                        resolve(VariantRef(str(fields["path"]), bool(fields["adapter"]))))
  elif op == "clear":
    runner.clear_slot(int(fields["slot"]))
  elif op == "refresh":
    runner.refresh()
  elif op == "compile":
    runner.compile_all(tuple(bool(f) for f in fields["forms"]), threads=int(fields["threads"]))
  elif op == "ping":  # the send itself was the check
    pass
  else:
    raise step_plan.PlanError(f"unknown plan op {op!r}")


def _is_runtime_error(e: BaseException) -> bool:
  """A failure of the distributed runtime (not a deterministic error in the op itself)."""
  try:
    from jax.errors import JaxRuntimeError
  except ImportError:  # older jax
    from jax.lib.xla_client import XlaRuntimeError as JaxRuntimeError  # type: ignore
  return isinstance(e, JaxRuntimeError | OSError | ConnectionError)


COMPILE_TIMEOUT_S = 1800.0  # the warm-up's compile of every program (CPU processes: minutes)


class LeaderRunner:
  """Process 0's runner: every call is sent to the followers as a plan, then made here."""

  def __init__(self, runner, send: Callable[[bytes], None], *, timeout_s: float,
               first_call_timeout_s: float | None = None):
    self.runner = runner
    self._send = send
    self.timeout_s = timeout_s
    # a call of a new shape compiles: allow it longer
    self.first_call_timeout_s = max(timeout_s, first_call_timeout_s or 300.0)
    self._seen: set = set()
    self.lost: str | None = None
    self.plans = 0
    self.plan_bytes = 0
    self.send_s = 0.0  # time spent encoding and sending plans

  def __getattr__(self, name):  # mesh, model, kv_bytes, compiles, fetch, neutral, ...
    return getattr(self.runner, name)

  # -- the runner's calls --------------------------------------------------------------------
  def run(self, batch, base_only: bool):
    import jax

    fields = step_plan.batch_fields(batch, base_only)
    # what selects a compiled program: every array's shape, and base_only's value
    kind = ("run",) + tuple((k, getattr(v, "shape", v)) for k, v in fields.items())
    return self._call("run", fields, lambda: jax.block_until_ready(
      self.runner.run(batch, base_only)), kind)

  def compile_all(self, forms=(False,), threads: int = 2, progress=None) -> float:
    """Every process compiles the same programs ahead of time (no collective runs)."""
    fields = {"forms": np.asarray(forms, bool), "threads": np.int32(threads)}
    return self._call("compile", fields, lambda: self.runner.compile_all(
      forms, threads=threads, progress=progress), ("compile",),
      timeout_s=max(self.first_call_timeout_s, COMPILE_TIMEOUT_S))

  @property
  def guard(self) -> bool:
    return self.runner.guard

  @guard.setter
  def guard(self, on: bool) -> None:
    self.runner.guard = on

  def copy_pages(self, src, dst) -> None:
    import jax

    def go():
      self.runner.copy_pages(src, dst)
      jax.block_until_ready(self.runner.k_pool)

    self._call("copy", {"src": src, "dst": dst}, go, ("copy", len(src)))

  def load_variant(self, slot: int, delta) -> None:
    if not isinstance(delta, VariantRef):
      raise TypeError("multi-process serving loads variants by path (a VariantRef)")
    self._call("load", {"slot": int(slot), "path": delta.path, "adapter": int(delta.adapter)},
               lambda: self.runner.load_variant(slot, resolve(delta)), ("load", delta.adapter))

  def clear_slot(self, slot: int) -> None:
    self._call("clear", {"slot": int(slot)}, lambda: self.runner.clear_slot(slot), ("clear",))

  def refresh(self) -> None:
    self._call("refresh", {}, self.runner.refresh, ("refresh",))

  def ping(self) -> None:
    """An empty plan: a dead worker shows up while the server is idle, not at the next
    request (the engine sends one every `Engine.IDLE_PING_S` when idle)."""
    self._call("ping", {}, lambda: None, ("ping",))

  def close(self) -> None:
    """Tells the followers to exit (skipped when a worker is already lost)."""
    if self.lost is not None:
      return
    t = threading.Thread(target=self._send, args=(step_plan.encode("stop"),), daemon=True)
    t.start()
    t.join(min(self.timeout_s, 30.0))

  # -- one plan --------------------------------------------------------------------------------
  def _call(self, op: str, fields: dict, fn: Callable[[], Any], kind: tuple,
            timeout_s: float | None = None) -> Any:
    """Sends the plan and runs ``fn`` here; `WorkerLost` on a timeout or runtime error."""
    if self.lost is not None:
      raise WorkerLost(self.lost)
    t0 = time.perf_counter()
    data = step_plan.encode(op, fields)
    timeout = timeout_s or (self.timeout_s if kind in self._seen else self.first_call_timeout_s)
    out: dict = {}

    def target():
      try:
        self._send(data)
        out["sent"] = time.perf_counter()
        out["value"] = fn()
      except BaseException as e:  # noqa: BLE001  re-raised on the calling thread
        out["error"] = e

    t = threading.Thread(target=target, name=f"bitdelta-plan-{op}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
      return self._lose(f"{op} did not finish within {timeout:g} s")
    self.plans += 1
    self.plan_bytes += len(data)
    if "sent" in out:
      self.send_s += out["sent"] - t0
    self._seen.add(kind)
    err = out.get("error")
    if err is None:
      return out["value"]
    if "sent" not in out or _is_runtime_error(err):
      return self._lose(f"{op} failed: {type(err).__name__}: {err}", err)
    raise err  # deterministic (e.g. a bad delta): the followers raised it too and carry on

  def _lose(self, why: str, cause: BaseException | None = None):
    self.lost = f"a worker process was lost ({why}); restart all server processes"
    log.error("%s", self.lost)
    raise WorkerLost(self.lost) from cause


# -- start-up ---------------------------------------------------------------------------------
def lead(cfg, build: dict, *, accept_timeout_s: float = 120.0):
  """Process 0: hands ``build`` (the model options) and the plan channel to every process and
  waits for the followers to connect; returns the `PlanSender`. Call it before any
  computation on the mesh (where the followers start `run_follower`)."""
  from bitdelta_jax.engine.multihost.channel import PlanSender
  from bitdelta_jax.engine.multihost.runtime import barrier, broadcast_json

  sender = PlanSender(cfg.num_processes - 1)
  barrier("joined")  # the broadcast is a collective: every peer must be there for it
  broadcast_json({"build": build, "port": sender.port, "token": sender.token.hex()},
                 max_bytes=1 << 14)
  sender.accept(accept_timeout_s)
  return sender


def run_follower(cfg) -> int:
  """The loop of a process other than 0 (``cfg``: its `EngineConfig`): receive plans, make
  their calls; an exit code.

  Call after `bitdelta_jax.engine.multihost.runtime.initialize`. Returns 0 on ``stop``, 1 when the channel
  to process 0 fails (process 0 died: there is nobody left to serve).
  """
  from bitdelta_jax.engine.build import build_generator
  from bitdelta_jax.engine.multihost.channel import PlanReceiver
  from bitdelta_jax.engine.multihost.runtime import barrier, broadcast_json
  from bitdelta_jax.models.banks import Banks

  barrier("joined")
  try:
    hello = broadcast_json(None, max_bytes=1 << 14)
    host = cfg.coordinator.rsplit(":", 1)[0]
    receiver = PlanReceiver(host, int(hello["port"]), bytes.fromhex(hello["token"]),
                            cfg.process_id, timeout_s=120.0)
  except Exception as e:  # noqa: BLE001
    log.error("follower %d: no plan channel from process 0: %s", cfg.process_id, e)
    return 1
  runner = build_generator(cfg, Banks(**hello["build"])).runner
  log.info("follower %d: model built; following process 0", cfg.process_id)
  plans = 0
  while True:
    try:
      op, fields = step_plan.decode(receiver.recv())
    except (OSError, ConnectionError, step_plan.PlanError) as e:
      log.error("follower %d: lost process 0: %s", cfg.process_id, e)
      return 1
    if op == "stop":
      log.info("follower %d: stop after %d plans", cfg.process_id, plans)
      return 0
    plans += 1
    try:
      apply(runner, op, fields)
    except Exception as e:  # noqa: BLE001
      if _is_runtime_error(e):
        log.error("follower %d: %s failed: %s", cfg.process_id, op, e)
        return 1
      log.warning("follower %d: %s failed (as on process 0): %s", cfg.process_id, op, e)


def build_options(engine) -> dict:
  """The banks process 0 derived from the manifests (`Banks`), for `build_generator`."""
  return engine.banks.model_kwargs()
