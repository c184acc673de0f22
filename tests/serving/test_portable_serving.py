"""One delta, served over every GGUF quantization of its base, from a transformers-5-style
directory (``rope_parameters``, the chat template in ``chat_template.jinja``) through
``bitdelta quantize`` to a running server.

References (independent of the served path): transformers on the GGUF's weights dequantized by
the `gguf` package under the SOURCE's config.json (so a wrong RoPE base or template in the file
shows), and transformers on ``apply_checkpoint(FILE.gguf, delta)`` (dequant(W_q) + α·sign Δ,
the fine-tune's config). The log probabilities of every prompt token (``echo``) must agree;
chat prompts are counted as transformers' own tokenizer renders the template.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import requests
from model_fixtures import make_bpe_tokenizer, make_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.server]

VOCAB = 320
# the second prompt long enough (~90 tokens) that a wrong RoPE base in the file moves logits
PROMPTS = ["the quick brown fox", " ".join(["over the lazy dog and the quick brown fox"] * 8)]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module", autouse=True)
def _f32_activations():
  """Parity with transformers is asked of f32 activations (int8, the default, moves
  logits slightly: its cost is measured in bench/results/fidelity/fidelity_quant.md)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("BITDELTA_QUANT_ACTIVATIONS", "f32")
    yield


def _tf5_style(d):
  cfg = json.loads((d / "config.json").read_text())
  cfg.pop("rope_theta", None)
  cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
  (d / "config.json").write_text(json.dumps(cfg))
  tc = json.loads((d / "tokenizer_config.json").read_text())
  tc.pop("chat_template", None)
  (d / "tokenizer_config.json").write_text(json.dumps(tc))
  (d / "chat_template.jinja").write_text(TEMPLATE)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  import torch

  from bitdelta_jax.delta.stream import compress_checkpoints

  d = tmp_path_factory.mktemp("portable_serving")
  model = make_hf_model("llama", d / "src", vocab_size=VOCAB, tie_word_embeddings=True)
  with torch.no_grad():  # sharper attention than the 0.02 init's (near uniform): RoPE matters
    for name, p in model.named_parameters():
      if name.endswith(("q_proj.weight", "k_proj.weight")):
        p.mul_(20.0)
  model.save_pretrained(d / "src")
  make_bpe_tokenizer(d / "src")
  _tf5_style(d / "src")
  g = torch.Generator().manual_seed(3)
  with torch.no_grad():  # a fine-tune: linear weights moved, the (tied) embedding unchanged
    for name, p in model.named_parameters():
      if p.ndim == 2 and "embed_tokens" not in name:
        p.add_(0.5 * float(p.std()) * torch.randn(p.shape, generator=g))
  model.save_pretrained(d / "ft")
  for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
    shutil.copy2(d / "src" / f, d / "ft" / f)
  m = compress_checkpoints(d / "src", d / "ft", d / "delta", progress=False)
  assert m["tokenizer"] is None  # the fine-tune's files are the source's
  return d


def _prompt_logprobs(model_dir, tok) -> list[np.ndarray]:
  """log p(token t | tokens < t) at every prompt position after the first (transformers)."""
  import torch
  import transformers as tf

  model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  out = []
  for p in PROMPTS:
    ids = tok(p, return_tensors="pt").input_ids
    with torch.no_grad():
      lp = torch.log_softmax(model(ids).logits[0].double(), -1)
    out.append(lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].numpy())
  return out


@pytest.mark.parametrize("fmt,recorded", [("q8_0", True), ("q4_0", True), ("q4_1", False)])
def test_one_delta_serves_over_each_quantization(family, serve, fmt, recorded, tmp_path):
  import gguf
  import transformers as tf

  from bitdelta_jax.delta.stream import apply_checkpoint
  from bitdelta_jax.hf import lineage_record
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base
  from bitdelta_jax.hf.gguf_export import write_gguf
  from bitdelta_jax.hf.gguf_import import write_hf_checkpoint

  d = family
  path = write_gguf(d / "src", tmp_path / f"src-{fmt}.gguf", dtype=fmt, record_source=recorded)
  if not recorded:  # a file made elsewhere: its source is named at start-up
    lineage_record.forget(resolve_base(path))
  tok = tf.AutoTokenizer.from_pretrained(d / "src")
  ref_base = tmp_path / "ref-base"
  write_hf_checkpoint(gguf.GGUFReader(path), ref_base)
  shutil.copy2(d / "src" / "config.json", ref_base / "config.json")  # the source's, not the file's
  if (ref_base / "generation_config.json").exists():
    (ref_base / "generation_config.json").unlink()
  merged = apply_checkpoint(path, d / "delta", tmp_path / "merged", progress=False,
                            overwrite=True) if recorded else None
  extra = {} if recorded else {"base_source": str(d / "src")}
  with serve(path, {"v": d / "delta"}, device_slots=1, max_batch=4, max_seq_len=128,
             kv_cache_mb=16, warmup=False, **extra) as h:
    if merged is None:  # the lineage the server checked applies to apply too
      merged = apply_checkpoint(path, d / "delta", tmp_path / "merged", progress=False,
                                overwrite=True)
    want = {"base": _prompt_logprobs(ref_base, tok), "v": _prompt_logprobs(merged, tok)}
    assert max(np.abs(a - b).max() for a, b in zip(want["v"], want["base"])) > 0.05
    for model, lps in want.items():
      r = requests.post(h.url + "/v1/completions", json={
        "model": model, "prompt": PROMPTS, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": 1}, timeout=300)
      assert r.status_code == 200, r.text
      for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
        got = np.array(c["logprobs"]["token_logprobs"][1:len(lps[c["index"]]) + 1], np.float64)
        np.testing.assert_allclose(got, lps[c["index"]], atol=2e-3, err_msg=model)
    # chat: the file's template is the source's (chat_template.jinja), on the base and the variant
    msgs = [{"role": "user", "content": "the lazy dog"}]
    want_prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(want_prompt, list):  # a BatchEncoding in transformers 5
      want_prompt = want_prompt["input_ids"]
    for model in ("base", "v"):
      r = requests.post(h.url + "/v1/chat/completions", json={
        "model": model, "messages": msgs, "max_tokens": 2, "temperature": 0}, timeout=300)
      assert r.status_code == 200, r.text
      assert r.json()["usage"]["prompt_tokens"] == len(want_prompt)
