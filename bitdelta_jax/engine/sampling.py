"""Per-row token sampling: greedy, temperature, top-k, top-p, each row with its own key.

    sample(logits [R, V], keys [R, 2] uint32, temperature [R], top_p [R], top_k [R],
           controls=None) -> [R] int32

``controls`` (`bitdelta_jax.engine.controls.LogitControls`) are applied to the logits first:
a structured-output token mask, logit bias (and min_tokens), presence / frequency / repetition
penalties, all per row; a batch whose rows use none of them skips that work.

``temperature <= 0`` is greedy (argmax). ``top_k <= 0`` and ``top_p >= 1`` disable those
filters. Filters follow transformers' order: temperature, then top-k, then top-p (the smallest
set of most likely tokens whose mass, renormalised over the top-k survivors, reaches ``top_p``;
the most likely token is always kept).

The draw is an inverse-CDF draw with one uniform ``u`` per row, so that a token depends only on
the row's key and its logits, never on the batch around it: the survivors (tokens whose
tempered logit is at least the smallest kept one; ties at the cut are kept) are walked in
token-id order and the first whose cumulative weight ``exp(x - max)`` reaches ``u · total`` is
taken. No step of the draw needs the vocabulary in sorted order.

A row's key for the token at sequence position ``p`` is ``fold_in(PRNGKey(seed), p)`` and ``u``
is ``uniform(key)``.

`sample_reference` is that definition written plainly (the cut found on a full sort of every
row). `sample` is the fast form the engine runs inside its jitted step: greedy batches are one
argmax (the sampled branch is skipped by a ``lax.cond``); a filtered row finds its cut among its
``lax.top_k`` candidates (64, then 1024), falling back to the full sort only when its nucleus is
wider than that; the draw itself is an exp and a blocked cumulative sum over V. Both give the
same tokens for the same keys (tests/engine/test_sampling.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bitdelta_jax.engine.controls import LogitControls, apply_controls
from bitdelta_jax.engine.sampling_params import INT32_MAX, SamplingParams  # noqa: F401

CANDIDATES = (64, 1024)
_BLOCK = 256


def row_keys(keys_Rx2: jax.Array, positions_R: jax.Array) -> jax.Array:
  return jax.vmap(jax.random.fold_in)(keys_Rx2, positions_R.astype(jnp.uint32))


def _prepare(logits_RxV, keys_Rx2, temperature_R, top_k_R):
  x = logits_RxV.astype(jnp.float32) / jnp.maximum(temperature_R, 1e-6)[:, None]
  v = x.shape[-1]
  k = jnp.where((top_k_R <= 0) | (top_k_R >= v), v, top_k_R).astype(jnp.int32)
  u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_Rx2)
  return x, k, u


def _pick(x_RxV: jax.Array, cut_R: jax.Array, u_R: jax.Array) -> jax.Array:
  """The first token id whose cumulative weight reaches ``u · total``, where a token's weight
  is ``exp(x - max)`` if ``x >= cut`` else 0. The cumulative sum is blocked (sums of 256-token
  blocks, then one block), which is much cheaper than a flat scan over V on CPU."""
  r, v = x_RxV.shape
  w = jnp.where(x_RxV >= cut_R[:, None], jnp.exp(x_RxV - jnp.max(x_RxV, -1, keepdims=True)), 0.0)
  nb = -(-v // _BLOCK)
  w = jnp.pad(w, ((0, 0), (0, nb * _BLOCK - v))).reshape(r, nb, _BLOCK)
  block_sums = jnp.sum(w, axis=-1)
  cum_blocks = jnp.cumsum(block_sums, axis=-1)
  target = u_R * cum_blocks[:, -1]
  last_block = nb - 1 - jnp.argmax(block_sums[:, ::-1] > 0, axis=-1)
  b = jnp.minimum(jnp.sum(cum_blocks < target[:, None], axis=-1), last_block)
  blk = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]
  start = jnp.take_along_axis(cum_blocks - block_sums, b[:, None], axis=-1)
  cs = start + jnp.cumsum(blk, axis=-1)
  last = _BLOCK - 1 - jnp.argmax(blk[:, ::-1] > 0, axis=-1)
  n = jnp.minimum(jnp.sum(cs < target[:, None], axis=-1), last)
  return (b * _BLOCK + n).astype(jnp.int32)


def _cutoff(sorted_RxC, k_R, top_p_R, log_z_R):
  """The smallest surviving logit, from logits sorted in descending order, and whether the
  survivors end inside these C candidates (else the caller must look further)."""
  c = sorted_RxC.shape[-1]
  ranks = jnp.arange(c)[None]
  in_k = ranks < k_R[:, None]
  probs = jnp.where(in_k, jnp.exp(sorted_RxC - log_z_R[:, None]), 0.0)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = in_k & ((mass_before < top_p_R[:, None]) | (ranks == 0))
  n_keep = jnp.sum(keep, axis=-1)
  cut = jnp.take_along_axis(sorted_RxC, (n_keep - 1)[:, None], axis=-1)[:, 0]
  return cut, ~keep[:, -1] | (k_R <= c)


def _log_z(x_RxV, sorted_RxC, k_R):
  """log Σ exp over the top-k survivors: from the candidates when k fits, else over all of V
  (exact for k == V; a row with C < k < V is left to a wider look by the caller)."""
  in_k = jnp.arange(sorted_RxC.shape[-1])[None] < k_R[:, None]
  lz_c = jax.nn.logsumexp(jnp.where(in_k, sorted_RxC, -jnp.inf), axis=-1)
  return jnp.where(k_R <= sorted_RxC.shape[-1], lz_c, jax.nn.logsumexp(x_RxV, axis=-1))


def _sorted_cutoff(x_RxV, k_R, top_p_R):
  """`_cutoff` over the whole vocabulary, sorted."""
  sorted_x = -jnp.sort(-x_RxV, axis=-1)
  return _cutoff(sorted_x, k_R, top_p_R, _log_z(x_RxV, sorted_x, k_R))[0]


def _is_filtered(x, k, top_p_R):
  return (k < x.shape[-1]) | (top_p_R < 1)


def sample_reference(
  logits_RxV: jax.Array,
  keys_Rx2: jax.Array,
  temperature_R: jax.Array,
  top_p_R: jax.Array,
  top_k_R: jax.Array,
  controls: LogitControls | None = None,
) -> jax.Array:
  """The sampling definition written plainly: every control on every row, a full sort of every
  row."""
  logits = apply_controls(logits_RxV, controls, fast=False)
  x, k, u = _prepare(logits, keys_Rx2, temperature_R, top_k_R)
  cut = jnp.where(_is_filtered(x, k, top_p_R), _sorted_cutoff(x, k, top_p_R), -jnp.inf)
  tok = _pick(x, cut, u)
  return jnp.where(temperature_R <= 0, jnp.argmax(logits, axis=-1), tok).astype(jnp.int32)


def _fast_cutoff(x, k, top_p):
  """`_cutoff` from the top-C candidates, widening C (then a full sort) only when needed."""

  def from_top(c):
    vals, _ = jax.lax.top_k(x, c)
    cut, fits = _cutoff(vals, k, top_p, _log_z(x, vals, k))
    return cut, fits & ((k <= c) | (k == x.shape[-1]))

  def widen(i, cut, fits):
    if i == len(CANDIDATES):
      return jnp.where(fits, cut, _sorted_cutoff(x, k, top_p))
    c = min(CANDIDATES[i], x.shape[-1])

    def wider():
      c2, f2 = from_top(c)
      return widen(i + 1, jnp.where(fits, cut, c2), fits | f2)

    return jax.lax.cond(jnp.all(fits), lambda: cut, wider)

  cut, fits = from_top(min(CANDIDATES[0], x.shape[-1]))
  return widen(1, cut, fits)


def sample(
  logits_RxV: jax.Array,
  keys_Rx2: jax.Array,
  temperature_R: jax.Array,
  top_p_R: jax.Array,
  top_k_R: jax.Array,
  controls: LogitControls | None = None,
) -> jax.Array:
  """Same tokens as `sample_reference`, without sorting the vocabulary (and with the controls
  no row uses skipped)."""
  logits = apply_controls(logits_RxV, controls, fast=True)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  sampled_rows = temperature_R > 0

  def sampled():
    x, k, u = _prepare(logits, keys_Rx2, temperature_R, top_k_R)
    filtered = sampled_rows & _is_filtered(x, k, top_p_R)
    no_cut = jnp.full(k.shape, -jnp.inf, jnp.float32)
    cut = jax.lax.cond(jnp.any(filtered), lambda: _fast_cutoff(x, k, top_p_R), lambda: no_cut)
    tok = _pick(x, jnp.where(filtered, cut, -jnp.inf), u)
    return jnp.where(sampled_rows, tok, greedy)

  return jax.lax.cond(jnp.any(sampled_rows), sampled, lambda: greedy)
