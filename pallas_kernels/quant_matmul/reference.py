"""The definition: ``x · dequant(W_q)`` plus the 1-bit delta term of each row's slot, in jnp.

``dequant`` is ggml's (`blocks.dequantize_jnp`); the delta term is exactly
`pallas_kernels.delta_matmul.reference.delta_matmul_reference`'s (its base product over a zero
matrix). f32 products at HIGHEST precision; the result is f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.delta_matmul.reference import delta_matmul_reference

from .blocks import QuantizedKernel, dequantize_jnp


def quant_matmul_reference(x: jax.Array, qk: QuantizedKernel, bits: jax.Array | None = None,
                           scale: jax.Array | None = None, slot_ids: jax.Array | None = None, *,
                           group_k: int) -> jax.Array:
  """f32 ``[M, N]``: x ``[M, K]`` times the ``[K, N]`` blocks, plus ``α_s ⊙ (x·S_s)``.

  bits / scale / slot_ids as `delta_matmul_reference`: one variant (bits ``[KP, N]``, scale
  ``[1|N]``, slot_ids None) or a bank (``[S, KP, N]``, ``[S, N]``, slot_ids ``[M]``; slot 0 is
  the base alone); bits None: the plain product."""
  x32 = x.astype(jnp.float32)
  w = dequantize_jnp(qk)
  y = jnp.dot(x32, w, precision=jax.lax.Precision.HIGHEST)
  if bits is None:
    return y
  zero = jnp.zeros((1, qk.shape[1]), jnp.float32)  # broadcast: no [K, N] zeros materialised
  zero = jnp.broadcast_to(zero, qk.shape)
  return y + delta_matmul_reference(x32, zero, bits, scale, slot_ids, group_k=group_k)


def with_reference_vjp(kernel, group_k: int):
  """``kernel(x, scale, qk, bits, slot_ids)`` (a kernel XLA cannot differentiate through) with
  the reference's gradients in x and scale; the blocks, bits and slot ids are constants."""

  @jax.custom_vjp
  def f(x, scale, qk, bits, slot_ids):
    return kernel(x, scale, qk, bits, slot_ids)

  def fwd(x, scale, qk, bits, slot_ids):
    return kernel(x, scale, qk, bits, slot_ids), (x, scale, qk, bits, slot_ids)

  def bwd(res, ct):
    x, scale, qk, bits, slot_ids = res
    return (*reference_grads(ct, x, scale, qk, bits, slot_ids, group_k), None, None, None)

  f.defvjp(fwd, bwd)
  return f


def reference_grads(ct, x, scale, qk, bits, slot_ids, group_k: int):
  """(dx, dscale) of `quant_matmul_reference` for the cotangent ``ct`` (dscale None without
  bits): the backward pass of the kernels (`with_reference_vjp`, `cpu_rows.rows_call_many`)."""
  if bits is None:
    _, vjp = jax.vjp(lambda x: quant_matmul_reference(x, qk, group_k=group_k), x)
    return vjp(ct)[0], None
  _, vjp = jax.vjp(lambda x, s: quant_matmul_reference(x, qk, bits, s, slot_ids,
                                                       group_k=group_k), x, scale)
  return vjp(ct)
