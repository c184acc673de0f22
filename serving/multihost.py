"""Multi-process serving: process 0 decides, every process runs the same jitted steps.

    # process 0 (the device thread of `serving.engine.Engine`, HTTP in front of it)
    gen = LeaderGenerator(replica, timeout_s=cfg.step_timeout_s, max_plan_bytes=...)
    # processes 1..N-1 (no HTTP)
    run_follower(cfg)

JAX's multi-controller runtime needs every process to dispatch the same computations over the
global mesh in the same order. The engine on process 0 drives its generator through
`LeaderGenerator`, which has the `Generator` step API (``init_state``, ``prefill``, ``insert``,
``step``, ``load_variant``, ``clear_slot``); each call becomes a *plan*, a small JSON object
(``{"op": "prefill", "prompt": [...], "slot": 2, "sampling": {...}}``, ``{"op": "step"}``,
``{"op": "load", "slot": 1, "path": ..., "adapter": false}``, ...), that
`bitdelta_jax.distributed.broadcast_json` hands to every process before all of them, process
0 included, execute it through the same `Replica`. The decode state and the last prefix live
in each process's `Replica`; the engine holds only handles, and reads sampled tokens from
replicated outputs (no extra collective). The first plan is ``{"op": "build", ...}`` (the
model options process 0 derived from the variant manifests), the last ``{"op": "stop"}``.

A lost worker: every plan (broadcast + execution) runs under a timeout on process 0. A
timeout or a runtime error (gloo reports a closed peer connection within milliseconds) raises
`WorkerLost`; the generator is then *lost* for good: later calls fail at once with the same
message, the engine fails in-flight requests with it, the HTTP front answers 503 and /health
says ``degraded``. (A thread stuck in a collective cannot be cancelled; it is a daemon.) An
idle engine sends an empty ``ping`` plan every few seconds, so a worker that dies while
nothing runs is noticed then. `serving.cli.run_server` turns on ``jax_enable_recoverability``
so that the coordination service does not terminate process 0 when a worker stops sending
heartbeats. The first call of each kind (per prefill bucket) compiles, so it gets
``first_call_timeout_s`` (at least 300 s) instead of the step timeout.

Variants: followers read the same delta directories (a filesystem shared by all hosts, or
identical copies at the same paths). Every process loads a variant with
`bitdelta_jax.sharding.load_variant_sharded` from the directory, each reading only its own
devices' slices; process 0's host tier then holds a `VariantRef`, not the delta's arrays.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bitdelta_jax.distributed import WorkerLost, broadcast_json

log = logging.getLogger("serving.multihost")

# SamplingParams fields that reach the device (stops are applied on process 0's host)
_DEVICE_SAMPLING = ("temperature", "top_p", "top_k", "seed")


def plan_bytes(max_seq_len: int) -> int:
  """Room for the largest plan: a prompt of ``max_seq_len`` token ids, or a delta path."""
  return 10 * max_seq_len + 8192


@dataclasses.dataclass(frozen=True)
class VariantRef:
  """A variant by path, what process 0's delta cache holds in multi-process mode (every
  process reads the slices it needs from ``path``). ``values()`` is empty so the host tier
  counts it as 0 bytes."""

  path: str
  adapter: bool = False

  def values(self) -> tuple:
    return ()


def load_ref(gen, slot: int, ref: VariantRef) -> None:
  """Writes the variant at ``ref.path`` into ``slot`` of a `ShardedGenerator`."""
  if ref.adapter:  # LoRA factors are small: each process reads the adapter whole
    from bitdelta_jax.merge.lora import load_adapter
    from bitdelta_jax.models.slots import lora_entries

    gen.load_variant(slot, lora_entries(load_adapter(ref.path)))
  else:
    gen.load_variant(slot, str(Path(ref.path)))


class Replica:
  """One process's copy of the engine's device-side state, advanced by plans."""

  def __init__(self, gen):
    self.gen = gen
    self.state = None
    self.prefix = None
    self.ops = 0

  def apply(self, plan: dict) -> Any:
    """Executes one plan; returns host values (sampled tokens) where the op has any."""
    from bitdelta_jax.models.sampling import SamplingParams

    gen, op = self.gen, plan["op"]
    self.ops += 1
    if op == "init":
      self.state = gen.init_state()
    elif op == "prefill":
      self.prefix = gen.prefill(plan["prompt"], plan["slot"], SamplingParams(**plan["sampling"]))
      return np.asarray(self.prefix.token)  # replicated: read from a local shard
    elif op == "insert":
      self.state = gen.insert(self.state, self.prefix, plan["row"])
    elif op == "step":
      self.state, toks = gen.step(self.state)
      return np.asarray(toks)
    elif op == "load":
      load_ref(gen, plan["slot"], VariantRef(plan["path"], plan["adapter"]))
    elif op == "clear":
      gen.clear_slot(plan["slot"])
    elif op == "ping":  # the broadcast itself was the check
      pass
    else:
      raise ValueError(f"unknown plan op {op!r}")
    return None


@dataclasses.dataclass(frozen=True)
class _Prefix:
  """What the engine sees of a prefill on process 0: the first sampled token (host)."""

  token: np.ndarray


def _is_runtime_error(e: BaseException) -> bool:
  """A failure of the distributed runtime (not a deterministic error in the op itself)."""
  try:
    from jax.errors import JaxRuntimeError
  except ImportError:  # older jax
    from jax.lib.xla_client import XlaRuntimeError as JaxRuntimeError  # type: ignore
  return isinstance(e, JaxRuntimeError | OSError | ConnectionError)


class LeaderGenerator:
  """Process 0's generator: the `Generator` step API, each call broadcast as a plan first."""

  def __init__(self, replica: Replica, *, timeout_s: float, max_plan_bytes: int,
               first_call_timeout_s: float | None = None, broadcast: Callable = broadcast_json):
    self.replica = replica
    self.timeout_s = timeout_s
    # the first call of each kind (per prefill bucket) compiles: allow it longer
    self.first_call_timeout_s = max(timeout_s, first_call_timeout_s or 300.0)
    self._seen: set = set()
    self._bucket: int | None = None  # of the last prefill (insert compiles per bucket)
    self.max_plan_bytes = max_plan_bytes
    self._broadcast = broadcast
    self.lost: str | None = None
    self.plans = 0

  def __getattr__(self, name):  # max_rows, buckets, model, bucket_for, ...
    return getattr(self.replica.gen, name)

  def run(self, plan: dict) -> Any:
    """Broadcasts ``plan`` and executes it here; `WorkerLost` on a timeout or runtime error."""
    if self.lost is not None:
      raise WorkerLost(self.lost)
    size = len(json.dumps(plan).encode())
    if size > self.max_plan_bytes:  # before any collective: the request fails, nothing else
      raise ValueError(f"plan of {size} bytes exceeds {self.max_plan_bytes} bytes")
    kind = (plan["op"], None)
    if plan["op"] == "prefill":
      kind = ("prefill", self.replica.gen.bucket_for(len(plan["prompt"])))
    elif plan["op"] == "insert":
      kind = ("insert", self._bucket)
    timeout = self.timeout_s if kind in self._seen else self.first_call_timeout_s
    out: dict = {}

    def target():
      try:
        self._broadcast(plan, max_bytes=self.max_plan_bytes)
        out["sent"] = True
        out["value"] = self.replica.apply(plan)
      except BaseException as e:  # noqa: BLE001  re-raised on the calling thread
        out["error"] = e

    t = threading.Thread(target=target, name=f"bitdelta-plan-{plan['op']}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
      return self._lose(f"{plan['op']} did not finish within {timeout:g} s")
    self.plans += 1
    self._seen.add(kind)
    if kind[0] == "prefill":
      self._bucket = kind[1]
    err = out.get("error")
    if err is None:
      return out["value"]
    if not out.get("sent") or _is_runtime_error(err):
      return self._lose(f"{plan['op']} failed: {type(err).__name__}: {err}", err)
    raise err  # deterministic (e.g. a bad slot): the followers raised it too and carry on

  def _lose(self, why: str, cause: BaseException | None = None):
    self.lost = f"a worker process was lost ({why}); restart all server processes"
    log.error("%s", self.lost)
    raise WorkerLost(self.lost) from cause

  # -- the Generator step API (what serving.engine.Engine calls) -----------------------------
  def init_state(self):
    self.run({"op": "init"})
    return self.replica  # a handle: the state lives in the replica

  def prefill(self, prompt, slot: int = 0, params=None) -> _Prefix:
    from bitdelta_jax.models.sampling import SamplingParams

    params = params or SamplingParams()
    gen = self.replica.gen
    gen.bucket_for(len(prompt))  # validate here, before any follower sees the plan
    if not len(prompt) or not 0 <= slot < gen.model.config.num_slots:
      raise ValueError(f"empty prompt or slot {slot} out of range")
    sampling = {k: getattr(params, k) for k in _DEVICE_SAMPLING}
    tok = self.run({"op": "prefill", "prompt": [int(t) for t in prompt], "slot": int(slot),
                    "sampling": sampling})
    return _Prefix(tok)

  def insert(self, state, prefix, row: int):
    self.run({"op": "insert", "row": int(row)})
    return self.replica

  def step(self, state):
    return self.replica, self.run({"op": "step"})

  def load_variant(self, slot: int, delta) -> None:
    if not isinstance(delta, VariantRef):
      raise TypeError("multi-process serving loads variants by path (a VariantRef)")
    self.run({"op": "load", "slot": int(slot), "path": delta.path, "adapter": delta.adapter})

  def clear_slot(self, slot: int) -> None:
    self.run({"op": "clear", "slot": int(slot)})

  def ping(self) -> None:
    """An empty plan: a dead worker shows up while the server is idle, not at the next
    request (the engine sends one every `Engine.IDLE_PING_S` when idle)."""
    self.run({"op": "ping"})

  def close(self) -> None:
    """Tells the followers to exit (skipped when a worker is already lost)."""
    if self.lost is not None:
      return
    t = threading.Thread(target=self._broadcast, args=({"op": "stop"},),
                         kwargs={"max_bytes": self.max_plan_bytes}, daemon=True)
    t.start()
    t.join(min(self.timeout_s, 30.0))


def run_follower(cfg) -> int:
  """The loop of a process other than 0: receive plans, execute them; returns an exit code.

  Call after `bitdelta_jax.distributed.initialize`. Returns 0 on ``stop``, 1 when the
  collective with process 0 fails (process 0 died: there is nobody left to serve).
  """
  from serving.engine import build_generator

  nbytes = plan_bytes(cfg.max_seq_len)
  try:
    first = broadcast_json(None, max_bytes=nbytes)
  except Exception as e:  # noqa: BLE001
    log.error("follower %d: no build plan from process 0: %s", cfg.process_id, e)
    return 1
  if first.get("op") != "build":
    log.error("follower %d: expected a build plan, got %r", cfg.process_id, first.get("op"))
    return 1
  replica = Replica(build_generator(cfg, embedding_slots=first["embedding_slots"],
                                    lora_rank=first["lora_rank"]))
  log.info("follower %d: model built; following process 0", cfg.process_id)
  while True:
    try:
      plan = broadcast_json(None, max_bytes=nbytes)
    except Exception as e:  # noqa: BLE001
      log.error("follower %d: lost process 0: %s", cfg.process_id, e)
      return 1
    if plan["op"] == "stop":
      log.info("follower %d: stop after %d plans", cfg.process_id, replica.ops)
      return 0
    try:
      replica.apply(plan)
    except Exception as e:  # noqa: BLE001
      if _is_runtime_error(e):
        log.error("follower %d: %s step failed: %s", cfg.process_id, plan["op"], e)
        return 1
      log.warning("follower %d: %s failed (as on process 0): %s", cfg.process_id, plan["op"], e)
