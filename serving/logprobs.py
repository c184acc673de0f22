"""Log probabilities in OpenAI's two wire formats.

An *entry* is one token's numbers as the engine reports them:
``(token_id, logprob | None, [(alt_id, alt_logprob), ...] | None)`` (None: the first prompt token
of an echo, which has no context to be scored in).

* completions (``logprobs: k``): one object per choice (or per streamed chunk)
  ``{"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
  "text_offset": [int]}``; ``text_offset`` counts characters of the choice's text (the echoed
  prompt included) before each token.
* chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's string is the text it adds to what came before (decoded in a short window of context,
so that the strings of a sequence join to its text, whatever the tokenizer does with spaces);
an alternative's string is that token decoded alone. Two alternatives that decode to the same
string share one key of the completions dict (a limit of the format). vLLM's
``return_tokens_as_token_ids`` names every token ``"token_id:<id>"`` instead (exact, and what a
client needs to re-score a sampled output); ``text_offset`` still counts characters.

A log probability that is not a finite number (logits that overflowed: NaN, or -inf for a token
the logits rule out entirely) is ``null``: JSON has no NaN or Infinity, and strict parsers (JS,
Go, openai-node) refuse the bare words Python's json module would write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_WINDOW = 8  # tokens of context decoded with each token


def token_strings(tokenizer, ids: Sequence[int], context: Sequence[int] = ()) -> list[str]:
  """The text each of ``ids`` adds after ``context`` + the ids before it."""
  seq = list(context) + list(ids)
  out = []
  for i in range(len(context), len(seq)):
    lo = max(0, i - _WINDOW)
    before = tokenizer.decode(seq[lo:i])
    upto = tokenizer.decode(seq[lo : i + 1])
    out.append(upto[len(before):] if upto.startswith(before) else tokenizer.decode([seq[i]]))
  return out


def finite_or_none(lp: float | None) -> float | None:
  """``lp``, or None when it is None or not a finite number (see the module docstring)."""
  return lp if lp is not None and math.isfinite(lp) else None


def _alt(tokenizer, alts, as_ids: bool) -> list[tuple[str, float | None]]:
  return [(f"token_id:{t}" if as_ids else tokenizer.decode([t]), finite_or_none(lp))
          for t, lp in alts]


def completion_logprobs(tokenizer, entries, *, context: Sequence[int] = (), offset: int = 0,
                        as_ids: bool = False):
  """The completions-format object of ``entries`` and the text offset after them."""
  ids = [e[0] for e in entries]
  strings = token_strings(tokenizer, ids, context)
  offsets = []
  for s in strings:
    offsets.append(offset)
    offset += len(s)
  tops = []
  for _, _, alts in entries:
    if alts is None:
      tops.append(None)
    else:
      d: dict[str, float | None] = {}
      for s, lp in _alt(tokenizer, alts, as_ids):
        d.setdefault(s, lp)
      tops.append(d)
  names = [f"token_id:{t}" for t in ids] if as_ids else strings
  obj = {"tokens": names, "token_logprobs": [finite_or_none(e[1]) for e in entries],
         "top_logprobs": tops,
         "text_offset": offsets}
  return obj, offset


def chat_logprobs(tokenizer, entries, *, context: Sequence[int] = (),
                  as_ids: bool = False) -> list[dict]:
  """The chat-format ``content`` list of ``entries``."""
  strings = token_strings(tokenizer, [e[0] for e in entries], context)
  out = []
  for s, (t, lp, alts) in zip(strings, entries):
    out.append({"token": f"token_id:{t}" if as_ids else s, "logprob": finite_or_none(lp),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode("utf-8"))}
                                 for a, alp in _alt(tokenizer, alts or [], as_ids)]})
  return out
