"""Small-M f32 matmul on the host CPU (decode steps): a C++ kernel called through `jax.ffi`.

Why: a decode step multiplies a few rows by every weight matrix. XLA's CPU dot is good at 1 row
(a GEMV near one core's bandwidth) and at many rows, but between 2 and 16 rows it runs far below
both the bandwidth and the FLOP rate: at 8 rows it costs nearly what 32 rows do.
``cpu_kernel.cc`` streams W once per 8 rows with all cores (a persistent thread pool splits
the columns). `DeltaDense` uses it for ``MIN_ROWS <= M <= MAX_ROWS`` f32 rows on the CPU
backend; everything else stays with XLA (see bench/results/small_matmul_cpu.md).
bf16 weights have their own kernels (`cpu_bf16`); `dense_f32` dispatches to either.

Numerics: f32 products and sums in another order than XLA's (agrees to rounding; tested against
`reference.small_matmul_reference`). Backend: host CPU; built on first use like
`pallas_kernels.delta_matmul.cpu` (``g++ -O3 -march=native``); ``$BITDELTA_CPU_THREADS`` caps
the pool; ``BITDELTA_SMALL_MATMUL=0`` turns it (and the bf16 kernels) off.
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp

from bitdelta_jax import native

MIN_ROWS, MAX_ROWS = 2, 16
_SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
_POOL = pathlib.Path(__file__).with_name("pool.h")  # included by the kernels: part of the key
_TARGET = "bitdelta_small_matmul"


@functools.cache
def _load() -> str | None:
  """Builds and registers the f32 kernel (and the bf16 kernels, if they build: a program
  loaded from the step cache calls every target without tracing); None or why not."""
  lib, reason = native.build(_SOURCE, "small_matmul", include_dirs=(jax.ffi.include_dir(),),
                             key_extra=jax.__version__.encode() + _POOL.read_bytes())
  if lib is None:
    return f"the CPU small-matmul kernel cannot be built: {reason}"
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.BitdeltaSmallMatmul), platform="cpu")
  from . import cpu_bf16

  cpu_bf16._load()
  return None


def usable(m: int, *dtypes) -> bool:
  """Whether the kernel path is taken for M rows of these dtypes here."""
  if os.environ.get("BITDELTA_SMALL_MATMUL", "1") == "0" or not MIN_ROWS <= m <= MAX_ROWS:
    return False
  if any(jnp.dtype(d) != jnp.float32 for d in dtypes):
    return False
  from pallas_kernels.platform import target_platform

  return target_platform() == "cpu" and _load() is None


def _call(x, w):
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                          vmap_method="sequential")
  return call(x, w)


@jax.custom_vjp
def _small_matmul(x, w):
  return _call(x, w)


def _fwd(x, w):
  return _call(x, w), (x, w)


def _bwd(res, g):
  x, w = res
  return g @ w.T, x.T @ g


_small_matmul.defvjp(_fwd, _bwd)


def small_matmul(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` in f32 through the kernel (raises NotImplementedError if it cannot be built)."""
  reason = _load()
  if reason:
    raise NotImplementedError(reason)
  return _small_matmul(x_MxK, w_KxN)


def dense(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` in ``x.dtype``: a kernel where `usable` / `cpu_bf16.usable`, else XLA's dot."""
  return dense_f32(x_MxK, w_KxN).astype(x_MxK.dtype)


def dense_f32(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` with f32 sums, f32: the f32 or bf16 kernel where it runs, else XLA's dot."""
  from . import cpu_bf16

  m = x_MxK.shape[0]
  if usable(m, x_MxK.dtype, w_KxN.dtype):
    return small_matmul(x_MxK, w_KxN)
  if cpu_bf16.handles(x_MxK.dtype, w_KxN.dtype):
    return cpu_bf16.dense(x_MxK, w_KxN)
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)
