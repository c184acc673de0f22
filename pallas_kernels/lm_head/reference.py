"""Readable references of the LM head's products (f32 logits), the kernels' ground truth.

* `logits_reference`: ``h · Eᵀ`` for a tied embedding ``E [V, D]``, or ``h · W`` for an LM head
  kernel ``W [D, V]``, f32 sums and result.
* `packed_products_reference`: ``base + α[s] ⊙ (h · S[s])`` per row for a bank of 1-bit
  embedding / LM-head deltas with a per-token α (bits ``[S, D_pad/8, V]``, α ``[S, V]``, the
  layout of `pallas_kernels.bits`); ``s < 0`` (or 0, the base slot): the base row only. Each
  slot present unpacks its signs under a ``lax.cond``. Differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bits import unpack_signs


def logits_reference(h_MxD: jax.Array, w: jax.Array, *, tied: bool) -> jax.Array:
  """f32 ``h · Eᵀ`` (``tied``: w is ``E [V, D]``) or ``h · W`` (w is ``W [D, V]``);
  h ``[..., D]``."""
  spec = "...d,vd->...v" if tied else "...d,dv->...v"
  return jnp.einsum(spec, h_MxD, w, preferred_element_type=jnp.float32)


def packed_products_reference(base_MxV, h_MxK, bits_SxRxV, scale_SxV, slots_M, group_k: int):
  """``base + α[s] ⊙ (h · S[s])`` per row, ``s = slots[m]`` (``s <= 0``: base only); f32."""
  k, v = h_MxK.shape[1], base_MxV.shape[1]
  for s in range(1, bits_SxRxV.shape[0]):
    rows = slots_M == s
    add = lambda y, s=s, rows=rows: y + jnp.where(
      rows[:, None], scale_SxV[s] * (h_MxK @ unpack_signs(bits_SxRxV[s], (k, v), group_k)), 0.0)
    base_MxV = jax.lax.cond(jnp.any(rows), add, lambda y: y, base_MxV)
  return base_MxV
