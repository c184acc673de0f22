"""svd_soup against numpy, and the in-training soup hook."""

import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax import merge as M

RNG = np.random.default_rng(2)


def np_trunc(d, r):
  u, s, vt = np.linalg.svd(d.astype(np.float64), full_matrices=False)
  return (u[:, :r] * s[:r]) @ vt[:r]


@pytest.mark.parametrize("rank", [1, 3, 50])
def test_svd_soup_matches_numpy(rank):
  base = {
    "w": RNG.normal(size=(12, 9)).astype(np.float32),
    "b": RNG.normal(size=9).astype(np.float32),
  }
  cks = [
    {k: v + 0.1 * RNG.normal(size=v.shape).astype(np.float32) for k, v in base.items()}
    for _ in range(3)
  ]
  out = M.svd_soup(base, cks, rank)
  ref_w = base["w"] + np.mean([np_trunc(c["w"] - base["w"], rank) for c in cks], 0)
  ref_b = np.mean([c["b"] for c in cks], 0)
  np.testing.assert_allclose(np.asarray(out["w"]), ref_w, atol=2e-6)
  np.testing.assert_allclose(np.asarray(out["b"]), ref_b, atol=2e-6)


def test_hook_merges_with_best_every_n_steps():
  base = {"w": jnp.zeros((6, 6))}
  hook = M.SvdSoupHook(base=base, every=3, rank=2)
  p = lambda v: {"w": jnp.asarray(RNG.normal(size=(6, 6)) * v, jnp.float32)}
  p1 = p(1.0)
  assert hook(1, p1, score=2.0) is p1  # best so far, no merge at step 1
  hook(2, p(1.0), score=5.0)  # worse: not kept
  np.testing.assert_array_equal(np.asarray(hook.best["w"]), np.asarray(p1["w"]))
  p3 = p(1.0)
  out = hook(3, p3)
  ref = 0.5 * (np_trunc(np.asarray(p3["w"]), 2) + np_trunc(np.asarray(p1["w"]), 2))
  np.testing.assert_allclose(np.asarray(out["w"]), ref, atol=1e-5)
  assert hook.merges == 1
  assert hook(4, p3) is p3


def test_hook_without_best_does_nothing():
  hook = M.SvdSoupHook(base={"w": jnp.zeros(3)}, every=1, rank=1, higher_is_better=True)
  x = {"w": jnp.ones(3)}
  assert hook(1, x) is x
  hook(2, x, score=1.0)
  hook(3, {"w": jnp.zeros(3)}, score=0.5)
  np.testing.assert_array_equal(np.asarray(hook.best["w"]), 1.0)
