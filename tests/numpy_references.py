"""Numpy references shared by tests of several areas (the engine's sampler, the server's
penalties and bias): the definitions written out, independent of the code under test."""

from __future__ import annotations

import numpy as np


def numpy_controls(x: np.ndarray, c) -> np.ndarray:
  """The controls written from their definitions (vLLM's order: mask, bias, penalties)."""
  x = x.astype(np.float32).copy()
  r, v = x.shape
  for i in range(r):
    words = np.asarray(c.mask[i]).view(np.uint32)
    allowed = ((words[np.arange(v) // 32] >> (np.arange(v) % 32).astype(np.uint32)) & 1) == 1
    x[i, ~allowed] = -np.inf
    for t, b in zip(c.bias_ids[i], c.bias_vals[i]):
      if t >= 0:
        x[i, t] += b
    hist = [int(t) for t in c.history[i] if t >= 0]
    prompt, out = hist[: c.prompt_len[i]], hist[c.prompt_len[i]:]
    counts = np.bincount(np.asarray(out, np.int64), minlength=v).astype(np.float32)[:v]
    seen = np.zeros(v, bool)
    seen[prompt + out] = True
    rep = np.float32(c.repetition[i])
    x[i, seen] = np.where(x[i, seen] > 0, x[i, seen] / rep, x[i, seen] * rep)
    x[i] -= np.float32(c.frequency[i]) * counts
    x[i] -= np.float32(c.presence[i]) * (counts > 0)
  return x
