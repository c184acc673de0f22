"""The shipped SmolLM2-135M-Instruct Q4_1 GGUF served as stored, with real variants.

The server takes the file itself as ``base``; its linear layers and the (Q8_0) embedding stay in
ggml blocks. The reference is independent of that path: transformers on the f32 checkpoint
`bitdelta zoo real-base` dequantizes from the same file, and on that checkpoint with a variant's
delta applied (`apply_checkpoint`). Greedy texts must be equal for the base and each variant.
"""

from __future__ import annotations

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.real_model]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def _f32_activations():
  """Greedy-text parity with transformers holds for f32 activations; q4's default int8
  activations move logits (bench/results/kernels/quant_kernel_logits.md)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("BITDELTA_QUANT_ACTIVATIONS", "f32")
    yield


@pytest.fixture(scope="module")
def real(tmp_path_factory):
  from bitdelta_jax.zoo import SHIPPED_REAL, shipped_real_family
  from bitdelta_jax.zoo.real_base import RealBaseUnavailable, real_gguf

  if not (SHIPPED_REAL / "family.json").exists():
    pytest.skip("no shipped real family")
  try:
    base_dir, variants, _ = shipped_real_family()  # the wheel from the package registry
    gguf = real_gguf()
  except RealBaseUnavailable as e:
    pytest.skip(f"SmolLM2 unavailable: {e}")
  names = sorted(variants)[:2]
  return gguf, base_dir, {n: variants[n] for n in names}, tmp_path_factory.mktemp("gguf_serving")


def _hf_greedy(model_dir, tokenizer) -> list[str]:
  import torch
  import transformers as tf

  model = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
  out = []
  for p in PROMPTS:
    ids = tokenizer(p, return_tensors="pt").input_ids
    with torch.no_grad():
      g = model.generate(ids, do_sample=False, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                         pad_token_id=tokenizer.eos_token_id)
    out.append(tokenizer.decode(g[0, ids.shape[1]:]))
  return out


def test_q4_1_file_serves_the_dequantized_models_greedy_texts(real, serve):
  import transformers as tf

  from bitdelta_jax.delta.stream import apply_checkpoint

  gguf, base_dir, variants, tmp = real
  tok = tf.AutoTokenizer.from_pretrained(base_dir)
  want = {"base": _hf_greedy(base_dir, tok)}
  for n, d in variants.items():
    merged = apply_checkpoint(base_dir, d, tmp / n, overwrite=True, progress=False)
    want[n] = _hf_greedy(merged, tok)
  assert want[sorted(variants)[0]] != want["base"]  # a variant changes the text
  # warmup=False: the subject is greedy parity; warming every bucket of the 30-layer model took
  # ~80 s of the suite's time; warm-ups of GGUF bases: test_step_cache_restarts, test_memory_peak
  with serve(gguf, variants, device_slots=2, max_batch=4, max_seq_len=256,
             kv_cache_mb=64, warmup=False) as h:
    for model, texts in want.items():
      r = requests.post(h.url + "/v1/completions", json={
        "model": model, "prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0,
        "ignore_eos": True}, timeout=300)
      assert r.status_code == 200, r.text
      got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
      assert got == texts, model
