"""Small-M f32 matmul on the host CPU (decode steps): a C++ kernel called through `jax.ffi`.

Why: a decode step multiplies a few rows by every weight matrix. XLA's CPU dot is good at 1 row
(a GEMV near one core's bandwidth) and at many rows, but between 2 and 16 rows it runs far below
both the bandwidth and the FLOP rate: at 8 rows it costs nearly what 32 rows do.
``cpu_kernel.cc`` streams W once per 8 rows with all cores (a persistent thread pool splits
the columns). `DeltaDense` uses it for ``MIN_ROWS <= M <= MAX_ROWS`` f32 rows on the CPU
backend; everything else stays with XLA (see bench/results/small_matmul_cpu.md).

bf16 weights (`small_matmul_bf16`): W is half the bytes, so a decode step reads half as much.
Where the build has AVX-512 BF16 and the CPU reports it at run time, ``vdpbf16ps`` multiplies
adjacent pairs of K (W's rows interleaved on the fly, no repacked copy of W); elsewhere W is
widened to f32 by a shift and multiplied with FMAs. x is rounded to bf16 first (a bf16 model's
activations already are), so both paths compute the same thing: exact bf16·bf16 products,
summed in f32. `dense` takes it for ``M <= BF16_MAX_ROWS`` bf16 rows; above, XLA's dot.

Numerics: f32 products and sums in another order than XLA's (agrees to rounding; tested against
`reference.small_matmul_reference` and float64). Backend: host CPU; built on first use like
`pallas_kernels.delta_matmul.cpu` (``g++ -O3 -march=native``); ``$BITDELTA_CPU_THREADS`` caps
the pool; ``BITDELTA_SMALL_MATMUL=0`` turns both kernels off.
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp

from bitdelta_jax import native

MIN_ROWS, MAX_ROWS = 2, 16
# bf16 weights: the kernel for 1..BF16_MAX_ROWS rows (bench/results/cpu_bf16.md)
BF16_MAX_ROWS = 64
_SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "bitdelta_small_matmul"
_BF16_TARGET = "bitdelta_small_matmul_bf16"


def _build(arch: tuple[str, ...] | None = None):
  return native.build(_SOURCE, "small_matmul", include_dirs=(jax.ffi.include_dir(),),
                      key_extra=jax.__version__.encode(), arch=arch)


@functools.cache
def _lib():
  return _build()


@functools.cache
def _load() -> str | None:
  lib, reason = _lib()
  if lib is None:
    return f"the CPU small-matmul kernel cannot be built: {reason}"
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.BitdeltaSmallMatmul), platform="cpu")
  jax.ffi.register_ffi_target(_BF16_TARGET, jax.ffi.pycapsule(lib.BitdeltaSmallMatmulBf16),
                              platform="cpu")
  return None


def bf16_isa() -> int | None:
  """The bf16 path the native build runs here: 1 ``vdpbf16ps``, 0 widen + FMA; None unbuilt."""
  return None if _load() else int(_lib()[0].BitdeltaSmallMatmulBf16Isa())


def build_target(arch: tuple[str, ...], target: str) -> int:
  """Builds the kernels with target flags ``arch`` (``("-march=native", "-mno-avx512bf16")``:
  the widening path with AVX-512; ``()``: portable) and registers the bf16 entry as FFI target
  ``target`` (pass it to `small_matmul_bf16`); returns its `bf16_isa`. For tests."""
  lib, reason = _build(arch)
  if lib is None:
    raise RuntimeError(f"the CPU small-matmul kernel cannot be built with {arch}: {reason}")
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.BitdeltaSmallMatmulBf16),
                              platform="cpu")
  return int(lib.BitdeltaSmallMatmulBf16Isa())


def usable(m: int, *dtypes) -> bool:
  """Whether the kernel path is taken for M rows of these dtypes here."""
  if os.environ.get("BITDELTA_SMALL_MATMUL", "1") == "0" or not MIN_ROWS <= m <= MAX_ROWS:
    return False
  if any(jnp.dtype(d) != jnp.float32 for d in dtypes):
    return False
  from pallas_kernels.platform import target_platform

  return target_platform() == "cpu" and _load() is None


def usable_bf16(m: int, x_dtype, w_dtype) -> bool:
  """Whether `dense` takes the bf16 kernel for M rows: bf16 x and W, ``1 <= M <= BF16_MAX_ROWS``."""
  if os.environ.get("BITDELTA_SMALL_MATMUL", "1") == "0" or not 1 <= m <= BF16_MAX_ROWS:
    return False
  if jnp.dtype(x_dtype) != jnp.bfloat16 or jnp.dtype(w_dtype) != jnp.bfloat16:
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _small_matmul_bf16(x, w, target):
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                          vmap_method="sequential")
  return call(x.astype(jnp.bfloat16), w)


def _bf16_fwd(x, w, target):
  return _small_matmul_bf16(x, w, target), (x, w)


def _bf16_bwd(target, res, g):
  x, w = res
  gx = jnp.dot(g, w.T.astype(jnp.float32)).astype(x.dtype)
  gw = jnp.dot(x.T.astype(jnp.float32), g).astype(w.dtype)
  return gx, gw


_small_matmul_bf16.defvjp(_bf16_fwd, _bf16_bwd)


def small_matmul_bf16(x_MxK: jax.Array, w_KxN: jax.Array, *, target: str = _BF16_TARGET
                      ) -> jax.Array:
  """``bf16(x) · W`` for bf16 ``W``, f32 ``[M, N]`` (f32 sums) through the kernel (raises
  NotImplementedError if it cannot be built). ``target``: another build (`build_target`)."""
  reason = _load()
  if reason:
    raise NotImplementedError(reason)
  if jnp.dtype(w_KxN.dtype) != jnp.bfloat16:
    raise NotImplementedError(f"small_matmul_bf16 takes bf16 weights, got {w_KxN.dtype}")
  return _small_matmul_bf16(x_MxK, w_KxN, target)


def small_matmul(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` in f32 through the kernel (raises NotImplementedError if it cannot be built)."""
  reason = _load()
  if reason:
    raise NotImplementedError(reason)
  return _small_matmul(x_MxK, w_KxN)


def dense(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` in ``x.dtype``: a kernel where `usable` / `usable_bf16`, else XLA's dot."""
  return dense_f32(x_MxK, w_KxN).astype(x_MxK.dtype)


def dense_f32(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` with f32 sums, f32: the kernels where they run, else XLA's dot."""
  m = x_MxK.shape[0]
  if usable(m, x_MxK.dtype, w_KxN.dtype):
    return small_matmul(x_MxK, w_KxN)
  if usable_bf16(m, x_MxK.dtype, w_KxN.dtype):
    return small_matmul_bf16(x_MxK, w_KxN)
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)
