"""CPU path: base GEMM by XLA, delta term by a small C++ kernel called through `jax.ffi`.

Why: on CPU a naive unpack-then-dot materialises a ``[K, N]`` f32 sign matrix per call and
costs ~11x the base GEMV at batch 1. The kernel in ``cpu_kernel.cc`` groups the rows by slot
(each slot present reads its bits once per block of rows) and picks a strategy per slot by its
row count:

* few rows (decode): ``x·S = 2·x·B − rowsum(x)``, summing ``B``'s rows through lookups in two
  16-entry tables per 8 rows of K (T-MAC style: ``vpermps`` looks up a nibble of packed bits for
  16 columns at once with AVX-512; with AVX2 two 8-entry ``vpermps`` and a blend for 8 columns; a
  portable loop elsewhere). Tables are built once per row and reused over all columns.
* many rows of one slot (prefill): per 64-column panel, ``S`` is expanded once to ±1 f32 in a
  scratch buffer that stays in L2, then an AVX-512 FMA micro-kernel (6 rows x 64 columns of
  accumulators) runs every row of the slot over it: one extra small-GEMM pass.

The switch is at ``expand_rows`` rows of one slot: `fused_call`'s argument, else
``$BITDELTA_CPU_EXPAND_ROWS``, else the kernel's measured default (bench/results/kernels/cpu_delta.md).
``expand_rows=1`` forces expand-then-FMA for every slot, a huge value forces the LUT (tests).

From `MERGED_MIN_ROWS` f32 rows `delta_matmul_cpu` takes the whole product: from
`EXPAND_MIN_ROWS` rows a batch whose rows all use one variant slot (a prefill chunk of one
prompt) runs XLA's dot on ``W + α⊙S`` expanded by ``cpu_expand_kernel.cc`` (XLA's GEMM is faster
than the merged micro-kernel at hundreds of rows, and writing W + α⊙S costs about as much as the
merged kernel's extra time at ~100 rows); any other batch `merged_call`
(``BITDELTA_CPU_EXPAND=0``: always `merged_call`). Decode rows (1-16) take `cpu_rows` in
`DeltaDense` instead.

Numerics: delta term accumulated in f32 from f32 x, α applied in the kernel's epilogue; the
base product is ``jnp.dot(x, w_base, preferred_element_type=f32)`` (for 2-16 f32 rows the
`pallas_kernels.small_matmul` kernel; for bf16 x and W_base `cpu_bf16.dense`: its kernel at
one row, else XLA's dot with f32 sums); the sum is cast to ``x.dtype``.

Backend: host CPU only. The kernel is compiled on first use with the system ``g++``
(``-O3 -march=native``; a persistent thread pool splits rows or columns once a call is big
enough, ``$BITDELTA_CPU_THREADS`` caps it) and cached under ``~/.cache/bitdelta_jax``
(``$BITDELTA_CACHE``: `pallas_kernels.cache.cache_root`). With no compiler, `unavailable_reason()` says why and
`api.delta_matmul` falls back to the pure-XLA path.
"""

from __future__ import annotations

import ctypes
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import settings
from pallas_kernels.native import registry
from pallas_kernels.native.registry import NativeKernel

_SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "bitdelta_delta_matmul"
_MERGED_TARGET = "bitdelta_delta_matmul_merged"
_EXPAND_SOURCE = pathlib.Path(__file__).with_name("cpu_expand_kernel.cc")
_EXPAND_TARGET = "bitdelta_delta_expand"
# f32 rows from which `delta_matmul_cpu` computes the whole product in the kernel
# (`merged_call`) instead of XLA's GEMM + the delta kernel (bench/results/kernels/cpu_delta.md).
MERGED_MIN_ROWS = 32
# From this many rows a chunk of one slot takes XLA's dot on the expanded weight. In-process TTFT
# of a variant's prompt on SmolLM2 f32 (2 cores): 40 tokens (a 64-row chunk) 125 ms merged vs
# 148 ms expanded (base 110); 120 tokens (128 rows) 270 vs 258 ms; 240 tokens 472 vs 451 ms.
EXPAND_MIN_ROWS = 128


