"""The variant registry: which model names exist, where their deltas live, who is using them.

Only names registered here (from the config or ``POST /v1/variants``) ever map to a path; a
request's ``model`` is looked up, never joined to a path. Each `Variant` also carries the
cache's view of it (tier, slot, load times, request-rate counter), which `serving.cache` owns.

A K-Merge pool (`bitdelta_jax.kmerge`, ``--kmerge-pool DIR``) registers each member's adapter
as one variant (one LoRA slot per member) and each task of its routing as an `Alias`: a model
name that resolves to its member's variant (`get`), never to a path of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from bitdelta_jax.delta.store import DeltaStoreError, load_entry
from bitdelta_jax.delta.variant import is_adapter, open_variant
from bitdelta_jax.models.banks import (
  Banks,
  added_tokens,
  changes_embeddings,
  packs_embeddings,
)
from serving.config import check_name


class RegistryError(ValueError):
  """A registration that cannot be accepted; ``param`` names the offending field."""

  def __init__(self, message: str, *, param: str | None = None, status: int = 400,
               code: str | None = None):
    super().__init__(message)
    self.param, self.status, self.code = param, status, code


def verify_arrays(path: Path, manifest: dict) -> None:
  """Reads each tensor of a delta (one at a time) and checks its arrays' crc32s."""
  for name, meta in manifest["tensors"].items():
    load_entry(Path(path), name, meta, verify=True)


@dataclasses.dataclass(frozen=True)
class Inspected:
  """What the start-up / registration checks learnt of a variant directory."""

  nbytes: int  # host bytes of its arrays
  added_tokens: int = 0  # tokens past the base's vocabulary
  tokenizer: Any = None  # its own `Tokenizer` (kept by compress), or None: the base's


@dataclasses.dataclass(eq=False)
class Variant:
  name: str
  path: Path
  source: str  # "config" | "admin"
  nbytes: int
  registered_at: float = dataclasses.field(default_factory=time.time)
  # usage
  added_tokens: int = 0  # vocabulary rows past the base's
  tokenizer: Any = None  # the variant's own Tokenizer, or None: the base's
  requests: int = 0
  in_flight: int = 0
  deleting: bool = False
  # engine requests (`bitdelta_jax.engine.request.Request`) of the in-flight HTTP requests, so that a
  # DELETE can end them; ``ended_by``: the error they get once it does
  live: set = dataclasses.field(default_factory=set)
  ended_by: str | None = None
  # cache state (owned by serving.cache)
  slot: int | None = None  # model slot id (1..device_slots) once loaded
  host_bytes: int = 0
  loads: int = 0
  last_load_time: float | None = None  # wall clock
  last_load_seconds: float | None = None
  last_load_source: str | None = None
  load_error: str | None = None
  load_failed_at: float = -math.inf  # monotonic
  rate: float = 0.0  # decayed request counter
  rate_t: float = 0.0
  last_used: float = 0.0
  waiting: int = 0  # requests waiting for this variant's load
  pinned: bool = False
  _idle: asyncio.Event | None = None

  def decayed_rate(self, now: float, half_life: float) -> float:
    return self.rate * 0.5 ** ((now - self.rate_t) / half_life)

  def touch(self, now: float, half_life: float) -> None:
    self.rate = self.decayed_rate(now, half_life) + 1.0
    self.rate_t = self.last_used = now


@dataclasses.dataclass(frozen=True)
class Alias:
  """A model name answered by another variant: a task of a K-Merge pool and its member."""

  name: str
  target: str  # the variant (pool member) that answers it
  source: str = "kmerge"
  registered_at: float = dataclasses.field(default_factory=time.time)


@dataclasses.dataclass(frozen=True)
class PoolMember:
  id: str
  path: Path  # its PEFT adapter directory
  tasks: tuple[str, ...]  # every task routed to it (merged in, or routed there by a fallback)


