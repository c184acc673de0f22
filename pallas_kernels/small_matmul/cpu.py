"""Small-M f32 matmuls on the host CPU (decode steps): C++ kernels called through `jax.ffi`.

Why: a decode step multiplies a few rows by every weight matrix. XLA's CPU dot is good at 1 row
(a GEMV near one core's bandwidth) and at many rows, but between 2 and 16 rows it runs far below
both the bandwidth and the FLOP rate: at 8 rows it costs nearly what 32 rows do.
``cpu_kernel.cc`` streams W once per 8 rows with all cores (a persistent thread pool splits
the columns). `DeltaDense` uses it for ``MIN_ROWS <= M <= MAX_ROWS`` f32 rows on the CPU
backend; everything else stays with XLA (see bench/results/kernels/small_matmul_cpu.md).
bf16 weights have their own kernels (`cpu_bf16`: the same source and library, its loops
templated on the weight type); `dense_f32` dispatches to either.
The NT kernel ``x · Eᵀ`` is the tied LM head's (``E [V, D]``, `small_matmul_nt`): XLA's f32
``h · Eᵀ`` reads SmolLM2's 113 MB embedding at the memory bandwidth at one row but at 60-50% of it
at 2-16 rows; the kernel streams E once per call with all cores for ``NT_MIN_ROWS <= M <=
NT_MAX_ROWS`` (0.60-0.81x XLA's time there: bench/results/kernels/cpu_head.md). One row too since the
pool's callers stopped sleeping for their workers (`pallas_kernels/native/pool.h`): the head
alone 0.85-0.89x XLA's time, the real model's in-process one-row decode step 25.1-26.0 ms
against 28.1-29.5 ms with XLA's dot (two interleaved runs).

Numerics: f32 products and sums in another order than XLA's (agrees to rounding; tested against
`reference.small_matmul_reference`). Backend: host CPU; built on first use like
`pallas_kernels.delta_matmul.cpu` (``g++ -O3 -march=native``); ``$BITDELTA_CPU_THREADS`` caps
the pool; ``BITDELTA_SMALL_MATMUL=0`` turns them (and the bf16 kernels) off,
``BITDELTA_CPU_HEAD=0`` only the f32 NT kernel (read when a program is traced).
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax
import jax.numpy as jnp

from pallas_kernels import settings
from pallas_kernels.native import registry
from pallas_kernels.native.registry import NativeKernel

MIN_ROWS, MAX_ROWS = 2, 16
NT_MIN_ROWS, NT_MAX_ROWS = 1, 16
_SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "bitdelta_small_matmul"  # a build's name: its f32 NN entry, the others suffixed

# one library for f32 and bf16 weights (`cpu_bf16` calls the last two entries)
KERNELS = (NativeKernel("small_matmul", _SOURCE, (
  (_TARGET, "BitdeltaSmallMatmul"), (_TARGET + "_nt", "BitdeltaSmallMatmulNt"),
  (_TARGET + "_bf16", "BitdeltaSmallMatmulBf16"),
  (_TARGET + "_bf16_nt", "BitdeltaSmallMatmulBf16Nt")),
  "the CPU small-matmul kernel"),)


def build_target(arch: tuple[str, ...], target: str) -> ctypes.CDLL:
  """Builds the kernels with target flags ``arch`` (``()``: portable code, no AVX-512) and
  registers them as ``target`` (f32 NN), ``target + "_nt"``, ``target + "_bf16"`` and
  ``target + "_bf16_nt"`` (pass ``target`` to the functions here and in `cpu_bf16`): for tests
  of the paths this machine's native build does not take."""
  return registry.build_variant(KERNELS[0], arch, target)


def _load() -> str | None:
  """Builds and registers the kernels (f32 and bf16: one library); None or why not."""
  return registry.load(KERNELS[0])[1]


def usable(m: int, *dtypes) -> bool:
  """Whether the kernel path is taken for M rows of these dtypes here."""
  if not settings.get("BITDELTA_SMALL_MATMUL") or not MIN_ROWS <= m <= MAX_ROWS:
    return False
  if any(jnp.dtype(d) != jnp.float32 for d in dtypes):
    return False
  from pallas_kernels.platform import target_platform

  return target_platform() == "cpu" and _load() is None


def usable_nt(m: int, x_dtype, e_dtype) -> bool:
  """Whether the NT kernel is taken for M f32 rows and an f32 E here (``BITDELTA_CPU_HEAD``)."""
  if not settings.get("BITDELTA_CPU_HEAD") or not NT_MIN_ROWS <= m <= NT_MAX_ROWS:
    return False
  if not settings.get("BITDELTA_SMALL_MATMUL"):
    return False
  if jnp.dtype(x_dtype) != jnp.float32 or jnp.dtype(e_dtype) != jnp.float32:
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


def _call_nt(x, e, target):
  call = jax.ffi.ffi_call(target + "_nt", jax.ShapeDtypeStruct((x.shape[0], e.shape[0]),
                                                              jnp.float32),
                          vmap_method="sequential")
  return call(x, e)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _nt(x, e, target):
  return _call_nt(x, e, target)


def _nt_fwd(x, e, target):
  return _call_nt(x, e, target), (x, e)


def _nt_bwd(target, res, g):
  x, e = res
  return g @ e, g.T @ x


_nt.defvjp(_nt_fwd, _nt_bwd)


def small_matmul_nt(x_MxK: jax.Array, e_NxK: jax.Array, *, target: str = _TARGET) -> jax.Array:
  """``x · Eᵀ`` in f32 for ``E [N, K]`` (a tied LM head) through the kernel (raises
  NotImplementedError if it cannot be built). ``target``: another build (`build_target`)."""
  reason = _load()
  if reason:
    raise NotImplementedError(reason)
  if jnp.dtype(x_MxK.dtype) != jnp.float32 or jnp.dtype(e_NxK.dtype) != jnp.float32:
    raise NotImplementedError(f"the f32 NT kernel takes f32 x and E, got {x_MxK.dtype}, "
                              f"{e_NxK.dtype}")
  return _nt(x_MxK, e_NxK, target)


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
