"""One streaming compressor for every mode (`stream.compress_checkpoints`) and one manifest
writer (`store.build_manifest`): every mode's manifest has the same keys, the low-rank modes
apply (and record) the same embedding policy, and only the linear weights differ by mode."""

import numpy as np
import pytest

from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.entries import Dense
from bitdelta_jax.delta.report import Report, describe_embeddings
from bitdelta_jax.delta.store import load_delta, read_manifest, save_delta
from bitdelta_jax.delta.stream import AUTO_EMBEDDING_MAX_ERROR, compress_checkpoints
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

CFG = SyntheticConfig(vocab_size=136, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
EMB = ("model.embed_tokens.weight", "lm_head.weight")
POLICIES = {
  "bitdelta": CompressPolicy(),
  "dqrelo": CompressPolicy(mode="dqrelo", rank=2, granularity="column"),
  "svd": CompressPolicy(mode="svd", rank=2),
  "delta-come": CompressPolicy(mode="delta-come", budget=1 / 8),
}


def _one_bit_error(base_w: np.ndarray, ft_w: np.ndarray) -> float:
  """numpy: ‖W_ft − (W_base + α·sign Δ)‖ / ‖W_base‖, one α = mean|Δ| per token (row)."""
  d = ft_w.astype(np.float64) - base_w
  approx = base_w + np.abs(d).mean(axis=1, keepdims=True) * np.where(d >= 0, 1.0, -1.0)
  return float(np.linalg.norm(ft_w - approx) / np.linalg.norm(base_w))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """A fine-tune whose embeddings moved a little (1-bit within the auto limit): every mode's
  delta of it, with the default ``embeddings="auto"``."""
  root = tmp_path_factory.mktemp("modes")
  base = {k: np.asarray(v, np.float32) for k, v in make_base(CFG, 0).items()}
  ft = make_finetune(base, seed=3, rel=0.05)
  rng = np.random.default_rng(5)
  for n in EMB:
    ft[n] = ft[n] + (0.0002 * rng.standard_normal(ft[n].shape)).astype(np.float32)
  b = write_checkpoint(base, root / "base", CFG.hf_config())
  f = write_checkpoint(ft, root / "ft", CFG.hf_config())
  manifests = {mode: compress_checkpoints(b, f, root / mode, p, progress=False)
               for mode, p in POLICIES.items()}
  return root, base, ft, manifests


def test_every_mode_writes_the_same_manifest_keys(pair, tmp_path):
  root, _, _, manifests = pair
  keys = {mode: set(m) for mode, m in manifests.items()}
  assert all(k == keys["bitdelta"] for k in keys.values()), keys
  assert {"embeddings", "embeddings_choice", "source", "finetuned_config", "warnings", "notes",
          "tokenizer", "mode", "lora_rank"} <= keys["bitdelta"]
  for mode in manifests:  # what was returned is what was written
    on_disk = read_manifest(root / mode)
    assert set(on_disk) == keys[mode] and on_disk["mode"] == mode
  # the in-memory writer (`save_delta`) goes through the same manifest builder
  m = save_delta(tmp_path / "mem", {"x": Dense("same")}, policy={},
                 base_fingerprint={"tensors": {}, "digest": "x"},
                 report=Report.from_dict(manifests["bitdelta"]["report"]))
  assert set(m) == keys["bitdelta"]
  assert (m["embeddings"], m["embeddings_choice"], m["mode"]) == ("exact", {}, "bitdelta")


@pytest.mark.parametrize("mode", ["dqrelo", "svd", "delta-come"])
def test_low_rank_modes_record_the_embedding_choice(pair, mode):
  """The same policy as ``bitdelta``'s: the 1-bit error is measured (the same number) and
  recorded; the low-rank modes keep the matrices exactly, as before the one compressor."""
  root, base, ft, manifests = pair
  m, ref = manifests[mode], manifests["bitdelta"]
  assert ref["embeddings"] == "1bit" and m["embeddings"] == "exact"
  assert set(m["embeddings_choice"]) == set(EMB)
  delta, _ = load_delta(root / mode)
  for n in EMB:
    c, rc = m["embeddings_choice"][n], ref["embeddings_choice"][n]
    assert (c["stored"], c["chosen_by"], c["mode"]) == ("exact", "auto", mode)
    assert (rc["stored"], rc["mode"]) == ("1bit", "bitdelta")
    assert set(c) == set(rc)
    assert c["rel_error_1bit"] == rc["rel_error_1bit"] <= AUTO_EMBEDDING_MAX_ERROR
    np.testing.assert_allclose(c["rel_error_1bit"], _one_bit_error(base[n], ft[n]), rtol=1e-4)
    assert m["tensors"][n]["kind"] == "value"
    np.testing.assert_array_equal(delta[n].value, ft[n])
  lines = describe_embeddings(m)
  assert len(lines) == 2 and all(f"mode {mode} keeps embeddings exactly" in x for x in lines)


@pytest.mark.parametrize("mode", ["dqrelo", "svd", "delta-come"])
def test_only_linear_weights_differ_by_mode(pair, mode):
  """Same base fingerprint, same entries for every tensor the mode does not decide (norms),
  and the same report fields and pair checks."""
  root, _, _, manifests = pair
  m, ref = manifests[mode], manifests["bitdelta"]
  assert m["base"] == ref["base"] and m["source"]["base"] == ref["source"]["base"] == "base"
  assert m["finetuned_config"] == ref["finetuned_config"] and m["warnings"] == ref["warnings"]
  assert m["lora_rank"] > 0 and ref["lora_rank"] == 0
  got, _ = load_delta(root / mode)
  want, _ = load_delta(root / "bitdelta")
  for n, meta in ref["tensors"].items():
    if n in EMB:
      continue
    if meta["kind"] == "packed":
      assert m["tensors"][n]["kind"] in ("residual", "lora", "packed")
      continue
    assert m["tensors"][n] == meta, n
    assert type(got[n]) is type(want[n]) is Dense
    if want[n].value is not None:
      np.testing.assert_array_equal(got[n].value, want[n].value)
  assert [t["name"] for t in m["report"]["tensors"]] == [t["name"] for t in ref["report"]["tensors"]]


def test_low_rank_modes_keep_the_embeddings_flag_exact_and_refuse_1bit(pair, tmp_path):
  root, *_ = pair
  m = compress_checkpoints(root / "base", root / "ft", tmp_path / "x", POLICIES["svd"],
                           embeddings="exact", progress=False)
  assert (m["embeddings"], m["embeddings_choice"]) == ("exact", {})
  assert all(m["tensors"][n]["kind"] == "value" for n in EMB)
  with pytest.raises(ValueError, match="mode 'bitdelta' only"):
    compress_checkpoints(root / "base", root / "ft", tmp_path / "y", POLICIES["svd"],
                         embeddings="1bit", progress=False)
  assert not (tmp_path / "y").exists()
