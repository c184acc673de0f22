"""The LM head's products, dispatch by backend and shape: `logits` (the base head) and
`add_packed_products` (a bank of 1-bit embedding / LM-head deltas read packed).

`logits(h, w, tied=...)`: f32 ``h · Eᵀ`` (tied embedding ``E [V, D]``) or ``h · W`` (``W [D, V]``).

* ``"cpu"``: the f32 NT kernel (`pallas_kernels.small_matmul.cpu.small_matmul_nt`, tied head,
  f32 h and E, up to ``NT_MAX_ROWS`` rows): XLA's f32 ``h · Eᵀ`` reads E at ~half the bandwidth
  (bench/results/kernels/cpu_head.md).
* ``"cpu_bf16"``: the bf16 kernels (`pallas_kernels.small_matmul.cpu_bf16`: NT for a tied head up
  to ``NT_MAX_ROWS`` rows, NN for an untied one up to ``MAX_ROWS``): XLA's bf16 ``h · Eᵀ`` is
  ~8x slower than f32 at one row.
* ``"xla"``: an einsum with f32 sums (`reference.logits_reference`), any backend.

`add_packed_products(base, h, bits, α, slots)`: ``base + α[s] ⊙ (h · S[s])`` per row.

* ``"mosaic_gpu"``: the Mosaic GPU bank kernel (`mosaic_gpu.packed_products`: the delta GEMM's
  bits→±1 expansion in shared memory and wgmma, per-column α, no base operand), when the target
  platform is CUDA (sm_90 or newer if there is a device) and ``group_k % 64 == 0``;
  ``interpret=True`` runs it in the Mosaic GPU interpreter. Its gradient is the reference's.
* ``"cpu"``: the fused native kernel (`pallas_kernels.delta_matmul.cpu.fused_call`: bits read
  once per row block; rows of the base slot and slots without a delta skipped), under a
  ``lax.cond`` that skips it when no row has such a slot (it would still walk the vocabulary).
  Its gradient is the reference's (the kernel has none): `packed_products_fused`.
* ``"reference"``: `reference.packed_products_reference`, any backend.

``implementation=None`` takes the first that can run; `fallback_reasons` / `packed_fallback_reasons`
say why each one before it could not. The CPU kernels run on one device only (their FFI calls do
not partition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.bits import DEFAULT_GROUP_K
from pallas_kernels.delta_matmul import cpu as delta_cpu
from pallas_kernels.platform import hopper_reason, override, target_platform
from pallas_kernels.quant_matmul import QuantizedKernel, quant_matmul
from pallas_kernels.small_matmul import cpu, cpu_bf16
from pallas_kernels.small_matmul.api import one_cpu_device_reason

from . import mosaic_gpu
from .reference import logits_reference, packed_products_reference

IMPLEMENTATIONS = ("cpu", "cpu_bf16", "xla")
PACKED_IMPLEMENTATIONS = ("mosaic_gpu", "cpu", "reference")
__all__ = ["IMPLEMENTATIONS", "PACKED_IMPLEMENTATIONS", "add_packed_products", "fallback_reasons",
           "logits", "packed_fallback_reasons", "packed_products_fused", "packed_products_gpu",
           "packed_unavailable_reason", "unavailable_reason"]


def unavailable_reason(name: str, rows: int, h_dtype, w_dtype, *, tied: bool) -> str | None:
  """None if ``name`` takes ``rows`` rows of the head here, else why not."""
  if name == "xla":
    return None
  if name == "cpu":
    if not tied:
      return "the f32 kernel is the tied head's (x · Eᵀ); an untied f32 head stays with XLA"
    if not cpu.usable_nt(rows, h_dtype, w_dtype):
      return (f"{rows} rows of h {jnp.dtype(h_dtype)}, E {jnp.dtype(w_dtype)}: the f32 NT kernel "
              f"takes {cpu.NT_MIN_ROWS}-{cpu.NT_MAX_ROWS} f32 rows and an f32 E on the CPU, "
              "built, BITDELTA_SMALL_MATMUL and BITDELTA_CPU_HEAD not 0")
    return one_cpu_device_reason("the f32 NT kernel")
  if name == "cpu_bf16":
    usable = cpu_bf16.usable_nt if tied else cpu_bf16.usable
    limit = cpu_bf16.NT_MAX_ROWS if tied else cpu_bf16.MAX_ROWS
    if not usable(rows, h_dtype, w_dtype):
      return (f"{rows} rows of h {jnp.dtype(h_dtype)}, w {jnp.dtype(w_dtype)}: the bf16 "
              f"{'NT' if tied else 'NN'} kernel takes 1-{limit} bf16 rows and bf16 weights on "
              "the CPU, built, BITDELTA_SMALL_MATMUL not 0")
    return one_cpu_device_reason("the bf16 kernel")
  raise ValueError(f"unknown implementation {name!r}; choose from {IMPLEMENTATIONS} or None")


def fallback_reasons(rows: int, h_dtype, w_dtype, *, tied: bool) -> dict[str, str | None]:
  """Each implementation in preference order with why it cannot run (None: it can)."""
  return {n: unavailable_reason(n, rows, h_dtype, w_dtype, tied=tied) for n in IMPLEMENTATIONS}


def logits(h: jax.Array, w: jax.Array, *, tied: bool,
           implementation: str | None = None) -> jax.Array:
  """f32 logits ``[..., V]`` of h ``[..., D]``: ``h · Eᵀ`` (``tied``, w ``E [V, D]``) or
  ``h · W`` (w ``W [D, V]``). A ggml-quantized head or tied embedding
  (`pallas_kernels.quant_matmul.QuantizedKernel`, always ``[D, V]``) goes to
  `pallas_kernels.quant_matmul.quant_matmul`, which picks its own kernel."""
  *lead, d = h.shape
  rows = 1
  for size in lead:
    rows *= size
  if isinstance(w, QuantizedKernel):
    y = quant_matmul(h.reshape(rows, d), w, group_k=DEFAULT_GROUP_K,
                     preferred_element_type=jnp.float32)
    return y.reshape(*lead, -1)
  if implementation is None:
    reasons = fallback_reasons(rows, h.dtype, w.dtype, tied=tied)
    implementation = next(name for name, why in reasons.items() if why is None)
  elif reason := unavailable_reason(implementation, rows, h.dtype, w.dtype, tied=tied):
    raise RuntimeError(f"LM head implementation {implementation!r} cannot run: {reason}")
  if implementation == "xla":
    return logits_reference(h, w, tied=tied)
  if implementation == "cpu":
    fn = cpu.small_matmul_nt
  else:
    fn = cpu_bf16.small_matmul_bf16_nt if tied else cpu_bf16.small_matmul_bf16
  return fn(h.reshape(rows, d), w).reshape(*lead, -1)


def packed_unavailable_reason(name: str, h_shape=None, bits_shape=None, group_k: int | None = None,
                              *, interpret: bool = False) -> str | None:
  """None if ``name`` can compute the packed bank product here (for h ``[M, D]`` and bits
  ``[S, D_pad/8, V]`` with ``group_k``, where given), else why not."""
  if name == "reference":
    return None
  if name == "cpu":
    if (platform := target_platform()) != "cpu":
      return f"the fused packed-delta kernel runs on the CPU, the target platform is {platform!r}"
    return one_cpu_device_reason("the fused packed-delta kernel") or delta_cpu.unavailable_reason()
  if name == "mosaic_gpu":
    if reason := mosaic_gpu.unavailable_reason(interpret=interpret):
      return reason
    if h_shape is not None and (reason := mosaic_gpu.shapes_supported(h_shape, bits_shape,
                                                                      group_k)):
      return reason
    if interpret:
      return None
    if (platform := target_platform()) != "cuda":
      note = "" if override() is None else " (set by lowering_platform)"
      return (f"the Mosaic GPU kernel needs CUDA, the target platform is {platform!r}{note} "
              "(interpret=True runs it on CPU)")
    return hopper_reason()
  raise ValueError(f"unknown implementation {name!r}; choose from {PACKED_IMPLEMENTATIONS} or None")


def packed_fallback_reasons(h_shape=None, bits_shape=None, group_k: int | None = None,
                            ) -> dict[str, str | None]:
  """Each packed implementation in preference order with why it cannot run (None: it can)."""
  return {name: packed_unavailable_reason(name, h_shape, bits_shape, group_k)
          for name in PACKED_IMPLEMENTATIONS}


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def packed_products_fused(base_MxV, h_MxK, bits_SxRxV, scale_SxV, slots_M, group_k: int):
  """`reference.packed_products_reference` by the fused native CPU kernel (slots ``< 0``: base
  only); its gradient is the reference's."""
  return delta_cpu.fused_call(h_MxK, bits_SxRxV, scale_SxV, slots_M, base_MxV, group_k=group_k)


