"""`merge.soup_training` on the built-in nano model: merge steps, equality with plain training,
each rule against an independent numpy computation at the merge step, and the real recipe's
``soup`` option reaching the loop."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bitdelta_jax.merge import soup_training
from bitdelta_jax.merge.soup_training import (
  METHODS,
  SoupRun,
  SoupSchedule,
  model_step_fns,
  soup_train,
)
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.zoo import shipped_family
from bitdelta_jax.zoo.recipe import _labels, _task_batches
from bitdelta_jax.zoo.tasks import TASKS
from bitdelta_jax.zoo.train import train

TASK = TASKS["nano-upper"]


def _optimizer():  # embeddings / LM head frozen, so some leaves never move
  return optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
    {"train": optax.adam(1e-3), "freeze": optax.set_to_zero()}, _labels))


def _stream():
  return _task_batches(TASK, 4, 40, 0)


@pytest.fixture(scope="module")
def nano():
  model = from_pretrained(shipped_family()[0], jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = _optimizer()
  step_fn, loss_fn = model_step_fns(graphdef, rest, opt)
  val = next(_task_batches(TASK, 8, 40, 1))
  vt, vm = jnp.asarray(val[0]), jnp.asarray(val[1])
  return {"graphdef": graphdef, "params": params, "rest": rest, "opt": opt, "step": step_fn,
          "val_loss": lambda p: loss_fn(p, vt, vm)}


def _run(nano, method, steps, every, window, rank=2, record=None):
  step = nano["step"]
  if record is not None:
    def step(p, s, t, m, _inner=nano["step"]):
      p, s, loss = _inner(p, s, t, m)
      record.append(jax.tree.map(lambda x: np.array(x, copy=True), p))  # after this step
      return p, s, loss
  params = soup_training.copy_tree(nano["params"])
  return soup_train(step, params, nano["opt"].init(params), _stream(), steps,
                    SoupSchedule(method, every=every, window=window, rank=rank),
                    start=nano["params"], val_loss=nano["val_loss"])


def _np_leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def test_schedule_validates():
  with pytest.raises(ValueError, match="soup method"):
    SoupSchedule("bogus")
  with pytest.raises(ValueError):
    SoupSchedule("average", every=0)
  s = SoupSchedule("average", every=8, window=4)
  assert s.check == 2 and s.is_check(6) and not s.is_check(5)
  assert s.is_merge(16) and not s.is_merge(12) and not SoupSchedule("none").is_merge(16)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_each_method_merges_at_its_steps(nano, method):
  run = _run(nano, method, steps=8, every=4, window=2)
  assert run.merges == ([] if method == "none" else [4, 8])
  assert [s for s, _ in run.val] == [2, 4, 6, 8]
  assert len(run.losses) == 8 and all(math.isfinite(x) for x in run.losses)


def test_svd_needs_a_validation_loss(nano):
  params = soup_training.copy_tree(nano["params"])
  with pytest.raises(ValueError, match="validation loss"):
    soup_train(nano["step"], params, nano["opt"].init(params), _stream(), 2,
               SoupSchedule("svd", every=2, window=1))


@pytest.mark.slow
def test_none_equals_plain_training(nano):
  run = _run(nano, "none", steps=3, every=1, window=1)
  model = nnx.merge(nano["graphdef"], soup_training.copy_tree(nano["params"]), nano["rest"])
  losses = train(model, _stream(), 3, _optimizer(), progress=False)
  np.testing.assert_allclose(run.losses, losses, rtol=1e-6)
  plain = nnx.split(model, nnx.Param, ...)[1]
  for a, b in zip(_np_leaves(run.params), _np_leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_average_is_the_mean_of_the_window(nano):
  record = []
  run = _run(nano, "average", steps=4, every=4, window=2, record=record)  # checks at 2 and 4
  want = [(a + b) / 2 for a, b in zip(_np_leaves(record[1]), _np_leaves(record[3]))]
  for got, w in zip(_np_leaves(run.params), want):
    np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)


def _np_monosoup(w0, w):
  """The paper's rule (freevariance) in float64 numpy, written from the formula."""
  d = w - w0
  if w.ndim != 2 or not d.any():
    return w
  u, s, vt = np.linalg.svd(d, full_matrices=False)
  p = s / s.sum()
  p = p[p > 0]
  k = int(np.clip(math.ceil(math.exp(-(p * np.log(p)).sum()) - 1e-6), 1, len(s)))
  pk = (s[:k] ** 2).sum() / (s**2).sum()
  rho = (s[k] / s[0]) ** 2 if k < len(s) else 0.0
  lam_low = float(np.clip(rho + (1 - rho) * math.sqrt(max(1 - pk, 0.0)), 0, 1))
  lam_high = float(np.clip(1 - lam_low, 0, 1))
  coef = np.where(np.arange(len(s)) < k, lam_high, lam_low)
  return w0 + (u * (coef * s)) @ vt


