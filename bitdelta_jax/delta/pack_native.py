"""The compression hot loop in C++ (`pack_kernel.cc`), called through ctypes on numpy arrays.

One pass over a block of HF rows computes the sign bits (group-bitplane layout), Σ|Δ| and ΣΔ²
per row, at memory speed; `stream.py` falls back to a jitted XLA version when no compiler is
available or the dtypes are not bf16/f32.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import ml_dtypes
import numpy as np

from pallas_kernels import settings
from pallas_kernels.native.build import build as build_native

_SOURCE = pathlib.Path(__file__).with_name("pack_kernel.cc")
_DTYPES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1}


@functools.cache
def _lib():
  lib, reason = build_native(_SOURCE, "pack_rows")
  if lib is not None:
    p = ctypes.c_void_p
    lib.bitdelta_pack_rows.argtypes = [p, ctypes.c_int, p, ctypes.c_int, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int, p, p, p, p]
    lib.bitdelta_pack_rows.restype = ctypes.c_int
  return lib, reason


def unavailable_reason(base: np.ndarray, ft: np.ndarray) -> str | None:
  if base.dtype not in _DTYPES or ft.dtype not in _DTYPES:
    return f"dtypes {base.dtype}/{ft.dtype} (the native packer takes bf16 and f32)"
  return _lib()[1]


def pack_rows(base: np.ndarray, ft: np.ndarray, group_k: int):
  """HF rows ``[R, K]`` → (bits ``[R, K_pad/8]``, Σ|Δ| ``[R]`` f64, ΣΔ² ``[R]`` f64, changed)."""
  lib = _lib()[0]
  base, ft = np.ascontiguousarray(base), np.ascontiguousarray(ft)
  r, k = ft.shape
  k_pad = -(-k // group_k) * group_k
  bits = np.empty((r, k_pad // 8), np.uint8)
  a, s = np.empty(r, np.float64), np.empty(r, np.float64)
  changed = ctypes.c_int(0)
  threads = settings.get("BITDELTA_CPU_THREADS") or os.cpu_count() or 1
  rc = lib.bitdelta_pack_rows(
    base.ctypes.data, _DTYPES[base.dtype], ft.ctypes.data, _DTYPES[ft.dtype], r, k, group_k,
    threads, bits.ctypes.data, a.ctypes.data, s.ctypes.data, ctypes.addressof(changed))
  if rc:
    raise ValueError(f"native packer rejected group_k={group_k}")
  return bits, a, s, bool(changed.value)
