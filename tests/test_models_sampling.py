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
