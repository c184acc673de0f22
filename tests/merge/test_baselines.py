"""Task-arithmetic-family merges against independent numpy oracles (mergekit semantics)."""

import jax
import numpy as np
import pytest

from bitdelta_jax import merge as M

RNG = np.random.default_rng(0)
SHAPES = {"layer.w": (12, 10), "layer.b": (10,), "emb": (7, 5)}


def _trees(n=3, scale=0.1):
  base = {k: RNG.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  models = [
    {k: v + scale * RNG.normal(size=v.shape).astype(np.float32) for k, v in base.items()}
    for _ in range(n)
  ]
  return base, models


def np_rescale_l1(d, kept, eps=1e-7):
  """mergekit 0.1.5 sparsify.rescaled_masked_tensor(norm=l1): match the unpruned L1 norm."""
  before, after = np.abs(d).sum(), np.abs(kept).sum()
  if before < eps or after < eps:
    return kept
  return kept * (before / after)


def np_trim(d, density, rescale=False):
  """mergekit 0.1.5 sparsify.magnitude: top k = max(1, int(density·numel)); none at <= 0."""
  if density >= 1:
    return d
  if density <= 0:
    return np.zeros_like(d)
  k = max(1, int(density * d.size))
  keep = np.argsort(-np.abs(d).ravel(), kind="stable")[:k]
  m = np.zeros(d.size, bool)
  m[keep] = True
  kept = np.where(m.reshape(d.shape), d, 0)
  return np_rescale_l1(d, kept) if rescale else kept


def np_drop(d, mask, density, rescale):
  """mergekit 0.1.5 sparsify.bernoulli on a given mask; rescale "density" is the DARE paper."""
  kept = np.where(mask, d, 0)
  if rescale in (True, "l1"):
    return np_rescale_l1(d, kept)
  return kept / density if rescale == "density" else kept


def np_gta(base, xs, w, *, consensus, normalize, lam=1.0):
  """mergekit GTATask.execute on already-sparsified deltas (float64)."""
  d = np.stack(xs).astype(np.float64)
  w = np.asarray(w, np.float64).reshape((-1,) + (1,) * (d.ndim - 1))
  wd = d * w
  if consensus:
    mass = wd.sum(0) if consensus == "sum" else np.sign(wd).sum(0)
    majority = np.where(mass >= 0, 1.0, -1.0)
    mask = np.sign(wd) == majority
    mixed = (wd * mask).sum(0)
    div = (w * mask).sum(0)
    div[div == 0] = 1
  else:
    mixed = wd.sum(0)
    div = w.sum()
    div = 1.0 if abs(div) < 1e-8 else div
  if normalize:
    mixed = mixed / div
  return base + lam * mixed


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("normalize", [True, False])
def test_linear(normalize):
  _, models = _trees()
  w = [0.5, 0.2, 1.3]
  out = M.linear(models, w, normalize=normalize)
  for k in SHAPES:
    ref = sum(wi * m[k].astype(np.float64) for wi, m in zip(w, models))
    close(out[k], ref / (sum(w) if normalize else 1.0))


def test_linear_default_is_the_mean():
  _, models = _trees()
  out = M.linear(models)
  for k in SHAPES:
    close(out[k], np.mean([m[k] for m in models], 0))


@pytest.mark.parametrize("normalize,lam", [(False, 1.0), (True, 0.7), (False, 0.3)])
def test_task_arithmetic(normalize, lam):
  base, models = _trees()
  w = [1.0, -0.5, 2.0]
  out = M.task_arithmetic(base, models, w, lambda_=lam, normalize=normalize)
  for k in SHAPES:
    ref = np_gta(
      base[k], [m[k] - base[k] for m in models], w, consensus=None, normalize=normalize, lam=lam
    )
    close(out[k], ref)


def test_magnitude_mask_keeps_top_k():
  d = RNG.normal(size=(9, 11)).astype(np.float32)
  m = np.asarray(M.magnitude_mask(d, 0.3))
  assert m.sum() == int(0.3 * d.size)
  assert np.abs(d[m]).min() >= np.abs(d[~m]).max()


def _stable_top_k_mask(d: np.ndarray, k: int) -> np.ndarray:
  """numpy: the k largest |d|, ties at the threshold going to the lower flat index."""
  order = np.argsort(-np.abs(d).ravel(), kind="stable")
  m = np.zeros(d.size, bool)
  m[order[:k]] = True
  return m.reshape(d.shape)


@pytest.mark.parametrize("shape", [(1,), (7,), (13, 17), (64, 33)])
@pytest.mark.parametrize("levels", [0, 3, 40])
def test_magnitude_mask_is_an_exact_top_k_with_ties_to_the_lower_index(shape, levels):
  """Radix selection keeps exactly k entries, as a stable sort would, also when many entries
  tie at the threshold (levels > 0 quantises |d| to a few values, as bf16 deltas do) and with
  zeros and signed zeros among them."""
  rng = np.random.default_rng(sum(shape) + levels)
  d = rng.normal(size=shape).astype(np.float32)
  if levels:
    d = np.round(d * levels / 3) / levels
  d.ravel()[:: 5] = -0.0
  for density in (0.01, 0.3, 0.5, 0.77, 0.999):
    k = max(1, int(density * d.size))
    np.testing.assert_array_equal(np.asarray(M.magnitude_mask(d, density)),
                                  _stable_top_k_mask(d, k), err_msg=f"density {density}")


@pytest.mark.parametrize("density", [0.2, [0.5, 0.3, 0.9]])
@pytest.mark.parametrize("consensus", ["sum", "count"])
def test_ties(density, consensus):
  base, models = _trees()
  w = [1.0, 0.6, 0.8]
  out = M.ties(base, models, density=density, weights=w, lambda_=0.9, consensus=consensus)
  dens = density if isinstance(density, list) else [density] * 3
  for k in SHAPES:
    trimmed = [np_trim(m[k] - base[k], dn) for m, dn in zip(models, dens)]
    ref = np_gta(base[k], trimmed, w, consensus=consensus, normalize=True, lam=0.9)
    close(out[k], ref)


@pytest.mark.parametrize("density", [0.3, [0.5, 0.0, 0.9]])
def test_ties_rescale_matches_l1_norm_per_tensor_and_model(density):
  base, models = _trees()
  w = [1.0, 0.6, 0.8]
  out = M.ties(base, models, density=density, weights=w, rescale=True)
  plain = M.ties(base, models, density=density, weights=w)
  dens = density if isinstance(density, list) else [density] * 3
  for k in SHAPES:
    trimmed = [np_trim(m[k] - base[k], dn, rescale=True) for m, dn in zip(models, dens)]
    close(out[k], np_gta(base[k], trimmed, w, consensus="sum", normalize=True))
    assert not np.allclose(np.asarray(out[k]), np.asarray(plain[k]))


def test_sparsify_l1_rescale_keeps_the_norm():
  d = RNG.normal(size=(9, 11)).astype(np.float32)
  for density in (0.05, 0.3, 0.8):
    kept = np.asarray(M.sparsify_magnitude(d, density, rescale=True))
    np.testing.assert_allclose(np.abs(kept).sum(), np.abs(d).sum(), rtol=1e-5)
    mask = np.asarray(M.magnitude_mask(d, density))
    np.testing.assert_allclose(kept, np_trim(d, density, rescale=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(kept != 0, mask)
  # below mergekit's eps=1e-7 nothing is rescaled
  tiny = np.array([4e-9, 3e-9, 2e-9, 1e-9], np.float32)
  np.testing.assert_array_equal(
    np.asarray(M.sparsify_magnitude(tiny, 0.5, True)), np.where(tiny > 2.5e-9, tiny, 0)
  )


@pytest.mark.parametrize(
  "method,kw",
  [
    ("ties", {}),
    ("ties", {"rescale": True}),
    ("dare_linear", {}),
    ("dare_linear", {"normalize": True}),
    ("dare_linear", {"rescale": "density"}),
    ("dare_linear", {"rescale": False}),
    ("dare_ties", {}),
    ("dare_ties", {"rescale": "density", "normalize": True}),
  ],
)
def test_density_zero_returns_the_base(method, kw):
  """mergekit 0.1.5: magnitude() returns zeros at density <= 0, bernoulli(p=0) keeps nothing
  and rescaled_masked_tensor leaves an all-zero result alone, so the merge is the base."""
  base, models = _trees()
  out = getattr(M, method)(base, models, density=0.0, **kw)
  for k in SHAPES:
    assert np.isfinite(np.asarray(out[k])).all()
    np.testing.assert_array_equal(np.asarray(out[k]), base[k])


def test_density_zero_for_one_model_drops_only_that_model():
  base, models = _trees()
  out = M.dare_linear(base, models, density=[1.0, 0.0, 1.0])
  ref = M.task_arithmetic(base, [models[0], models[2]])
  for k in SHAPES:
    close(out[k], np.asarray(ref[k], np.float64))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), [0.5, -1.0, 0.5]])
