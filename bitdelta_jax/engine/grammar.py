"""Structured output: per-row token bitmasks for OpenAI ``response_format`` (llguidance).

    grammar = compile_grammar(tokenizer, {"type": "json_schema", "json_schema": {...}})
    m = grammar.matcher()                       # one per sequence
    words = np.zeros(bitmask_width(V), np.int32)
    while True:
      m.fill_bitmask(words)                     # bit t % 32 of word t // 32 allows token t
      token = sample(apply_bitmask(logits, words[None])[0])
      if token == tokenizer.eos_token_id:       # allowed only once the value is complete
        break
      m.accept(token)

``{"type": "text"}`` compiles to None (no constraint); ``json_object`` is any JSON object;
``json_schema`` is the client's schema, enforced by llguidance's JSON-schema compiler (the
supported subset: https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md;
anything else, and an unsatisfiable schema, is a `GrammarError`). ``strict`` is accepted and
changes nothing: the output always matches the schema as written (so a missing
``additionalProperties: false`` lets the model add keys, as JSON Schema says).

Whitespace is fixed by default (`GrammarOptions`): ``", "`` between items, ``": "`` after keys,
no newlines — a small model with free whitespace can spend its whole budget on newlines. A
schema's own ``"x-guidance"`` options override these.

EOS: the mask allows the tokenizer's EOS exactly when the text so far is a complete value. Once
`Matcher.is_finished` (nothing but EOS can follow) the mask is EOS alone, so a sampler that
applies the mask every step ends the sequence by itself. A sequence cut by ``max_tokens`` ends
with incomplete JSON (``finish_reason: "length"``, as OpenAI does). Tokens at or past the
tokenizer's vocabulary (a model's padded embedding rows) are never allowed.

Costs (SmolLM2 tokenizer, 49,152 tokens, on a shared and busy 2-core CPU; printed by
tests/engine/test_grammar.py::test_timings_smollm2 with ``-s``):
  * llguidance's view of a `Tokenizer`: 0.4-1.2 s, once per tokenizer object (`warm_up` it at
    server start);
  * compiling a schema (6 fields, enum, bounds, date-time): 1.5-4.5 ms; a cache hit ~0.1 ms
    (the canonical JSON of the format); `CompiledGrammar.matcher` (a deep copy): 20-50 us;
  * `Matcher.fill_bitmask`: median 12-30 us (json_object) and 45-90 us (that schema) per token,
    p90 50-300 us; the first steps through a new grammar build lexer states lazily and can take
    up to ~7 ms once;
  * `Matcher.accept`: 5-15 us.
`fill_bitmask_batch` fills the rows of a batch in parallel (llguidance's thread pool, GIL
released), so the mask work of a decode step need not grow with the batch on a many-core host.

Threading: `compile_grammar` is thread-safe; the server should call it while handling the
request (off the event loop: a large schema can take 100s of ms), so that a bad schema is a 400
before the request reaches the engine. A `Matcher` is not thread-safe: one thread (the
engine's) owns it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  import jax

LLGUIDANCE_REQUIREMENT = "llguidance==1.9.1"
CACHE_SIZE = 64


class GrammarError(ValueError):
  """A bad or unsupported ``response_format``, or a token the grammar does not allow."""


@dataclasses.dataclass(frozen=True)
class GrammarOptions:
  """llguidance JSON-compiler defaults (a schema's ``"x-guidance"`` overrides them)."""

  whitespace_flexible: bool = False
  item_separator: str = ", "
  key_separator: str = ": "

  def as_json_options(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def bitmask_width(vocab_size: int) -> int:
  """Words in one row of the token bitmask: ``ceil(vocab_size / 32)``."""
  return (vocab_size + 31) // 32


def _llg():
  try:
    import llguidance
  except ImportError as e:  # a server set-up problem, not a bad request
    raise ImportError(f"structured output needs `pip install {LLGUIDANCE_REQUIREMENT}`") from e
  return llguidance


# -- response_format -------------------------------------------------------------------------
def parse_response_format(response_format: Any) -> dict[str, Any] | None:
  """The JSON schema a ``response_format`` asks for (None for ``text``); checks its shape."""
  if not isinstance(response_format, Mapping):
    raise GrammarError("response_format must be an object with a 'type'")
  kind = response_format.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return {"type": "object"}
  if kind != "json_schema":
    raise GrammarError(
      f"response_format.type {kind!r} is not supported (use 'text', 'json_object' or 'json_schema')"
    )
  spec = response_format.get("json_schema")
  if not isinstance(spec, Mapping):
    raise GrammarError("response_format.json_schema must be an object with a 'schema'")
  name = spec.get("name")
  if name is not None and not isinstance(name, str):
    raise GrammarError("response_format.json_schema.name must be a string")
  strict = spec.get("strict")
  if strict is not None and not isinstance(strict, bool):
    raise GrammarError("response_format.json_schema.strict must be a boolean")
  schema = spec.get("schema")
  if not isinstance(schema, Mapping):
    raise GrammarError("response_format.json_schema.schema must be a JSON Schema object")
  return dict(schema)


# -- compilation and caches -------------------------------------------------------------------
_LOCK = threading.Lock()
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILED: collections.OrderedDict = collections.OrderedDict()  # key -> (weakref(tok), grammar)


def _ll_tokenizer(tokenizer):
  """llguidance's tokenizer for ``tokenizer`` (~0.4 s for 49k tokens, so built once)."""
  with _LOCK:
    found = _LL_TOKENIZERS.get(tokenizer)
  if found is not None:
    return found
  eos = tokenizer.eos_token_id
  if eos is None:
    raise GrammarError("response_format needs a tokenizer with an EOS token; this one has none")
  text = tokenizer.tok.to_str()
  if tokenizer.tok.padding or tokenizer.tok.truncation:  # llguidance's tokenizer must do neither
    spec = json.loads(text)
    spec["padding"] = spec["truncation"] = None
    text = json.dumps(spec)
  built = _llg().LLTokenizer(text, eos_token=eos)
  with _LOCK:
    return _LL_TOKENIZERS.setdefault(tokenizer, built)


def warm_up(tokenizer) -> None:
  """Builds llguidance's view of ``tokenizer`` now (server start) instead of on first use."""
  _ll_tokenizer(tokenizer)


def compile_grammar(
  tokenizer, response_format: Mapping[str, Any], options: GrammarOptions = GrammarOptions()
) -> CompiledGrammar | None:
  """The grammar of ``response_format`` for ``tokenizer`` (None for ``{"type": "text"}``).

  Raises `GrammarError` (its message names the problem) for a malformed ``response_format`` or
  a schema llguidance cannot compile. Results are LRU-cached by tokenizer identity and the
  canonical JSON of ``response_format``.
  """
  schema = parse_response_format(response_format)
  if schema is None:
    return None
  try:
    canonical = json.dumps(
      [response_format, dataclasses.asdict(options)], sort_keys=True, separators=(",", ":")
    )
  except (TypeError, ValueError) as e:
    raise GrammarError(f"response_format is not valid JSON: {e}") from e
  key = (id(tokenizer), canonical)
  with _LOCK:
    hit = _COMPILED.get(key)
    if hit is not None and hit[0]() is tokenizer:
      _COMPILED.move_to_end(key)
      return hit[1]
  grammar = _compile(tokenizer, schema, options)
  with _LOCK:
    _COMPILED[key] = (weakref.ref(tokenizer), grammar)
    _COMPILED.move_to_end(key)
    while len(_COMPILED) > CACHE_SIZE:
      _COMPILED.popitem(last=False)
  return grammar


def _compile(tokenizer, schema: dict[str, Any], options: GrammarOptions) -> CompiledGrammar:
  llg = _llg()
  ll_tok = _ll_tokenizer(tokenizer)
  try:
    text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=options.as_json_options())
  except (TypeError, ValueError) as e:
    raise GrammarError(f"response_format schema: {e}") from e
  # Building the matcher compiles the schema (GIL released); errors leave it in an error state.
  template = llg.LLMatcher(
    ll_tok, text, log_level=0, limits=llg.LLParserLimits(verbose_errors=False)
  )
  if template.is_error():
    raise GrammarError(f"response_format schema is not supported: {template.get_error()}")
  return CompiledGrammar(
    schema=schema,
    eos_token_id=int(ll_tok.eos_token),
    tokenizer_vocab_size=int(ll_tok.vocab_size),
    _template=template,
  )


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
  """A compiled ``response_format``: `matcher()` hands out per-sequence state."""

  schema: dict[str, Any]
  eos_token_id: int
  tokenizer_vocab_size: int  # tokens at or past this are never allowed
  _template: Any = dataclasses.field(repr=False)  # llguidance.LLMatcher, never advanced

  def matcher(self) -> Matcher:
    return Matcher(self, self._template.deep_copy())


class Matcher:
  """One sequence's position in a grammar (llguidance ``LLMatcher``); not thread-safe."""

  __slots__ = ("grammar", "_m", "_words")

  def __init__(self, grammar: CompiledGrammar, ll_matcher):
    self.grammar = grammar
    self._m = ll_matcher
    self._words = bitmask_width(grammar.tokenizer_vocab_size)

  def fill_bitmask(self, words: np.ndarray) -> None:
    """Writes the allowed next tokens into ``words`` (int32 ``[ceil(V / 32)]``, V >= vocab)."""
    if (
      words.dtype != np.int32
      or words.ndim != 1
      or not words.flags["C_CONTIGUOUS"]
      or not words.flags["WRITEABLE"]
    ):
      raise ValueError("fill_bitmask needs a writeable, contiguous 1-D int32 array")
    if words.shape[0] < self._words:
      raise ValueError(f"bitmask row has {words.shape[0]} words; the tokenizer needs {self._words}")
    self._m.unsafe_compute_mask_ptr(words.ctypes.data, self._words * 4)
    words[self._words :] = 0

  def accept(self, token_id: int) -> None:
    """Advances past ``token_id``; a token the grammar does not allow raises `GrammarError`
    and leaves the state unchanged."""
    token_id = int(token_id)
    if not 0 <= token_id < self.grammar.tokenizer_vocab_size:
      raise GrammarError(f"token {token_id} is outside the tokenizer's vocabulary")
    # validate_tokens refuses EOS once the matcher has stopped, though the mask allows it then.
    allowed = (
      self._m.is_accepting()
      if token_id == self.grammar.eos_token_id
      else self._m.validate_tokens([token_id]) == 1
    )
    if not allowed:
      raise GrammarError(f"token {token_id} is not allowed by the response_format grammar here")
    if not self._m.consume_token(token_id):
      raise GrammarError(f"token {token_id} was rejected: {self._m.get_error()}")

  def is_finished(self) -> bool:
    """True when nothing but EOS can follow (the value is complete, or the matcher failed)."""
    return bool(self._m.is_stopped())

  def can_end(self) -> bool:
    """True when EOS is allowed now (the text so far is a complete value)."""
    return bool(self._m.is_accepting())

  @property
  def error(self) -> str | None:
    """llguidance's error, if the matcher failed (its mask is then EOS alone)."""
    return self._m.get_error() or None

  def rollback(self, n: int) -> None:
    """Undoes the last ``n`` accepted tokens (speculative decoding, stop strings)."""
    if n and not self._m.rollback(int(n)):
      raise GrammarError(f"cannot roll back {n} tokens: {self._m.get_error()}")


_EXECUTOR = None


def fill_bitmask_batch(matchers: Sequence[Matcher | None], words_RxW: np.ndarray) -> None:
  """Fills row r of ``words_RxW`` for ``matchers[r]`` in parallel; a None row allows all.

  Matchers must be distinct objects. The work runs on llguidance's thread pool with the GIL
  released.
  """
  global _EXECUTOR
  if words_RxW.dtype != np.int32 or words_RxW.ndim != 2 or len(matchers) != words_RxW.shape[0]:
    raise ValueError("fill_bitmask_batch needs int32 [len(matchers), W] words")
  rows = [(r, m) for r, m in enumerate(matchers) if m is not None]
  words_RxW[[r for r, m in enumerate(matchers) if m is None]] = -1
  if not rows:
    return
  width = rows[0][1]._words
  if any(m._words != width for _, m in rows) or words_RxW.shape[1] < width:
    raise ValueError("fill_bitmask_batch: matchers of one tokenizer, rows wide enough for it")
  with _LOCK:
    if _EXECUTOR is None:
      _EXECUTOR = _llg().LLExecutor()
  scratch = np.zeros((len(rows), width), np.int32)
  pairs = [(m._m, i) for i, (_, m) in enumerate(rows)]
  _EXECUTOR.unsafe_compute_mask_ptr(pairs, scratch.ctypes.data, width * 4, len(rows))
  index = [r for r, _ in rows]
  words_RxW[index, :width] = scratch
  words_RxW[index, width:] = 0


# -- applying a mask ---------------------------------------------------------------------------
def apply_bitmask_reference(logits_RxV: np.ndarray, words_RxW: np.ndarray) -> np.ndarray:
  """numpy: logits with every token the bitmask does not allow set to -inf."""
  v = logits_RxV.shape[-1]
  bytes_ = np.ascontiguousarray(words_RxW, dtype="<i4").view(np.uint8)
  allowed = np.unpackbits(bytes_, axis=-1, bitorder="little")[:, :v].astype(bool)
  return np.where(allowed, logits_RxV, -np.inf).astype(logits_RxV.dtype)


def apply_bitmask(logits_RxV: jax.Array, words_RxW: jax.Array) -> jax.Array:
  """jnp (jit-friendly) `apply_bitmask_reference`: bits expanded with shifts."""
  import jax.numpy as jnp  # here: the scheduler uses this module without JAX

  rows, v = logits_RxV.shape
  if words_RxW.shape != (rows, bitmask_width(v)):
    raise ValueError(f"bitmask {words_RxW.shape} does not fit logits {logits_RxV.shape}")
  shifts = jnp.arange(32, dtype=jnp.int32)
  bits = jnp.right_shift(words_RxW.astype(jnp.int32)[:, :, None], shifts) & 1
  allowed = bits.reshape(rows, -1)[:, :v] != 0
  return jnp.where(allowed, logits_RxV, jnp.asarray(-jnp.inf, logits_RxV.dtype))