def _fused_fwd(base, h, bits, scale, slots, group_k):
  return packed_products_fused(base, h, bits, scale, slots, group_k), (base, h, bits, scale, slots)


def _fused_bwd(group_k, res, ct):
  base, h, bits, scale, slots = res
  _, vjp = jax.vjp(lambda b, x, a: packed_products_reference(b, x, bits, a, slots, group_k),
                   base, h, scale)
  gb, gh, ga = vjp(ct)
  return gb, gh, None, ga, None


packed_products_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def packed_products_gpu(base_MxV, h_MxK, bits_SxRxV, scale_SxV, slots_M, group_k: int,
                        interpret: bool = False):
  """`reference.packed_products_reference` by the Mosaic GPU bank kernel (slots ``<= 0``: base
  only); its gradient is the reference's."""
  return mosaic_gpu.packed_products(base_MxV, h_MxK, bits_SxRxV, scale_SxV, slots_M,
                                    group_k=group_k, interpret=interpret)


def _gpu_fwd(base, h, bits, scale, slots, group_k, interpret):
  out = packed_products_gpu(base, h, bits, scale, slots, group_k, interpret)
  return out, (base, h, bits, scale, slots)


def _gpu_bwd(group_k, interpret, res, ct):
  return _fused_bwd(group_k, res, ct)


