"""Per-row logit controls and log probabilities, inside the batched jitted sampler.

    x = apply_controls(logits [R, V], controls: LogitControls, fast=True)   # before sampling
    lp = logprobs_of(logits [R, V], tokens [R], want [R])                   # raw-model values

Every control is a fixed-shape per-row array, so one compiled step serves any mix of requests
(no per-request recompilation), and a row that does not use a control holds its neutral value:

* ``mask [R, W]`` int32 bitmask words (``W = ceil(V / 32)``; bit ``v % 32`` of word ``v // 32``
  allows token ``v``): structured output. Unconstrained rows are all ones (``-1``); a
  disallowed token's logit becomes ``-inf``.
* ``bias_ids [R, K]`` / ``bias_vals [R, K]``: added to the logits (OpenAI ``logit_bias``;
  ``min_tokens`` puts ``-inf`` on the stop tokens here while a row is shorter). Unused entries
  hold id ``-1`` and are dropped.
* ``history [R, H]`` (token ids, ``-1`` padding), ``prompt_len [R]``: the row's prompt followed
  by its output so far, for vLLM's penalties. With ``prompt`` = the first ``prompt_len``
  entries and ``output`` = the rest: ``repetition`` divides a positive logit / multiplies a
  negative one of every token seen in the prompt or the output (1 = off); ``frequency`` subtracts
  ``frequency · count_in_output``; ``presence`` subtracts ``presence · [token in output]``.

Order (vLLM's): mask, bias, penalties; then the sampler's temperature / top-k / top-p. The fast
form skips each control with a ``lax.cond`` when no row of the batch uses it, so plain batches
cost what they did before; the reference form (``fast=False``) applies every control to every row
(a neutral value is an exact identity), and both give bit-identical logits.

Log probabilities are ``log_softmax`` of the *raw* model logits of the serving variant, before
any control, temperature or filter (vLLM's default ``raw_logprobs``): the number a scorer such
as lm-evaluation-harness expects, and the same whatever sampling parameters the request used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bitdelta_jax.engine.logit_controls import (  # noqa: F401 (re-exported)
  BIAS_SLOTS,
  TOP_LOGPROBS,
  LogitControls,
  mask_words,
)
from bitdelta_jax.engine.pytrees import register_step_data

register_step_data()

def allowed_of(mask_RxW: jax.Array, vocab_size: int) -> jax.Array:
  """Bool ``[R, V]``: the tokens a bitmask allows."""
  v = jnp.arange(vocab_size, dtype=jnp.int32)
  words = mask_RxW[:, v // 32]
  return ((words >> (v % 32)) & 1).astype(bool)


def _masked(x, c: LogitControls):
  return jnp.where(allowed_of(c.mask, x.shape[-1]), x, -jnp.inf)


def _biased(x, c: LogitControls):
  r, v = x.shape
  ids = jnp.where(c.bias_ids < 0, v, c.bias_ids)  # out of range: dropped
  rows = jnp.broadcast_to(jnp.arange(r)[:, None], ids.shape)
  return x.at[rows, ids].add(c.bias_vals, mode="drop")


def _penalised(x, c: LogitControls):
  r, v = x.shape
  h = c.history
  rows = jnp.broadcast_to(jnp.arange(r)[:, None], h.shape)
  ids = jnp.where(h < 0, v, h)
  is_out = (jnp.arange(h.shape[1])[None] >= c.prompt_len[:, None]) & (h >= 0)
  counts = jnp.zeros((r, v), jnp.float32).at[rows, ids].add(is_out.astype(jnp.float32),
                                                            mode="drop")
  seen = jnp.zeros((r, v), bool).at[rows, ids].set(True, mode="drop")
  rep = jnp.where(seen, c.repetition[:, None], 1.0)
  x = jnp.where(x > 0, x / rep, x * rep)
  x = x - c.frequency[:, None] * counts
  return x - c.presence[:, None] * (counts > 0)


def _uses(c: LogitControls):
  """Per control, whether any row of the batch uses it."""
  return (
    jnp.any(c.mask != -1),
    jnp.any(c.bias_ids >= 0),
    jnp.any((c.presence != 0) | (c.frequency != 0) | (c.repetition != 1)),
  )


def apply_controls(logits_RxV: jax.Array, c: LogitControls | None, *, fast: bool = True):
  """f32 logits after mask, bias and penalties (see the module docstring)."""
  x = logits_RxV.astype(jnp.float32)
  if c is None:
    return x
  steps = (_masked, _biased, _penalised)
  if not fast:
    for f in steps:
      x = f(x, c)
    return x
  for used, f in zip(_uses(c), steps):
    x = jax.lax.cond(used, lambda x, f=f: f(x, c), lambda x: x, x)
  return x


def logprobs_of(logits_RxV: jax.Array, tokens_R: jax.Array, want_R: jax.Array):
  """``(logprob of tokens_R [R], top ids [R, TOP_LOGPROBS], top logprobs [R, TOP_LOGPROBS])``
  of the raw logits; zeros when no row wants them (the work is skipped)."""
  r, v = logits_RxV.shape
  k = min(TOP_LOGPROBS, v)

  def compute():
    lsm = jax.nn.log_softmax(logits_RxV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lsm, tokens_R[:, None].astype(jnp.int32), axis=-1)[:, 0]
    vals, ids = jax.lax.top_k(lsm, k)
    return chosen, ids.astype(jnp.int32), vals

  def skip():
    return (jnp.zeros((r,), jnp.float32), jnp.zeros((r, k), jnp.int32),
            jnp.zeros((r, k), jnp.float32))

  if r == 0:
    return skip()
  return jax.lax.cond(jnp.any(want_R), compute, skip)
