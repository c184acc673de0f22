"""Which per-slot banks a model needs for a set of variants, read from their manifests.

    banks = banks_for(manifests, vocab_size=49152)       # manifest dicts (a LoRA adapter's:
    model = from_pretrained(base, num_slots=3, **banks.model_kwargs())   # {"lora_rank": r})

A variant whose embeddings / LM head changed exactly needs dense embedding banks, a 1-bit one
packed banks, one that added tokens ``extra_vocab`` rows, a PEFT LoRA adapter or a delta with
low-rank factors (manifest ``lora_rank``: dqrelo, svd, delta-come) LoRA banks of its rank. The
server (`serving.app`), the engine (`engine.build`) and `from_pretrained(..., variants=...)`
all ask here: it lives with the model, below both, and below the variant directories
(`bitdelta_jax.delta.variant.bank_options` reads their manifests and asks here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

EMBEDDING_TENSORS = ("embed_tokens", "lm_head", "wte", "wpe")


def added_tokens(manifest: dict, vocab_size: int) -> int:
  """How many tokens the variant added to the base's ``vocab_size`` (embedding / LM-head rows
  past the base's: ``extra_rows``, or a kept ``value`` that is longer)."""
  n = 0
  for name, meta in manifest["tensors"].items():
    if not any(e in name for e in EMBEDDING_TENSORS):
      continue
    arrays = meta.get("arrays") or {}
    if "extra_rows" in arrays:
      n = max(n, int(arrays["extra_rows"]["shape"][0]))
    elif meta.get("kind") == "value" and "value" in arrays:
      n = max(n, int(arrays["value"]["shape"][0]) - vocab_size)
  return n


def changes_embeddings(manifest: dict) -> bool:
  """Whether the variant needs dense per-slot embedding / LM-head banks (an exact delta)."""
  return any(any(e in n for e in EMBEDDING_TENSORS) and m["kind"] not in ("same", "packed")
             for n, m in manifest["tensors"].items())


def packs_embeddings(manifest: dict) -> bool:
  """Whether the variant has 1-bit embedding / LM-head deltas (packed per-slot banks)."""
  return any(any(e in n for e in EMBEDDING_TENSORS) and m["kind"] == "packed"
             for n, m in manifest["tensors"].items())


@dataclasses.dataclass(frozen=True)
class Banks:
  """The per-slot banks of a model: what every variant it may hold needs."""

  dense_embedding_slots: bool = False  # exact embedding / LM-head deltas
  packed_embedding_slots: bool = False  # 1-bit embedding / LM-head deltas
  lora_rank: int = 0  # LoRA adapters and low-rank delta factors
  extra_vocab: int = 0  # rows for added tokens (a multiple of 64)

  def model_kwargs(self) -> dict:
    """``from_pretrained`` / ``restore_base`` keyword arguments."""
    return dataclasses.asdict(self)


def banks_for(manifests: Iterable[dict], vocab_size: int, *, embedding_slots: bool | None = None,
              lora_rank: int | None = None, extra_vocab: int | None = None) -> Banks:
  """The banks that fit every manifest (a delta's, or ``{"lora_rank": r}`` for a PEFT LoRA
  adapter); an argument that is not None overrides what the manifests ask (the server's
  ``--embedding-slots``, ``--lora-rank``, ``--extra-vocab``)."""
  dense = packed = False
  rank = extra = 0
  for m in manifests:
    tensors = m.get("tensors") or {}
    if tensors:
      dense |= changes_embeddings(m)
      packed |= packs_embeddings(m)
      extra = max(extra, added_tokens(m, vocab_size))
    rank = max(rank, int(m.get("lora_rank") or 0))  # adapters; dqrelo / svd / delta-come
  return Banks(dense if embedding_slots is None else bool(embedding_slots), packed,
               rank if lora_rank is None else int(lora_rank),
               -(-extra // 64) * 64 if extra_vocab is None else int(extra_vocab))
