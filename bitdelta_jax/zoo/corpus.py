"""Pre-training text every machine with Python has: the standard library's own sources."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from bitdelta_jax.zoo.tokenizer_build import BOS, EOS

N_SPECIAL = 5


def stdlib_text(max_bytes: int = 4 << 20) -> bytes:
  """Top-level ``*.py`` files of the standard library, sorted by name, up to ``max_bytes``."""
  root = Path(sysconfig.get_paths()["stdlib"])
  out, n = [], 0
  for f in sorted(root.glob("*.py")):
    try:
      b = f.read_bytes()
    except OSError:
      continue
    out.append(b)
    n += len(b)
    if n >= max_bytes:
      break
  if not out:
    raise RuntimeError(f"no Python sources found under {root}")
  return b"\n".join(out)[:max_bytes]


def encode_bytes(b: bytes) -> np.ndarray:
  """Byte-level ids (the tokenizer's byte tokens start after the 5 specials)."""
  return np.frombuffer(b, np.uint8).astype(np.int32) + N_SPECIAL


def lm_batches(ids: np.ndarray, batch: int, seq: int, seed: int):
  """Endless random windows ``[batch, seq+1]`` starting with <bos>."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(ids) - seq, size=batch)
    win = np.stack([ids[s:s + seq] for s in starts])
    yield np.concatenate([np.full((batch, 1), BOS, np.int32), win], axis=1)


__all__ = ["stdlib_text", "encode_bytes", "lm_batches", "BOS", "EOS"]
