"""OpenAI wire format: request validation (400s that name the field) and response objects.

Only what the server needs: `/v1/completions` and `/v1/chat/completions` request bodies,
error objects, and the JSON / server-sent-event payloads that go back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import secrets
import time
import uuid
from collections.abc import Mapping

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
  """An error that becomes an OpenAI error object: ``{"error": {message, type, param, code}}``."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, type: str | None = None, headers: Mapping | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.type = type or ("invalid_request_error" if status < 500 else "server_error")
    self.headers = dict(headers or {})

  def body(self) -> dict:
    return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
  return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
  return ApiError(400, f"{param}: {message}", param=param, code=code)


class HugeInt(float):
  """A JSON integer literal too long to convert (``int()`` refuses more than 4300 digits, and
  no field takes more than 20): kept as an infinite float that remembers its length, so that
  the reader of its field names the field and the length instead of a 500."""

  digits: int

  def __new__(cls, literal: str):
    x = super().__new__(cls, "-inf" if literal.startswith("-") else "inf")
    x.digits = len(literal.lstrip("-"))
    return x


MAX_INT_DIGITS = 40  # longer integer literals become a `HugeInt` (every field refuses them)


def _parse_int(literal: str) -> int | HugeInt:
  return int(literal) if len(literal) <= MAX_INT_DIGITS else HugeInt(literal)


# request-body codings we decode (the server runs aiohttp with auto_decompress off and decodes
# here, so a bad body is a JSON 400 and the decoded size is bounded too); others are a 415
CONTENT_ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")


def decode_body(raw: bytes, header: str | None, limit: int) -> bytes:
  """``raw`` decoded per a ``Content-Encoding`` header (codings applied in order, so undone
  in reverse). A 415 naming the header for a coding not in `CONTENT_ENCODINGS`, a 400 for
  data that does not decode, a 413 when the decoded body passes ``limit`` bytes."""
  import zlib

  codings = [c.strip().lower() for c in (header or "").split(",") if c.strip()]
  for c in codings:
    if c not in CONTENT_ENCODINGS:
      raise ApiError(415, f"Content-Encoding: {c[:40]!r} is not supported (send the body as is, "
                          f"or with one of {', '.join(CONTENT_ENCODINGS)})",
                     param="Content-Encoding", code="unsupported_content_encoding")
  for c in reversed(codings):
    if c == "identity":
      continue
    # gzip: a gzip header; deflate: zlib-wrapped (RFC 9110), or raw deflate as some clients send
    windows = (16 + zlib.MAX_WBITS,) if c in ("gzip", "x-gzip") else (zlib.MAX_WBITS,
                                                                       -zlib.MAX_WBITS)
    for i, wbits in enumerate(windows):
      d = zlib.decompressobj(wbits)
      try:
        out = d.decompress(raw, limit + 1)
        if len(out) <= limit:
          out += d.flush()
        if not d.eof and len(out) <= limit:
          raise zlib.error("the data is truncated")
        break
      except zlib.error as e:
        if i + 1 == len(windows):
          raise ApiError(400, f"Content-Encoding: the body is not valid {c} data ({e})",
                         param="Content-Encoding", code="invalid_content_encoding") from None
    if len(out) > limit:
      raise ApiError(413, f"the request body is larger than the limit ({limit} bytes) once "
                          f"decoded ({c})", code="request_too_large")
    raw = out
  return raw


async def read_json(request, limit: int, timeout: float | None = None) -> dict:
  """The request's JSON object body, decoded per its Content-Encoding (`decode_body`); a body
  still arriving after ``timeout`` seconds is a 408."""
  try:
    async with asyncio.timeout(timeout):
      raw = await request.read()
  except TimeoutError:
    raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                   code="request_timeout") from None
  return parse_json(decode_body(raw, request.headers.get("Content-Encoding"), limit))


def parse_json(raw: bytes) -> dict:
  try:
    body = json.loads(raw, parse_int=_parse_int)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
  return body


