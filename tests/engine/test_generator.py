"""The engine's `Generator`: parity with transformers, chunked prefill, prefix reuse, preemption,
row/length buckets, mixed variants, stops (ids, strings, length, context)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import model_fixtures
import numpy as np
import pytest
from model_fixtures import hf_greedy, make_tokenizer_dir

from bitdelta_jax.delta.compress import CompressPolicy, apply_delta, compress
from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.kv_pages import PagePool, page_hashes
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.models import base_tensors, from_pretrained, from_tensors
from bitdelta_jax.models.tokenizer import Tokenizer

RNG = np.random.RandomState(0)
PROMPTS = [list(RNG.randint(3, 256, n)) for n in (3, 9, 14, 5, 11)]



@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("preset", ["llama", "mistral_sliding"])
def test_greedy_matches_transformers_with_chunks_and_pages(hf_models, preset, scan):
  hf, path = hf_models(preset)
  # pages of 4 tokens, prefill chunks of 8 tokens (prompts of 9, 11, 14 tokens take 2 chunks),
  # 3 rows for 5 prompts (rows are refilled); the layers unrolled or as one scan (sliding
  # windows then come from a per-layer array)
  gen = Generator(from_pretrained(path, jnp.float32), max_rows=3, max_seq_len=32,
                       page_size=4, prefill_chunk=8, scan_layers=scan)
  assert (gen.runner._stacked is not None) == scan
  results = gen.generate(PROMPTS, params=SamplingParams(max_new_tokens=8))
  for prompt, res in zip(PROMPTS, results):
    assert res.tokens == hf_greedy(hf, prompt, 8)
    assert res.finish_reason == "length"
  assert gen.pool.used == 0  # every page released (some may stay cached for prefixes)


@pytest.fixture(scope="module")
def llama_path(hf_models):
  return hf_models("llama")


@pytest.mark.slow
def test_prefix_reuse_gives_the_same_tokens_and_skips_pages(llama_path):
  hf, path = llama_path
  gen = Generator(from_pretrained(path, jnp.float32), max_rows=4, max_seq_len=48,
                       page_size=4, prefill_chunk=16)
  header = list(RNG.randint(3, 256, 13))
  prompts = [header + list(RNG.randint(3, 256, n)) for n in (2, 5, 7)]
  first = gen.generate(prompts[:1], params=SamplingParams(max_new_tokens=5))[0]
  hits = gen.pool.hits
  rest = gen.generate(prompts[1:], params=SamplingParams(max_new_tokens=5))
  assert gen.pool.hits - hits >= 2 * 3  # 3 full pages of the 13-token header, twice
  for p, r in zip(prompts, [first, *rest]):
    assert r.tokens == hf_greedy(hf, p, 5)
  # the same prompt again: all full pages but the last token's come from the cache
  again = gen.generate(prompts[:1], params=SamplingParams(max_new_tokens=5))[0]
  assert again.tokens == first.tokens


@pytest.mark.slow
def test_preemption_when_pages_run_out_keeps_outputs(llama_path):
  hf, path = llama_path
  # 9 usable pages of 4 tokens = 36 tokens for 4 sequences that need up to 22 each
  gen = Generator(from_pretrained(path, jnp.float32), max_rows=4, max_seq_len=32,
                       page_size=4, num_pages=10, prefill_chunk=8,
                       prefix_caching=False)
  prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[4], PROMPTS[1]]
  res = gen.generate(prompts, params=SamplingParams(max_new_tokens=8))
  for p, r in zip(prompts, res):
    assert r.tokens == hf_greedy(hf, p, 8)
  assert gen.pool.used == 0


def test_sequence_larger_than_the_pool_is_an_error(llama_path):
  _, path = llama_path
  gen = Generator(from_pretrained(path, jnp.float32), max_rows=2, max_seq_len=64,
                       page_size=4, num_pages=4)
  with pytest.raises(RuntimeError, match="cannot hold a sequence of 20 tokens"):
    gen.generate([list(range(3, 23))], params=SamplingParams(max_new_tokens=2))


@pytest.mark.slow
def test_every_step_runs_a_program_compiled_by_the_warmup(llama_path):
  hf, path = llama_path
  gen = Generator(from_pretrained(path, jnp.float32, num_slots=2), max_rows=8,
                       max_seq_len=64, page_size=4, prefill_chunk=24)
  assert gen.shapes.buckets() == [1, 2, 4, 8, 16, 32]  # budget = 8 decode + 24 prompt tokens
  gen.warmup()
  assert gen.compiles == 6  # one program per bucket (base rows skip the deltas inside it)
  gen.runner.guard = True  # any other program raises CompileAfterWarmup
  prompts = [list(RNG.randint(3, 256, n)) for n in range(1, 21)]
  res = gen.generate(prompts, slot_ids=[i % 2 for i in range(20)],
                     params=SamplingParams(max_new_tokens=3))
  assert gen.compiles == 6
  for p, r in zip(prompts[::2], res[::2]):  # slot 0 (empty slot 1 equals the base too)
    assert r.tokens == hf_greedy(hf, p, 3)
  assert {n for n, _ in gen.shapes_run} <= set(gen.shapes.buckets())
  # a lone stream decodes one token per step, not max_rows
  gen.shapes_run.clear()
  gen.generate([PROMPTS[0]], params=SamplingParams(max_new_tokens=3))
  assert gen.shapes_run == {(4, False), (1, False)}  # a 3-token prompt, then 1-token steps


@pytest.mark.slow
def test_background_compile_serves_from_the_ready_buckets_then_from_all(llama_path):
  """`warmup(background=True)`: the programs of 1 token and of max_rows tokens first; the rest
  compile on a background thread (decode buckets first) and are made ready between steps.
  Meanwhile no step is larger than the largest ready bucket (a long prompt runs in chunks of
  it), none compiles, and the tokens are transformers'."""
  import threading
  import time

  hf, path = llama_path
  gen = Generator(from_pretrained(path, jnp.float32, num_slots=2), max_rows=8,
                  max_seq_len=64, page_size=4, prefill_chunk=24)
  release = threading.Event()
  gen.warmup(background=True, on_compiled=lambda: release.wait(120))  # holds after bucket 2
  r = gen.runner
  assert r.ready_buckets(False) == (1, 8)
  assert {n for n, _ in r.pending} == {2, 4, 16, 32}
  r.guard = True  # a step that needs a program not ready raises
  long_prompt = list(RNG.randint(3, 256, 30))
  res = gen.generate([long_prompt, PROMPTS[0]], params=SamplingParams(max_new_tokens=4))
  assert max(n for n, _ in gen.shapes_run) == 8  # 30 prompt tokens in chunks of <= 8 - decode
  assert r.ready_buckets(False) in ((1, 8), (1, 2, 8))  # bucket 2 may have been promoted
  assert res[0].tokens == hf_greedy(hf, long_prompt, 4)
  assert res[1].tokens == hf_greedy(hf, PROMPTS[0], 4)
  release.set()
  deadline = time.monotonic() + 300
  while gen.pending_buckets and time.monotonic() < deadline:
    gen.promote()  # what the engine's device thread runs when told (or a step does)
    time.sleep(0.05)
  assert r.ready_buckets(False) == tuple(gen.shapes.buckets()) and not gen.pending_buckets
  assert gen.schedulers[0].buckets is None and r.compiles_after_warmup == 0
  gen.shapes_run.clear()
  other = list(RNG.randint(3, 256, 30))  # (not the first: its pages are cached)
  res = gen.generate([other], params=SamplingParams(max_new_tokens=4))
  assert (32, False) in gen.shapes_run  # the whole prompt in one step now
  assert res[0].tokens == hf_greedy(hf, other, 4)


