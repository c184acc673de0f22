"""When a request ends, and its text as it becomes final: the one stop rule of the engine.

`check_stop` is called once per generated token, by the device-thread engine and by the offline
`Generator.generate` alike (vLLM's ``check_stop``). `TextStream` decodes incrementally: each
token decodes a window of the last few tokens (a prefix window and the new ones, the difference
being the new text), so host work per token is constant however long the output grows; the
last ``max(len(stop string)) - 1`` characters are held back until no stop string can start in
them, and a token that ends inside a UTF-8 character waits for the rest.
"""

from __future__ import annotations

from bitdelta_jax.engine.request import Request


class TextStream:
  """The text of a request's generated tokens, decoded as they arrive; stop strings found."""

  def __init__(self, tokenizer, stop_strings=()):
    self.tokenizer = tokenizer
    self.stops = tuple(s for s in stop_strings if s)
    self.hold = max((len(s) for s in self.stops), default=1) - 1
    self.ids: list[int] = []
    self.prefix_offset = 0  # ids[prefix_offset:read_offset] were decoded already: the context
    self.read_offset = 0  # ids past it are not in `text` yet
    self.text = ""  # final characters (cut before a stop string once one is found)
    self.sent = 0  # characters handed out by `take`
    self.stop_at: int | None = None  # where the first stop string starts

  @property
  def stopped(self) -> bool:
    return self.stop_at is not None

  def add(self, token: int) -> None:
    self.ids.append(token)
    if self.tokenizer is not None and self.stop_at is None:
      self._decode(final=False)

  def _decode(self, final: bool) -> None:
    if self.read_offset == len(self.ids):
      return
    decode = self.tokenizer.decode
    prefix = decode(self.ids[self.prefix_offset:self.read_offset])
    full = decode(self.ids[self.prefix_offset:])
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
      return  # nothing new yet, or a character split across tokens: wait for the rest
    new = full[len(prefix):]
    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
    start = max(0, len(self.text) - self.hold)
    self.text += new
    hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
    if hits:
      self.stop_at = min(hits)
      self.text = self.text[:self.stop_at]

  def final(self) -> str:
    """The whole text, every token decoded (cut before a stop string once one is found)."""
    self.take(final=True)
    return self.text

  def take(self, final: bool = False) -> str:
    """The characters not handed out yet that no later token can change: all of them when
    ``final`` (or a stop string was found), else all but the held-back tail."""
    if final and self.tokenizer is not None and self.stop_at is None:
      self._decode(final=True)
    end = len(self.text) if final or self.stop_at is not None else len(self.text) - self.hold
    if end <= self.sent:
      return ""
    out, self.sent = self.text[self.sent:end], end
    return out


def check_stop(r: Request, max_seq_len: int, tokenizer=None) -> str | None:
  """Why ``r`` ends now that its last token is in ``r.tokens`` ("stop" or "length"), or None.
  Stops: a scoring request (``max_new_tokens == 0``: the token drawn after the prompt is not
  kept); a stop token id (not kept); a stop string (the text is cut before it, the token that
  completed it kept); a finished grammar; ``max_new_tokens``; the context ``max_seq_len``.
  Feeds the token to ``r.text`` (created here with the request's tokenizer, else
  ``tokenizer``)."""
  p = r.params
  if p.max_new_tokens == 0:
    return "length"
  tok = r.tokens[-1]
  if tok in p.stop_token_ids:
    return "stop"
  if r.text is None:
    r.text = TextStream(r.tokenizer or tokenizer, p.stop_strings)
  r.text.add(tok)
  if r.text.stopped or r.grammar_done:
    return "stop"
  if r.num_generated >= p.max_new_tokens or len(r.tokens) >= max_seq_len:
    return "length"
  return None


def num_kept(r: Request) -> int:
  """How many generated tokens a result reports (O(1)): not a scoring request's draw, not a
  stop token."""
  n = r.num_generated
  if r.params.max_new_tokens == 0:
    return 0
  if n and r.tokens[-1] in r.params.stop_token_ids:
    return n - 1
  return n


def kept_tokens(r: Request) -> list[int]:
  """The generated tokens a result reports (`num_kept` of them)."""
  return r.tokens[len(r.prompt):len(r.prompt) + num_kept(r)]
