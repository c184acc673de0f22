"""The scoring and sampling-control fields of a request (issue 13), validated into `Controls`.

    c = controls_of(body, chat=False, vocab_size=V)    # a 400 naming the field when invalid

OpenAI's fields: ``n`` (1-16), ``logprobs`` (completions: 0-20 alternatives; chat: a boolean,
with ``top_logprobs`` 0-20), ``echo`` (completions), ``presence_penalty`` and
``frequency_penalty`` (-2..2), ``logit_bias`` ({token id: -100..100}, at most 300 entries),
``response_format``; vLLM's: ``repetition_penalty`` (> 0, at most 2 here), ``min_tokens``,
``stop_token_ids``, ``return_tokens_as_token_ids``. ``max_completion_tokens`` and ``ignore_eos`` are read with the other options
in `serving.protocol.options_of`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from serving.protocol import HugeInt, _bool, _int, _num, invalid

MAX_N = 16
# one request's work, bounded before anything is queued (a 400 naming the field beyond):
# n x prompts choices, and log-probability entries (1 + alternatives per scored position:
# each generated token of every choice, and with echo each prompt token)
MAX_CHOICES = 256
MAX_LOGPROB_ENTRIES = 1 << 20
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 16


@dataclasses.dataclass(frozen=True)
class Controls:
  n: int = 1
  logprobs: int | None = None  # alternatives per generated token; None: no log probabilities
  echo: bool = False
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()
  min_tokens: int = 0
  stop_token_ids: tuple[int, ...] = ()
  response_format: Mapping | None = None  # None or {"type": "text"}: unconstrained
  token_ids: bool = False  # vLLM's return_tokens_as_token_ids: tokens named "token_id:<id>"


def _logprobs(body: Mapping, chat: bool) -> int | None:
  if chat:
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
      raise invalid("logprobs", f"must be a boolean, got {json.dumps(lp)[:40]}")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not lp:
      raise invalid("top_logprobs", "needs logprobs: true")
    return (top or 0) if lp else None
  if isinstance(body.get("logprobs"), bool):
    raise invalid("logprobs", "must be an integer in [0, 20] for /v1/completions")
  return _int(body, "logprobs", 0, 20)


def _logit_bias(body: Mapping, vocab_size: int) -> tuple[tuple[int, float], ...]:
  lb = body.get("logit_bias")
  if lb is None:
    return ()
  if not isinstance(lb, dict):
    raise invalid("logit_bias", "must be an object mapping token ids to numbers")
  if len(lb) > MAX_LOGIT_BIAS:
    raise invalid("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(lb)}")
  out = []
  for k, v in lb.items():
    try:
      t = int(k)
    except (TypeError, ValueError):
      raise invalid("logit_bias", f"keys must be token ids, got {str(k)[:40]!r}") from None
    if not 0 <= t < vocab_size:
      raise invalid("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab_size})")
    bias = _num({"logit_bias": v}, "logit_bias", 0.0, -100.0, 100.0)
    out.append((t, bias))
  return tuple(out)


def _stop_token_ids(body: Mapping, vocab_size: int) -> tuple[int, ...]:
  ids = body.get("stop_token_ids")
  if ids is None:
    return ()
  huge = [t for t in ids if isinstance(t, HugeInt)] if isinstance(ids, list) else []
  if huge:
    raise invalid("stop_token_ids", f"a token id of {huge[0].digits} digits is outside the "
                                    f"vocabulary [0, {vocab_size})")
  if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in ids):
    raise invalid("stop_token_ids", "must be a list of token ids")
  if len(ids) > MAX_STOP_TOKEN_IDS:
    raise invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise invalid("stop_token_ids", f"token id {bad[0]} is outside the vocabulary "
                                    f"[0, {vocab_size})")
  return tuple(dict.fromkeys(ids))


def controls_of(body: Mapping, *, chat: bool, vocab_size: int,
                max_tokens: int | None = None) -> Controls:
  """The validated issue-13 fields of ``body``; ``max_tokens`` (if given) bounds
  ``min_tokens``."""
  n = _int(body, "n", 1, MAX_N) or 1
  echo = body.get("echo")
  if echo is not None and not isinstance(echo, bool):
    raise invalid("echo", "must be a boolean")
  if chat and echo:
    raise invalid("echo", "is a /v1/completions parameter (send false or leave it out)",
                  code="unsupported_parameter")
  echo = bool(echo)
  min_tokens = _int(body, "min_tokens", 0) or 0
  if max_tokens is not None and min_tokens > max_tokens:
    raise invalid("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
  rf = body.get("response_format")
  if rf is not None and not isinstance(rf, dict):
    raise invalid("response_format", "must be an object with a 'type'")
  if rf == {"type": "text"}:
    rf = None
  return Controls(
    n=n,
    logprobs=_logprobs(body, chat),
    echo=echo,
    presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
    frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
    repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
    logit_bias=_logit_bias(body, vocab_size),
    min_tokens=min_tokens,
    stop_token_ids=_stop_token_ids(body, vocab_size),
    response_format=rf,
    token_ids=_bool(body, "return_tokens_as_token_ids"),
  )


def check_budget(ctl: Controls, prompt_lens: list[int], max_new_tokens: list[int]) -> None:
  """A 400 naming ``n`` when ``n x prompts`` exceeds `MAX_CHOICES`, or ``logprobs`` when the
  request asks for more than `MAX_LOGPROB_ENTRIES` log-probability entries."""
  choices = ctl.n * len(prompt_lens)
  if choices > MAX_CHOICES:
    raise invalid("n", f"n x prompts is {ctl.n} x {len(prompt_lens)} = {choices} choices; at "
                       f"most {MAX_CHOICES} per request", code="request_too_large")
  if ctl.logprobs is None:
    return
  positions = ctl.n * sum(max_new_tokens) + (sum(prompt_lens) if ctl.echo else 0)
  entries = positions * (ctl.logprobs + 1)
  if entries > MAX_LOGPROB_ENTRIES:
    raise invalid("logprobs", f"{positions} scored positions x {ctl.logprobs + 1} entries = "
                              f"{entries} log-probability entries; at most "
                              f"{MAX_LOGPROB_ENTRIES} per request (lower n, max_tokens or "
                              "logprobs, or send fewer prompts)", code="request_too_large")