KERNELS = (
  NativeKernel("delta_term", _SOURCE, ((_TARGET, "BitdeltaDeltaMatmul"),
                                       (_MERGED_TARGET, "BitdeltaDeltaMatmulMerged")),
               "the CPU delta kernel"),
  NativeKernel("delta_expand", _EXPAND_SOURCE, ((_EXPAND_TARGET, "BitdeltaDeltaExpand"),),
               "the CPU expand kernel"),
)


def _load() -> tuple[ctypes.CDLL | None, str | None]:
  """Builds (once per machine and source version) and registers the kernels: the delta
  term's library, or why it (or the expansion) cannot be built."""
  lib, reason = registry.load(KERNELS[0])
  if lib is None:
    return None, reason
  expand, reason = registry.load(KERNELS[1])
  return (lib, None) if expand is not None else (None, reason)


def isa() -> int | None:
  """The tile the native build runs: 512 (AVX-512), 2 (AVX2), 0 (portable); None if unbuilt."""
  lib, _ = _load()
  return None if lib is None else int(lib.BitdeltaDeltaMatmulIsa())


def build_target(arch: tuple[str, ...], target: str) -> int:
  """Builds the kernel with target flags ``arch`` (e.g. ``("-march=native", "-mno-avx512f")``
  for the AVX2 tile on an AVX-512 machine, ``()`` for the portable loop) and registers it as
  FFI target ``target`` (pass it to `fused_call`; its merged entry as ``target + "_merged"``
  for `merged_call`); returns the tile it runs. For tests of the paths this machine's native
  build does not take."""
  return int(registry.build_variant(KERNELS[0], arch, target).BitdeltaDeltaMatmulIsa())


def unavailable_reason() -> str | None:
  """None if the C++ kernel can run here, else why not."""
  from pallas_kernels.platform import target_platform

  if target_platform() != "cpu":
    return f"the C++ delta kernel runs on the host CPU; the target platform is {target_platform()}"
  return _load()[1]


def shapes_supported(x_shape, w_shape, bits_shape, scale_shape, group_k: int) -> str | None:
  """None if the kernel takes these shapes, else a readable reason."""
  k, n = w_shape
  if len(x_shape) != 2 or x_shape[1] != k:
    return f"x must be [M, {k}], got {tuple(x_shape)}"
  if bits_shape[-2] * 8 < k or bits_shape[-1] != n:
    return f"bits {tuple(bits_shape)} do not cover w_base {tuple(w_shape)}"
  if scale_shape[-1] not in (1, n):
    return f"scale last dim must be 1 or {n}, got {scale_shape[-1]}"
  return None


def expand_rows_default() -> int:
  """``$BITDELTA_CPU_EXPAND_ROWS`` if set, else 0 (the kernel's own default)."""
  return settings.get("BITDELTA_CPU_EXPAND_ROWS")


def fused_call(
  x,
  bits,
  scale,
  slots,
  base,
  *,
  group_k: int,
  target: str = _TARGET,
  expand_rows: int | None = None,
) -> jax.Array:
  """``base + α ⊙ (x·S)`` per row, f32 ``[M, N]``; bits ``[S, R, N]``; slots ``[M]`` (<0: base).
  ``target``: another build of the kernel (`build_target`). ``expand_rows``: a slot with at
  least this many rows takes expand-then-FMA, fewer the LUT (None: `expand_rows_default`)."""
  if expand_rows is None:
    expand_rows = expand_rows_default()
  call = jax.ffi.ffi_call(
    target,
    jax.ShapeDtypeStruct(base.shape, jnp.float32),
    vmap_method="sequential",
    input_output_aliases={4: 0},
  )
  return call(
    x.astype(jnp.float32),
    bits.astype(jnp.uint8),
    scale.astype(jnp.float32),
    slots.astype(jnp.int32),
    base.astype(jnp.float32),
    group_k=np.int64(group_k),
    expand_rows=np.int64(expand_rows),
  )


