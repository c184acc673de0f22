"""MonoSoup: a model soup from one fine-tuned checkpoint (arXiv:2602.09689).

Per 2-D layer, with ΔW = W_ft − W0 = U diag(σ) Vᵀ (σ descending):

    k       = ceil(exp(H(p))),  p_i = σ_i / Σσ            ("freevariance": entropy effective rank)
            | min{k : Σ_{i≤k} σ_i² ≥ energy · Σσ²}        ("variance")
    P_k     = Σ_{i≤k} σ_i² / Σσ²
    ρ       = (σ_{k+1} / σ_1)²                            (0 when k is the full rank)
    λ_low   = clip(ρ + (1 − ρ) · sqrt(1 − P_k), 0, 1);  λ_high = clip(1 − λ_low, 0, 1)
    W       = W0 + λ_high · ΔW_high + λ_low · ΔW_low      (ΔW_high = rank-k part, ΔW_low = rest)

1-D parameters (norms, biases) and negligible updates keep the fine-tuned values. k is data
dependent, so the split is a mask over singular values and the function stays jit-able.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from bitdelta_jax.merge.baselines import Tree, map_named

Mode = Literal["freevariance", "variance"]


def entropy_effective_rank(s: jax.Array) -> jax.Array:
  """exp of the Shannon entropy of σ / Σσ (Roy & Vetterli, 2007)."""
  p = s / jnp.maximum(s.sum(), 1e-30)
  h = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0))
  return jnp.exp(h)


def split_rank(s: jax.Array, mode: Mode = "freevariance", energy: float = 0.8) -> jax.Array:
  """The number k of high-energy directions for singular values `s` (descending)."""
  n = s.shape[0]
  if mode == "freevariance":
    k = jnp.ceil(entropy_effective_rank(s) - 1e-6).astype(jnp.int32)
  elif mode == "variance":
    frac = jnp.cumsum(s**2) / jnp.maximum(jnp.sum(s**2), 1e-30)
    k = jnp.argmax(frac >= energy - 1e-7).astype(jnp.int32) + 1
  else:
    raise ValueError(f"monosoup mode must be 'freevariance' or 'variance', got {mode!r}")
  return jnp.clip(k, 1, n)


def coefficients(s: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(λ_high, λ_low) for singular values `s` split after the first k."""
  e = s**2
  total = jnp.maximum(e.sum(), 1e-30)
  idx = jnp.arange(s.shape[0])
  p_k = jnp.sum(jnp.where(idx < k, e, 0.0)) / total
  s_next = jnp.where(k < s.shape[0], s[jnp.minimum(k, s.shape[0] - 1)], 0.0)
  rho = (s_next / jnp.maximum(s[0], 1e-30)) ** 2
  lam_low = jnp.clip(rho + (1 - rho) * jnp.sqrt(jnp.clip(1 - p_k, 0.0, 1.0)), 0.0, 1.0)
  lam_high = jnp.clip(1 - lam_low, 0.0, 1.0)
  return lam_high, lam_low


@functools.partial(jax.jit, static_argnames=("mode", "energy", "tol"))
def monosoup_tensor(
  w0: jax.Array,
  w_ft: jax.Array,
  mode: Mode = "freevariance",
  energy: float = 0.8,
  tol: float = 1e-7,
) -> jax.Array:
  """MonoSoup of one 2-D tensor (float32 result). Negligible updates (‖ΔW‖ ≤ tol·‖W0‖, or
  exactly zero) return W_ft."""
  w0 = w0.astype(jnp.float32)
  w_ft = w_ft.astype(jnp.float32)
  d = w_ft - w0
  u, s, vt = jnp.linalg.svd(d, full_matrices=False)
  k = split_rank(s, mode, energy)
  lam_high, lam_low = coefficients(s, k)
  coef = jnp.where(jnp.arange(s.shape[0]) < k, lam_high, lam_low)
  merged = w0 + (u * (coef * s)) @ vt
  negligible = jnp.linalg.norm(d) <= tol * jnp.linalg.norm(w0)
  return jnp.where(negligible, w_ft, merged)


def monosoup(
  base: Tree, finetuned: Tree, mode: Mode = "freevariance", energy: float = 0.8, tol: float = 1e-7
) -> Tree:
  """MonoSoup over a parameter tree: 2-D float leaves are re-weighted, others keep `finetuned`."""

  def one(_name, w0, w):
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
      return w
    return monosoup_tensor(w0, w, mode, energy, tol).astype(w.dtype)

  return map_named(one, base, finetuned)