# -- field readers ------------------------------------------------------------------------------
def _num(body: Mapping, key: str, default: float, lo: float, hi: float, *, lo_open=False) -> float:
  x = body.get(key)
  if x is None:
    return default
  _refuse_huge(key, x, lo, hi)
  if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
    raise invalid(key, f"must be a number, got {json.dumps(x)[:40]}")
  if x < lo or x > hi or (lo_open and x == lo):
    raise invalid(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {x}")
  return float(x)


def _refuse_huge(key: str, x, lo, hi) -> None:
  if isinstance(x, HugeInt):
    bounds = "in range" if lo is None and hi is None else (
      f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
    raise invalid(key, f"must be {bounds}, got an integer of {x.digits} digits")


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int(body: Mapping, key: str, lo: int | None = None, hi: int | None = INT32_MAX) -> int | None:
  x = body.get(key)
  if x is None:
    return None
  _refuse_huge(key, x, lo, hi)
  if isinstance(x, bool) or not isinstance(x, int):
    if isinstance(x, float) and x.is_integer():
      x = int(x)
    else:
      raise invalid(key, f"must be an integer, got {json.dumps(x)[:40]}")
  if (lo is not None and x < lo) or (hi is not None and x > hi):
    bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
    raise invalid(key, f"must be {bounds}, got {x}")
  return x


def _bool(body: Mapping, key: str, default: bool = False) -> bool:
  x = body.get(key)
  if x is None:
    return default
  if not isinstance(x, bool):
    raise invalid(key, f"must be a boolean, got {json.dumps(x)[:40]}")
  return x


def check_text(s: str, param: str) -> str:
  """``s`` unchanged, or a 400 naming ``param`` if it holds a lone UTF-16 surrogate (JSON
  allows ``"\\ud800"``; no tokenizer can encode it)."""
  try:
    s.encode("utf-8")
  except UnicodeEncodeError as e:
    raise invalid(param, f"is not valid Unicode: a lone surrogate {s[e.start]!a} at character "
                         f"{e.start}") from None
  return s


def model_of(body: Mapping) -> str:
  m = body.get("model")
  if m is None:
    raise invalid("model", "is required")
  if not isinstance(m, str) or not m:
    raise invalid("model", "must be a non-empty string")
  return check_text(m, "model")


@dataclasses.dataclass(frozen=True)
class Options:
  """Validated sampling / output options of one request."""

  max_tokens: int | None
  temperature: float
  top_p: float
  top_k: int
  seed: int
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  ignore_eos: bool = False  # vLLM's extension: generate through the end-of-sequence token


# OpenAI (and vLLM) request fields this server does not implement: a request that sets one to
# anything but its neutral value gets a 400 naming it, never a silently different answer.
# Fields not listed here and not read below (``user``, ``metadata``, ``store``, ...) are ignored.
def _neutral_none(x) -> bool:
  return x is None


def _neutral_empty(x) -> bool:
  return x is None or x == [] or x == {}


def _neutral_false(x) -> bool:
  return x is None or x is False


UNSUPPORTED: dict[str, tuple] = {  # field -> (is_neutral(value), what it would do)
  "suffix": (lambda x: x in (None, ""), "suffix (insertion) is not supported"),
  "audio": (_neutral_none, "audio output is not supported"),
  "modalities": (lambda x: x in (None, ["text"]), 'only the "text" modality is supported'),
  "prediction": (_neutral_none, "predicted outputs are not supported"),
  "web_search_options": (_neutral_none, "web search is not supported"),
  # vLLM sampling extensions
  "min_p": (lambda x: x in (None, 0), "min_p sampling is not supported"),
  "use_beam_search": (_neutral_false, "beam search is not supported"),
  "include_stop_str_in_output": (_neutral_false, "include_stop_str_in_output is not supported"),
  "guided_json": (_neutral_none, "guided decoding is not supported"),
  "guided_regex": (_neutral_none, "guided decoding is not supported"),
  "guided_choice": (_neutral_none, "guided decoding is not supported"),
  "guided_grammar": (_neutral_none, "guided decoding is not supported"),
  "structured_outputs": (_neutral_none, "guided decoding is not supported"),
}


def refuse_unsupported(body: Mapping, *, chat: bool) -> None:
  """400 for the first field of `UNSUPPORTED` (and best_of) that asks for something this server
  does not do. (n, logprobs, echo, penalties, logit_bias, ... are read by
  `serving.openai_params.controls_of`.)"""
  if _int(body, "best_of", 1) not in (None, 1):
    raise invalid("best_of", "only best_of=1 is supported (n choices are)",
                  code="unsupported_parameter")
  for key, (neutral, what) in UNSUPPORTED.items():
    x = body.get(key)
    try:
      ok = neutral(x)
    except Exception:  # noqa: BLE001  an unhashable / odd value is not neutral
      ok = False
    if not ok:
      raise invalid(key, what, code="unsupported_parameter")


def options_of(body: Mapping, *, chat: bool) -> Options:
  """The sampling / output options; ``max_completion_tokens`` (OpenAI's newer name) wins over
  ``max_tokens``; 0 is allowed only with ``echo`` (a scoring request)."""
  refuse_unsupported(body, chat=chat)
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = _int(body, key, 0)
  if max_tokens == 0 and (chat or body.get("echo") is not True):
    raise invalid(key, "must be >= 1 (0 only with echo: true, to score the prompt)")
  stop = body.get("stop")
  if stop is None:
    stops: tuple[str, ...] = ()
  elif isinstance(stop, str):
    stops = (check_text(stop, "stop"),) if stop else ()
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    if len(stop) > 4:
      raise invalid("stop", "at most 4 stop sequences")
    stops = tuple(check_text(s, "stop") for s in stop if s)
  else:
    raise invalid("stop", "must be a string or a list of strings")
  seed = _int(body, "seed", INT64_MIN, INT64_MAX)
  so = body.get("stream_options")
  if so is not None and not isinstance(so, dict):
    raise invalid("stream_options", "must be an object")
  include_usage = _bool(so or {}, "include_usage") if so else False
  top_k = _int(body, "top_k", -1)  # vLLM: -1 (or 0) disables top-k
  return Options(
    max_tokens=max_tokens,
    temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
    top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
    top_k=max(top_k or 0, 0),
    seed=(secrets.randbits(31) if seed is None else seed & 0x7FFFFFFF),
    stop=stops,
    stream=_bool(body, "stream"),
    include_usage=include_usage,
    ignore_eos=_bool(body, "ignore_eos"),
  )


MAX_PROMPTS = 64


def prompts_of(body: Mapping, tokenizer, vocab_size: int,
               base_vocab: int | None = None) -> list[list[int]]:
  """`/v1/completions` ``prompt``: a string, a list of token ids, or a list of either (one
  choice per prompt, in order). Token ids must be below ``vocab_size`` (the serving variant's:
  the base's plus the tokens it added; ``base_vocab`` names the base's in the error)."""
  p = body.get("prompt")
  if p is None:
    raise invalid("prompt", "is required")
  if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
    if len(p) > MAX_PROMPTS:
      raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
    return [_one_prompt(x, tokenizer, vocab_size, base_vocab) for x in p]
  return [_one_prompt(p, tokenizer, vocab_size, base_vocab)]


def prompt_of(body: Mapping, tokenizer, vocab_size: int, base_vocab: int | None = None) -> list[int]:
  """A `prompts_of` that holds exactly one prompt."""
  ps = prompts_of(body, tokenizer, vocab_size, base_vocab)
  if len(ps) != 1:
    raise invalid("prompt", "must be a single prompt here")
  return ps[0]


def _one_prompt(p, tokenizer, vocab_size: int, base_vocab: int | None) -> list[int]:
  if isinstance(p, list) and any(isinstance(t, HugeInt) for t in p):
    t = next(t for t in p if isinstance(t, HugeInt))
    raise invalid("prompt", f"a token id of {t.digits} digits is outside this model's "
                            f"vocabulary [0, {vocab_size})")
  if isinstance(p, str):
    ids = tokenizer.encode(check_text(p, "prompt"), add_special_tokens=True)
  elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
    bad = [t for t in p if not 0 <= t < vocab_size]
    if bad:
      why = ""
      if base_vocab is not None and bad[0] >= base_vocab and bad[0] >= 0:
        why = (f" (ids from {base_vocab} on are tokens a variant added; this model "
               f"{'adds none' if vocab_size == base_vocab else f'adds {vocab_size - base_vocab}'})")
      raise invalid("prompt", f"token id {bad[0]} is outside this model's vocabulary "
                              f"[0, {vocab_size}){why}")
    ids = list(p)
  else:
    raise invalid("prompt", "must be a string, a list of token ids, or a list of either")
  if not ids and tokenizer.bos_token_id is not None:
    ids = [tokenizer.bos_token_id]
  if not ids:
    raise invalid("prompt", "must not be empty")
  return ids


def messages_of(body: Mapping) -> list[dict]:
  msgs = body.get("messages")
  if msgs is None:
    raise invalid("messages", "is required")
  if not isinstance(msgs, list) or not msgs:
    raise invalid("messages", "must be a non-empty list")
  out = []
  for i, m in enumerate(msgs):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise invalid(where, "must be an object")
    role = m.get("role")
    if role not in CHAT_ROLES:
      raise invalid(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}")
    content = m.get("content")
    if content is None:
      content = ""
    if isinstance(content, list):  # content parts: only text
      parts = []
      for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
            part.get("text"), str):
          raise invalid(f"{where}.content[{j}]", "only text parts are supported")
        parts.append(part["text"])
      content = "".join(parts)
    if not isinstance(content, str):
      raise invalid(f"{where}.content", "must be a string or a list of text parts")
    check_text(content, f"{where}.content")
    msg = {"role": "system" if role == "developer" else role, "content": content}
    for key in ("tool_calls", "tool_call_id", "name"):  # tool use, for templates that show it
      if m.get(key) is not None:
        msg[key] = m[key]
    out.append(msg)
  return out


# -- responses --------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
  return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, choices: list[dict], use: dict | None, *, chat: bool,
               created: int) -> dict:
  """A whole response; ``choices`` as `serving.choices.Choices.final` gives them."""
  out = {"id": rid, "object": "chat.completion" if chat else "text_completion",
         "created": created, "model": model, "choices": choices}
  if use is not None:
    out["usage"] = use
  return out


