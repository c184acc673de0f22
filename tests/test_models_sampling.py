"""Per-row sampling filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.models.sampling import SamplingParams, sample

LOGITS = jnp.log(jnp.asarray([0.05, 0.4, 0.3, 0.15, 0.1]))


def draws(n=4000, **kw):
  r = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **kw}
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  keys = jax.random.key_data(keys) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys
  out = sample(
    jnp.broadcast_to(LOGITS, (n, 5)),
    keys,
    jnp.full((n,), r["temperature"], jnp.float32),
    jnp.full((n,), r["top_p"], jnp.float32),
    jnp.full((n,), r["top_k"], jnp.int32),
  )
  return np.bincount(np.asarray(out), minlength=5) / n


def test_greedy_top_k_top_p_supports():
  assert draws(temperature=0.0)[1] == 1.0
  assert set(np.flatnonzero(draws(top_k=2))) == {1, 2}
  assert set(np.flatnonzero(draws(top_p=0.6))) == {1, 2}  # 0.4 < 0.6 <= 0.7
  assert set(np.flatnonzero(draws(top_p=0.3))) == {1}  # the top token is always kept
  assert set(np.flatnonzero(draws())) == {0, 1, 2, 3, 4}


def test_unfiltered_frequencies_follow_the_distribution():
  np.testing.assert_allclose(draws(), np.exp(np.asarray(LOGITS)), atol=0.03)


def test_params_are_validated():
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplingParams(max_new_tokens=0)


@pytest.mark.parametrize("scale", [0.2, 1.0, 4.0, 12.0])
def test_fast_sampler_equals_the_reference(scale):
  """Same tokens for the same keys: greedy, temperature only, top-k (below, at and above the
  candidate counts), top-p (narrow and wide nuclei, so every fallback runs), mixed rows."""
  from bitdelta_jax.models.sampling import sample_reference

  r, v = 96, 5000
  rng = np.random.default_rng(int(scale * 10))
  x = jnp.asarray(rng.normal(size=(r, v)) * scale, jnp.float32)
  keys = jnp.asarray(rng.integers(0, 2**32, size=(r, 2), dtype=np.uint32))
  t = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 1.7], r), jnp.float32)
  tp = jnp.asarray(rng.choice([1.0, 0.99, 0.9, 0.5, 0.05], r), jnp.float32)
  tk = jnp.asarray(rng.choice([0, 1, 7, 64, 65, 900, 2000, v, v + 3], r), jnp.int32)
  fast = np.asarray(jax.jit(sample)(x, keys, t, tp, tk))
  ref = np.asarray(jax.jit(sample_reference)(x, keys, t, tp, tk))
  np.testing.assert_array_equal(fast, ref)
  greedy = np.asarray(jnp.argmax(x, -1))
  np.testing.assert_array_equal(fast[np.asarray(t) == 0], greedy[np.asarray(t) == 0])


def test_top_k_and_top_p_supports_match_numpy():
  """Every drawn token lies in the support numpy computes from the definition."""
  r, v = 200, 300
  rng = np.random.default_rng(3)
  x = rng.normal(size=(r, v)).astype(np.float32) * 2
  keys = rng.integers(0, 2**32, size=(r, 2), dtype=np.uint32)
  tk = rng.choice([0, 3, 40], r).astype(np.int32)
  tp = rng.choice([1.0, 0.6, 0.95], r).astype(np.float32)
  out = np.asarray(sample(jnp.asarray(x), jnp.asarray(keys), jnp.ones(r), jnp.asarray(tp),
                          jnp.asarray(tk)))
  for i in range(r):
    order = np.argsort(-x[i], kind="stable")
    k = v if tk[i] <= 0 else tk[i]
    p = np.exp(x[i][order[:k]] - x[i][order[0]])
    p /= p.sum()
    before = np.cumsum(p) - p
    n = int(np.sum((before < tp[i]) | (np.arange(k) == 0)))
    assert x[i][out[i]] >= x[i][order[n - 1]]