def test_negative_or_nan_density_is_refused(bad):
  base, models = _trees()
  for fn in (M.ties, M.dare_linear, M.dare_ties):
    with pytest.raises(ValueError, match="density"):
      fn(base, models, density=bad)


def test_rescale_density_is_dare_only():
  base, models = _trees()
  with pytest.raises(ValueError, match="DARE"):
    M.ties(base, models, density=0.5, rescale="density")
  with pytest.raises(ValueError, match="rescale"):
    M.dare_linear(base, models, density=0.5, rescale="l2")


def test_ties_opposing_signs_are_disjoint_mean():
  base = {"w": np.zeros((2, 2), np.float32)}
  a = {"w": np.array([[1.0, -1.0], [2.0, 0.0]], np.float32)}
  b = {"w": np.array([[3.0, 0.5], [-1.0, 0.0]], np.float32)}
  out = np.asarray(M.ties(base, [a, b], density=1.0)["w"])
  # [0,0]: both +, mean 2. [0,1]: mass -0.5 -> '-', only a. [1,0]: mass +1 -> '+', only a.
  # [1,1]: nobody -> 0.
  np.testing.assert_allclose(out, [[2.0, -1.0], [2.0, 0.0]])


def _dare_masks(seed, name, n, shape, density):
  key = M.tensor_key(seed, name)
  return [np.asarray(M.random_mask(jax.random.fold_in(key, i), shape, density)) for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("rescale", [None, True, "density", False])
def test_dare(method, normalize, rescale):
  """rescale None = the default, which is mergekit's L1-norm match (True)."""
  base, models = _trees()
  w = [1.0, 0.5, 0.7]
  density = 0.4
  fn = getattr(M, method)
  kw = {} if rescale is None else {"rescale": rescale}
  out = fn(base, models, density=density, weights=w, normalize=normalize, seed=3, **kw)
  mode = True if rescale is None else rescale
  for k, shape in SHAPES.items():
    masks = _dare_masks(3, k, 3, shape, density)
    drops = [np_drop(m[k] - base[k], mk, density, mode) for mk, m in zip(masks, models)]
    ref = np_gta(
      base[k], drops, w, consensus="sum" if method == "dare_ties" else None, normalize=normalize
    )
    close(out[k], ref)


def test_dare_drop_rate_and_seed():
  base = {"w": np.zeros((200, 100), np.float32)}
  model = {"w": np.ones((200, 100), np.float32)}
  out = np.asarray(M.dare_linear(base, [model], density=0.3, seed=1, rescale="density")["w"])
  kept = out != 0
  assert abs(kept.mean() - 0.3) < 0.02
  np.testing.assert_allclose(out[kept], 1 / 0.3, rtol=1e-6)
  # the default (mergekit): survivors scaled so the L1 norm of the delta is kept exactly
  l1 = np.asarray(M.dare_linear(base, [model], density=0.3, seed=1)["w"])
  np.testing.assert_array_equal(l1 != 0, kept)
  np.testing.assert_allclose(l1[kept], kept.size / kept.sum(), rtol=1e-6)
  np.testing.assert_allclose(np.abs(l1).sum(), kept.size, rtol=1e-5)
  again = np.asarray(M.dare_linear(base, [model], density=0.3, seed=1)["w"])
  other = np.asarray(M.dare_linear(base, [model], density=0.3, seed=2)["w"])
  np.testing.assert_array_equal(l1, again)
  assert (other != l1).any()
  no_rescale = np.asarray(M.dare_linear(base, [model], density=0.3, seed=1, rescale=False)["w"])
  np.testing.assert_allclose(no_rescale[kept], 1.0)


def test_per_tensor_function_jits_and_keeps_dtype():
  import jax.numpy as jnp

  base = {"w": jnp.ones((4, 4), jnp.bfloat16)}
  models = [{"w": jnp.full((4, 4), 2.0, jnp.bfloat16)}]
  out = M.task_arithmetic(base, models, lambda_=0.5)
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out["w"], np.float32), 1.5)


def test_linear_normalized_zero_weight_sum_is_refused():
  _, models = _trees(n=2)
  with pytest.raises(ValueError, match="sum to 0"):
    M.linear(models, [1.0, -1.0])
  out = M.linear(models, [1.0, -1.0], normalize=False)
  for k in SHAPES:
    close(out[k], models[0][k].astype(np.float64) - models[1][k])


def test_weights_length_is_checked():
  base, models = _trees()
  with pytest.raises(ValueError, match="weights"):
    M.task_arithmetic(base, models, [1.0, 2.0])
