"""MonoSoup against an independent numpy computation of the published formulas."""

import numpy as np
import pytest

from bitdelta_jax import merge as M
from bitdelta_jax.merge.monosoup import coefficients

RNG = np.random.default_rng(1)


def np_monosoup(w0, wft, mode, energy=0.8):
  w0, wft = w0.astype(np.float64), wft.astype(np.float64)
  d = wft - w0
  u, s, vt = np.linalg.svd(d, full_matrices=False)
  if mode == "freevariance":
    p = s / s.sum()
    p = p[p > 0]
    k = int(np.ceil(np.exp(-(p * np.log(p)).sum())))
  else:
    frac = np.cumsum(s**2) / np.sum(s**2)
    k = int(np.nonzero(frac >= energy)[0][0]) + 1
  k = min(max(k, 1), len(s))
  p_k = np.sum(s[:k] ** 2) / np.sum(s**2)
  rho = (s[k] / s[0]) ** 2 if k < len(s) else 0.0
  lam_low = np.clip(rho + (1 - rho) * np.sqrt(1 - p_k), 0, 1)
  lam_high = np.clip(1 - lam_low, 0, 1)
  high = (u[:, :k] * s[:k]) @ vt[:k]
  low = (u[:, k:] * s[k:]) @ vt[k:]
  return w0 + lam_high * high + lam_low * low, k


def _update(shape, decay):
  """An update whose spectrum decays like decay**i (a fine-tune-like low effective rank)."""
  m, n = shape
  q1, _ = np.linalg.qr(RNG.normal(size=(m, m)))
  q2, _ = np.linalg.qr(RNG.normal(size=(n, n)))
  r = min(m, n)
  s = decay ** np.arange(r)
  return 0.05 * (q1[:, :r] * s) @ q2[:, :r].T


@pytest.mark.parametrize("shape", [(16, 16), (24, 12), (10, 20)])
@pytest.mark.parametrize(
  "mode,energy", [("freevariance", 0.8), ("variance", 0.8), ("variance", 0.95)]
)
@pytest.mark.parametrize("decay", [0.6, 0.95])
def test_matches_numpy(shape, mode, energy, decay):
  w0 = RNG.normal(size=shape).astype(np.float32)
  wft = (w0 + _update(shape, decay)).astype(np.float32)
  ref, k = np_monosoup(w0, wft, mode, energy)
  out = np.asarray(M.monosoup_tensor(w0, wft, mode, energy))
  np.testing.assert_allclose(out, ref, atol=2e-6, rtol=1e-5)
  s = np.linalg.svd(wft.astype(np.float64) - w0, compute_uv=False)
  assert int(M.split_rank(np.asarray(s, np.float32), mode, energy)) == k


def test_coefficients_lie_in_unit_interval_and_sum_to_one():
  s = np.sort(RNG.random(12))[::-1].astype(np.float32)
  for k in range(1, 13):
    hi, lo = (float(x) for x in coefficients(s, k))
    assert 0 <= lo <= 1 and 0 <= hi <= 1 and abs(hi + lo - 1) < 1e-6


def test_tree_keeps_1d_and_negligible_updates_finetuned():
  base = {
    "w": RNG.normal(size=(8, 8)).astype(np.float32),
    "norm": np.ones(8, np.float32),
    "same": RNG.normal(size=(8, 8)).astype(np.float32),
  }
  ft = {
    "w": base["w"] + _update((8, 8), 0.7).astype(np.float32),
    "norm": base["norm"] + 0.3,
    "same": base["same"].copy(),
  }
  out = M.monosoup(base, ft)
  np.testing.assert_array_equal(np.asarray(out["norm"]), ft["norm"])
  np.testing.assert_array_equal(np.asarray(out["same"]), ft["same"])
  ref, _ = np_monosoup(base["w"], ft["w"], "freevariance")
  np.testing.assert_allclose(np.asarray(out["w"]), ref, atol=2e-6)
  assert not np.allclose(np.asarray(out["w"]), ft["w"])  # it does re-weight


def test_rank_one_update_is_kept_whole():
  w0 = np.zeros((6, 6), np.float32)
  d = np.outer(RNG.normal(size=6), RNG.normal(size=6)).astype(np.float32)
  out = np.asarray(M.monosoup_tensor(w0, w0 + d))
  np.testing.assert_allclose(out, d, atol=1e-5)  # k = 1, P_k = 1, ρ = 0 -> λ_high = 1
