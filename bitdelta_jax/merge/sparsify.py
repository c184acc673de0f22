"""Sparsification of task vectors, as mergekit 0.1.5's ``mergekit/sparsify.py`` does it.

* ``magnitude`` (TIES trim): keep the k = max(1, int(density · numel)) largest |τ|; density ≥ 1
  keeps everything, density ≤ 0 (or an empty tensor) keeps nothing.
* ``random`` (DARE drop): keep each entry with probability ``density``; density ≥ 1 keeps
  everything, density ≤ 0 keeps nothing (so a merge at density 0 returns the base).
* rescale ``"l1"`` is mergekit's ``rescale: true`` (``rescaled_masked_tensor`` with
  ``RescaleNorm.l1``): the kept entries are multiplied by ‖τ‖₁ / ‖kept‖₁, per tensor and per
  model, unless either norm is below 1e-7 (then the kept entries are returned as they are).
  ``"density"`` is the DARE paper's 1/density, which mergekit no longer uses; it is offered for
  DARE only, as an explicit choice.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

Rescale = Literal["l1", "density"]
RESCALE_MODES = ("l1", "density")
L1_EPS = 1e-7  # mergekit rescaled_masked_tensor(eps=1e-7)


def rescale_mode(rescale: bool | str | None) -> Rescale | None:
  """Normalises a ``rescale`` argument: True → "l1" (mergekit), False/None → None."""
  if rescale is None or rescale is False:
    return None
  if rescale is True:
    return "l1"
  if rescale in RESCALE_MODES:
    return rescale  # type: ignore[return-value]
  raise ValueError(f"rescale: expected True, False or one of {RESCALE_MODES}, got {rescale!r}")


def check_density(density: float, what: str = "density") -> float:
  """A density is a number ≥ 0 (values ≥ 1 keep everything, as in mergekit)."""
  d = float(density)
  if math.isnan(d) or d < 0:
    raise ValueError(f"{what} must be >= 0 (0 keeps nothing, >= 1 keeps everything), got {d}")
  return d


def rescale_l1(delta: jax.Array, kept: jax.Array, eps: float = L1_EPS) -> jax.Array:
  """Scales ``kept`` so that its L1 norm equals ``delta``'s (mergekit ``RescaleNorm.l1``)."""
  before = jnp.abs(delta).sum()
  after = jnp.abs(kept).sum()
  ok = (before >= eps) & (after >= eps)
  return jnp.where(ok, kept * (before / jnp.where(ok, after, 1.0)), kept)


def magnitude_bits(x: jax.Array) -> jax.Array:
  """|x| as flat int32 bit patterns, which order as the magnitudes do."""
  return jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32).reshape(-1)


def kth_largest_magnitude(bits: jax.Array, k: int) -> jax.Array:
  """The k-th largest of ``bits`` (`magnitude_bits` of a tensor), by radix selection.

  Non-negative floats order as their int32 bit patterns do, so the largest t with
  count(bits >= t) >= k is found one bit at a time from the top: 31 counting passes over bits,
  O(31·n) with no sort. On XLA CPU this takes 0.84 s for a 49152x576 embedding, against tens
  of seconds for ``lax.top_k`` of half of it. NaN sorts above inf, as in ``lax.top_k``."""

  def step(i, t):
    cand = t | jnp.left_shift(jnp.int32(1), 30 - i)
    return jnp.where(jnp.sum(bits >= cand, dtype=jnp.int32) >= k, cand, t)

  return jax.lax.fori_loop(0, 31, step, jnp.int32(0))


def magnitude_mask(delta: jax.Array, density: float) -> jax.Array:
  """Keeps the k = max(1, int(density · numel)) largest |delta|; none at density ≤ 0.

  Exactly k entries are kept. Among entries equal to the k-th largest magnitude the
  lower flat indices are kept, as ``lax.top_k`` orders ties (mergekit's torch argsort leaves
  that order unspecified)."""
  if density >= 1:
    return jnp.ones(delta.shape, bool)
  if density <= 0 or delta.size == 0:
    return jnp.zeros(delta.shape, bool)
  k = max(1, int(density * delta.size))
  bits = magnitude_bits(delta)
  t = kth_largest_magnitude(bits, k)
  above = bits > t
  need = k - jnp.sum(above, dtype=jnp.int32)  # how many of the entries equal to t to keep
  at = bits == t

  def first_ties(_):
    return at & (jnp.cumsum(at, dtype=jnp.int32) <= need)

  ties = jax.lax.cond(need >= jnp.sum(at, dtype=jnp.int32), lambda _: at, first_ties, None)
  return (above | ties).reshape(delta.shape)


def random_mask(key: jax.Array, shape, density: float) -> jax.Array:
  """Keeps each entry independently with probability ``density`` (DARE's drop step)."""
  if density >= 1:
    return jnp.ones(shape, bool)
  if density <= 0:
    return jnp.zeros(shape, bool)
  return jax.random.bernoulli(key, density, shape)


def sparsify_magnitude(
  delta: jax.Array, density: float, rescale: bool | Literal["l1"] | None = None
) -> jax.Array:
  """TIES trim (mergekit ``magnitude``); ``rescale`` True/"l1" matches the L1 norm."""
  mode = rescale_mode(rescale)
  if mode == "density":
    raise ValueError("rescale='density' is DARE's 1/density; magnitude trimming takes l1 only")
  if density >= 1:
    return delta
  kept = jnp.where(magnitude_mask(delta, density), delta, 0)
  return rescale_l1(delta, kept) if mode == "l1" else kept


def sparsify_random(
  delta: jax.Array, density: float, key: jax.Array, rescale: bool | Rescale | None = True
) -> jax.Array:
  """DARE drop (mergekit ``bernoulli``): rescale True/"l1" matches the L1 norm of ``delta``
  (mergekit ``rescale: true``); "density" divides by density (the DARE paper)."""
  mode = rescale_mode(rescale)
  if density >= 1:
    return delta
  if density <= 0:
    return jnp.zeros_like(delta)
  kept = jnp.where(random_mask(key, delta.shape, density), delta, 0)
  if mode == "l1":
    return rescale_l1(delta, kept)
  if mode == "density":
    return kept / density
  return kept
