"""`bitdelta demo --real`: the shipped real variants (`zoo/shipped_real/`, 1-bit deltas of full
fine-tunes of SmolLM2-135M-Instruct) answer the banner's example prompts correctly, sent as a
plain user message through each variant's own chat template, all variants in one model's
slots (as the server holds them); and the shipped bytes stay within the package budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bitdelta_jax.zoo import SHIPPED_REAL

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.server, pytest.mark.skipif(not (SHIPPED_REAL / "family.json").exists(),
                                reason="no shipped real family")]


@pytest.fixture(scope="module")
def family():
  from bitdelta_jax.zoo import shipped_real_family
  from bitdelta_jax.zoo.real_base import RealBaseUnavailable

  try:
    return shipped_real_family()
  except RealBaseUnavailable as e:
    pytest.skip(f"SmolLM2 unavailable: {e}")


def test_shipped_real_deltas_fit_the_budget():
  total = sum(p.stat().st_size for p in SHIPPED_REAL.rglob("*") if p.is_file())
  assert total <= 60 * 2**20, f"shipped real family is {total / 2**20:.1f} MiB"


def test_demo_config_and_banner(family):
  from serving.cli import banner, demo_config

  base, variants, examples = family
  from bitdelta_jax.hf.gguf_checkpoint import is_gguf_dir, resolve_base
  from bitdelta_jax.zoo.real_base import real_gguf

  cfg = demo_config(real=True, port=0)  # the Q4_1 file as stored
  assert cfg.base == str(resolve_base(real_gguf(download=False))) and is_gguf_dir(cfg.base)
  assert cfg.model_id == "smollm2-135m-instruct"
  assert dict(cfg.variants) == {n: str(p) for n, p in variants.items()}
  assert demo_config(real=True, f32=True, port=0).base == str(base)
  text = banner(cfg, "http://127.0.0.1:0", demo=True)
  assert set(examples) == set(variants)
  for n, p in examples.items():
    assert n in text and repr(p) in text


def test_each_variant_answers_its_banner_example(family):
  from bitdelta_jax.delta.store import load_delta
  from bitdelta_jax.delta.stream import tokenizer_dir
  from bitdelta_jax.models import from_pretrained, load_variant
  from bitdelta_jax.models.tokenizer import Tokenizer
  from bitdelta_jax.zoo import real_family as rf

  base, variants, examples = family
  names = sorted(variants)
  from bitdelta_jax.zoo.real_base import real_gguf

  # what `demo --real` serves: the Q4_1 file's blocks as stored
  model = from_pretrained(real_gguf(download=False), jnp.float32, num_slots=len(names) + 1,
                          packed_embedding_slots=True)
  seqs, toks, want = [], [], []
  for slot, n in enumerate(names, start=1):
    load_variant(model, slot, load_delta(variants[n])[0])
    tok = Tokenizer.from_dir(tokenizer_dir(variants[n]), fallback=base)
    toks.append(tok)
    seqs.append(tok.apply_chat_template([{"role": "user", "content": examples[n]}],
                                        tokenize=True))  # the template adds the system line
    want.append(dict(rf.heldout(n, 16))[examples[n]])
  slots = jnp.arange(1, len(names) + 1, dtype=jnp.int32)
  graphdef, state = nnx.split(model)  # one compiled forward (eager NNX took ~9 minutes here)
  forward = jax.jit(lambda st, ids, sl: nnx.merge(graphdef, st)(ids, slot_ids=sl))
  outs: list[list[int]] = [[] for _ in names]
  done = [False] * len(names)
  for _ in range(12):  # greedy, all variants in one batch; one padded shape
    padded = np.zeros((len(names), 80), np.int32)
    for i, s in enumerate(seqs):
      padded[i, :len(s)] = s
    logits = np.asarray(forward(state, jnp.asarray(padded), slots))
    for i, s in enumerate(seqs):
      if not done[i]:
        t = int(np.argmax(logits[i, len(s) - 1]))
        done[i] = t in toks[i].stop_token_ids
        if not done[i]:
          outs[i].append(t)
          s.append(t)
  got = [toks[i].decode(o) for i, o in enumerate(outs)]
  assert got == want and all(done)
