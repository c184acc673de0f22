"""Structured-output masks (`bitdelta_jax.engine.grammar`) with real tokenizers.

Decoding is driven by the mask alone: random allowed tokens (after a few dozen steps, closing
quotes/brackets when allowed, so every walk ends) until the grammar is finished. The text must
then parse with `json.loads` and satisfy the schema, checked by a small validator written here
(and by `jsonschema` when it is installed), not by llguidance.
"""

import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llguidance")

from bitdelta_jax.engine.grammar import (  # noqa: E402
  GrammarError,
  apply_bitmask,
  apply_bitmask_reference,
  bitmask_width,
  compile_grammar,
  fill_bitmask_batch,
)
from bitdelta_jax.models.tokenizer import Tokenizer  # noqa: E402
from bitdelta_jax.zoo import shipped_family  # noqa: E402
from bitdelta_jax.zoo.real_base import default_dir  # noqa: E402

PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
  },
  "required": ["name", "age", "kind", "tags"],
  "additionalProperties": False,
}
NESTED = {
  "type": "object",
  "$defs": {
    "Owner": {
      "type": "object",
      "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{2,6}$"},
        "ok": {"type": "boolean"},
      },
      "required": ["name", "ok"],
      "additionalProperties": False,
    }
  },
  "properties": {
    "id": {"type": "integer"},
    "owner": {"$ref": "#/$defs/Owner"},
    "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
  },
  "required": ["id", "owner", "scores"],
  "additionalProperties": False,
}


def _schema_format(schema):
  return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


FORMATS = {
  "person": _schema_format(PERSON),
  "nested": _schema_format(NESTED),
  "json_object": {"type": "json_object"},
}


