"""The engine's one stop rule (`bitdelta_jax.engine.stops`): the incremental detokenizer gives the
text a whole decode gives, cut before the first stop string, hands out nothing a later token
could change, and `check_stop` ends a request for each reason. The reference is the tokenizer's
own decode of the whole output."""

from __future__ import annotations

import numpy as np
import pytest

from bitdelta_jax.engine.request import Request
from bitdelta_jax.engine.sampling_params import SamplingParams
from bitdelta_jax.engine.stops import TextStream, check_stop, kept_tokens, num_kept

TEXTS = ["héllo wörld — 日本語 🙂 the end of it", "plain ascii text, nothing more " * 3,
         "ab😀😀cd\n\nSTOP here? no: STOP!"]


@pytest.fixture(scope="module")
def tok():
  from bitdelta_jax.models.tokenizer import Tokenizer
  from bitdelta_jax.zoo import shipped_family

  return Tokenizer.from_dir(shipped_family()[0])  # byte-level: characters split over tokens


def stream(tok, ids, stops, valid=True):
  ts = TextStream(tok, stops)
  pieces = []
  for i, t in enumerate(ids):
    ts.add(t)
    piece = ts.take()
    # what goes out is final: the whole decode of the tokens so far starts with it
    pieces.append(piece)
    assert tok.decode(ids[: i + 1]).startswith("".join(pieces)) or ts.stopped
    assert not valid or "\ufffd" not in piece  # no character cut in two
    if ts.stopped:
      break
  pieces.append(ts.take(final=True))
  return ts, "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stops", [(), ("STOP",), ("日本", "zz"), ("nothing more plain",)])
def test_stream_is_the_whole_decode_cut_at_the_first_stop(tok, text, stops):
  ids = tok.encode(text, add_special_tokens=False)
  full = tok.decode(ids)
  hits = [full.find(s) for s in stops if s in full]
  want = full[: min(hits)] if hits else full
  ts, got = stream(tok, ids, stops)
  assert got == want
  assert ts.stopped == bool(hits)


def test_held_back_tail_is_never_emitted_before_it_is_safe(tok):
  ids = tok.encode("xxSTOyySTOP", add_special_tokens=False)
  ts = TextStream(tok, ("STOP",))
  out = ""
  for t in ids[:-1]:
    ts.add(t)
    out += ts.take()
  # "xxSTOyySTO" so far: its last 3 characters could start "STOP", so they wait
  assert out == "xxSTOyy" and not ts.stopped
  ts.add(ids[-1])
  assert ts.stopped and ts.take() == "" and ts.take(final=True) == ""


def test_random_bytes_stream_like_the_whole_decode(tok):
  rng = np.random.default_rng(0)
  for _ in range(20):
    ids = rng.integers(3, 259, 60).tolist()  # arbitrary bytes, invalid UTF-8 included
    _, got = stream(tok, ids, (), valid=False)
    assert got == tok.decode(ids)


def req(prompt, max_new=5, **kw):
  r = Request(list(prompt), 0, SamplingParams(max_new_tokens=max_new, **kw))
  r.tokens = list(prompt)
  return r


def feed(r, toks, max_seq_len=100, tokenizer=None):
  for t in toks:
    r.tokens.append(t)
    why = check_stop(r, max_seq_len, tokenizer)
    if why:
      return why
  return None


def test_check_stop_reasons(tok):
  r = req([5, 6], max_new=3)
  assert feed(r, [40, 41, 42, 43]) == "length" and kept_tokens(r) == [40, 41, 42]
  r = req([5, 6], max_new=9, stop_token_ids=(2,))
  assert feed(r, [40, 2, 50]) == "stop" and kept_tokens(r) == [40] and num_kept(r) == 1
  r = req([5] * 8, max_new=50)
  assert feed(r, [40] * 20, max_seq_len=12) == "length" and num_kept(r) == 4
  r = req([5], max_new=0)  # scoring only: the token drawn after the prompt is not kept
  assert feed(r, [40]) == "length" and kept_tokens(r) == []
  ids = tok.encode("ab STOP cd", add_special_tokens=False)
  r = req([5], max_new=50, stop_strings=("STOP",))
  assert feed(r, ids, tokenizer=tok) == "stop"
  # the text is cut before the stop string; the token that completed it is kept (byte-level:
  # "ab STOP" is 7 tokens)
  assert r.text.take(final=True) == "ab " and kept_tokens(r) == ids[:7]
