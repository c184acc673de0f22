"""PackedDelta: pack/unpack round trips, layout properties, α optimality."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitdelta_jax.delta.format import (
  PackedDelta,
  dense_delta,
  group_k_for,
  pack,
  packed_rows,
  round_up,
  unpack_signs,
)


def numpy_pack(delta: np.ndarray, group_k: int) -> np.ndarray:
  """Independent loop-level packing straight from the layout's definition in docs/FORMAT.md."""
  k, n = delta.shape
  g = group_k_for(k, group_k)
  p = g // 8
  out = np.zeros((packed_rows(k, g), n), np.uint8)
  for row in range(k):
    grp, within = divmod(row, g)
    j, pp = divmod(within, p)
    out[grp * p + pp] |= ((delta[row] >= 0).astype(np.uint8) << j)
  return out


shapes = st.tuples(st.integers(1, 70), st.integers(1, 9))
groups = st.sampled_from([8, 16, 24, 64, 128])


@settings(max_examples=60, deadline=None)
@given(shape=shapes, group_k=groups, gran=st.sampled_from(["matrix", "column"]), data=st.data())
def test_pack_unpack_roundtrip(shape, group_k, gran, data):
  # Subnormal deltas are excluded: XLA on CPU flushes them to zero (sign +1), numpy does not.
  d = data.draw(hnp.arrays(np.float32, shape,
                           elements=st.floats(-4, 4, width=32, allow_subnormal=False)))
  pd = pack(d, gran, group_k)
  assert pd.bits.dtype == np.uint8 and pd.scale.dtype == np.float32
  np.testing.assert_array_equal(pd.bits, numpy_pack(d, group_k))
  signs = unpack_signs(pd.bits, pd.shape, pd.group_k, np.float32)
  np.testing.assert_array_equal(signs, np.where(d >= 0, 1.0, -1.0))  # sign(0) = +1
  want_scale = np.abs(d).mean(keepdims=True)[0] if gran == "matrix" else np.abs(d).mean(0)
  np.testing.assert_allclose(pd.scale, want_scale, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape,group_k", [((1, 1), 8), ((70, 9), 16), ((200, 72), 128), ((13, 3), 64)])
def test_jnp_path_matches_numpy(shape, group_k):
  d = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
  d[0, 0] = 0.0
  pd = pack(d, "column", group_k)
  pj = pack(jnp.asarray(d), "column", group_k)
  np.testing.assert_array_equal(np.asarray(pj.bits), pd.bits)
  np.testing.assert_allclose(np.asarray(pj.scale), pd.scale, rtol=1e-6)
  np.testing.assert_array_equal(
    np.asarray(unpack_signs(pj.bits, pd.shape, pd.group_k)),
    unpack_signs(pd.bits, pd.shape, pd.group_k, np.float32))


@pytest.mark.parametrize("gran", ["matrix", "column"])
def test_scale_is_l2_optimal(gran):
  r = np.random.default_rng(0)
  d = r.standard_normal((96, 12)).astype(np.float32) * r.uniform(0.1, 3, 12).astype(np.float32)
  pd = pack(d, gran, 32)
  s = np.where(d >= 0, 1.0, -1.0)

  def err(alpha):
    return np.sum((d - alpha * s) ** 2)

  best = err(pd.scale)
  for eps in (1e-3, -1e-3, 1e-2, -1e-2):
    if gran == "matrix":
      assert err(pd.scale * (1 + eps)) > best
    else:
      for col in range(12):  # perturbing any single column's α increases the error
        a = pd.scale.copy()
        a[col] *= 1 + eps
        assert err(a) > best
  # closed form: <Δ,S>/<S,S> per granularity
  if gran == "matrix":
    np.testing.assert_allclose(pd.scale[0], np.sum(d * s) / s.size, rtol=1e-5)
  else:
    np.testing.assert_allclose(pd.scale, np.sum(d * s, 0) / d.shape[0], rtol=1e-5)


def test_group_slices_unpack_locally():
  """A contiguous run of whole groups (a K-tile or K-shard) unpacks from a contiguous slice."""
  r = np.random.default_rng(1)
  d = r.standard_normal((512, 24)).astype(np.float32)
  pd = pack(d, "column", 128)
  p = pd.group_k // 8
  for g0, g1 in [(0, 1), (1, 3), (2, 4)]:
    local = unpack_signs(pd.bits[g0 * p:g1 * p], ((g1 - g0) * 128, 24), 128, np.float32)
    np.testing.assert_array_equal(local, np.where(d[g0 * 128:g1 * 128] >= 0, 1.0, -1.0))
  # bit plane j of a group is a contiguous row block: no interleave needed
  grp = pd.bits[p:2 * p]
  for j in range(8):
    plane = (grp >> j) & 1
    np.testing.assert_array_equal(plane, (d[128 + j * p:128 + (j + 1) * p] >= 0).astype(np.uint8))


@pytest.mark.parametrize("k,group_k,want", [
  (1, 128, 8), (100, 128, 104), (128, 128, 128), (576, 128, 64), (960, 128, 64),
  (1536, 128, 128), (11008, 128, 128), (200, 128, 128), (136, 128, 128), (130, 128, 128),
  (1000, 128, 128), (24 * 7, 24, 24), (96, 64, 32), (160, 64, 32),
])
def test_group_size_fits_k(k, group_k, want):
  """Issue 22: the largest of group_k, /2, /4 that divides round_up(K, 8), so K is not padded
  (SmolLM2's 576: 64-row groups, 576 bits per column, not 640); group_k when none does; one
  group for K <= group_k. A fixed point, so an already chosen size can be passed on."""
  g = group_k_for(k, group_k)
  assert g == want
  assert group_k_for(k, g) == g
  brute = min((round_up(k, c) for c in (group_k, group_k // 2, group_k // 4)
               if c > 0 and c % 8 == 0), default=None)
  if k > group_k and round_up(k, 8) % g == 0:
    assert round_up(k, g) == round_up(k, 8) == brute  # no padding beyond the 8-row rounding
  assert packed_rows(k, g) * 8 == round_up(k, g)


def test_packed_delta_is_a_pytree_and_validates():
  d = np.random.default_rng(2).standard_normal((40, 5)).astype(np.float32)
  pd = pack(d, "column", 16)  # 16 does not divide 40, 8 does: the group size fitted to K
  leaves, tree = jax.tree.flatten(pd)
  assert len(leaves) == 2
  again = jax.tree.unflatten(tree, leaves)
  assert again.shape == (40, 5) and again.group_k == 8 and pd.bits.shape == (5, 5)
  out = jax.jit(lambda p: dense_delta(p))(pd)
  np.testing.assert_allclose(out, np.where(d >= 0, 1, -1) * pd.scale, rtol=1e-6)
  with pytest.raises(ValueError, match="trailing shape"):
    PackedDelta(bits=np.zeros((3, 5), np.uint8), scale=pd.scale, shape=(40, 5), group_k=8)
  with pytest.raises(ValueError, match="granularity"):
    pack(d, "row")
  with pytest.raises(ValueError, match="multiple of 8"):
    pack(d, "matrix", 12)
