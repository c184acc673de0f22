"""Readable reference for the 1-bit delta matmul.

Why: every other implementation (Pallas GPU, CPU fast path) is tested against this.
Numerics: unpack signs to ±1 in f32, accumulate in f32, cast to x.dtype at the end.

    y[m] = x[m] · W_base + α[v] ⊙ (x[m] · S[v]),   v = slot_ids[m]; v == 0 means base only.

Bit layout: `pallas_kernels.bits` (group-local bit planes, ``group_k`` rows per group).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bits import DEFAULT_GROUP_K, group_k_for, unpack_signs


def delta_matmul_reference(
  x: jax.Array,
  w_base: jax.Array,
  bits: jax.Array,
  scale: jax.Array,
  slot_ids: jax.Array | None = None,
  *,
  group_k: int = DEFAULT_GROUP_K,
) -> jax.Array:
  """x ``[M, K]``; w_base ``[K, N]``; bits ``[K_pad/8, N]`` or a bank ``[S, K_pad/8, N]``;
  scale ``[1|N]`` or ``[S, 1|N]``; slot_ids ``[M]`` int (bank only; 0 = base only)."""
  k, n = w_base.shape
  g = group_k_for(k, group_k)
  hi = jax.lax.Precision.HIGHEST
  base = jnp.dot(x.astype(jnp.float32), w_base.astype(jnp.float32), precision=hi)
  if slot_ids is None:
    if bits.ndim != 2:
      raise ValueError("a bank of deltas needs slot_ids")
    signs = unpack_signs(bits, (k, n), g)  # [K, N]
    d = jnp.dot(x.astype(jnp.float32), signs, precision=hi) * scale.astype(jnp.float32)
  else:
    if bits.ndim != 3:
      raise ValueError("slot_ids given but bits is not a bank [S, K_pad/8, N]")
    signs = unpack_signs(bits, (k, n), g)  # [S, K, N]
    per_slot = jnp.einsum("mk,skn->smn", x.astype(jnp.float32), signs, precision=hi)
    per_slot = per_slot * scale.astype(jnp.float32)[:, None, :]
    m = jnp.arange(x.shape[0])
    d = per_slot[slot_ids, m]  # [M, N]
    d = jnp.where((slot_ids == 0)[:, None], 0.0, d)
  return (base + d).astype(x.dtype)


def with_reference_vjp(forward, group_k: int, *, f32: bool = False):
  """``forward(x, w_base, scale, bits, slot_ids)`` — a kernel XLA cannot differentiate through —
  with the gradients (w.r.t. x, w_base and scale) of `delta_matmul_reference`, so scale
  distillation and fine-tuning run through any implementation. ``f32``: the reference runs on
  x and w_base cast to f32 (for a kernel that computes in f32 whatever their dtypes)."""

  @jax.custom_vjp
  def f(x, w_base, scale, bits, slot_ids):
    return forward(x, w_base, scale, bits, slot_ids)

  def fwd(x, w_base, scale, bits, slot_ids):
    return f(x, w_base, scale, bits, slot_ids), (x, w_base, scale, bits, slot_ids)

  def bwd(res, ct):
    x, w_base, scale, bits, slot_ids = res
    cast = (lambda a: a.astype(jnp.float32)) if f32 else (lambda a: a)
    _, vjp = jax.vjp(lambda x, w, s: delta_matmul_reference(
      cast(x), cast(w), bits, s, slot_ids, group_k=group_k), x, w_base, scale)
    return (*vjp(ct), None, None)

  f.defvjp(fwd, bwd)
  return f