def read_pool(path) -> tuple[PoolMember, ...]:
  """The members of a saved K-Merge pool (``KMergePool.save``: ``pool.json`` and one PEFT
  adapter directory per member) with the tasks its routing sends to each. Reads ``pool.json``
  only; a missing or malformed one is a `RegistryError` naming the directory and the problem."""
  from bitdelta_jax.kmerge import POOL_FILE

  root = Path(path)
  if not root.is_dir():
    raise RegistryError(f"{root}: no such K-Merge pool directory", param="kmerge_pool")
  index = root / POOL_FILE
  if not index.is_file():
    raise RegistryError(f"{root}: not a K-Merge pool (no {POOL_FILE}; build one with "
                        "`bitdelta kmerge build`)", param="kmerge_pool")
  try:
    state = json.loads(index.read_text())
    ids = [str(m["id"]) for m in state["members"]]
    routing = {str(t): str(m) for t, m in dict(state["routing"]).items()}
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise RegistryError(f"{index}: corrupt pool index ({type(e).__name__}: {e})",
                        param="kmerge_pool") from None
  missing = sorted({m for m in routing.values() if m not in ids})
  if missing:
    raise RegistryError(f"{index}: the routing names members that the pool lacks: {missing}",
                        param="kmerge_pool")
  out = []
  for mid in ids:
    adapter_dir = root / "members" / mid
    if not is_adapter(adapter_dir):
      raise RegistryError(f"{root}: member {mid!r} has no adapter ({adapter_dir} lacks "
                          "adapter_config.json)", param="kmerge_pool")
    out.append(PoolMember(mid, adapter_dir.resolve(),
                          tuple(t for t, m in routing.items() if m == mid)))
  return tuple(out)


REFUSED_PATH = ("path is not a variant directory this server may load (allowed: readable "
                "directories under the server's --variant-root directories)")


