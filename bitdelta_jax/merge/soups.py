"""SVD soup of several checkpoints and a training hook that uses it.

    W = W_base + (1/k) · Σ_i trunc_r(W_i − W_base)

trunc_r keeps the top-r singular directions of a 2-D update; 1-D (and other non-2-D) updates are
averaged unchanged. This is the seed's "multi-checkpoint MonoSoup"; the published single-
checkpoint method is `bitdelta_jax.merge.monosoup`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from bitdelta_jax.merge.baselines import Tree


def truncate_rank(delta: jax.Array, rank: int) -> jax.Array:
  """Best rank-`rank` approximation (Eckart–Young) of a 2-D array, in float32."""
  d = delta.astype(jnp.float32)
  if rank >= min(d.shape):
    return d
  u, s, vt = jnp.linalg.svd(d, full_matrices=False)
  return (u[:, :rank] * s[:rank]) @ vt[:rank]


@functools.partial(jax.jit, static_argnames=("rank",))
def svd_soup_tensor(base: jax.Array, tensors: jax.Array, rank: int) -> jax.Array:
  """base ``[...]``, tensors ``[k, ...]`` -> float32 soup of one tensor."""
  b = base.astype(jnp.float32)
  deltas = tensors.astype(jnp.float32) - b[None]
  if b.ndim == 2:
    deltas = jax.vmap(lambda d: truncate_rank(d, rank))(deltas)
  return b + deltas.mean(0)


def svd_soup(base: Tree, checkpoints: Sequence[Tree], rank: int) -> Tree:
  """W_base + mean of the rank-`rank` truncations of each checkpoint's update."""
  if not checkpoints:
    raise ValueError("svd_soup needs at least one checkpoint")
  if rank < 1:
    raise ValueError(f"rank must be >= 1, got {rank}")

  def one(b, *xs):
    if not jnp.issubdtype(b.dtype, jnp.floating):
      return xs[0]
    stacked = jnp.stack([jnp.asarray(x, jnp.float32) for x in xs])
    return svd_soup_tensor(b, stacked, rank).astype(b.dtype)

  return jax.tree.map(one, base, *checkpoints)


@dataclass
class SvdSoupHook:
  """Every `every` steps, replaces the parameters by svd_soup(base, [params, best], rank).

  For an optax loop::

      hook = SvdSoupHook(base=params0, every=1000, rank=16)
      for step in range(n):
        params, opt_state = train_step(params, opt_state, batch)
        params = hook(step + 1, params, score=eval_loss if step % 100 == 0 else None)

  `score` (lower is better unless ``higher_is_better``) updates the best checkpoint so far; the
  merge happens only once a best exists. Optimizer state is left as is: the moments keep
  describing the (nearby) merged point, as with naive in-training averaging.
  """

  base: Tree
  every: int = 1000
  rank: int = 16
  higher_is_better: bool = False
  best: Tree | None = None
  best_score: float | None = None
  merges: int = 0
  _soup: Callable[..., Any] = field(default=svd_soup, repr=False)

  def observe(self, params: Tree, score: float) -> bool:
    """Records `params` as the best checkpoint if `score` beats the best so far."""
    better = self.best_score is None or (
      score > self.best_score if self.higher_is_better else score < self.best_score
    )
    if better:
      self.best = jax.tree.map(jnp.array, params)  # a copy: donated buffers may be reused
      self.best_score = float(score)
    return better

  def __call__(self, step: int, params: Tree, score: float | None = None) -> Tree:
    if score is not None:
      self.observe(params, score)
    if self.every > 0 and step > 0 and step % self.every == 0 and self.best is not None:
      params = self._soup(self.base, [params, self.best], self.rank)
      self.merges += 1
    return params
