"""The 1-bit delta format: `PackedDelta`, packing, unpacking and optimal scales.

A delta ``Δ = W_ft − W_base`` of a Flax-layout kernel ``[K, N]`` (in, out) is stored as
``α ⊙ S`` with ``S = sign(Δ)`` (sign(0) = +1) and α either one float per matrix or one per
output column. Each is the L2-optimal value for its granularity:
``argmin_α ‖Δ − α S‖² = ⟨Δ, S⟩ / ⟨S, S⟩ = mean|Δ|`` over the matrix or the column.

Bit layout ("group-local bit planes", see docs/FORMAT.md): K is cut into groups of
``group_k`` rows (a multiple of 8; P = group_k / 8 packed rows per group). Within group g,
packed byte ``bits[g*P + p, n]`` holds in bit j the sign of row ``g*group_k + j*P + p``.
So a contiguous run of whole groups is a contiguous slice of ``bits``, and bit plane j of a
group is the contiguous row block ``[j*P, (j+1)*P)``: kernels expand it with a shift and a
mask, no interleave. ``group_k == 8`` is the classic layout (byte i = rows 8i..8i+7).
K is padded up to a multiple of ``group_k``; padded rows hold bit 0 and are never used.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bitdelta_jax.delta.entries import (  # noqa: F401  (the layout's names, read from here)
  DEFAULT_GROUP_K,
  GRANULARITIES,
  LAYOUT,
  Granularity,
  PackedDelta,
  packed_rows,
  register_pytrees,
  round_up,
)

register_pytrees()


def group_k_for(k: int, group_k: int = DEFAULT_GROUP_K) -> int:
  """The group size actually used for a contracting dimension of size ``k``.

  * ``k <= group_k``: one group of ``round_up(k, 8)`` rows, so a tiny model does not pay for
    padding up to ``group_k``.
  * otherwise the largest of ``group_k``, ``group_k / 2``, ``group_k / 4`` (multiples of 8)
    that divides ``round_up(k, 8)``, so K needs no padding: SmolLM2's K = 576 uses 64-row
    groups (576 packed bits per column, not 640 with 128-row groups: 10% fewer bytes);
  * ``group_k`` itself when none does.

  The choice is a fixed point (``group_k_for(k, group_k_for(k, g)) == group_k_for(k, g)``), so a
  group size already chosen can be passed on as ``group_k`` again. Every `PackedDelta` records
  its own ``group_k``; a delta packed with another group size is re-packed when it is loaded.
  """
  if group_k <= 0 or group_k % 8:
    raise ValueError(f"group_k must be a positive multiple of 8, got {group_k}")
  k8 = round_up(k, 8)
  if k8 <= group_k:
    return k8
  for g in (group_k, group_k // 2, group_k // 4):
    if g > 0 and g % 8 == 0 and k8 % g == 0:
      return g
  return group_k


def _pack_bits(positive, k: int, group_k: int, xp):
  """positive: bool/uint8 [K, N] → uint8 [K_pad/8, N] in the group-bitplane layout."""
  n = positive.shape[1]
  k_pad = round_up(k, group_k)
  b = positive.astype(xp.uint8)
  if k_pad != k:
    b = xp.concatenate([b, xp.zeros((k_pad - k, n), xp.uint8)], axis=0)
  p = group_k // 8
  b = b.reshape(k_pad // group_k, 8, p, n)
  shifts = xp.arange(8, dtype=xp.uint8).reshape(1, 8, 1, 1)
  packed = (b << shifts).sum(axis=1, dtype=xp.uint8) if xp is np else jnp.sum(
    b << shifts, axis=1, dtype=jnp.uint8
  )
  return packed.reshape(k_pad // 8, n)


def unpack_signs(bits, shape: tuple[int, int], group_k: int, dtype=jnp.float32):
  """uint8 ``[..., K_pad/8, N]`` → ±1 ``[..., K, N]`` in ``dtype`` (works on jnp and np)."""
  xp = np if isinstance(bits, np.ndarray) else jnp
  k, n = shape
  lead = bits.shape[:-2]
  p = group_k // 8
  g = bits.shape[-2] // p
  b = bits.reshape(*lead, g, 1, p, n)
  shifts = xp.arange(8, dtype=xp.uint8).reshape(8, 1, 1)
  planes = (b >> shifts) & xp.uint8(1)  # [..., g, 8, p, n]
  signs = planes.reshape(*lead, g * group_k, n)[..., :k, :]
  return (signs.astype(dtype) * 2 - 1).astype(dtype)


def optimal_scale(delta, granularity: str, xp=np):
  """L2-optimal α for ``sign(delta)``: mean|Δ| over the matrix ([1]) or each column ([N])."""
  a = xp.abs(delta.astype(xp.float32))
  if granularity == "matrix":
    return a.mean().reshape(1).astype(xp.float32)
  if granularity == "column":
    return a.mean(axis=0).astype(xp.float32)
  raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def pack(
  delta, granularity: str = "matrix", group_k: int = DEFAULT_GROUP_K
) -> PackedDelta:
  """Packs a Flax-layout delta ``[K, N]`` into a `PackedDelta` (numpy in → numpy out)."""
  xp = np if isinstance(delta, np.ndarray) else jnp
  if delta.ndim != 2:
    raise ValueError(f"pack expects a 2-D [in, out] delta, got shape {delta.shape}")
  k, n = delta.shape
  g = group_k_for(k, group_k)
  d32 = delta.astype(xp.float32)
  bits = _pack_bits(d32 >= 0, k, g, xp)
  return PackedDelta(
    bits=bits, scale=optimal_scale(d32, granularity, xp), shape=(k, n), group_k=g,
    granularity=granularity,
  )


def dense_delta(pd: PackedDelta, dtype=jnp.float32):
  """``α ⊙ S`` as a dense ``[K, N]`` array (for tests, apply and reference paths)."""
  s = unpack_signs(pd.bits, pd.shape, pd.group_k, dtype=np.float32 if isinstance(
    pd.bits, np.ndarray) else jnp.float32)
  return (s * pd.scale[..., None, :]).astype(dtype)
