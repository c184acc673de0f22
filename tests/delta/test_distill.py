"""Distillation of a full fine-tune whose embeddings, LM head and norms changed (as every real
full fine-tune's do): those are taken from the fine-tune, only α trains."""

import sys

import numpy as np
import pytest

from bitdelta_jax.cli import main
from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.format import PackedDelta
from bitdelta_jax.delta.store import load_delta
from bitdelta_jax.delta.stream import apply_checkpoint, compress_checkpoints
from bitdelta_jax.distill import SLOT, DistillConfig, build_student, distill_checkpoint
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from model_fixtures import forward, make_tokenizer_dir  # noqa: E402

CFG = SyntheticConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
CHANGED = ("model.embed_tokens.weight", "lm_head.weight")


def _full_finetune(base, seed, extra_vocab=0):
  """A fine-tune whose embeddings and LM head moved too, not only the linear layers."""
  ft = make_finetune(base, seed, rel=0.05, extra_vocab=extra_vocab)
  r = np.random.default_rng(seed + 100)
  for n in CHANGED:
    ft[n] = (ft[n] + 0.01 * r.standard_normal(ft[n].shape)).astype(ft[n].dtype)
  return ft


@pytest.fixture(scope="module", params=[0, 3], ids=["same-vocab", "grown-vocab"])
def pair(request, tmp_path_factory):
  extra = request.param
  root = tmp_path_factory.mktemp(f"distill{extra}")
  base = make_base(CFG, 0, dtype=np.float32)
  ft = _full_finetune(base, 1, extra)
  b = write_checkpoint(base, root / "base", CFG.hf_config())
  f = write_checkpoint(ft, root / "ft", CFG.hf_config(CFG.vocab_size + extra))
  make_tokenizer_dir(b, CFG.vocab_size)
  d = root / "delta"
  compress_checkpoints(b, f, d, CompressPolicy(), progress=False)
  return {"root": root, "base": b, "ft": f, "delta": d, "ft_t": ft, "extra": extra}


def test_student_is_base_plus_one_bit_with_the_finetunes_other_tensors(pair, tmp_path):
  """Slot 1 of the student computes what the materialised checkpoint (apply) computes."""
  delta, _ = load_delta(pair["delta"])
  for n in CHANGED:
    assert delta[n].kind == "value"  # the pair really changed them
  student = build_student(pair["base"], pair["ft"], delta)
  applied = apply_checkpoint(pair["base"], pair["delta"], tmp_path / "applied", progress=False)
  ids = np.random.default_rng(0).integers(0, CFG.vocab_size + pair["extra"], (2, 12))
  want = forward(from_pretrained(applied, dtype=np.float32), ids)
  got = forward(student, ids, slot_ids=[SLOT, SLOT])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_distill_trains_only_scales_and_keeps_finetuned_embeddings(pair, tmp_path):
  import shutil

  d = tmp_path / "delta"
  shutil.copytree(pair["delta"], d)
  before, _ = load_delta(d)
  ids = np.random.default_rng(1).integers(0, CFG.vocab_size + pair["extra"], 4000)
  info = distill_checkpoint(pair["base"], pair["ft"], d, ids.astype(np.int32),
                            DistillConfig(steps=30, lr=3e-4, seq=16, batch=4, eval_every=5),
                            progress=False)
  assert info["held_mse_after"] < info["held_mse_before"]
  after, m = load_delta(d)
  assert m["scales"]["method"] == "distilled"
  changed_scales = 0
  for n, e in before.items():
    if isinstance(e, PackedDelta):
      np.testing.assert_array_equal(after[n].bits, e.bits)
      changed_scales += not np.array_equal(after[n].scale, e.scale)
    else:  # kept exactly, equal to the fine-tune's tensor, not trained
      assert after[n].kind == e.kind
      if e.kind == "value":
        np.testing.assert_array_equal(after[n].value, pair["ft_t"][n])
  assert changed_scales > 0


@pytest.mark.slow
def test_cli_distill_on_changed_embeddings(pair, tmp_path, capsys):
  import shutil

  if pair["extra"]:
    pytest.skip("the calibration tokenizer is the base's 64-word one; one case is enough")
  d = tmp_path / "delta"
  shutil.copytree(pair["delta"], d)
  calib = tmp_path / "calib.txt"
  calib.write_text(" ".join(f"w{i}" for i in np.random.default_rng(2).integers(3, 64, 600)))
  rc = main(["distill", "--base", str(pair["base"]), "--finetuned", str(pair["ft"]),
             "--delta", str(d), "--calibration", str(calib), "--steps", "3", "--seq", "16",
             "--batch", "2", "--quiet"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert out == "" and "dense_embedding_slots" not in err


def test_cli_distill_rejects_bad_settings_without_internal_names(pair, tmp_path, capsys):
  if pair["extra"]:
    pytest.skip("checked once")
  rc = main(["distill", "--base", str(pair["base"]), "--finetuned", str(pair["ft"]),
             "--delta", str(pair["delta"]), "--calibration", str(tmp_path / "x.txt"),
             "--steps", "-1"])
  assert rc == 2 and "steps must be >= 0" in capsys.readouterr().err