def chunk(rid: str, model: str, *, chat: bool, created: int, choices: list[dict] | None = None,
          use: dict | None = None) -> dict:
  """One SSE payload; no ``choices`` gives the usage-only chunk."""
  out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
         "created": created, "model": model, "choices": choices or []}
  if use is not None:
    out["usage"] = use
  return out


def role_choice(index: int) -> dict:
  """A chat stream's first choice object: the assistant role, no text yet."""
  return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None}


def _finite(obj):
  """``obj`` with every float that is not finite replaced by None (lists, tuples, dicts)."""
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {k: _finite(v) for k, v in obj.items()}
  if isinstance(obj, list | tuple):
    return [_finite(v) for v in obj]
  return obj


def dumps(obj, **kw) -> str:
  """``json.dumps`` that never writes NaN or Infinity (not JSON: strict clients fail on them):
  a non-finite float becomes null. The common case is one encoder pass; only a body that holds
  such a float is walked and mapped."""
  try:
    return json.dumps(obj, allow_nan=False, **kw)
  except ValueError:  # "Out of range float values are not JSON compliant"
    return json.dumps(_finite(obj), allow_nan=False, **kw)


def sse(obj: dict | str) -> bytes:
  data = obj if isinstance(obj, str) else dumps(obj, separators=(",", ":"))
  return f"data: {data}\n\n".encode()


def now() -> int:
  return int(time.time())
