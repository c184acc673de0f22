"""What a variant directory is, read in one place: a BitDelta delta or a PEFT LoRA adapter.

    v = open_variant("deltas/math")            # reads the manifest / adapter_config.json only
    v.kind, v.manifest, v.nbytes, v.lora_rank  # "delta" | "lora"
    v.added_tokens(vocab_size), v.tokenizer_dir()
    banks_for([v.manifest], vocab_size)        # the slot banks it needs (`models.banks`)
    kw = bank_options(["deltas/math", "adapters/code"], vocab_size=49152)   # from directories
    payload = v.slot_payload(base_fingerprint=fp)       # what `runner.load_variant` takes
    payload = v.slot_payload(by_shards=True)            # on a mesh: each process its slices

A K-Merge pool member is a LoRA adapter. Loading a variant into a slot is the same call on one
device, on a mesh and across hosts: the runner's ``load_variant(slot, v.slot_payload(...))``;
on one device the payload is the delta's arrays (or the adapter's LoRA entries), on a mesh the
delta's directory, which `bitdelta_jax.sharding.load_variant_sharded` reads shard by shard.
The server's registry (`serving.registry`) keeps names and routing and asks here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for manifest sizes)
import numpy as np

from bitdelta_jax.models.banks import added_tokens, banks_for

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(path) -> bool:
  """Whether ``path`` is a PEFT LoRA adapter directory (it has ``adapter_config.json``)."""
  return (Path(path) / ADAPTER_CONFIG).exists()


def manifest_bytes(manifest: dict) -> int:
  """Host bytes of a delta (all stored arrays), from its manifest."""
  total = 0
  for meta in manifest["tensors"].values():
    for a in meta["arrays"].values():
      total += int(np.prod(a["shape"], dtype=np.int64)) * np.dtype(a["dtype"]).itemsize
  return total


def adapter_rank(path) -> int:
  """A PEFT adapter's largest rank (``r`` and its ``rank_pattern``), from its config."""
  p = Path(path) / ADAPTER_CONFIG
  try:
    cfg = json.loads(p.read_text())
    return int(max(int(r) for r in [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]))
  except (ValueError, TypeError, AttributeError) as e:
    raise ValueError(f"{p}: not a PEFT adapter config ({type(e).__name__}: {e})") from None


@dataclasses.dataclass(frozen=True)
class VariantDir:
  path: Path
  kind: str  # "delta" | "lora"
  # a delta's manifest; an adapter's stands in as {"lora_rank": r, "tensors": {}}, which is
  # what the bank and vocabulary rules read (`models.banks`)
  manifest: dict

  @classmethod
  def known(cls, path, kind: str) -> VariantDir:
    """A variant whose kind is already known (a follower's load plan), its manifest unread:
    for `slot_payload` only."""
    if kind not in ("delta", "lora"):
      raise ValueError(f"variant kind {kind!r}: 'delta' or 'lora'")
    return cls(Path(path), kind, {})

  @property
  def lora_rank(self) -> int:
    return int(self.manifest.get("lora_rank") or 0)

  @property
  def nbytes(self) -> int:
    """Host bytes of a delta's arrays (an adapter's: `slot_payload`'s, after loading it)."""
    return manifest_bytes(self.manifest) if self.kind == "delta" else 0

  def added_tokens(self, vocab_size: int) -> int:
    return added_tokens(self.manifest, vocab_size) if self.kind == "delta" else 0

  def tokenizer_dir(self) -> Path | None:
    """The variant's own tokenizer (kept by compress, or an adapter's), else None."""
    if self.kind == "lora":
      return self.path if (self.path / "tokenizer.json").exists() else None
    from bitdelta_jax.delta.stream import tokenizer_dir

    own = tokenizer_dir(self.path, self.manifest)
    return None if own is None else Path(own)

  def slot_payload(self, *, base_fingerprint=None, by_shards: bool = False):
    """What a runner's ``load_variant`` takes: the adapter's LoRA entries (small: read whole
    everywhere); a delta's arrays (checked against ``base_fingerprint``), or with ``by_shards``
    (a mesh) its directory, read slice by slice where each device needs it."""
    if self.kind == "lora":
      from bitdelta_jax.merge.lora import load_adapter
      from bitdelta_jax.models.slots import lora_entries

      return lora_entries(load_adapter(self.path))
    if by_shards:
      return str(self.path)
    from bitdelta_jax.delta.store import load_delta

    return load_delta(self.path, base_fingerprint=base_fingerprint)[0]


def open_variant(path) -> VariantDir:
  """The variant at ``path``, from its manifest (or adapter config) alone; a
  `bitdelta_jax.delta.store.DeltaStoreError` / ValueError / OSError naming the path if it is
  neither."""
  p = Path(path)
  if is_adapter(p):
    return VariantDir(p, "lora", {"lora_rank": adapter_rank(p), "tensors": {}})
  from bitdelta_jax.delta.store import read_manifest

  return VariantDir(p, "delta", read_manifest(p))


def bank_options(variants: Iterable[str | os.PathLike], vocab_size: int) -> dict:
  """``from_pretrained`` keyword arguments whose banks fit every variant directory (deltas
  and PEFT LoRA adapters): ``dense_embedding_slots``, ``packed_embedding_slots``,
  ``lora_rank``, ``extra_vocab`` (rounded up to 64)."""
  return banks_for([open_variant(v).manifest for v in variants], vocab_size).model_kwargs()
