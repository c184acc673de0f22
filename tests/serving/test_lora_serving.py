"""A PEFT LoRA adapter served beside BitDelta variants from one base, in the same batches."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import requests

from bitdelta_jax.delta.compress import apply_delta
from bitdelta_jax.delta.store import load_delta
from bitdelta_jax.engine import Generator
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.merge.lora import apply_adapter, from_factors, save_adapter
from bitdelta_jax.models import from_tensors
from bitdelta_jax.models.loading import load_config
from bitdelta_jax.models.tokenizer import Tokenizer
from serving.testing import synthetic_family

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

PROMPTS = ["hello", "The quick brown fox", "1 2 3"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, serve):
  root = tmp_path_factory.mktemp("lora_family")
  base, deltas = synthetic_family(root, n=1)
  with CheckpointReader(base) as r:
    tensors = {n: r.read(n) for n in r.names()}
  rng = np.random.default_rng(3)
  factors = {}
  for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
    out_f, in_f = tensors[name + ".weight"].shape
    factors[name] = (rng.standard_normal((4, in_f)).astype(np.float32) * 0.3,
                     rng.standard_normal((out_f, 4)).astype(np.float32) * 0.3)
  adapter = from_factors(factors)
  save_adapter(adapter, root / "adapter")
  with serve(base, {"bd": deltas["v0"], "lora": root / "adapter"}, max_batch=4, max_seq_len=64,
             device_slots=2) as h:
    yield h, base, tensors, deltas["v0"], adapter


def _expected(base_dir, weights, prompts, n):
  """Greedy texts of the materialised model, run alone."""
  tok = Tokenizer.from_dir(base_dir)
  model = from_tensors(load_config(base_dir), weights, jnp.float32)
  gen = Generator(model, max_seq_len=64, max_rows=4, tokenizer=tok)
  outs = gen.generate([tok.encode(p) for p in prompts], 0, SamplingParams(max_new_tokens=n))
  return {p: tok.decode(o.tokens) for p, o in zip(prompts, outs)}


def test_lora_and_bitdelta_in_one_server(setup):
  h, base_dir, tensors, delta_dir, adapter = setup
  models = {m["id"]: m for m in requests.get(h.url + "/v1/models", timeout=30).json()["data"]}
  assert models["lora"]["parent"] == "base" and models["bd"]["parent"] == "base"
  jobs = [(m, p) for p in PROMPTS for m in ("base", "bd", "lora")]

  def run(job):
    m, p = job
    r = requests.post(h.url + "/v1/completions", json={"model": m, "prompt": p, "max_tokens": 8,
                                                       "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]

  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # mixed batches
    got = dict(zip(jobs, pool.map(run, jobs)))
  weights = {"base": tensors,
             "bd": apply_delta(tensors, load_delta(delta_dir)[0], hf_layout=True),
             "lora": apply_adapter(tensors, adapter)}
  want = {m: _expected(base_dir, w, PROMPTS, 8) for m, w in weights.items()}
  for (m, p), text in got.items():
    assert text == want[m][p], (m, p)
  assert got[("lora", PROMPTS[1])] != got[("base", PROMPTS[1])] or \
    got[("lora", PROMPTS[0])] != got[("base", PROMPTS[0])]


def test_bad_adapter_registration(setup):
  h, base_dir, tensors, _, _ = setup
  wide = from_factors({"model.layers.0.self_attn.q_proj": (
    np.ones((16, tensors["model.layers.0.self_attn.q_proj.weight"].shape[1]), np.float32),
    np.ones((tensors["model.layers.0.self_attn.q_proj.weight"].shape[0], 16), np.float32))})
  wide_dir = Path(dict(h.cfg.variants)["lora"]).parent / "wide"  # under the variant roots
  save_adapter(wide, wide_dir)
  r = requests.post(h.url + "/v1/variants", json={"name": "wide", "path": str(wide_dir)},
                    timeout=30)
  assert r.status_code == 400 and "exceeds the server's LoRA slot rank" in r.text