packed_products_gpu.defvjp(_gpu_fwd, _gpu_bwd)


def add_packed_products(base_MxV: jax.Array, h_MxK: jax.Array, bits_SxRxV: jax.Array,
                        scale_SxV: jax.Array, slots_M: jax.Array, *, group_k: int,
                        implementation: str | None = None, interpret=False) -> jax.Array:
  """f32 ``base + α[s] ⊙ (h · S[s])`` per row m, ``s = slots[m]``; rows of slot 0 and of slots
  whose α is all zero (no delta loaded) keep ``base``. h is used in f32. ``interpret``: run the
  Mosaic GPU kernel in its interpreter (with ``implementation="mosaic_gpu"``)."""
  h = h_MxK.astype(jnp.float32)
  used = jnp.any(scale_SxV != 0, axis=1)  # [S]
  slots = slots_M.astype(jnp.int32)
  slots = jnp.where((slots > 0) & used[slots], slots, -1)
  shapes = (h.shape, bits_SxRxV.shape, group_k)
  if implementation is None:
    reasons = packed_fallback_reasons(*shapes)
    implementation = next(name for name, why in reasons.items() if why is None)
  elif reason := packed_unavailable_reason(implementation, *shapes, interpret=bool(interpret)):
    raise RuntimeError(f"packed LM-head implementation {implementation!r} cannot run: {reason}")
  if implementation == "reference":
    return packed_products_reference(base_MxV, h, bits_SxRxV, scale_SxV, slots, group_k)
  if implementation == "mosaic_gpu":
    kernel = lambda y: packed_products_gpu(  # noqa: E731
      y, h, bits_SxRxV, scale_SxV, slots, group_k, interpret)
  else:
    kernel = lambda y: packed_products_fused(y, h, bits_SxRxV, scale_SxV, slots, group_k)  # noqa: E731
  # a batch without such a row never enters the kernel (it would still walk the vocabulary)
  return jax.lax.cond(jnp.any(slots >= 0), kernel, lambda y: y, base_MxV.astype(jnp.float32))
