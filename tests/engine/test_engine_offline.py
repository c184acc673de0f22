"""The device-thread `Engine` as a library, without the HTTP server: its offline `generate`
batches the prompts on the device thread and applies the server's stops; the tokens equal
transformers' greedy ones, and a stop string cuts the text as a whole decode would."""

from __future__ import annotations

import numpy as np
import pytest
from model_fixtures import hf_greedy, make_tokenizer_dir

from bitdelta_jax.engine import Engine, EngineConfig, SamplingParams
from bitdelta_jax.models.tokenizer import Tokenizer

RNG = np.random.RandomState(5)
PROMPTS = [list(RNG.randint(3, 256, n)) for n in (4, 9, 13)]


@pytest.fixture(scope="module")
def engine(hf_models):
  hf, path = hf_models("llama")
  tok = Tokenizer.from_dir(make_tokenizer_dir(path / "tok"))
  eng = Engine(EngineConfig(base=str(path), max_batch=4, max_seq_len=48, page_size=4,
                            prefill_chunk=8, warmup=False), tokenizer=tok)
  eng.start().result(300)
  yield hf, tok, eng
  eng.stop()


@pytest.mark.slow
def test_offline_generate_equals_transformers_greedy(engine):
  hf, tok, eng = engine
  out = eng.generate(PROMPTS, params=SamplingParams(max_new_tokens=6), timeout=300)
  for prompt, g in zip(PROMPTS, out):
    assert g.tokens == hf_greedy(hf, prompt, 6)
    assert g.finish_reason == "length" and g.prompt_len == len(prompt)
    assert g.text == tok.decode(g.tokens)


def test_offline_generate_applies_stop_strings_and_ids(engine):
  hf, tok, eng = engine
  full = eng.generate([PROMPTS[1]], params=SamplingParams(max_new_tokens=8), timeout=300)[0]
  stop = full.text[3:6]
  assert stop and stop in full.text
  cut = eng.generate([PROMPTS[1]], params=SamplingParams(max_new_tokens=8, stop_strings=(stop,)),
                     timeout=300)[0]
  assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
  by_id = eng.generate([PROMPTS[1]], params=SamplingParams(
    max_new_tokens=8, stop_token_ids=(full.tokens[2],)), timeout=300)[0]
  assert by_id.finish_reason == "stop"
  assert by_id.tokens == full.tokens[: full.tokens.index(full.tokens[2])]


def test_a_refused_request_raises_naming_why(engine):
  _, _, eng = engine
  with pytest.raises(RuntimeError, match="leaves no room"):
    eng.generate([list(range(3, 60))], params=SamplingParams(max_new_tokens=2), timeout=60)
