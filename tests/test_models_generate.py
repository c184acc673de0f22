"""The public `Generator` (the one engine, `Generator`): seeded sampling, host stops,
variant rows against their applied models, slot swaps without recompiling."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import model_fixtures
import numpy as np
import pytest
from model_fixtures import make_tokenizer_dir

from bitdelta_jax.delta.compress import CompressPolicy, apply_delta, compress
from bitdelta_jax.engine import Generator
from bitdelta_jax.models import base_tensors, from_pretrained, from_tensors
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.models.tokenizer import Tokenizer

RNG = np.random.RandomState(0)
PROMPTS = [list(RNG.randint(3, 256, n)) for n in (3, 9, 14, 5, 11)]

hf_models = model_fixtures.hf_models  # the session fixture, visible to pytest here


@pytest.fixture(scope="module")
def gen(hf_models):
  _, path = hf_models("llama")
  return Generator(from_pretrained(path, jnp.float32), max_rows=4, max_seq_len=48,
                   tokenizer=Tokenizer.from_dir(make_tokenizer_dir(path / "tok")))


def test_seeded_sampling_is_per_request(gen):
  p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_new_tokens=6)
  alone = gen.generate([PROMPTS[0]], params=p)[0].tokens
  others = [dataclasses.replace(p, seed=s) for s in (1, 2, 3)]
  mixed = gen.generate(
    [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]], params=[others[0], p, others[1], others[2]]
  )
  assert mixed[1].tokens == alone  # same seed, different batch-mates and row
  assert mixed[3].tokens != alone  # another seed
  greedy = gen.generate([PROMPTS[0]], params=SamplingParams(max_new_tokens=6))[0].tokens
  top1 = gen.generate([PROMPTS[0]], params=dataclasses.replace(p, top_k=1))[0].tokens
  assert top1 == greedy


def test_stop_token_ids_and_max_new_tokens(gen):
  full = gen.generate([PROMPTS[2]], params=SamplingParams(max_new_tokens=8))[0]
  assert len(full.tokens) == 8 and full.finish_reason == "length"
  stop = full.tokens[3]
  first = full.tokens.index(stop)
  res = gen.generate([PROMPTS[2]], params=SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))[
    0
  ]
  assert res.tokens == full.tokens[:first] and res.finish_reason == "stop"


def test_stop_strings(gen):
  full = gen.generate([PROMPTS[3]], params=SamplingParams(max_new_tokens=8))[0]
  words = full.text.split(" ")
  stop = " ".join(words[3:5])
  res = gen.generate([PROMPTS[3]], params=SamplingParams(max_new_tokens=8, stop_strings=(stop,)))[0]
  assert res.finish_reason == "stop"
  assert res.text == full.text[: full.text.find(stop)]
  assert res.tokens == full.tokens[: len(res.tokens)] and len(res.tokens) <= 5


def test_cache_length_limit(gen):
  res = gen.generate([list(RNG.randint(3, 256, 30))], params=SamplingParams(max_new_tokens=40))[0]
  assert res.finish_reason == "length" and 30 + len(res.tokens) == gen.max_seq_len


def test_rows_on_different_variants(hf_models):
  _, path = hf_models("qwen2")
  model = from_pretrained(path, jnp.float32, num_slots=3)
  base = base_tensors(model)
  rng = np.random.RandomState(1)
  deltas = []
  for _ in range(2):
    ft = {
      k: a if "embed" in k or "lm_head" in k else a + 0.05 * rng.randn(*a.shape).astype(a.dtype)
      for k, a in base.items()
    }
    deltas.append(compress(base, ft, CompressPolicy(), hf_layout=True)[0])
  gen = Generator(model, max_rows=3, max_seq_len=32)
  for slot, delta in zip((1, 2), deltas):
    gen.load_variant(slot, delta)
  params = SamplingParams(max_new_tokens=6)
  slots = [0, 1, 2, 1]
  prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[4]]
  mixed = gen.generate(prompts, slot_ids=slots, params=params)
  cfg = dataclasses.replace(model.config, num_slots=1)
  for slot in (0, 1, 2):
    weights = base if slot == 0 else apply_delta(base, deltas[slot - 1], hf_layout=True)
    alone = Generator(from_tensors(cfg, weights), max_rows=2, max_seq_len=32)
    rows = [i for i, s in enumerate(slots) if s == slot]
    want = alone.generate([prompts[i] for i in rows], params=params)
    assert [mixed[i].tokens for i in rows] == [w.tokens for w in want]
  assert mixed[1].tokens != mixed[2].tokens  # same prompt, different variants
  # swapping variants between slots reuses the compiled steps (the same shapes)
  compiles = gen.compiles
  gen.load_variant(1, deltas[1])
  gen.clear_slot(2)
  swapped = gen.generate(prompts, slot_ids=slots, params=params)
  assert gen.compiles == compiles
  on_base = gen.generate(prompts[1:2], slot_ids=[0], params=params)[0]
  assert [r.tokens for r in swapped[:3]] == [mixed[0].tokens, mixed[2].tokens, on_base.tokens]
