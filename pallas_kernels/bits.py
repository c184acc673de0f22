"""The 1-bit delta bit layout the kernels read: group-local bit planes (docs/FORMAT.md).

K is cut into groups of ``group_k`` rows (a multiple of 8; P = group_k / 8 packed rows per
group). Within group g, packed byte ``bits[g*P + p, n]`` holds in bit j the sign of row
``g*group_k + j*P + p`` (bit 1: positive). A contiguous run of whole groups is a contiguous
slice of ``bits``, and bit plane j of a group is the contiguous row block ``[j*P, (j+1)*P)``:
kernels expand it with a shift and a mask, no interleave. ``group_k == 8`` is the classic layout
(byte i = rows 8i..8i+7). K is padded up to a multiple of ``group_k``; padded rows hold bit 0.

numpy only at module level: the store and the server's HTTP layer read these names without JAX
(`bitdelta_jax.delta.entries`). The packing functions take numpy or jax arrays (jax.numpy is
imported only when given a jax array).
"""

from __future__ import annotations

import numpy as np

LAYOUT = "group-bitplane-v1"
DEFAULT_GROUP_K = 128


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def packed_rows(k: int, group_k: int) -> int:
  """Packed byte rows of a ``[K, N]`` matrix: ``round_up(K, group_k) / 8``."""
  return round_up(k, group_k) // 8


def group_k_for(k: int, group_k: int = DEFAULT_GROUP_K) -> int:
  """The group size actually used for a contracting dimension of size ``k``.

  * ``k <= group_k``: one group of ``round_up(k, 8)`` rows, so a tiny model does not pay for
    padding up to ``group_k``.
  * otherwise the largest of ``group_k``, ``group_k / 2``, ``group_k / 4`` (multiples of 8)
    that divides ``round_up(k, 8)``, so K needs no padding: SmolLM2's K = 576 uses 64-row
    groups (576 packed bits per column, not 640 with 128-row groups: 10% fewer bytes);
  * ``group_k`` itself when none does.

  The choice is a fixed point (``group_k_for(k, group_k_for(k, g)) == group_k_for(k, g)``), so a
  group size already chosen can be passed on as ``group_k`` again. Every packed delta records
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


def _xp(a):
  if isinstance(a, np.ndarray):
    return np
  import jax.numpy as jnp

  return jnp


def pack_bits(positive, k: int, group_k: int):
  """positive: bool/uint8 ``[K, N]`` → uint8 ``[K_pad/8, N]`` in the group-bitplane layout
  (numpy in → numpy out, jax in → jax out)."""
  xp = _xp(positive)
  n = positive.shape[1]
  k_pad = round_up(k, group_k)
  b = positive.astype(xp.uint8)
  if k_pad != k:
    b = xp.concatenate([b, xp.zeros((k_pad - k, n), xp.uint8)], axis=0)
  p = group_k // 8
  b = b.reshape(k_pad // group_k, 8, p, n)
  shifts = xp.arange(8, dtype=xp.uint8).reshape(1, 8, 1, 1)
  packed = xp.sum(b << shifts, axis=1, dtype=xp.uint8)
  return packed.reshape(k_pad // 8, n)


def unpack_signs(bits, shape: tuple[int, int], group_k: int, dtype=np.float32):
  """uint8 ``[..., K_pad/8, N]`` → ±1 ``[..., K, N]`` in ``dtype`` (numpy or jax arrays)."""
  xp = _xp(bits)
  k, n = shape
  lead = bits.shape[:-2]
  p = group_k // 8
  g = bits.shape[-2] // p
  b = bits.reshape(*lead, g, 1, p, n)
  shifts = xp.arange(8, dtype=xp.uint8).reshape(8, 1, 1)
  planes = (b >> shifts) & xp.uint8(1)  # [..., g, 8, p, n]
  signs = planes.reshape(*lead, g * group_k, n)[..., :k, :]
  return (signs.astype(dtype) * 2 - 1).astype(dtype)


__all__ = ["DEFAULT_GROUP_K", "LAYOUT", "group_k_for", "pack_bits", "packed_rows", "round_up",
           "unpack_signs"]