@pytest.mark.slow
def test_long_prompt_is_chunked_and_decode_rows_keep_stepping(llama_path):
  hf, path = llama_path
  gen = Generator(from_pretrained(path, jnp.float32), max_rows=2, max_seq_len=64,
                       page_size=4, prefill_chunk=8)
  short = gen.add(PROMPTS[0], params=SamplingParams(max_new_tokens=20))
  gen.step()  # the short prompt's prefill
  long_prompt = list(RNG.randint(3, 256, 40))
  long = gen.add(long_prompt, params=SamplingParams(max_new_tokens=4))
  steps_to_first = 0
  while len(long.generated) == 0:
    before = len(short.generated)
    res = gen.step()
    steps_to_first += 1
    assert len(short.generated) == before + 1  # one decode token per iteration meanwhile
    assert res.prefill_tokens <= 8
  assert steps_to_first == 5  # 40 tokens in chunks of 8
  while len(long.generated) < 4:
    gen.step()
  assert long.generated[:4] == hf_greedy(hf, long_prompt, 4)


@pytest.mark.slow
def test_seeded_sampling_is_per_request(llama_path):
  _, path = llama_path
  model = from_pretrained(path, jnp.float32)
  gen = Generator(model, max_rows=4, max_seq_len=48, page_size=4)
  p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_new_tokens=6)
  alone = gen.generate([PROMPTS[0]], params=p)[0].tokens
  others = [dataclasses.replace(p, seed=s) for s in (1, 2, 3)]
  mixed = gen.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]],
                       params=[others[0], p, others[1], others[2]])
  assert mixed[1].tokens == alone
  assert mixed[3].tokens != alone