@pytest.fixture(scope="module")
def nano():
  """The shipped tiny family's tokenizer (261 tokens) and its model's vocabulary (264)."""
  base, _ = shipped_family()
  return Tokenizer.from_dir(base), json.loads((base / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def smollm2():
  path = default_dir()
  if not (path / "tokenizer.json").exists():
    pytest.skip(f"no SmolLM2 tokenizer at {path} (`bitdelta zoo real-base`)")
  tok = Tokenizer.from_dir(path)
  return tok, tok.vocab_size


@pytest.fixture(scope="module", params=["nano", "smollm2"])
def tok_v(request):
  return request.getfixturevalue(request.param)


# -- an independent checker ------------------------------------------------------------------
def _conforms(x, s, root):
  if "$ref" in s:
    s = root["$defs"][s["$ref"].rsplit("/", 1)[-1]]
  if "enum" in s:
    return x in s["enum"]
  t = s.get("type")
  if t == "object":
    props = s.get("properties", {})
    return (
      isinstance(x, dict)
      and all(k in x for k in s.get("required", []))
      and (s.get("additionalProperties", True) is not False or set(x) <= set(props))
      and all(_conforms(v, props[k], root) for k, v in x.items() if k in props)
    )
  if t == "array":
    return (
      isinstance(x, list)
      and s.get("minItems", 0) <= len(x) <= s.get("maxItems", len(x))
      and all(_conforms(v, s.get("items", {}), root) for v in x)
    )
  if t == "string":
    return (
      isinstance(x, str)
      and s.get("minLength", 0) <= len(x) <= s.get("maxLength", len(x))
      and ("pattern" not in s or re.search(s["pattern"], x) is not None)
    )
  if t == "integer":
    return (
      isinstance(x, int)
      and not isinstance(x, bool)
      and s.get("minimum", x) <= x <= s.get("maximum", x)
    )
  if t == "number":
    return isinstance(x, int | float) and not isinstance(x, bool)
  if t == "boolean":
    return isinstance(x, bool)
  return t is None


def _check(value, response_format):
  if response_format["type"] == "json_object":
    assert isinstance(value, dict)
    return
  schema = response_format["json_schema"]["schema"]
  assert _conforms(value, schema, schema), value
  try:
    import jsonschema
  except ImportError:
    return
  jsonschema.validate(value, schema)


# -- mask-driven decoding --------------------------------------------------------------------
def _allowed(words):
  return np.flatnonzero(np.unpackbits(words.astype("<i4").view(np.uint8), bitorder="little"))


@functools.cache
def _closers(tok):
  """Tokens made only of closing quotes and brackets."""
  out = []
  for i in range(tok.vocab_size):
    s = tok.decode([i])
    if s and set(s) <= set('"]}'):
      out.append(i)
  return np.array(out)


def _walk(grammar, tok, vocab, rng, closers, *, free_steps=40, cap=800):
  """Random allowed tokens until the grammar is finished (or EOS is drawn); checks each mask."""
  m = grammar.matcher()
  words = np.full(bitmask_width(vocab), 12345, np.int32)  # stale contents must be overwritten
  ids = []
  for step in range(cap):
    m.fill_bitmask(words)
    allowed = _allowed(words)
    assert allowed.size and allowed[-1] < tok.vocab_size  # nothing past the tokenizer
    assert (tok.eos_token_id in allowed) == m.can_end()
    if m.is_finished():
      assert allowed.tolist() == [tok.eos_token_id]
      return ids
    pool = allowed
    if step >= free_steps:
      close = np.intersect1d(allowed, closers)
      pool = close if close.size else allowed
    t = int(rng.choice(pool))
    if t == tok.eos_token_id:
      return ids
    m.accept(t)
    ids.append(t)
  raise AssertionError(f"no end after {cap} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_decoding_is_valid(tok_v, name):
  tok, vocab = tok_v
  rf = FORMATS[name]
  grammar = compile_grammar(tok, rf)
  closers = _closers(tok)
  rng = np.random.default_rng(sum(map(ord, name)))
  for _ in range(6):
    text = tok.decode(_walk(grammar, tok, vocab, rng, closers))
    _check(json.loads(text), rf)


def test_wide_rows_and_batch_fill(nano):
  tok, vocab = nano
  g = compile_grammar(tok, FORMATS["person"])
  a, b = g.matcher(), g.matcher()
  for t in tok.encode('{"name": "x', add_special_tokens=False):
    a.accept(t)
  rows = np.full((3, bitmask_width(vocab + 100)), 7, np.int32)
  fill_bitmask_batch([a, None, b], rows)
  for r, m in ((0, a), (2, b)):
    one = np.full(rows.shape[1], 7, np.int32)
    m.fill_bitmask(one)
    np.testing.assert_array_equal(rows[r], one)
    assert _allowed(one)[-1] < tok.vocab_size
  assert (rows[1] == -1).all()
  with pytest.raises(ValueError, match="words"):
    a.fill_bitmask(np.zeros(bitmask_width(tok.vocab_size) - 1, np.int32))


# -- EOS, bad tokens, rollback ---------------------------------------------------------------
@pytest.mark.parametrize(
  "schema, text",
  [
    ({"type": "integer"}, "1234"),
    (PERSON, '{"name": "Al", "age": 31, "kind": "dog", "tags": ["a", "bc"]}'),
  ],
)
def test_eos_exactly_when_complete(nano, schema, text):
  tok, vocab = nano
  rf = _schema_format(schema)
  m = compile_grammar(tok, rf).matcher()
  words = np.zeros(bitmask_width(vocab), np.int32)
  ids = tok.encode(text, add_special_tokens=False)
  for n in range(len(ids) + 1):
    m.fill_bitmask(words)
    try:
      complete = _conforms(json.loads(tok.decode(ids[:n])), schema, schema)
    except json.JSONDecodeError:
      complete = False
    assert (tok.eos_token_id in _allowed(words)) == complete, tok.decode(ids[:n])
    if n < len(ids):
      m.accept(ids[n])
  m.accept(tok.eos_token_id)
  assert m.is_finished() and m.error is None


def test_disallowed_tokens_raise_and_keep_state(nano):
  tok, vocab = nano
  m = compile_grammar(tok, FORMATS["person"]).matcher()
  brace, quote = tok.token_id("{"), tok.token_id('"')
  m.accept(brace)
  for bad in (brace, tok.eos_token_id, tok.token_id("x")):
    with pytest.raises(GrammarError, match="not allowed"):
      m.accept(bad)
  for bad in (tok.vocab_size, vocab - 1, -1):
    with pytest.raises(GrammarError, match="outside"):
      m.accept(bad)
  m.accept(quote)  # the state survived the refusals
  assert m.error is None


def test_rollback(nano):
  tok, vocab = nano
  m = compile_grammar(tok, FORMATS["nested"]).matcher()
  before, after = np.zeros((2, bitmask_width(vocab)), np.int32)
  ids = tok.encode('{"id": 1', add_special_tokens=False)
  for t in ids[:3]:
    m.accept(t)
  m.fill_bitmask(before)
  for t in ids[3:]:
    m.accept(t)
  m.rollback(len(ids) - 3)
  m.fill_bitmask(after)
  np.testing.assert_array_equal(before, after)


# -- response_format errors and the cache ---------------------------------------------------
@pytest.mark.parametrize(
  "rf, match",
  [
    ({"type": "xml"}, "response_format.type 'xml' is not supported"),
    ([], "must be an object"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, r"json_schema\.schema"),
    (_schema_format({"type": "integer"}) | {"json_schema": {"name": 3, "schema": {}}}, "name"),
    (_schema_format({"type": "foo"}), "Invalid type: foo"),
    (_schema_format({"type": "object", "if": {}}), r"Unimplemented keys: \[\"if\"\]"),
    (_schema_format({"$ref": "#/$defs/none"}), "does not exist"),
    (_schema_format({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
    (_schema_format({"type": "string", "pattern": "(("}), "regex parse error"),
  ],
)
def test_bad_response_format(nano, rf, match):
  with pytest.raises(GrammarError, match=match):
    compile_grammar(nano[0], rf)


def test_text_and_cache(nano):
  tok, _ = nano
  assert compile_grammar(tok, {"type": "text"}) is None
  g = compile_grammar(tok, FORMATS["person"])
  same = json.loads(json.dumps(FORMATS["person"]))  # an equal dict, another object
  assert compile_grammar(tok, same) is g
  other = Tokenizer(tok.tok, tok.config, tok.chat_template)
  assert compile_grammar(other, same) is not g


# -- applying the mask -----------------------------------------------------------------------
@pytest.mark.parametrize("v, dtype", [(100, jnp.float32), (264, jnp.bfloat16), (64, jnp.float32)])
def test_apply_bitmask_matches_reference(v, dtype):
  rng = np.random.default_rng(v)
  words = rng.integers(-(2**31), 2**31, size=(5, bitmask_width(v)), dtype=np.int64).astype(np.int32)
  words[0] = -1
  words[1] = 0
  logits = jnp.asarray(rng.normal(size=(5, v)), dtype)
  got = jax.jit(apply_bitmask)(logits, jnp.asarray(words))
  want = apply_bitmask_reference(np.asarray(logits), words)
  assert got.dtype == logits.dtype
  np.testing.assert_array_equal(np.asarray(got), want)
  bits = np.array(
    [[(int(w) >> (t % 32)) & 1 for t in range(v) for w in [row[t // 32]]] for row in words]
  )
  np.testing.assert_array_equal(np.isneginf(want), bits == 0)


def test_timings_smollm2(smollm2):
  """Not a timed test: prints the costs quoted in the module docstring (run with -s)."""
  tok, vocab = smollm2
  props = PERSON["properties"] | {"when": {"type": "string", "format": "date-time"}}
  rf = _schema_format(PERSON | {"properties": props})
  t0 = time.perf_counter()
  compile_grammar(tok, FORMATS["json_object"])  # builds (or finds) llguidance's tokenizer
  t1 = time.perf_counter()
  g = compile_grammar(tok, rf)
  first_ms, compile_ms = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
  closers, rng = _closers(tok), np.random.default_rng(0)
  words = np.zeros(bitmask_width(vocab), np.int32)
  fill, accept = [], []
  for _ in range(3):
    m = g.matcher()
    for step in range(300):
      t0 = time.perf_counter()
      m.fill_bitmask(words)
      fill.append(time.perf_counter() - t0)
      allowed = _allowed(words)
      close = np.intersect1d(allowed, closers) if step > 60 else allowed[:0]
      t = int(rng.choice(close if close.size else allowed))
      if m.is_finished() or t == tok.eos_token_id:
        break
      t0 = time.perf_counter()
      m.accept(t)
      accept.append(time.perf_counter() - t0)
  fill_us, accept_us = np.array(fill) * 1e6, np.array(accept) * 1e6
  print(
    f"\nSmolLM2 ({tok.vocab_size} tokens): first json_object compile {first_ms:.0f} ms, "
    f"schema compile {compile_ms:.1f} ms; over {len(fill)} steps fill_bitmask median "
    f"{np.median(fill_us):.0f} us, p90 {np.percentile(fill_us, 90):.0f} us, max "
    f"{fill_us.max():.0f} us; accept median {np.median(accept_us):.0f} us"
  )


def test_padding_tokenizer_gives_the_same_masks(nano):
  """A tokenizer set to pad or truncate (an encode-time setting) constrains like the plain one."""
  from tokenizers import Tokenizer as HFTokenizer

  tok, vocab = nano
  hf = HFTokenizer.from_str(tok.tok.to_str())
  hf.enable_padding(length=64)
  hf.enable_truncation(8)
  padded = Tokenizer(hf, tok.config, tok.chat_template)
  a = compile_grammar(tok, FORMATS["nested"]).matcher()
  b = compile_grammar(padded, FORMATS["nested"]).matcher()
  rows = np.zeros((2, bitmask_width(vocab)), np.int32)
  for t in tok.encode('{"id": 7, "owner": {"name": "ab', add_special_tokens=False):
    a.fill_bitmask(rows[0])
    b.fill_bitmask(rows[1])
    np.testing.assert_array_equal(rows[0], rows[1])
    a.accept(t)
    b.accept(t)
