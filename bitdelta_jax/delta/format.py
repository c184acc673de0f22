"""The 1-bit delta format: `PackedDelta`, packing, unpacking and optimal scales.

A delta ``Δ = W_ft − W_base`` of a Flax-layout kernel ``[K, N]`` (in, out) is stored as
``α ⊙ S`` with ``S = sign(Δ)`` (sign(0) = +1) and α either one float per matrix or one per
output column. Each is the L2-optimal value for its granularity:
``argmin_α ‖Δ − α S‖² = ⟨Δ, S⟩ / ⟨S, S⟩ = mean|Δ|`` over the matrix or the column.

Bit layout ("group-local bit planes", docs/FORMAT.md): `pallas_kernels.bits`, the one
definition the kernels and this module share (``group_k`` rows per group, K padded to a
multiple of ``group_k``); its names are re-exported here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bitdelta_jax.delta.entries import (  # noqa: F401  (the entry types, read from here)
  GRANULARITIES,
  Granularity,
  PackedDelta,
  register_pytrees,
)
from pallas_kernels.bits import (  # noqa: F401  (the layout's names, read from here)
  DEFAULT_GROUP_K,
  LAYOUT,
  group_k_for,
  pack_bits,
  packed_rows,
  round_up,
  unpack_signs,
)

register_pytrees()


def _pack_bits(positive, k: int, group_k: int, xp):
  """`pallas_kernels.bits.pack_bits` on ``xp``'s arrays (numpy in → numpy out)."""
  return pack_bits(np.asarray(positive) if xp is np else positive, k, group_k)


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
