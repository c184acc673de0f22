"""A 1-bit embedding / LM-head bank added to the logits on GPU, read packed (NVIDIA Hopper).

Why: a packed bank holds bits ``[S, D/8, V]`` and a per-token α ``[S, V]``; the reference
unpacks a dense ``[D, V]`` sign matrix per slot present (an embedding-sized tensor per step).
The head's delta term ``α[s] ⊙ (h · S[s])`` is the delta GEMM of a linear layer with a per-column
α and no base weight, so it runs on the fused delta GEMM's bank kernel
(`pallas_kernels.delta_matmul.mosaic_gpu.delta_bank_products`): bits streamed by TMA, expanded
to ±1 in shared memory per K step, one wgmma loop per slot with rows in a tile, slot 0 and
slots without rows never read. The base logits come from `api.logits` and are added after.

Numerics: h in f32 as the reference takes it, split into three bf16 pieces (``x·S`` by three
exact wgmmas per K step, f32 accumulation): as exact as an f32 dot; α applied in f32 in the
epilogue. Rows whose slot is 0 or negative (the api maps slots without a delta to -1) get
``base`` unchanged.

Backend: Mosaic GPU (sm_90a wgmma), kernel ``KERNEL_NAME``; ``interpret=True`` runs it in the
Mosaic GPU interpreter. Needs ``group_k % 64 == 0`` (`shapes_supported`); a vocabulary that is
not a multiple of the column tile is zero padded by the wrapper (a copy of the bank per call:
the shipped vocabularies are multiples of 64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.delta_matmul import mosaic_gpu as delta_mosaic

KERNEL_NAME = "bitdelta_head_bank"


def unavailable_reason(*, interpret: bool = False) -> str | None:
  """None if this jax can build (or with ``interpret`` run) the kernel, else why."""
  return delta_mosaic.unavailable_reason(interpret=interpret)


def shapes_supported(h_shape, bits_shape, group_k: int) -> str | None:
  """None if the kernel takes h ``[M, D]`` and bits ``[S, D_pad/8, V]``, else why not."""
  return delta_mosaic.bank_shapes_supported(h_shape, bits_shape, group_k, jnp.float32)


def packed_products(base_MxV, h_MxK, bits_SxRxV, scale_SxV, slots_M, *, group_k: int,
                    interpret=False) -> jax.Array:
  """``base + α[s] ⊙ (h · S[s])`` per row (``s <= 0``: base only), f32; the reference's
  semantics (`reference.packed_products_reference`)."""
  h = h_MxK.astype(jnp.float32)
  slots = jnp.where(slots_M > 0, slots_M, 0).astype(jnp.int32)
  delta = delta_mosaic.delta_bank_products(h, bits_SxRxV, scale_SxV, slots, group_k=group_k,
                                           interpret=interpret, kernel_name=KERNEL_NAME)
  return base_MxV.astype(jnp.float32) + delta


__all__ = ["KERNEL_NAME", "packed_products", "shapes_supported", "unavailable_reason"]
