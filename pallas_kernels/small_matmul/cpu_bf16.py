"""Small-M matmuls with bf16 weights on the host CPU (decode steps): C++ through `jax.ffi`.

Why: bf16 weights are half the bytes of f32 ones and a decode step is bound by reading them,
but XLA's CPU bf16 dot is slow at one row (its ``x · Eᵀ`` LM head ~8x slower than f32 on
SmolLM2, the kernel ~15-25x faster than it). ``cpu_kernel.cc`` (the f32 kernels' source,
templated on the weight type; one library) has two kernels for bf16: NN
``x · W`` for ``[in, out]`` Linear kernels and NT ``x · Eᵀ`` for a tied embedding ``[V, D]``
used as the LM head. Where the build
has AVX-512 BF16 and the CPU reports it at run time they use ``vdpbf16ps`` (pairs of adjacent
K: W's rows interleaved on the fly, no repacked copy of W; E's rows hold the pairs already);
elsewhere W is widened to f32 by a shift and multiplied with FMAs (still half the bytes).
`DeltaDense`, the delta kernel's base product and the LM head take them for bf16 rows up to
`MAX_ROWS` / `NT_MAX_ROWS` (bench/results/kernels/cpu_bf16.md); above, XLA's dot with f32 sums
(`dense`): inside a model program XLA's CPU bf16 dot with a bf16 result ran 1.3-4.4x slower.

Numerics: x is rounded to bf16 first (a bf16 model's activations already are), so every
product is exact in f32; sums in f32 in another order than XLA's (tested against float64 on
the bf16 inputs, `reference.small_matmul_bf16_reference`). vdpbf16ps flushes denormals.
Backend: host CPU; built on first use like `cpu` (``g++ -O3 -march=native``), on the process's
one thread pool (``pallas_kernels/native/pool.h``); ``$BITDELTA_CPU_THREADS`` caps the pool;
``BITDELTA_SMALL_MATMUL=0`` turns the kernels off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import settings
from pallas_kernels.native import registry

from . import cpu

# Rows up to which the kernels run (bench/results/kernels/cpu_bf16.md, ratios to XLA inside programs
# over seven runs of the bench on this shared machine): the NN kernel beat XLA's dot with f32
# sums at one row in every run (0.22-0.72x), tied at 2-4 (0.83-1.45x, medians ~1.0) and lost at
# 8 in six of seven, so it runs where it wins: single-row decode steps. The NT kernel's median
# ratio to XLA's bf16 einsum over five runs: 0.06 at 1 row, 0.57 at 4, 0.76 at 8, 0.75 at 16,
# 0.92 at 64 (two of five above 1 there).
MAX_ROWS = 1
NT_MAX_ROWS = 16


def _load() -> str | None:
  """Builds (once per machine and source version) and registers the kernels; None or why not."""
  return cpu._load()


def isa() -> int | None:
  """The path the native build runs here: 1 ``vdpbf16ps``, 0 widen + FMA; None if unbuilt."""
  lib = registry.load(cpu.KERNELS[0])[0]
  return None if lib is None else int(lib.BitdeltaSmallMatmulBf16Isa())


def build_target(arch: tuple[str, ...], target: str) -> int:
  """Builds the kernels with target flags ``arch`` (``("-march=native", "-mno-avx512bf16")``:
  the widening path in AVX-512 code; ``()``: portable) and registers them under the build name
  ``target`` (`cpu.build_target`; pass ``target`` to the functions below); returns the `isa`
  that build runs. For tests of the paths this machine's native build does not take."""
  return int(cpu.build_target(arch, target).BitdeltaSmallMatmulBf16Isa())


def _usable(m: int, limit: int, x_dtype, w_dtype) -> bool:
  if not settings.get("BITDELTA_SMALL_MATMUL") or not 1 <= m <= limit:
    return False
  if jnp.dtype(x_dtype) != jnp.bfloat16 or jnp.dtype(w_dtype) != jnp.bfloat16:
    return False  # f32 rows with bf16 weights stay with XLA: no silent rounding of x
  from pallas_kernels.platform import target_platform

  return target_platform() == "cpu" and _load() is None