def test_monosoup_matches_numpy_at_the_merge_step(nano):
  record = []
  run = _run(nano, "monosoup", steps=4, every=4, window=2, record=record)
  moved = 0
  for got, w0, w in zip(_np_leaves(run.params), _np_leaves(nano["params"]),
                        _np_leaves(record[3])):
    want = _np_monosoup(w0, w)
    moved += w.ndim == 2 and bool((w != w0).any())
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, np.abs(w0).max()))
  assert moved > 0


@pytest.mark.slow
def test_svd_soup_matches_numpy_at_the_merge_step(nano):
  record, rank = [], 2
  run = _run(nano, "svd", steps=4, every=4, window=2, rank=rank, record=record)
  vals = dict(run.val)  # best of the checks at steps 2 and 4 (ties: the first)
  best = record[1] if vals[2] <= vals[4] else record[3]

  def trunc(d):
    if d.ndim != 2:
      return d
    u, s, vt = np.linalg.svd(d, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vt[:rank]

  for got, w0, w, b in zip(_np_leaves(run.params), _np_leaves(nano["params"]),
                           _np_leaves(record[3]), _np_leaves(best)):
    want = w0 + (trunc(w - w0) + trunc(b - w0)) / 2 if (w != w0).any() else w
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, np.abs(w0).max()))


# ---------------------------------------------------------------- the real recipe's option


def test_recipe_key_unchanged_without_soup():
  from bitdelta_jax.zoo.real_family import RealRecipe

  assert json.loads(RealRecipe().key()) == {"steps": 64, "batch": 8, "seq": 56, "lr": 5e-5,
                                            "warmup": 6, "weight_decay": 0.01, "seed": 0}
  k = json.loads(RealRecipe(soup="monosoup", soup_every=8).key())
  assert k["soup"] == "monosoup" and k["soup_every"] == 8
  with pytest.raises(ValueError, match="soup"):
    RealRecipe(soup="bogus")


class _FakeTokenizer:
  def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
    return [1, 2, 3] + [ord(c) % 50 + 4 for c in msgs[-1]["content"]][:8]

  def encode(self, text, add_special_tokens=False):
    return [ord(c) % 50 + 4 for c in text][:8]


@pytest.mark.parametrize("method", ["svd", "monosoup"])
def test_recipe_soup_reaches_the_loop(nano, monkeypatch, method):
  import bitdelta_jax.models as models
  from bitdelta_jax.models import tokenizer
  from bitdelta_jax.zoo import real_family

  seen = {}

  def fake_train(model, batches, steps, optimizer, schedule, *, val=None, log=None):
    toks, mask = next(batches)
    seen.update(steps=steps, schedule=schedule, val=val, shape=toks.shape)
    return SoupRun(None, None, [1.0] * steps, [], [], 0.0)

  monkeypatch.setattr(soup_training, "train_with_soups", fake_train)
  monkeypatch.setattr(models, "from_pretrained",
                      lambda *a, **k: nnx.merge(nano["graphdef"], nano["params"], nano["rest"]))
  monkeypatch.setattr(tokenizer.Tokenizer, "from_dir", staticmethod(lambda d: _FakeTokenizer()))
  recipe = real_family.RealRecipe(steps=4, batch=2, seq=24, warmup=1, soup=method,
                                  soup_every=2)
  _, losses = real_family.finetune("unused", "smol-upper", recipe, progress=False)
  assert losses == [1.0] * 4
  assert seen["schedule"] == SoupSchedule(method, every=2)
  assert seen["shape"] == (2, 24)
  assert (seen["val"] is not None) == (method == "svd")


def test_cli_soup_flags_reach_the_recipe(tmp_path, monkeypatch):
  from bitdelta_jax.cli import main
  from bitdelta_jax.zoo import real_family

  seen = {}

  def fake_build(out, *, recipe, distill_steps, progress):
    seen["recipe"] = recipe
    return {"variants": {}}

  monkeypatch.setattr(real_family, "build_real_family", fake_build)
  assert main(["zoo", "build", "--real", "--soup", "average", "--soup-every", "8", "--out",
               str(tmp_path / "fam"), "--quiet"]) == 0
  assert seen["recipe"].soup == "average" and seen["recipe"].soup_every == 8
  assert main(["zoo", "build", "--real", "--out", str(tmp_path / "fam2"), "--quiet"]) == 0
  assert seen["recipe"] == real_family.RealRecipe()
  with pytest.raises(SystemExit, match="--real"):
    main(["zoo", "build", "--soup", "monosoup", "--out", str(tmp_path / "fam3")])
  assert not (tmp_path / "fam3").exists()
