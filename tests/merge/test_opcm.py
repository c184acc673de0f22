"""OPCM against a numpy transcription of the authors' reference loop (fusion_bench opcm)."""

import numpy as np
import pytest

from bitdelta_jax import merge as M

RNG = np.random.default_rng(3)
SHAPES = {
  "layers.0.q.weight": (10, 10),
  "layers.0.up.weight": (14, 8),
  "layers.0.down.weight": (8, 14),
  "layers.0.norm.weight": (10,),
  "embed_tokens.weight": (12, 10),
}


def projects(name, shape):
  return len(shape) == 2 and "embed" not in name


def np_opcm(base, models, alpha):
  """fusion_bench OPCM.run: full-matrix SVD, λ_t from the whole-model task-vector norm."""
  f = lambda t: {k: v.astype(np.float64) for k, v in t.items()}
  base, models = f(base), [f(m) for m in models]
  norm = lambda t: np.sqrt(sum(np.sum(v**2) for v in t.values()))
  merged = dict(models[0])
  norms = [norm({k: models[0][k] - base[k] for k in base})]
  prev_lam = 1.0
  for task in models[1:]:
    norms.append(norm({k: task[k] - base[k] for k in base}))
    avg = np.mean(norms)
    lam = 1.0
    for k in base:
      prev_tv, tv = merged[k] - base[k], task[k] - base[k]
      if projects(k, base[k].shape):
        u, s, vh = np.linalg.svd(prev_tv, full_matrices=True)
        v = vh.T
        split = int(np.argmax(np.cumsum(s) / s.sum() > alpha))
        p = u.T @ tv @ v
        np.fill_diagonal(p, 0)
        p[:split, :split] = 0
        tv = u @ p @ v.T
      merged[k] = base[k] + (prev_lam * prev_tv + tv) / lam
    tvn = norm({k: merged[k] - base[k] for k in base})
    lam *= tvn / avg
    merged = {k: base[k] + (merged[k] - base[k]) * (avg / tvn) for k in base}
    prev_lam = lam
  return merged


def _models(n):
  base = {k: RNG.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  models = [
    {k: v + 0.1 * RNG.normal(size=v.shape).astype(np.float32) for k, v in base.items()}
    for _ in range(n)
  ]
  return base, models


@pytest.mark.parametrize("n,alpha", [(1, 0.5), (2, 0.5), (4, 0.5), (3, 0.8)])
def test_matches_reference(n, alpha):
  base, models = _models(n)
  out = M.opcm(base, models, alpha)
  ref = np_opcm(base, models, alpha)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(out[k]), ref[k], atol=3e-5, rtol=1e-4)


def test_projection_removes_the_dominant_block_and_diagonal():
  m = RNG.normal(size=(9, 7))
  t = RNG.normal(size=(9, 7))
  cleaned = np.asarray(M.project_task_vector(m.astype(np.float32), t.astype(np.float32), 0.5))
  u, s, vt = np.linalg.svd(m, full_matrices=False)
  split = int(np.argmax(np.cumsum(s) / s.sum() > 0.5))
  c = u.T @ cleaned @ vt.T
  assert split >= 1
  np.testing.assert_allclose(c[:split, :split], 0, atol=1e-5)
  np.testing.assert_allclose(np.diag(c), 0, atol=1e-5)
  off = ~(np.eye(7, dtype=bool) | (np.arange(7)[:, None] < split) & (np.arange(7)[None] < split))
  np.testing.assert_allclose(c[off], (u.T @ t @ vt.T)[off], atol=1e-5)


def test_merged_task_vector_has_mean_norm():
  base, models = _models(3)
  out = M.opcm(base, models)
  norm = lambda t: np.sqrt(sum(np.sum((np.asarray(t[k], np.float64) - base[k]) ** 2) for k in base))
  assert abs(norm(out) - np.mean([norm(m) for m in models])) < 1e-4 * norm(out)


def test_incremental_state_equals_batch():
  base, models = _models(3)
  st = M.opcm_init(base, models[0])
  for m in models[1:]:
    st = M.opcm_update(st, base, m)
  assert st.count == 3
  inc, batch = M.opcm_merged(st, base), M.opcm(base, models)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(inc[k]), np.asarray(batch[k]), atol=1e-6)
