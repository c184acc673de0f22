"""OPCM: sequential orthogonal-projection continual merging (Tang et al., arXiv:2501.09522).

Models arrive one at a time; memory stays constant in their number. With task vectors
τ_t = θ_t − θ_0, following the authors' reference (fusion_bench ``opcm``):

    S_1 = τ_1
    S_t = S_{t−1} + P(S_{t−1}, τ_t)                      (P: projection below, per linear weight;
                                                         identity for other parameters)
    λ_t = ‖S_t‖ / mean_{i≤t} ‖τ_i‖                       (norms over the whole model)
    θ^(t) = θ_0 + S_t / λ_t

so the merged task vector always has the mean norm of the task vectors seen so far. The
projection of a new τ against the current merged update M = U diag(σ) Vᵀ removes, in M's
singular basis, the block of the top-`split` directions and the diagonal:

    C = Uᵀ τ V;  C[:split, :split] = 0;  C[i, i] = 0 for every i;  P(M, τ) = τ − U (C_removed) Vᵀ
    split = first index i with Σ_{j≤i} σ_j / Σσ > alpha

(the reference's `(cumsum(s)/s.sum() > alpha).argmax()`). One deliberate difference: the
reference uses full SVD bases and zeroes the diagonal even for directions with σ_i = 0, whose
basis vectors are arbitrary; here the diagonal is zeroed only where σ_i > rtol·σ_1. For
full-rank updates (every real fine-tune) the two coincide; for low-rank ones (LoRA deltas) this
makes the result basis-independent. S_t is scale-free (λ only rescales M, and `split` depends
on σ ratios), which is what lets the CLI stream tensor by tensor and normalise in a second pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from bitdelta_jax.merge.baselines import Tree, map_named

Predicate = Callable[[str, jax.Array], bool]


def default_projects(name: str, x) -> bool:
  """Project 2-D weights except embeddings (the reference projects nn.Linear weights only)."""
  return x.ndim == 2 and "embed" not in name.lower() and "wte" not in name.lower()


@functools.partial(jax.jit, static_argnames=("alpha", "rtol"))
def project_task_vector(
  merged_tv: jax.Array, task_tv: jax.Array, alpha: float = 0.5, rtol: float = 1e-6
) -> jax.Array:
  """P(M, τ): τ with the components in M's dominant singular block and diagonal removed."""
  m = merged_tv.astype(jnp.float32)
  t = task_tv.astype(jnp.float32)
  u, s, vt = jnp.linalg.svd(m, full_matrices=False)
  total = s.sum()
  split = jnp.argmax(jnp.cumsum(s) / jnp.where(total > 0, total, 1.0) > alpha)
  idx = jnp.arange(s.shape[0])
  block = (idx[:, None] < split) & (idx[None, :] < split)
  diag = jnp.diag(s > rtol * s[0])
  remove = (block | diag) & (total > 0)
  c = u.T @ t @ vt.T
  return t - u @ jnp.where(remove, c, 0.0) @ vt


@dataclass
class OPCMState:
  """Running OPCM merge: `acc` = S_t (a tree, float32), `norms` = ‖τ_i‖ of each model seen."""

  acc: Tree
  norms: list[float]

  @property
  def count(self) -> int:
    return len(self.norms)


def _tv(base: Tree, model: Tree) -> Tree:
  return jax.tree.map(
    lambda b, x: jnp.asarray(x, jnp.float32) - jnp.asarray(b, jnp.float32), base, model
  )


def tree_norm(tree: Tree) -> float:
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))))


def opcm_init(base: Tree, first: Tree) -> OPCMState:
  tv = _tv(base, first)
  return OPCMState(acc=tv, norms=[tree_norm(tv)])


def opcm_update(
  state: OPCMState,
  base: Tree,
  model: Tree,
  alpha: float = 0.5,
  projects: Predicate = default_projects,
) -> OPCMState:
  """Folds one more model into the merge."""
  tv = _tv(base, model)

  def one(name, s, t):
    return project_task_vector(s, t, alpha) + s if projects(name, t) else s + t

  return OPCMState(acc=map_named(one, state.acc, tv), norms=state.norms + [tree_norm(tv)])


def opcm_merged(state: OPCMState, base: Tree) -> Tree:
  """θ_0 + S_t · mean‖τ‖ / ‖S_t‖, cast to the base dtypes."""
  norm = tree_norm(state.acc)
  scale = (sum(state.norms) / len(state.norms)) / norm if norm > 0 else 0.0
  return jax.tree.map(
    lambda b, s: (jnp.asarray(b, jnp.float32) + scale * s).astype(jnp.asarray(b).dtype),
    base,
    state.acc,
  )


def opcm(
  base: Tree, models: Sequence[Tree], alpha: float = 0.5, projects: Predicate = default_projects
) -> Tree:
  """Merges `models` in the given order with OPCM."""
  if not models:
    raise ValueError("opcm needs at least one model")
  state = opcm_init(base, models[0])
  for m in models[1:]:
    state = opcm_update(state, base, m, alpha, projects)
  return opcm_merged(state, base)