class Registry:
  def __init__(self, base_id: str, *, admin_roots: tuple[str, ...] = (),
               banks: Banks = Banks(),
               base_tensors: set[str] | None = None, vocab_size: int | None = None,
               base_dir: str | None = None,
               base_shapes: dict[str, tuple[int, ...]] | None = None):
    self.base_dir = base_dir  # a variant's kept tokenizer files fall back to the base's
    self.base_shapes = base_shapes  # HF name -> shape: a LoRA module must fit its weight
    self.banks = banks  # what the model's per-slot banks can hold
    self.base_id = base_id
    self.vocab_size = vocab_size
    self.admin_roots = tuple(Path(r).resolve() for r in admin_roots)
    self.base_tensors = base_tensors
    self._variants: dict[str, Variant] = {}
    self._aliases: dict[str, Alias] = {}
    self._pending_removals: set[asyncio.Task] = set()  # DELETEs waiting for the engine

  # -- lookup ----------------------------------------------------------------------------------
  def get(self, name: str) -> Variant | None:
    """The live variant answering ``name`` (None if unknown or being deleted); an alias (a
    K-Merge task) resolves to its target."""
    if not isinstance(name, str):
      return None
    a = self._aliases.get(name)
    v = self._variants.get(a.target if a is not None else name)
    return None if v is None or v.deleting else v

  def all(self) -> list[Variant]:
    return [v for v in self._variants.values() if not v.deleting]

  def aliases(self) -> list[Alias]:
    """The live aliases (those whose target is live), in registration order."""
    return [a for a in self._aliases.values() if self.get(a.target) is not None]

  def alias_of(self, name: str) -> Alias | None:
    a = self._aliases.get(name) if isinstance(name, str) else None
    return a if a is not None and self.get(a.target) is not None else None

  def tasks_of(self, target: str) -> list[str]:
    """The alias names that resolve to the variant ``target``."""
    return [a.name for a in self._aliases.values() if a.target == target]

  def __contains__(self, name: str) -> bool:
    return self.get(name) is not None

  # -- registration ----------------------------------------------------------------------------
  def check(self, name, path, *, source: str) -> tuple[str, Path]:
    """Validates a name and path (cheap checks, no I/O beyond ``stat``)."""
    self._check_new_name(name)
    if not isinstance(path, str) or not path or "\x00" in path:
      raise RegistryError("path must be a non-empty string", param="path")
    try:
      os.fsencode(path)
    except UnicodeEncodeError:
      raise RegistryError("path is not a valid file name (unencodable characters)",
                          param="path") from None
    p = Path(path).expanduser()
    if source == "admin":
      if not p.is_absolute():
        raise RegistryError("path must be absolute", param="path")
      p = p.resolve()
      # one answer for outside the roots, missing, not a directory and unreadable: an admin
      # route is no oracle for what exists on the server's disk
      if (self.admin_roots and not any(p.is_relative_to(r) for r in self.admin_roots)) or not (
          p.is_dir() and os.access(p, os.R_OK | os.X_OK)):
        raise RegistryError(REFUSED_PATH, param="path", status=403, code="path_not_allowed")
    return name, p.resolve()

  def _check_new_name(self, name) -> None:
    """A valid model name that is free: not the base, a variant or an alias."""
    try:
      check_name(name, "name")
    except ValueError as e:
      raise RegistryError(str(e), param="name") from None
    if name == self.base_id:
      raise RegistryError(f"{name!r} is the base model's name", param="name", status=409,
                          code="variant_exists")
    self._check_free(name)

  def _check_free(self, name: str) -> None:
    if name in self._variants:
      raise RegistryError(f"a variant named {name!r} is already registered", param="name",
                          status=409, code="variant_exists")
    if name in self._aliases:
      raise RegistryError(
        f"{name!r} is already a K-Merge task name (served by member "
        f"{self._aliases[name].target!r})", param="name", status=409, code="variant_exists")

  def add_alias(self, name: str, target: str, *, source: str = "kmerge") -> Alias:
    """Makes ``name`` a model answered by the registered variant ``target``. The name must be
    valid and free (not the base, a variant or another alias)."""
    self._check_new_name(name)
    if target not in self._variants:
      raise RegistryError(f"{name!r}: no variant {target!r} to serve it", param="name")
    a = self._aliases[name] = Alias(name, target, source)
    return a

  def inspect(self, path: Path, base_check, *, verify: bool = False) -> Inspected:
    """Reads and checks the manifest (run in an IO thread).

    With ``verify``, also reads every stored array once and checks its shape and crc32 (a
    corrupt or truncated delta fails here rather than at its first request).
    A directory with ``adapter_config.json`` is a PEFT LoRA adapter: its modules must be linear
    layers of the base and its rank must fit the model's LoRA slots.
    A variant that added tokens must fit the server's added-token rows; its own tokenizer
    (kept by ``compress`` in ``tokenizer/``) is loaded and must fit its vocabulary."""
    if not os.path.isdir(path):
      raise RegistryError(f"{path}: no such delta directory", param="path")
    var = open_variant(path)
    if var.kind == "lora":
      own = var.tokenizer_dir()
      return Inspected(self._inspect_adapter(path), 0,
                       None if own is None else self._tokenizer(path, own, 0))
    m = var.manifest
    try:
      if base_check is not None:
        base_check(m, str(path))
      if changes_embeddings(m) and not self.banks.dense_embedding_slots:
        raise RegistryError(
          f"{path}: this variant changes the embeddings / LM head, but the server was started "
          f"without per-slot embedding banks (start it with this variant configured, or with "
          f"--embedding-slots)", param="path")
      if packs_embeddings(m) and not (self.banks.packed_embedding_slots or self.banks.dense_embedding_slots):
        raise RegistryError(
          f"{path}: this variant has 1-bit embedding / LM-head deltas, but the server was "
          f"started without per-slot embedding banks (start it with this variant configured)",
          param="path")
      rank = int(m.get("lora_rank") or 0)  # 1-bit + low-rank / low-rank modes use LoRA banks
      if rank > self.banks.lora_rank:
        raise RegistryError(
          f"{path}: this delta's low-rank part has rank {rank}, but the server's LoRA slots "
          f"have rank {self.banks.lora_rank} (start it with this variant configured, or with "
          f"--lora-rank {rank})", param="path")
      added = added_tokens(m, self.vocab_size) if self.vocab_size else 0
      if added > self.banks.extra_vocab:
        raise RegistryError(
          f"{path}: this variant adds {added} tokens to the vocabulary, but the server has room "
          f"for {self.banks.extra_vocab} added tokens per slot (start it with this variant configured, "
          f"or with --extra-vocab {added})", param="path")
      own = var.tokenizer_dir()
      tok = None if own is None else self._tokenizer(path, own, added)
      if verify:
        verify_arrays(path, m)
      return Inspected(var.nbytes, added, tok)
    except (KeyError, TypeError, AttributeError) as e:  # fields missing or of the wrong type
      raise DeltaStoreError(f"{path}: corrupt manifest ({type(e).__name__}: {e})") from None

  def _tokenizer(self, path: Path, tok_dir, added: int):
    """The variant's own tokenizer; its ids must fit the variant's vocabulary."""
    from bitdelta_jax.models.tokenizer import Tokenizer

    try:
      tok = Tokenizer.from_dir(tok_dir, fallback=self.base_dir)
    except Exception as e:  # noqa: BLE001  tokenizers raises its own exception types
      raise RegistryError(f"{path}: the variant's tokenizer cannot be loaded: {e}",
                          param="path") from None
    if self.vocab_size and tok.vocab_size > self.vocab_size + added:
      raise RegistryError(
        f"{path}: the variant's tokenizer has {tok.vocab_size} tokens, but its embeddings have "
        f"{self.vocab_size + added} rows", param="path")
    return tok

  def _inspect_adapter(self, path: Path) -> int:
    from bitdelta_jax.merge.lora import load_adapter

    try:
      adapter = load_adapter(path)
    except (ValueError, OSError, NotImplementedError) as e:
      raise RegistryError(f"{path}: not a usable PEFT LoRA adapter: {e}", param="path") from None
    if self.base_tensors is not None:
      unknown = sorted(m for m in adapter.modules if f"{m}.weight" not in self.base_tensors)
      if unknown:
        raise RegistryError(f"{path}: adapter modules not in the base: {unknown[:4]}",
                            param="path")
    if self.base_shapes is not None:
      for m, mod in sorted(adapter.modules.items()):
        out_f, in_f = mod.B.shape[0], mod.A.shape[1]
        if mod.fan_in_fan_out:
          out_f, in_f = in_f, out_f
        want = tuple(self.base_shapes.get(f"{m}.weight", ()))
        if want and want != (out_f, in_f):
          raise RegistryError(
            f"{path}: adapter module {m} changes a [{out_f}, {in_f}] weight, but the base's "
            f"{m}.weight is {list(want)} (an adapter for another base?)", param="path")
    if adapter.rank > self.banks.lora_rank:
      raise RegistryError(
        f"{path}: LoRA rank {adapter.rank} exceeds the server's LoRA slot rank {self.banks.lora_rank} "
        "(start the server with --lora-rank, or with this adapter configured)", param="path")
    return adapter.nbytes

  def add(self, name: str, path: Path, info: Inspected | int, *, source: str) -> Variant:
    self._check_free(name)  # raced with another registration
    if not isinstance(info, Inspected):
      info = Inspected(int(info))
    v = Variant(name=name, path=path, source=source, nbytes=info.nbytes,
                added_tokens=info.added_tokens, tokenizer=info.tokenizer)
    self._variants[name] = v
    return v

  # -- in-flight tracking ----------------------------------------------------------------------
  def begin(self, v: Variant) -> None:
    v.requests += 1
    v.in_flight += 1
    if v._idle is not None:
      v._idle.clear()

  def end(self, v: Variant) -> None:
    v.in_flight -= 1
    if v.in_flight == 0 and v._idle is not None:
      v._idle.set()

  async def remove(self, name: str, on_removed, *, grace_s: float = math.inf,
                   end_wait_s: float = 10.0) -> Variant:
    """Hides ``name`` from new requests and waits up to ``grace_s`` for its in-flight ones;
    those still running then end with an error (`end_requests`), and after ``end_wait_s``
    more it returns regardless: the variant is forgotten as soon as the last one lets go."""
    v = self._variants.get(name)  # never through an alias: a task name does not delete its member
    if v is None or v.deleting:
      raise KeyError(name)
    v.deleting = True  # its aliases stop resolving with it

    async def forget() -> None:
      if v.in_flight:
        await v._idle.wait()
      await on_removed(v)
      self._variants.pop(name, None)
      for a in [a for a in self._aliases.values() if a.target == name]:
        del self._aliases[a.name]

    v._idle = asyncio.Event()
    if not v.in_flight:
      v._idle.set()
    try:
      await asyncio.wait_for(asyncio.shield(v._idle.wait()), grace_s)
    except TimeoutError:
      end_requests(v, f"the model {name!r} was deleted while this request was generating")
    task = asyncio.ensure_future(forget())
    try:
      await asyncio.wait_for(asyncio.shield(task), end_wait_s)
    except TimeoutError:  # finishes in the background once the engine lets go
      self._pending_removals.add(task)
      task.add_done_callback(self._pending_removals.discard)
    return v


def end_requests(v: Variant, reason: str) -> None:
  """Ends every in-flight engine request of ``v`` with an error naming ``reason`` (the engine
  frees their rows at its next iteration); requests that start later end at once."""
  v.ended_by = reason
  for r in list(v.live):
    end_request(r, reason)


def end_request(r, reason: str) -> None:
  """Cancels engine request ``r`` so that it ends with an error naming ``reason``."""
  r.cancel_reason, r.cancel_code = reason, "variant_deleted"
  r.cancelled = True
