"""Per-row sampling filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy_references import numpy_controls

from bitdelta_jax.engine.sampling import SamplingParams, sample

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


@pytest.mark.slow
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
    SamplingParams(max_new_tokens=-1)
  SamplingParams(max_new_tokens=0)  # a scoring request: prompt log probabilities only
  with pytest.raises(ValueError, match="repetition_penalty"):
    SamplingParams(repetition_penalty=0.0)
  with pytest.raises(ValueError, match="logprobs"):
    SamplingParams(logprobs=21)
  with pytest.raises(ValueError, match="at most"):
    SamplingParams(logit_bias=tuple((i, 1.0) for i in range(400)))


@pytest.mark.slow
@pytest.mark.parametrize("scale", [0.2, 1.0, 4.0, 12.0])
def test_fast_sampler_equals_the_reference(scale):
  """Same tokens for the same keys: greedy, temperature only, top-k (below, at and above the
  candidate counts), top-p (narrow and wide nuclei, so every fallback runs), mixed rows."""
  from bitdelta_jax.engine.sampling import sample_reference

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


# -- logit controls: mask, bias (min_tokens), penalties; log probabilities ----------------------
def _controls(rng, r, v, h=24):
  """Random per-row controls, each row using a random subset (some rows none at all)."""
  from bitdelta_jax.engine.controls import LogitControls, mask_words

  c = LogitControls.neutral(r, v, h)
  for i in range(r):
    if rng.random() < 0.4:  # a token mask (at least one allowed token)
      allowed = rng.random(v) < 0.3
      allowed[rng.integers(v)] = True
      bits = np.zeros(mask_words(v) * 32, bool)
      bits[:v] = allowed
      c.mask[i] = _pack(bits)
    if rng.random() < 0.5:
      k = int(rng.integers(1, 8))
      c.bias_ids[i, :k] = rng.integers(0, v, k)
      c.bias_vals[i, :k] = rng.choice([-100.0, -np.inf, -2.0, 3.0, 100.0], k)
    if rng.random() < 0.6:
      n = int(rng.integers(1, h))
      c.history[i, :n] = rng.integers(0, v, n)
      c.prompt_len[i] = int(rng.integers(0, n + 1))
      c.presence[i] = rng.choice([0.0, 0.5, -1.0, 2.0])
      c.frequency[i] = rng.choice([0.0, 0.3, -0.7, 2.0])
      c.repetition[i] = rng.choice([1.0, 1.3, 0.8, 2.0])
  return c


def _pack(bits: np.ndarray) -> np.ndarray:
  """Bit ``j`` of word ``w`` = ``bits[32 w + j]``, as int32 words."""
  b = bits.reshape(-1, 32).astype(np.uint64)
  return (b << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32).view(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_controls_equal_numpy_and_fast_sampler_equals_reference(seed):
  from bitdelta_jax.engine.controls import apply_controls
  from bitdelta_jax.engine.sampling import sample_reference

  r, v = 48, 700
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(r, v)) * 3).astype(np.float32)
  c = _controls(rng, r, v)
  cj = jax.tree.map(jnp.asarray, c)
  got = np.asarray(jax.jit(lambda x, c: apply_controls(x, c, fast=True))(x, cj))
  np.testing.assert_allclose(got, numpy_controls(x, c), rtol=1e-6, atol=1e-5)
  ref_x = np.asarray(jax.jit(lambda x, c: apply_controls(x, c, fast=False))(x, cj))
  np.testing.assert_array_equal(got, ref_x)
  keys = jnp.asarray(rng.integers(0, 2**32, size=(r, 2), dtype=np.uint32))
  t = jnp.asarray(rng.choice([0.0, 0.7, 1.0], r), jnp.float32)
  tp = jnp.asarray(rng.choice([1.0, 0.9, 0.5], r), jnp.float32)
  tk = jnp.asarray(rng.choice([0, 5, 100], r), jnp.int32)
  fast = np.asarray(jax.jit(sample)(x, keys, t, tp, tk, cj))
  ref = np.asarray(jax.jit(sample_reference)(x, keys, t, tp, tk, cj))
  np.testing.assert_array_equal(fast, ref)
  want = numpy_controls(x, c)
  greedy = np.asarray(t) == 0
  np.testing.assert_array_equal(fast[greedy], want.argmax(-1)[greedy])
  assert np.all(np.isfinite(want[np.arange(r), fast]))  # never a masked / -inf token


@pytest.mark.slow
def test_neutral_controls_change_nothing():
  from bitdelta_jax.engine.controls import LogitControls

  r, v = 16, 300
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(r, v)) * 2, jnp.float32)
  keys = jnp.asarray(rng.integers(0, 2**32, size=(r, 2), dtype=np.uint32))
  t, tp, tk = jnp.ones(r), jnp.full(r, 0.9), jnp.zeros(r, jnp.int32)
  c = jax.tree.map(jnp.asarray, LogitControls.neutral(r, v, 8))
  np.testing.assert_array_equal(np.asarray(sample(x, keys, t, tp, tk, c)),
                                np.asarray(sample(x, keys, t, tp, tk)))


def test_logprobs_are_the_raw_log_softmax():
  from bitdelta_jax.engine.controls import logprobs_of

  r, v = 6, 50
  rng = np.random.default_rng(2)
  x = rng.normal(size=(r, v)).astype(np.float32) * 3
  tok = rng.integers(0, v, r).astype(np.int32)
  chosen, ids, vals = (np.asarray(a) for a in logprobs_of(jnp.asarray(x), jnp.asarray(tok),
                                                         jnp.asarray([True] * r)))
  lsm = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(
    -1, keepdims=True)
  np.testing.assert_allclose(chosen, lsm[np.arange(r), tok], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ids, np.argsort(-lsm, -1, kind="stable")[:, :20])
  np.testing.assert_allclose(vals, np.take_along_axis(lsm, ids, -1), rtol=1e-5, atol=1e-5)
  skipped = logprobs_of(jnp.asarray(x), jnp.asarray(tok), jnp.zeros(r, bool))
  assert not np.any(np.asarray(skipped[0]))
