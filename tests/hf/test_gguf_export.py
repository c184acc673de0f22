"""`bitdelta_jax.hf.gguf_export`: a tiny HF Llama checkpoint with a byte-level BPE tokenizer,
written as GGUF and read back by the importer (tensors, config, tokenizer ids) and by
transformers' own GGUF loader (logits), in f32 and bf16."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_fixtures import BPE_TEXTS as TEXTS
from model_fixtures import hf_logits, make_bpe_tokenizer, make_hf_model

from bitdelta_jax.hf import gguf_import
from bitdelta_jax.hf.gguf_export import write_gguf
from bitdelta_jax.hf.gguf_names import GGUFExportError, permute_rows, unpermute_rows

VOCAB = 320


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny_llama")
  model = make_hf_model("llama", d, vocab_size=VOCAB, tie_word_embeddings=True)
  return model, d, make_bpe_tokenizer(d)


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory):
  out = tmp_path_factory.mktemp("gguf")
  return {dt: write_gguf(tiny[1], out / f"tiny-{dt}.gguf", dtype=dt) for dt in ("f32", "bf16")}


def _bf16(a: np.ndarray) -> np.ndarray:
  u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
  return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def test_permute_inverts_the_importers_unpermute():
  w = np.random.RandomState(0).randn(3 * 8, 5).astype(np.float32)
  np.testing.assert_array_equal(unpermute_rows(permute_rows(w, 3), 3), w)
  # one head of 4 rows [a0, a1, b0, b1] (rotate-half pairs a_i, b_i) is stored as [a0, b0, a1, b1]
  np.testing.assert_array_equal(permute_rows(np.arange(4.0)[:, None], 1)[:, 0], [0, 2, 1, 3])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_tensors_and_config_read_back(tiny, ggufs, dtype):
  import gguf
  import torch

  model, d, _ = tiny
  reader = gguf.GGUFReader(ggufs[dtype])
  cfg = gguf_import.hf_config(reader)
  src = json.loads((d / "config.json").read_text())
  for k in (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
  ):
    assert cfg[k] == src[k], k
  assert cfg["rms_norm_eps"] == pytest.approx(src["rms_norm_eps"])
  ref = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
  got = dict(gguf_import.hf_tensors(reader, cfg))
  assert set(got) == set(ref) - {"lm_head.weight"}
  for name, a in got.items():
    want = ref[name] if dtype == "f32" or ref[name].ndim == 1 else _bf16(ref[name])
    np.testing.assert_array_equal(a, want, err_msg=name)
  types = {t.name: t.tensor_type.name for t in reader.tensors}
  assert types["blk.0.attn_norm.weight"] == "F32"
  assert types["blk.0.attn_q.weight"] == ("F32" if dtype == "f32" else "BF16")


def test_tokenizer_ids_read_back(tiny, ggufs):
  import gguf

  _, _, tok = tiny
  reader = gguf.GGUFReader(ggufs["f32"])
  assert gguf_import.field(reader, "tokenizer.ggml.pre") == "smollm"
  assert gguf_import.field(reader, "tokenizer.ggml.bos_token_id") == tok.token_to_id("<|im_start|>")
  assert gguf_import.field(reader, "tokenizer.ggml.eos_token_id") == tok.token_to_id("<|im_end|>")
  tokens = gguf_import.field(reader, "tokenizer.ggml.tokens")
  assert len(tokens) == VOCAB and tokens[-1] == f"[PAD{VOCAB - 1}]"
  back = gguf_import.build_tokenizer(reader)
  for text in TEXTS:
    assert back.encode(text).ids == tok.encode(text).ids, text


@pytest.mark.slow  # loads transformers' GGUF reader (~5 s)
def test_transformers_reads_the_f32_file_with_the_same_logits(tiny, ggufs):
  from transformers import AutoModelForCausalLM

  model, _, _ = tiny
  path = ggufs["f32"]
  loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
  ids = np.asarray([[5, 17, 200, 3, 42, 99, 7]])
  np.testing.assert_allclose(hf_logits(loaded, ids), hf_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_unsupported_checkpoints_are_refused(tiny, tmp_path):
  _, d, _ = tiny
  cfg = json.loads((d / "config.json").read_text())
  bad = tmp_path / "bad"
  bad.mkdir()
  for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    (bad / f).symlink_to(d / f)
  (bad / "config.json").write_text(
    json.dumps({**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
  )
  with pytest.raises(GGUFExportError, match="rope_scaling"):
    write_gguf(bad, tmp_path / "x.gguf")
  with pytest.raises(ValueError, match="dtype"):
    write_gguf(d, tmp_path / "x.gguf", dtype="q4")