@pytest.mark.slow
def test_mixed_variants_in_one_batch_equal_their_applied_models(hf_models):
  _, path = hf_models("qwen2")
  model = from_pretrained(path, jnp.float32, num_slots=3, dense_embedding_slots=True)
  base = base_tensors(model)
  rng = np.random.RandomState(1)
  deltas = []
  for i in range(2):  # the second variant also changes the embeddings and the LM head
    ft = {k: a if ("embed" in k or "lm_head" in k) and i == 0
          else a + 0.05 * rng.randn(*a.shape).astype(a.dtype) for k, a in base.items()}
    deltas.append(compress(base, ft, CompressPolicy(), hf_layout=True)[0])
  gen = Generator(model, max_rows=3, max_seq_len=32, page_size=4, prefill_chunk=16)
  for slot, delta in zip((1, 2), deltas):
    gen.load_variant(slot, delta)
  params = SamplingParams(max_new_tokens=6)
  slots = [0, 1, 2, 1]
  prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[4]]
  mixed = gen.generate(prompts, slot_ids=slots, params=params)
  emb = model.model.embed_tokens
  assert list(np.asarray(emb.weight_delta_used[...])) == [0.0, 0.0, 1.0]
  cfg = dataclasses.replace(model.config, num_slots=1, dense_embedding_slots=False)
  for slot in (0, 1, 2):
    weights = base if slot == 0 else apply_delta(base, deltas[slot - 1], hf_layout=True)
    alone = Generator(from_tensors(cfg, weights), max_rows=2, max_seq_len=32)
    rows = [i for i, s in enumerate(slots) if s == slot]
    want = alone.generate([prompts[i] for i in rows], params=params)
    assert [mixed[i].tokens for i in rows] == [w.tokens for w in want]
  # a reloaded slot never reuses the old variant's cached prefix pages
  gen.load_variant(1, deltas[1])
  swapped = gen.generate([prompts[1]], slot_ids=[1], params=params)[0]
  assert swapped.tokens == mixed[2].tokens


def test_page_pool_refcounts_and_prefix_cache():
  pool = PagePool(num_pages=4, page_size=2)
  a, b = pool.allocate(), pool.allocate()
  hs = page_hashes([5, 6, 7, 8], 2, (0,), 2)
  assert hs != page_hashes([5, 6, 7, 8], 2, (1, 0), 2)  # the variant is part of the name
  pool.publish(a, hs[0])
  pool.publish(b, hs[1])
  pool.release([a, b])
  assert pool.available == 3 and pool.used == 0
  assert pool.lookup(hs) == [a, b] and pool.used == 2
  assert pool.lookup(page_hashes([5, 6, 9, 9], 2, (0,), 2)) == [a]  # the shared first page
  pool.release([a, b, a])
  c = pool.allocate()  # from the free list first; the cached pages stay
  assert c not in (a, b) and pool.lookup(hs[:1]) == [a]
  pool.release([a])
  pool.allocate()
  pool.allocate()  # evicts the least recently released cached pages
  assert pool.lookup(hs) == []


