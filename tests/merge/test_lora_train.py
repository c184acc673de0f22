"""LoRA training (`merge.lora_train`), the related tasks (`zoo.lora_tasks`) and the real
adapters' cache (`zoo.real_loras`)."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.merge.lora import apply_adapter, load_adapter, save_adapter
from bitdelta_jax.merge.lora_train import LoraRecipe, LoraTrainer
from bitdelta_jax.zoo.lora_tasks import FAMILIES, LORA_TASKS, family_of
from bitdelta_jax.zoo.tasks import is_heldout

WORDS_RE = re.compile(r"[a-z]+")


def _answer(task: str, prompt: str) -> str:
  """The right answer, computed from the prompt text alone (independent of the generators)."""
  arg = prompt.split(" ", 1)[1]
  if task in ("lora-add", "lora-sub", "lora-mul"):
    a, b = map(int, arg.split())
    return str({"lora-add": a + b, "lora-sub": a - b, "lora-mul": a * b}[task])
  if task == "lora-upper":
    return arg.upper()
  if task == "lora-lower":
    return arg.lower()
  if task == "lora-last":
    return arg.split()[-1]
  if task == "lora-count":
    return str(len(arg.split()))
  if task == "lora-recall":
    pairs, q = arg.rsplit(" ?", 1)
    return dict(kv.split("=") for kv in pairs.split())[q]
  if task == "lora-json":
    obj, field = arg.rsplit(" ", 1)
    return str(json.loads(obj)[field])
  if task == "lora-csv":
    row, _, col = arg.rsplit(" ", 2)
    return row.split(",")[int(col) - 1]
  raise AssertionError(task)


@pytest.mark.parametrize("task", sorted(LORA_TASKS))
def test_answers_follow_from_the_prompt_and_heldout_is_never_trained(task):
  t = LORA_TASKS[task]
  rng = random.Random(0)
  train = [t.example(rng) for _ in range(300)]
  held = t.heldout(40)
  assert len(held) == 40 and len({p for p, _ in held}) == 40
  for p, a in train + held:
    assert _answer(task, p) == a, (p, a)
  assert not any(is_heldout(p) for p, _ in train)
  assert all(is_heldout(p) for p, _ in held)
  assert not {p for p, _ in train} & {p for p, _ in held}


def test_families_partition_the_tasks():
  members = [t for m in FAMILIES.values() for t in m]
  assert sorted(members) == sorted(LORA_TASKS) and len(members) == len(set(members))
  assert len(FAMILIES) == 4 and all(len(m) >= 2 for m in FAMILIES.values())
  assert family_of("lora-sub") == "arith"
  with pytest.raises(KeyError, match="no family"):
    family_of("nano-math")


@pytest.fixture(scope="module")
def nano():
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.zoo import shipped_family

  base_dir, _ = shipped_family()
  return base_dir, LoraTrainer(from_pretrained(base_dir, jnp.float32))


def _nano_batches(seed=0, batch=8, seq=24):
  from bitdelta_jax.zoo.data import batch_examples
  from bitdelta_jax.zoo.tasks import TASKS

  rng = random.Random(seed)
  while True:
    yield batch_examples([TASKS["nano-upper"].example(rng) for _ in range(batch)], seq)


@pytest.mark.slow
def test_training_lowers_the_loss_and_the_forward_equals_the_merged_weights(nano, tmp_path):
  from bitdelta_jax.hf.safetensors_io import CheckpointReader
  from bitdelta_jax.models.loading import from_tensors, load_config

  base_dir, trainer = nano
  recipe = LoraRecipe(rank=4, alpha=8.0, steps=24, batch=8, seq=24, lr=3e-3,
                      targets=("q_proj", "v_proj", "down_proj"))
  adapter, losses = trainer.train(_nano_batches(), recipe, "t")
  assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses
  assert {m.rsplit(".", 1)[-1] for m in adapter.modules} == {"q_proj", "v_proj", "down_proj"}
  assert adapter.rank == 4

  # The same adapter through PEFT's file format, applied in numpy to the HF weights.
  again = load_adapter(save_adapter(adapter, tmp_path / "a"))
  with CheckpointReader(base_dir) as r:
    weights = {n: r.read(n).astype(np.float32) for n in r.names()}  # stored bf16: add in f32
  merged = from_tensors(load_config(base_dir), apply_adapter(weights, again), jnp.float32)
  toks = jnp.asarray(next(_nano_batches(seed=5))[0])
  np.testing.assert_allclose(np.asarray(trainer.forward(adapter)(toks)), np.asarray(merged(toks)),
                             rtol=2e-5, atol=2e-5)
  base_logits = np.asarray(trainer.forward(None)(toks))
  assert np.abs(base_logits - np.asarray(merged(toks))).max() > 1e-2  # the adapter does something


def test_bad_targets_and_modules_are_named(nano):
  _, trainer = nano
  with pytest.raises(ValueError, match="no linear layer"):
    trainer.init_factors(LoraRecipe(targets=("qkv",)), "t")
  adapter, _ = trainer.train(_nano_batches(), LoraRecipe(rank=2, steps=1, batch=2, seq=24), "t")
  adapter.modules["model.layers.99.mlp.up_proj"] = next(iter(adapter.modules.values()))
  with pytest.raises(ValueError, match="modules the base does not have"):
    trainer.forward(adapter)


@pytest.mark.slow
def test_real_lora_is_cached_and_records_scores(tmp_path):
  pytest.importorskip("tokenizers")
  from bitdelta_jax.zoo.real_base import RealBaseUnavailable, import_real_base
  from bitdelta_jax.zoo.real_loras import RealLoraContext, ensure_real_lora

  try:
    import_real_base()
  except RealBaseUnavailable as e:
    pytest.skip(str(e))
  ctx = RealLoraContext()
  recipe = LoraRecipe(steps=2, batch=2, seq=48)
  path = ensure_real_lora("lora-csv", recipe, ctx=ctx, cache_root=tmp_path, progress=False,
                          n_heldout=16)
  info = json.loads((path / "info.json").read_text())
  assert info["family"] == "format" and len(info["losses"]) == 2
  assert info["heldout"]["n"] == 16 and 0.0 <= info["heldout"]["score"] <= 100.0 and info["heldout"]["base_score"] == 0.0
  adapter = load_adapter(path)
  assert adapter.rank == 8 and adapter.nbytes == info["bytes"]
  stamp = (path / "adapter_model.safetensors").stat().st_mtime_ns
  assert ensure_real_lora("lora-csv", recipe, cache_root=tmp_path) == path  # no ctx: cached
  assert (path / "adapter_model.safetensors").stat().st_mtime_ns == stamp
  other = dataclasses.replace(recipe, seed=1)
  with pytest.raises(KeyError, match="unknown LoRA task"):
    ensure_real_lora("lora-nope", other, cache_root=tmp_path)
