"""Per-row token sampling: greedy, temperature, top-k, top-p, each row with its own key.

    sample(logits [R, V], keys [R, 2] uint32, temperature [R], top_p [R], top_k [R]) -> [R] int32

``temperature <= 0`` is greedy (argmax). ``top_k <= 0`` and ``top_p >= 1`` disable those
filters. Filters follow transformers' order: temperature, then top-k, then top-p (the smallest
set of most likely tokens whose mass reaches ``top_p``; the most likely token is always kept).
A row's key for the token at sequence position ``p`` is ``fold_in(PRNGKey(seed), p)``, so a
request's samples depend only on its seed and its own tokens, not on the batch around it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request decoding parameters."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  max_new_tokens: int = 16
  stop_token_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def row_keys(keys_Rx2: jax.Array, positions_R: jax.Array) -> jax.Array:
  return jax.vmap(jax.random.fold_in)(keys_Rx2, positions_R.astype(jnp.uint32))


def sample(
  logits_RxV: jax.Array,
  keys_Rx2: jax.Array,
  temperature_R: jax.Array,
  top_p_R: jax.Array,
  top_k_R: jax.Array,
) -> jax.Array:
  logits = logits_RxV.astype(jnp.float32)
  v = logits.shape[-1]
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = logits / jnp.maximum(temperature_R, 1e-6)[:, None]
  sorted_desc = -jnp.sort(-x, axis=-1)
  k = jnp.where((top_k_R <= 0) | (top_k_R > v), v, top_k_R).astype(jnp.int32)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
  x = jnp.where(x < kth, -jnp.inf, x)
  # top-p on the top-k survivors, in sorted order
  ranks = jnp.arange(v)[None]
  sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p_R[:, None]) | (ranks == 0)
  cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  x = jnp.where(x < cutoff, -jnp.inf, x)
  sampled = jax.vmap(jax.random.categorical)(keys_Rx2, x).astype(jnp.int32)
  return jnp.where(temperature_R <= 0, greedy, sampled)