# -- issue 13: log probabilities, n choices sharing a prefill, logit controls, grammar masks -----
def _log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def llama_model(llama_path):
  return from_pretrained(llama_path[1], jnp.float32)


@pytest.fixture(scope="module")
def gen(llama_model, llama_path):
  """One engine for these tests (its compiled shapes are shared): pages of 4 tokens, prefill
  chunks of 8, 4 rows; a tokenizer for stop strings."""
  tok = Tokenizer.from_dir(make_tokenizer_dir(llama_path[1] / "tok"))
  return Generator(llama_model, max_rows=4, max_seq_len=48, page_size=4, prefill_chunk=8,
                   tokenizer=tok)


@pytest.mark.slow
def test_stop_token_ids_and_max_new_tokens(gen):
  full = gen.generate([PROMPTS[2]], params=SamplingParams(max_new_tokens=8))[0]
  assert len(full.tokens) == 8 and full.finish_reason == "length"
  stop = full.tokens[3]
  first = full.tokens.index(stop)
  res = gen.generate([PROMPTS[2]],
                     params=SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))[0]
  assert res.tokens == full.tokens[:first] and res.finish_reason == "stop"


def test_stop_strings(gen):
  full = gen.generate([PROMPTS[3]], params=SamplingParams(max_new_tokens=8))[0]
  assert full.text == gen.tokenizer.decode(full.tokens)
  words = full.text.split(" ")
  stop = " ".join(words[3:5])
  res = gen.generate([PROMPTS[3]], params=SamplingParams(max_new_tokens=8, stop_strings=(stop,)))[0]
  assert res.finish_reason == "stop"
  assert res.text == full.text[: full.text.find(stop)]
  assert res.tokens == full.tokens[: len(res.tokens)] and len(res.tokens) <= 5


def test_cache_length_limit(gen):
  res = gen.generate([list(RNG.randint(3, 256, 30))], params=SamplingParams(max_new_tokens=40))[0]
  assert res.finish_reason == "length" and 30 + len(res.tokens) == gen.max_seq_len


@pytest.mark.slow
def test_logprobs_and_prompt_logprobs_equal_a_full_forward(llama_model, gen):
  prompt = list(RNG.randint(3, 256, 19))  # 3 prefill chunks
  gen.generate([prompt], params=SamplingParams(max_new_tokens=2))  # its pages are now cached
  p = SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, logprobs=3, prompt_logprobs=2)
  s = gen.add(prompt, params=p)
  while len(s.generated) < 5:
    gen.step()
  gen.finish(s)
  ids = prompt + s.generated
  lsm = _log_softmax(model_fixtures.forward(llama_model, np.asarray([ids]))[0])
  assert sorted(s.prompt_logprobs) == list(range(1, len(prompt)))
  for q, (lp, top_ids, top_lps) in s.prompt_logprobs.items():
    np.testing.assert_allclose(lp, lsm[q - 1, ids[q]], rtol=1e-4, atol=1e-4)
    assert top_ids == list(np.argsort(-lsm[q - 1], kind="stable")[:2])
    np.testing.assert_allclose(top_lps, lsm[q - 1, top_ids], rtol=1e-4, atol=1e-4)
  assert len(s.token_logprobs) == 5
  for i, (lp, top_ids, _) in enumerate(s.token_logprobs):
    at = len(prompt) - 1 + i
    np.testing.assert_allclose(lp, lsm[at, ids[at + 1]], rtol=1e-4, atol=1e-4)
    assert len(top_ids) == 3 and top_ids[0] == int(lsm[at].argmax())


def test_scoring_only_request_generates_nothing(gen):
  res = gen.generate([PROMPTS[1]], params=SamplingParams(max_new_tokens=0, prompt_logprobs=0))
  assert res[0].tokens == [] and res[0].finish_reason == "length"


