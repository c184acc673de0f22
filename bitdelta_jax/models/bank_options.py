"""Which per-slot banks a model needs for a set of variants, read from their manifests.

    kw = bank_options(["deltas/math", "adapters/code"], vocab_size=49152)
    model = from_pretrained(base, num_slots=3, **kw)     # or: from_pretrained(..., variants=[...])

A variant whose embeddings / LM head changed exactly needs dense embedding banks, a 1-bit one
packed banks, one that added tokens ``extra_vocab`` rows, a PEFT LoRA adapter or a delta with
low-rank factors (manifest ``lora_rank``: dqrelo, svd, delta-come) LoRA banks of its rank. The
server (`serving.app`) and `from_pretrained(..., variants=...)` both ask here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

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


def bank_options(variants: Iterable[str | os.PathLike], vocab_size: int) -> dict:
  """``from_pretrained`` keyword arguments whose banks fit every variant directory (deltas
  and PEFT LoRA adapters): ``dense_embedding_slots``, ``packed_embedding_slots``,
  ``lora_rank``, ``extra_vocab`` (rounded up to 64)."""
  from bitdelta_jax.delta.store import read_manifest

  dense = packed = False
  rank = extra = 0
  for v in variants:
    p = Path(v)
    if (p / "adapter_config.json").exists():
      cfg = json.loads((p / "adapter_config.json").read_text())
      rank = max(rank, *[int(r) for r in [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]])
      continue
    m = read_manifest(p)
    dense |= changes_embeddings(m)
    packed |= packs_embeddings(m)
    extra = max(extra, added_tokens(m, vocab_size))
    rank = max(rank, int(m.get("lora_rank") or 0))  # dqrelo / svd / delta-come factors
  return {"dense_embedding_slots": dense, "packed_embedding_slots": packed,
          "lora_rank": rank, "extra_vocab": -(-extra // 64) * 64}