def usable(m: int, x_dtype, w_dtype) -> bool:
  """Whether the NN kernel is taken for M rows: bf16 x and W, ``1 <= M <= MAX_ROWS``, CPU."""
  return _usable(m, MAX_ROWS, x_dtype, w_dtype)


def usable_nt(m: int, x_dtype, e_dtype) -> bool:
  """Whether the NT kernel is taken for M rows: bf16 x and E, ``1 <= M <= NT_MAX_ROWS``, CPU."""
  return _usable(m, NT_MAX_ROWS, x_dtype, e_dtype)


def handles(x_dtype, w_dtype) -> bool:
  """Whether bf16 x and W are on the CPU: then `dense` is the matmul to use (kernel or not)."""
  from pallas_kernels.platform import target_platform

  bf = jnp.dtype(jnp.bfloat16)
  return jnp.dtype(x_dtype) == bf and jnp.dtype(w_dtype) == bf and target_platform() == "cpu"


def dense(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """``x · W`` for bf16 x and W on the CPU, f32: the NN kernel where `usable`, else XLA's dot
  with f32 sums (its bf16-result dot ran 1.3-4.4x slower inside a SmolLM2 program)."""
  if usable(x_MxK.shape[0], x_MxK.dtype, w_KxN.dtype):
    return small_matmul_bf16(x_MxK, w_KxN)
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)


def _ffi(target: str, x, w, n: int):
  call = jax.ffi.ffi_call(
    target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential"
  )
  return call(x.astype(jnp.bfloat16), w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _nn(x, w, target):
  return _ffi(target + "_bf16", x, w, w.shape[1])


def _nn_fwd(x, w, target):
  return _nn(x, w, target), (x, w)


def _nn_bwd(target, res, g):
  x, w = res
  gx = jnp.dot(g, w.astype(jnp.float32).T).astype(x.dtype)
  gw = jnp.dot(x.astype(jnp.float32).T, g).astype(w.dtype)
  return gx, gw


_nn.defvjp(_nn_fwd, _nn_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _nt(x, e, target):
  return _ffi(target + "_bf16_nt", x, e, e.shape[0])


def _nt_fwd(x, e, target):
  return _nt(x, e, target), (x, e)


def _nt_bwd(target, res, g):
  x, e = res
  gx = jnp.dot(g, e.astype(jnp.float32)).astype(x.dtype)
  ge = jnp.dot(g.T, x.astype(jnp.float32)).astype(e.dtype)
  return gx, ge


_nt.defvjp(_nt_fwd, _nt_bwd)


def _check(w) -> None:
  reason = _load()
  if reason:
    raise NotImplementedError(reason)
  if jnp.dtype(w.dtype) != jnp.bfloat16:
    raise NotImplementedError(f"the bf16 kernels take bf16 weights, got {w.dtype}")


def small_matmul_bf16(x_MxK: jax.Array, w_KxN: jax.Array, *, target: str = cpu._TARGET
                      ) -> jax.Array:
  """``bf16(x) · W`` for bf16 ``W [K, N]``: f32 ``[M, N]``, f32 sums (raises
  NotImplementedError if the kernels cannot be built). ``target``: another build's name
  (`build_target`)."""
  _check(w_KxN)
  return _nn(x_MxK, w_KxN, target)


def small_matmul_bf16_nt(x_MxK: jax.Array, e_NxK: jax.Array, *, target: str = cpu._TARGET
                         ) -> jax.Array:
  """``bf16(x) · Eᵀ`` for bf16 ``E [N, K]`` (a tied LM head): f32 ``[M, N]``, f32 sums."""
  _check(e_NxK)
  return _nt(x_MxK, e_NxK, target)
