"""Low-rank factors in the delta store: `CodedLora` ↔ arrays (docs/FORMAT.md, "Low-rank factors").

One tensor's factors ``a [K, r]``, ``b [r, N]`` are stored per rank component at its width:

    widths          uint8 [r]                  16, 32, 8, 4 or 2 per component, in rank order
    a16, b16        bf16/f16 [K, r16], [r16, N] the 16-bit components (``float_dtype``)
    a32, b32        f32 [K, r32], [r32, N]      plain `LoraEntry` factors (e.g. a PEFT adapter)
    a{w}, b{w}      uint8 [r_w, ceil(K·w/8)], [r_w, ceil(N·w/8)]   w-bit codes, packed along
                    the vector (code j of a byte in bits j·w...), value = (code − 2^(w−1) + ½)·step
    a{w}_step, b{w}_step   f32 [r_w]

Within each width the components keep their rank order; ``widths`` interleaves them back.
Reading returns a `CodedLora` holding exactly the decoded values that were written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from bitdelta_jax.delta.entries import LoraEntry, ResidualEntry
from bitdelta_jax.delta.residual import (
  CODE_WIDTHS,
  FLOAT_DTYPES,
  CodedLora,
  codes_of,
  decode,
  pack_codes,
  unpack_codes,
)


def is_low_rank(entry) -> bool:
  return isinstance(entry, (LoraEntry, ResidualEntry))


def _coded(entry: LoraEntry) -> CodedLora:
  if isinstance(entry, CodedLora):
    return entry
  r = int(np.shape(entry.a)[1])
  return CodedLora(a=np.asarray(entry.a, np.float32), b=np.asarray(entry.b, np.float32),
                   widths=(32,) * r, a_step=np.zeros(r, np.float32), b_step=np.zeros(r, np.float32))


def write_factors(d: Path, entry: LoraEntry, write_array: Callable) -> dict:
  """Writes one tensor's factors under ``d``; returns its manifest entry (kind ``lora``)."""
  e = _coded(entry)
  k, n = e.a.shape[0], e.b.shape[1]
  widths = np.asarray(e.widths, np.uint8).reshape(-1)
  if e.b.shape[0] != len(widths) or e.a.shape[1] != len(widths):
    raise ValueError(f"factors {e.a.shape} / {e.b.shape} do not match {len(widths)} widths")
  arrays = {"widths": write_array(d / "widths", widths)}
  for w in sorted(set(int(x) for x in widths)):
    j = np.nonzero(widths == w)[0]
    if w in (16, 32):
      dt = np.float32 if w == 32 else FLOAT_DTYPES[e.float_dtype]
      a, b = e.a[:, j].astype(dt), e.b[j].astype(dt)
      if not (np.array_equal(a.astype(np.float32), e.a[:, j])
              and np.array_equal(b.astype(np.float32), e.b[j])):
        raise ValueError(f"{w}-bit factors are not exactly representable in {np.dtype(dt).name}")
      arrays[f"a{w}"] = write_array(d / f"a{w}", a)
      arrays[f"b{w}"] = write_array(d / f"b{w}", b)
      continue
    if w not in CODE_WIDTHS:
      raise ValueError(f"unknown factor width {w}")
    for side, vecs, steps, length in (("a", e.a[:, j].T, e.a_step[j], k),
                                      ("b", e.b[j], e.b_step[j], n)):
      codes = np.stack([codes_of(v, s, w) for v, s in zip(vecs, steps)])
      assert codes.shape[1] == length
      arrays[f"{side}{w}"] = write_array(d / f"{side}{w}", pack_codes(codes, w))
      arrays[f"{side}{w}_step"] = write_array(d / f"{side}{w}_step", np.asarray(steps, np.float32))
  return {"kind": "lora", "shape": [k, n], "rank": int(len(widths)),
          "float_dtype": e.float_dtype, "arrays": arrays}


def read_factors(meta: dict, read: Callable[[str], np.ndarray]) -> CodedLora:
  k, n = meta["shape"]
  widths = read("widths").astype(np.int64)
  r = len(widths)
  a = np.zeros((k, r), np.float32)
  b = np.zeros((r, n), np.float32)
  a_step = np.zeros(r, np.float32)
  b_step = np.zeros(r, np.float32)
  for w in sorted(set(int(x) for x in widths)):
    j = np.nonzero(widths == w)[0]
    if w in (16, 32):
      a[:, j] = read(f"a{w}").astype(np.float32)
      b[j] = read(f"b{w}").astype(np.float32)
      continue
    a_step[j], b_step[j] = read(f"a{w}_step"), read(f"b{w}_step")
    ca, cb = unpack_codes(read(f"a{w}"), w, k), unpack_codes(read(f"b{w}"), w, n)
    for i, jj in enumerate(j):
      a[:, jj] = decode(ca[i], a_step[jj], w)
      b[jj] = decode(cb[i], b_step[jj], w)
  return CodedLora(a=a, b=b, widths=tuple(int(x) for x in widths), a_step=a_step, b_step=b_step,
                   float_dtype=meta.get("float_dtype", "bfloat16"))


def read_entry(d: Path, meta: dict, read: Callable[[str], np.ndarray]):
  """A ``residual`` or ``lora`` tensor → `ResidualEntry` / `CodedLora` (a `LoraEntry`)."""
  from bitdelta_jax.delta.format import PackedDelta

  lora = read_factors(meta, read)
  if meta["kind"] == "lora":
    return lora
  packed = PackedDelta(bits=read("bits"), scale=read("scale"), shape=tuple(meta["shape"]),
                       group_k=meta["group_k"], granularity=meta["granularity"],
                       layout=meta["layout"])
  return ResidualEntry(packed=packed, lora=lora)
