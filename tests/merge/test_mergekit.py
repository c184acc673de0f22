"""The task-arithmetic family against mergekit itself, when mergekit (with torch) is importable.

mergekit is an optional test oracle, never a requirement: these tests skip without it. To run
them, put mergekit 0.1.5's sources on PYTHONPATH (e.g. `pip download --no-deps mergekit==0.1.5`
and unzip the wheel). DARE's random masks are made equal by handing mergekit our masks through
a patched ``torch.bernoulli``.
"""

import jax
import numpy as np
import pytest

from bitdelta_jax import merge as M

mk = pytest.importorskip("mergekit.merge_methods", reason="mergekit is an optional test oracle")
torch = pytest.importorskip("torch")

RNG = np.random.default_rng(11)
SHAPE = (12, 10)
IDS = ["base", "m0", "m1", "m2"]


def _inputs():
  base = RNG.normal(size=SHAPE).astype(np.float32)
  models = [(base + 0.1 * RNG.normal(size=SHAPE)).astype(np.float32) for _ in range(3)]
  return base, models


def _mergekit(method, base, models, **params):
  per_model = {}
  for key in ("weight", "density"):
    if key in params and isinstance(params[key], list):
      per_model[key] = dict(zip(IDS[1:], params.pop(key)))
  tensors = [torch.from_numpy(x) for x in (base, *models)]
  out = mk.merge_tensors(tensors, method, parameters={**params, **per_model}, ids=IDS, base_index=0)
  return out.numpy()


def _ours(fn, base, models, **kw):
  return np.asarray(fn({"w": base}, [{"w": m} for m in models], **kw)["w"])


@pytest.mark.parametrize("density", [0.0, 0.3, [0.5, 0.0, 0.9], 1.0])
@pytest.mark.parametrize("rescale", [False, True])
def test_ties_matches_mergekit(density, rescale):
  base, models = _inputs()
  w = [1.0, 0.6, 0.8]
  ref = _mergekit(
    "ties", base, models, weight=w, density=density, rescale=rescale, **{"lambda": 0.9}
  )
  got = _ours(M.ties, base, models, density=density, weights=w, lambda_=0.9, rescale=rescale)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_task_arithmetic_matches_mergekit():
  base, models = _inputs()
  w = [1.0, -0.5, 2.0]
  ref = _mergekit("task_arithmetic", base, models, weight=w, **{"lambda": 0.7})
  got = _ours(M.task_arithmetic, base, models, weights=w, lambda_=0.7)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("density", [0.0, 0.4])
@pytest.mark.parametrize("rescale", [False, True])
def test_dare_matches_mergekit_on_the_same_masks(monkeypatch, method, density, rescale):
  base, models = _inputs()
  w = [1.0, 0.5, 0.7]
  key = M.tensor_key(3, "w")
  masks = [np.asarray(M.random_mask(jax.random.fold_in(key, i), SHAPE, density)) for i in range(3)]
  handed = iter(masks)
  real = torch.bernoulli

  def bernoulli(p, *a, **k):
    if p.shape != SHAPE:
      return real(p, *a, **k)
    return torch.from_numpy(next(handed).astype(np.float32)).to(p.dtype)

  monkeypatch.setattr(torch, "bernoulli", bernoulli)
  ref = _mergekit(method, base, models, weight=w, density=density, rescale=rescale)
  got = _ours(getattr(M, method), base, models, density=density, weights=w, seed=3, rescale=rescale)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  if density == 0:
    np.testing.assert_array_equal(got, base)