@pytest.mark.slow
def test_n_choices_share_the_prefill_and_equal_separate_runs(gen):
  from bitdelta_jax.engine.batch import prng_key

  # 14 new tokens (2 prefill chunks): 3 full pages + a partial one (copied per choice)
  prompt = list(np.random.RandomState(5).randint(3, 256, 14))
  p = SamplingParams(temperature=1.0, seed=11, max_new_tokens=6)
  group = gen.add_n(prompt, 0, p, ["a", "b", "c", "d", "e"])  # 5 choices, 4 rows
  prefill_tokens = 0
  while gen.has_work:
    res = gen.step()
    prefill_tokens += res.prefill_tokens
    for s, _ in res.tokens:
      if len(s.generated) == 6:
        gen.finish(s)
  assert prefill_tokens == len(prompt)  # one prefill for all five
  assert gen.pool.used == 0
  outs = [s.generated for s in group]
  assert len({tuple(o) for o in outs}) > 1
  assert outs[0] == gen.generate([prompt], params=p)[0].tokens  # choice 0 = the single answer
  for i in (1, 4):  # every choice equals a sequence run alone with that choice's key
    s = gen.add(prompt, params=p)
    s.key = prng_key(p.seed, i)
    while len(s.generated) < 6:
      gen.step()
    gen.finish(s)
    assert s.generated == outs[i]


@pytest.mark.slow
def test_penalties_bias_and_min_tokens_follow_numpy_over_a_generation(llama_model, gen):
  """Greedy decoding with the controls: every token is the argmax of the full-forward logits
  with the controls applied by numpy (tests/engine/test_sampling.py's reference)."""
  from numpy_references import numpy_controls

  from bitdelta_jax.engine.controls import LogitControls

  prompt = PROMPTS[1]
  plain = gen.generate([prompt], params=SamplingParams(max_new_tokens=8))[0].tokens
  stop = plain[0]
  cases = [
    SamplingParams(max_new_tokens=8, repetition_penalty=1.5, frequency_penalty=0.4),
    SamplingParams(max_new_tokens=8, presence_penalty=1.0, logit_bias=((plain[1], 2.5),)),
    SamplingParams(max_new_tokens=8, stop_token_ids=(stop,), min_tokens=3,
                   frequency_penalty=-0.5),
  ]
  res = gen.generate([prompt] * 3 + [PROMPTS[0]], params=cases + [SamplingParams(max_new_tokens=8)])
  assert res[3].tokens == gen.generate([PROMPTS[0]], params=SamplingParams(max_new_tokens=8))[
    0].tokens  # a plain row beside controlled ones is unaffected
  for p, r in zip(cases, res):
    toks = r.tokens + ([stop] if r.finish_reason == "stop" else [])
    ids = prompt + toks
    logits = model_fixtures.forward(llama_model, np.asarray([ids]))[0]
    for i, t in enumerate(toks):
      c = LogitControls.neutral(1, logits.shape[-1], 40)
      bias = list(p.logit_bias) + ([(x, -np.inf) for x in p.stop_token_ids]
                                   if i < p.min_tokens else [])
      for j, (b, v) in enumerate(bias):
        c.bias_ids[0, j], c.bias_vals[0, j] = b, v
      c.history[0, : len(prompt) + i] = ids[: len(prompt) + i]
      c.prompt_len[0] = len(prompt)
      c.presence[0], c.frequency[0] = p.presence_penalty, p.frequency_penalty
      c.repetition[0] = p.repetition_penalty
      want = numpy_controls(logits[None, len(prompt) - 1 + i], c)[0]
      assert t == int(want.argmax()), (p, i)
  assert stop not in res[2].tokens[:3]
  assert res[0].tokens != plain


class EvenTokens:
  """A stand-in grammar: only even token ids, finished after 4 tokens."""

  def matcher(self):
    return self

  def __init__(self):
    self.n = 0

  def fill_bitmask(self, words):
    words[:] = np.int32(0x55555555)

  def accept(self, tok):
    assert tok % 2 == 0
    self.n += 1

  def is_finished(self):
    return self.n >= 4


@pytest.mark.slow
def test_grammar_mask_constrains_each_row_and_stops_it(gen):

  class Grammar:
    def matcher(self):
      return EvenTokens()

  p = SamplingParams(temperature=1.0, seed=1, max_new_tokens=10, grammar=Grammar())
  free = SamplingParams(temperature=1.0, seed=1, max_new_tokens=10)
  res = gen.generate([PROMPTS[0], PROMPTS[0], PROMPTS[3]], params=[p, free, p])
  for r in (res[0], res[2]):
    assert len(r.tokens) == 4 and r.finish_reason == "stop"
    assert all(t % 2 == 0 for t in r.tokens)
  assert len(res[1].tokens) == 10 and any(t % 2 for t in res[1].tokens)


