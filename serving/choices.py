"""The choices of one request (several prompts x ``n``) as they come back from the engine.

    cs = Choices(tokenizer, prompts, n, chat=False, echo=True, logprobs=1)
    piece = cs.update(index, event)       # streaming: the choice object of one chunk (or None)
    body_choices = cs.final()             # non-streaming: every choice object, index order

Choice ``index = prompt_index * n + j`` (OpenAI's order). Each engine `bitdelta_jax.engine.engine.Event`
carries the text it adds, the log-probability entries of the tokens behind it
(`serving.logprobs`), and on a choice's first event the prompt's entries (``echo``). With
``echo`` a completions choice's text starts with the prompt's text, and its logprobs with the
prompt's tokens (the first one None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from serving.logprobs import chat_logprobs, completion_logprobs


@dataclasses.dataclass
class _Choice:
  index: int
  prompt: list[int]
  parts: list[str] = dataclasses.field(default_factory=list)
  entries: list = dataclasses.field(default_factory=list)  # echo: the prompt's first
  finish: str | None = None
  completion_tokens: int = 0
  started: bool = False
  done: bool = False
  offset: int = 0  # text_offset reached (streaming)
  context: list[int] = dataclasses.field(default_factory=list)  # ids before the next entry


class Choices:
  """Collects and formats the choices of one request; see the module docstring."""

  def __init__(self, tokenizer, prompts: Sequence[Sequence[int]], n: int, *, chat: bool,
               echo: bool = False, logprobs: int | None = None, as_ids: bool = False,
               tools=None):
    self.tok, self.chat, self.echo, self.logprobs = tokenizer, chat, echo, logprobs
    self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids
    self.tools = tools  # a forced tool_choice (serving.tools.ToolPlan): text becomes tool_calls
    self.choices = [_Choice(i * n + j, list(p)) for i, p in enumerate(prompts) for j in range(n)]
    for c in self.choices:
      c.context = [] if echo else list(c.prompt)

  def __len__(self) -> int:
    return len(self.choices)

  @property
  def done(self) -> bool:
    return all(c.done for c in self.choices)

  @property
  def completion_tokens(self) -> int:
    return sum(c.completion_tokens for c in self.choices)

  def _echo_text(self, c: _Choice) -> str:
    return self.tok.decode(c.prompt) if self.echo and not self.chat else ""

  def update(self, index: int, ev) -> dict | None:
    """Takes one event of choice ``index``; returns the choice object of a streamed chunk for
    its new text and log probabilities (None when it adds neither)."""
    c = self.choices[index]
    text = ev.text or ""
    new_entries = list(ev.logprobs or [])
    if not c.started:
      c.started = True
      text = self._echo_text(c) + text
      if self.echo and not self.chat and self.logprobs is not None:
        new_entries = list(ev.prompt_logprobs or []) + new_entries
    c.parts.append(text)
    c.entries.extend(new_entries)
    if ev.kind == "done":
      c.done, c.finish, c.completion_tokens = True, ev.finish_reason, ev.completion_tokens
    if (not text and not new_entries) or self.tools is not None:  # calls go out at the end
      return None
    return self._piece(c, text, new_entries)

  def _logprobs_obj(self, c: _Choice, entries, *, offset: int):
    if self.logprobs is None:
      return None, offset
    if self.chat:
      return {"content": chat_logprobs(self.tok, entries, context=c.context,
                                       as_ids=self.as_ids)}, offset
    return completion_logprobs(self.tok, entries, context=c.context, offset=offset,
                               as_ids=self.as_ids)

  def _piece(self, c: _Choice, text: str, entries) -> dict:
    lp, c.offset = self._logprobs_obj(c, entries, offset=c.offset)
    c.context = c.context + [e[0] for e in entries]
    if self.chat:
      return {"index": c.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
    return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}

  def finish_piece(self, index: int) -> dict:
    """The last streamed choice object of a finished choice (its finish_reason)."""
    c = self.choices[index]
    if self.tools is not None:
      calls, finish = self._calls(c)
      delta = {"tool_calls": [dict(call, index=k) for k, call in enumerate(calls)]} if calls \
        else {"content": "".join(c.parts)}
      lp, _ = self._logprobs_obj(c, c.entries, offset=0)
      return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    if self.chat:
      return {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish}
    return {"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish}

  def _calls(self, c: _Choice) -> tuple[list | None, str | None]:
    """A finished choice's tool calls and finish_reason ("tool_calls"; an incomplete call, cut
    by max_tokens, stays text with its own finish_reason)."""
    calls = self.tools.tool_calls("".join(c.parts)) if c.finish == "stop" else None
    return calls, "tool_calls" if calls else c.finish

  def final(self) -> list[dict]:
    """Every choice object of a non-streamed response, in index order."""
    out = []
    for c in self.choices:
      text = "".join(c.parts)
      context = [] if self.echo else c.prompt
      saved, c.context = c.context, list(context)
      lp, _ = self._logprobs_obj(c, c.entries, offset=0)
      c.context = saved
      if self.tools is not None:
        calls, finish = self._calls(c)
        msg = ({"role": "assistant", "content": None, "tool_calls": calls} if calls
               else {"role": "assistant", "content": text})
        out.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": finish})
      elif self.chat:
        out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                    "logprobs": lp, "finish_reason": c.finish})
      else:
        out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish})
    return out
