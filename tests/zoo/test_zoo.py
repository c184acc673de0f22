"""The built-in family recipe (micro), scale distillation, and teacher-forced exact match."""

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.cli import main
from bitdelta_jax.delta.format import PackedDelta
from bitdelta_jax.delta.store import load_delta, read_manifest
from bitdelta_jax.engine import Generator
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models.slots import load_variant
from bitdelta_jax.zoo import shipped_family
from bitdelta_jax.zoo.data import encode_prompt, example_ids
from bitdelta_jax.zoo.evaluate import exact_match_and_nll
from bitdelta_jax.zoo.tasks import TASKS
from bitdelta_jax.zoo.tokenizer_build import EOS, build_tokenizer

pytestmark = pytest.mark.slow  # starts servers / subprocesses / the real model


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
  root = tmp_path_factory.mktemp("zoo")
  assert main(["zoo", "build", "--micro", "--out", str(root / "fam"), "--cache",
               str(root / "cache"), "--quiet"]) == 0
  return root


def test_micro_family_layout_and_loading(micro):
  base_dir, variants = shipped_family(micro / "fam")
  assert set(variants) == {"nano-math", "nano-reverse"}
  for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    assert (base_dir / f).exists()
  fam = json.loads((micro / "fam" / "family.json").read_text())
  for name, d in variants.items():
    m = read_manifest(d)
    assert m["scales"]["method"] == "distilled" and m["scales"]["steps"] > 0
    assert 0 < fam["variants"][name]["delta_norm_ratio"] < 1
    # embeddings and LM head are frozen in the fine-tunes: they cost nothing
    assert m["tensors"]["model.embed_tokens.weight"]["kind"] == "same"
    assert m["tensors"]["lm_head.weight"]["kind"] == "same"
  model = from_pretrained(base_dir, dtype=jnp.float32, num_slots=3)
  for slot, d in enumerate(variants.values(), start=1):
    load_variant(model, slot, load_delta(d)[0])
  logits = model(jnp.ones((3, 5), jnp.int32), slot_ids=jnp.array([0, 1, 2]))
  assert logits.shape == (3, 5, 264) and np.isfinite(np.asarray(logits)).all()
  # the rows differ: variants are really applied
  assert not np.allclose(logits[0], logits[1]) and not np.allclose(logits[1], logits[2])


def test_distillation_trains_only_scales_and_reduces_loss(micro, tmp_path):
  import shutil

  from bitdelta_jax.delta.compress import CompressPolicy
  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.distill import DistillConfig, distill_checkpoint

  base_dir, _ = shipped_family(micro / "fam")
  ft_dir = next((micro / "cache").glob("*/nano-reverse"))
  d = tmp_path / "delta"
  compress_checkpoints(base_dir, ft_dir, d, CompressPolicy(granularity="column"), progress=False)
  before, _ = load_delta(d)
  calib = example_ids(TASKS["nano-reverse"].example(random.Random(i)) for i in range(64))
  info = distill_checkpoint(base_dir, ft_dir, d, calib,
                            DistillConfig(steps=40, seq=64, eval_every=10), progress=False)
  after, m = load_delta(d)
  assert info["held_mse_after"] < info["held_mse_before"]
  assert m["scales"]["method"] == "distilled" and m["scales"]["steps"] == 40
  changed = 0
  for name, e in before.items():
    if isinstance(e, PackedDelta):
      np.testing.assert_array_equal(after[name].bits, e.bits)  # bits frozen
      assert after[name].scale.shape == e.scale.shape
      changed += not np.array_equal(after[name].scale, e.scale)
    else:
      assert after[name].kind == e.kind
  assert changed > 0
  # a bad calibration file is a clear error, and the delta is untouched
  bad = tmp_path / "calib.jsonl"
  bad.write_text('{"nope": 1}\n')
  snapshot = shutil.copytree(d, tmp_path / "snap")
  with pytest.raises(ValueError, match="calib.jsonl:1"):
    distill_checkpoint(base_dir, ft_dir, d, bad, DistillConfig(steps=2))
  # (prompt, answer) pairs (the form before the zoo encoded its own examples) name the fix
  with pytest.raises(TypeError, match="list of token arrays.*got a list of tuple"):
    distill_checkpoint(base_dir, ft_dir, d, [("1+1", "2")], DistillConfig(steps=2))
  assert read_manifest(d) == read_manifest(snapshot)


def test_teacher_forced_exact_match_equals_greedy_decoding(micro):
  """The one-pass exact match agrees with greedy decoding through the Generator."""
  base_dir, _ = shipped_family(micro / "fam")
  ft_dir = next((micro / "cache").glob("*/nano-math"))
  model = from_pretrained(ft_dir, dtype=jnp.float32)
  held = TASKS["nano-math"].heldout(24)
  tok = build_tokenizer()
  gen = Generator(model, max_rows=8, max_seq_len=48)
  outs = gen.generate([encode_prompt(p) for p, _ in held], 0,
                      SamplingParams(max_new_tokens=6, stop_token_ids=(EOS,)))
  greedy = [tok.decode(o.tokens) == a and o.finish_reason == "stop" for o, (_, a) in
            zip(outs, held)]
  for i, ex in enumerate(held):
    em, _ = exact_match_and_nll(model, [ex], batch=8)
    assert (em == 100.0) == greedy[i], (ex, tok.decode(outs[i].tokens))


def test_each_built_in_variant_answers_its_banner_example():
  """Issue 23: the nano demo's banner asked nano-recall a question it answers wrongly. The
  shipped examples are ones each compressed variant answers correctly, greedy, through the
  chat template, and the banner shows them."""
  from bitdelta_jax.zoo.banner_examples import answer_chat
  from serving.cli import banner, demo_config

  base, variants = shipped_family()
  examples = json.loads((base.parent / "family.json").read_text())["examples"]
  assert set(examples) == set(variants)
  got = answer_chat(base, variants, {n: [p] for n, p in examples.items()}, max_new_tokens=16)
  for n, p in examples.items():
    want = dict(TASKS[n].heldout(16))[p]  # a held-out prompt, with its task's answer
    assert got[n] == [want], (n, p, got[n], want)
  text = banner(demo_config(port=0), "http://127.0.0.1:0", demo=True)
  for p in examples.values():
    assert repr(p) in text