def _run_group(gen, prompt, p, n):
  """``n`` choices of ``prompt`` to ``max_new_tokens`` each; every choice must finish."""
  group = gen.add_n(prompt, 0, p, list(range(n)))
  for _ in range(200):
    if not gen.has_work:
      break
    for s, _ in gen.step().tokens:
      if len(s.generated) == p.max_new_tokens:
        gen.finish(s)
  assert not gen.has_work and all(s.finished for s in group)
  assert all(len(s.generated) == p.max_new_tokens for s in group), [s.generated for s in group]
  return [s.generated for s in group]


@pytest.mark.slow
@pytest.mark.parametrize("length", [1, 3, 4, 5, 9])  # 1, page_size - 1, page_size, ps + 1, 2 ps + 1
def test_n_choices_fork_whatever_call_computes_the_leaders_last_prompt_token(gen, length):
  """Issue 24: a leader with one prompt token left to compute (a 1-token prompt, or a prompt
  whose full pages are prefix-cache hits) used to run as a decode row, which never forked its
  choices: they hung. Cached and uncached, every choice finishes and equals its lone run."""
  from bitdelta_jax.engine.batch import prng_key

  prompt = list(np.random.RandomState(length).randint(3, 256, length))
  p = SamplingParams(temperature=1.0, seed=3, max_new_tokens=3)
  gen.pool.clear_cache()
  for n, cached in ((2, False), (5, True), (16, True)):
    hits = gen.pool.hits
    outs = _run_group(gen, prompt, p, n)
    if cached and length > 4:
      assert gen.pool.hits > hits  # the full pages came from the prefix cache
    assert gen.pool.used == 0
    for i in (0, n - 1):  # choice i equals a sequence run alone with choice i's key
      s = gen.add(prompt, params=p)
      s.key = prng_key(p.seed, i)
      while len(s.generated) < 3:
        gen.step()
      gen.finish(s)
      assert s.generated == outs[i], (n, i)


def test_prng_key_on_the_host_equals_jax_keys():
  import jax

  from bitdelta_jax.engine.batch import prng_key

  for seed in (0, 7, 123456789, 2**31 - 1, 2**32 - 1, -5, 2**40 + 3):
    for choice in (0, 1, 2, 15, 2**31):
      key = jax.random.PRNGKey(seed)
      if choice:
        key = jax.random.fold_in(key, choice)
      np.testing.assert_array_equal(prng_key(seed, choice),
                                    np.asarray(jax.random.key_data(key), np.uint32))


@pytest.mark.slow
def test_step_cache_loads_every_program_and_gives_the_same_tokens(llama_path, tmp_path):
  hf, path = llama_path
  kw = dict(max_rows=2, max_seq_len=32, page_size=4, prefill_chunk=6, step_cache_dir=tmp_path)
  prompts = [PROMPTS[0], PROMPTS[1]]
  first = Generator(from_pretrained(path, jnp.float32), **kw)
  first.warmup()
  assert first.runner.loaded_programs == 0 and first.compiles == 4  # buckets 1, 2, 4, 8
  files = sorted(tmp_path.iterdir())
  assert len(files) == 4
  files[0].write_bytes(b"not a program")  # a bad entry is a miss, compiled and saved again
  again = Generator(from_pretrained(path, jnp.float32), **kw)
  again.warmup()
  assert again.runner.loaded_programs == 3 and again.compiles == 4
  again.runner.guard = True
  res = again.generate(prompts, params=SamplingParams(max_new_tokens=6))
  for p, r in zip(prompts, res):
    assert r.tokens == hf_greedy(hf, p, 6)
  other = Generator(from_pretrained(path, jnp.float32), **{**kw, "max_seq_len": 40})
  other.warmup()  # other shapes: other keys, nothing loaded
  assert other.runner.loaded_programs == 0