def merged_call(
  x,
  w_base,
  bits,
  scale,
  slots,
  *,
  group_k: int,
  target: str = _MERGED_TARGET,
  expand_rows: int | None = None,
) -> jax.Array:
  """``x·W_base + α ⊙ (x·S)`` per row, f32 ``[M, N]``, base GEMM included (many f32 rows):
  rows of a slot with at least ``expand_rows`` rows run over ``W_base + α ⊙ S`` expanded per
  panel, others over ``W_base`` (small slots then add their delta by the LUT). ``expand_rows``
  None: `expand_rows_default` (0: the kernel's default, 8)."""
  if expand_rows is None:
    expand_rows = expand_rows_default()
  call = jax.ffi.ffi_call(
    target,
    jax.ShapeDtypeStruct((x.shape[0], w_base.shape[1]), jnp.float32),
    vmap_method="sequential",
  )
  return call(
    x.astype(jnp.float32),
    w_base.astype(jnp.float32),
    bits.astype(jnp.uint8),
    scale.astype(jnp.float32),
    slots.astype(jnp.int32),
    group_k=np.int64(group_k),
    expand_rows=np.int64(expand_rows),
  )


def expand_call(w_base, bits, scale, slot, *, group_k: int) -> jax.Array:
  """``W_base + α_s ⊙ S_s`` for the one slot ``slot`` (an int32 scalar array), f32 ``[K, N]``
  (``cpu_expand_kernel.cc``)."""
  call = jax.ffi.ffi_call(_EXPAND_TARGET, jax.ShapeDtypeStruct(w_base.shape, jnp.float32),
                          vmap_method="sequential")
  n = w_base.shape[1]
  return call(w_base.astype(jnp.float32), bits.astype(jnp.uint8),
              jnp.broadcast_to(scale.astype(jnp.float32), (bits.shape[0], n)),
              jnp.reshape(slot, (1,)).astype(jnp.int32), group_k=np.int64(group_k))


def _one_slot_or_merged(x, w_base, bank, scales, slots, *, group_k: int) -> jax.Array:
  """Many f32 rows. When every row uses one variant slot s (a prefill chunk of one variant's
  prompt: padding tokens take the last token's slot): XLA's dot on ``W_eff = W + α_s⊙S_s``
  (`expand_call`). Otherwise `merged_call`. A ``lax.cond`` picks at run time."""
  s = jnp.max(slots)
  one_slot = (s >= 0) & jnp.all(slots == s)
  return jax.lax.cond(
    one_slot,
    lambda x: jnp.dot(x, expand_call(w_base, bank, scales, s, group_k=group_k)),
    lambda x: merged_call(x, w_base, bank, scales, slots, group_k=group_k), x)


def delta_matmul_cpu(x, w_base, bits, scale, slot_ids=None, *, group_k: int) -> jax.Array:
  """y = x·W_base + α ⊙ (x·S); see `api.delta_matmul`. ``group_k`` is the group size in use."""
  reason = unavailable_reason() or shapes_supported(
    x.shape, w_base.shape, bits.shape, scale.shape, group_k
  )
  if reason:
    raise NotImplementedError(reason)
  if slot_ids is None:
    bank, scales = bits[None], scale[None]
    slots = jnp.zeros((x.shape[0],), jnp.int32)
  else:
    bank, scales = bits, scale
    slots = jnp.where(slot_ids == 0, -1, slot_ids).astype(jnp.int32)  # slot 0: base only
  f32 = x.dtype == w_base.dtype == jnp.float32
  if f32 and x.shape[0] >= MERGED_MIN_ROWS and settings.get("BITDELTA_CPU_MERGED"):
    if x.shape[0] < EXPAND_MIN_ROWS or not settings.get("BITDELTA_CPU_EXPAND"):
      return merged_call(x, w_base, bank, scales, slots, group_k=group_k)
    return _one_slot_or_merged(x, w_base, bank, scales, slots, group_k=group_k)
  from pallas_kernels.small_matmul.cpu import dense_f32

  # f32 rows: the f32 small-M kernel for 2-16 rows; bf16 x and W_base: `cpu_bf16.dense` (exact
  # bf16 products, f32 sums; x.astype(f32) in fused_call is exact too)
  base = dense_f32(x, w_base)
  return fused_call(x, bank, scales, slots, base, group_k=group_k).astype(x.dtype)
