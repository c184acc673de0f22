"""`quant_matmul`: a Linear layer's product over a ggml-quantized base (Q8_0 / Q4_0 / Q4_1
blocks, `blocks.QuantizedKernel`), with the 1-bit delta term of each row's variant slot.

Implementations (``implementation=``), in order of preference:

* ``"cpu_rows"``: the native CPU kernel (`cpu_rows`), blocks dequantized in registers and every
  slot's delta fused into the same pass; one CPU device. x is quantized per 32-block as
  llama.cpp does by default (int8); ``$BITDELTA_QUANT_ACTIVATIONS=f32`` keeps it f32 (``auto``:
  int8 for Q4_0 / Q4_1, f32 for Q8_0; `cpu_rows.activations_for`).
* ``"mosaic_gpu"``: Mosaic GPU kernels for Hopper (`mosaic_gpu`): the blocks TMA-copied and
  dequantized in registers to x's dtype (bf16 / f16 x only), each slot's delta term fused;
  ``interpret=True`` runs them in the Mosaic GPU interpreter on CPU (tests).
* ``"reference"``: `reference.quant_matmul_reference` (dequantizes the whole matrix inside the
  program: any backend, the definition).

``implementation=None`` takes the first of the target platform's (`pallas_kernels.platform`:
the default backend, or the one `lowering_platform` sets) that can run: ``cpu_rows`` then the
reference on CPU, ``mosaic_gpu`` then the reference under CUDA, the reference elsewhere;
`fallback_reasons` says why each one before it could not. Naming one that cannot run raises
with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bits import DEFAULT_GROUP_K, group_k_for
from pallas_kernels.delta_matmul.api import check_delta_operands
from pallas_kernels.platform import hopper_reason, override, target_platform

from . import mosaic_gpu
from .blocks import QuantizedKernel
from .reference import quant_matmul_reference, with_reference_vjp

IMPLEMENTATIONS = ("cpu_rows", "mosaic_gpu", "reference")
_PREFERENCE = {"cpu": ("cpu_rows", "reference"), "cuda": ("mosaic_gpu", "reference")}
__all__ = ["IMPLEMENTATIONS", "fallback_reasons", "quant_matmul", "unavailable_reason"]


def _cpu_rows():
  try:
    from . import cpu_rows
  except ImportError:  # not built into this tree
    return None
  return cpu_rows


def unavailable_reason(name: str, x: jax.Array, qk: QuantizedKernel, bits=None,
                       group_k: int = DEFAULT_GROUP_K, *, interpret: bool = False) -> str | None:
  """None if ``name`` computes ``x · qk`` (+ the delta term of ``bits``, packed with
  ``group_k_for(K, group_k)``) on the target platform, else why not."""
  if name == "reference":
    return None
  if name == "cpu_rows":
    mod = _cpu_rows()
    if mod is None:
      return "the native quantized kernel is not part of this build"
    return mod.unavailable_reason() or mod.shapes_supported(x.shape[0], qk)
  if name == "mosaic_gpu":
    if reason := mosaic_gpu.unavailable_reason(interpret=interpret):
      return reason
    if not interpret:
      platform = target_platform()
      if platform != "cuda":
        note = "" if override() is None else " (set by lowering_platform)"
        return (f"the Mosaic GPU kernels need a CUDA GPU (Hopper), the target platform is "
                f"{platform!r}{note} (interpret=True runs them on CPU)")
      if reason := hopper_reason():
        return reason
    g = group_k_for(qk.shape[0], group_k)
    return mosaic_gpu.shapes_supported(x.shape, x.dtype, qk, None if bits is None else bits.shape,
                                       g)
  raise ValueError(f"unknown implementation {name!r}; choose from {IMPLEMENTATIONS} or None")


def fallback_reasons(x: jax.Array, qk: QuantizedKernel, bits=None,
                     group_k: int = DEFAULT_GROUP_K, *,
                     interpret: bool = False) -> dict[str, str | None]:
  """The target platform's implementations in preference order, each with why it cannot run
  (None: it can)."""
  names = _PREFERENCE.get(target_platform(), ("reference",))
  return {name: unavailable_reason(name, x, qk, bits, group_k, interpret=interpret)
          for name in names}


def quant_matmul(x: jax.Array, qk: QuantizedKernel, bits: jax.Array | None = None,
                 scale: jax.Array | None = None, slot_ids: jax.Array | None = None, *,
                 group_k: int, implementation: str | None = None, interpret: bool = False,
                 preferred_element_type=None) -> jax.Array:
  """``[M, N]``: ``x · dequant(qk)`` (+ ``α_s ⊙ (x · S_s)`` per row, as `delta_matmul`).

  Args:
    x: ``[M, K]`` activations (used in f32).
    qk: the ``[K, N]`` blocks.
    bits, scale, slot_ids: None (the plain product), one variant (``[KP, N]``, ``[1|N]``,
      None) or a bank (``[S, KP, N]``, ``[S, N]``, ``[M]``; slot 0 = base only).
    group_k: the bit planes' packing ``group_k`` (the group used is
      ``pallas_kernels.bits.group_k_for(K, group_k)``, as `delta_matmul`).
    implementation: one of `IMPLEMENTATIONS`, or None for the best that can run.
    interpret: run the Mosaic GPU kernels in the interpreter (tests, CPU).
    preferred_element_type: the result's dtype (default ``x.dtype``); sums are f32.
  """
  if x.ndim != 2 or x.shape[1] != qk.shape[0]:
    raise ValueError(f"x {tuple(x.shape)} does not multiply a {qk.format} kernel {qk.shape}")
  g = group_k_for(qk.shape[0], group_k)
  check_delta_operands(x, qk.shape, bits, scale, slot_ids, g)
  out = jnp.dtype(preferred_element_type or x.dtype)
  if implementation is None:
    reasons = fallback_reasons(x, qk, bits, g, interpret=interpret)
    implementation = next(name for name, why in reasons.items() if why is None)
  elif reason := unavailable_reason(implementation, x, qk, bits, g, interpret=interpret):
    raise RuntimeError(f"quant_matmul implementation {implementation!r} cannot run: {reason}")
  if implementation == "reference":
    y = quant_matmul_reference(x, qk, bits, scale, slot_ids, group_k=g)
  elif implementation == "mosaic_gpu":
    kernel = lambda x, s, q, b, i: mosaic_gpu.quant_matmul_mosaic(  # noqa: E731
      x, q, b, s, i, group_k=g, interpret=interpret)
    y = with_reference_vjp(kernel, g)(x, scale, qk, bits, slot_ids)
  else:
    y = _cpu_rows().rows_call(x, qk, bits, scale, slot_ids, group_k=g)
  return y.astype(out)


def quant_matmul_many(x: jax.Array, qks, banks=None, slot_ids: jax.Array | None = None, *,
                      group_k: int, preferred_element_type=None) -> list[jax.Array]:
  """``[quant_matmul(x, qk, *bank, slot_ids) for each]``: the products of one x (a layer's
  q/k/v, its gate/up) in one call of the CPU rows kernel where it takes them all
  (`cpu_rows.rows_call_many`: x quantized once, one thread-pool run, the same bits as the
  separate calls), else one `quant_matmul` each. ``banks``: None (plain products) or one
  ``(bits [S, KP, N_i], scale [S, N_i])`` per product, sharing ``slot_ids``."""
  qks = list(qks)
  mod = _cpu_rows()
  bits = None if banks is None else [b for b, _ in banks]
  scales = None if banks is None else [s for _, s in banks]
  out = jnp.dtype(preferred_element_type or x.dtype)
  if mod is not None and x.ndim == 2 and mod.many_unavailable_reason(x, qks, bits) is None:
    g = group_k_for(qks[0].shape[0], group_k)
    for i, qk in enumerate(qks):
      if x.shape[1] != qk.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} does not multiply a {qk.format} kernel {qk.shape}")
      check_delta_operands(x, qk.shape, None if bits is None else bits[i],
                           None if scales is None else scales[i], slot_ids, g)
    ys = mod.rows_call_many(x, qks, bits, scales, slot_ids, group_k=g)
    return [y.astype(out) for y in ys]
  return [quant_matmul(x, qk, *(() if banks is None else (*banks[i], slot_ids)), group_k=group_k,
                       preferred_element_type=preferred_element_type)
          for i, qk in enumerate(qks)]
