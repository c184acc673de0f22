"""A request as the engine holds it: one choice of one prompt, from arrival to its last event.

The scheduler, the device thread and the HTTP handler all read and write the same `Request`
(vLLM v1's one ``Request``): its tokens (prompt + generated) and KV pages, its grammar state and
log probabilities, its text stream (`stops.TextStream`) and its cancellation. ``n`` choices of
one prompt are ``n`` requests; choice 0 leads (computes the prompt) and the others fork from it.
Host data only: no JAX here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from bitdelta_jax.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class Event:
  """What the engine tells a request's ``emit``: text as it becomes final, then one last
  ``done`` or ``error``."""

  kind: str  # "token" | "done" | "error"
  text: str = ""
  finish_reason: str | None = None
  completion_tokens: int = 0
  message: str | None = None
  code: str | None = None  # e.g. "worker_lost", "step_failed", "stalled" (the HTTP status)
  # (token id, logprob, [(alternative id, logprob)]) of each token behind this event's text
  logprobs: list | None = None
  # a choice's first event with echo + logprobs: the prompt's entries (the first logprob None)
  prompt_logprobs: list | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One choice of one prompt. ``tokens`` = prompt + generated; the first ``n_cached`` have
  their K/V in ``pages`` (of data group ``group_index``'s pool)."""

  prompt: list[int]
  slot: int = 0
  params: SamplingParams = SamplingParams()
  model: str = ""
  emit: Callable[[Event], None] | None = None  # called on the device thread
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  tokenizer: object = None  # the variant's own (decodes its tokens); None: the engine's
  tag: object = None  # the caller's (offline `generate`: the prompt's index)
  # -- cancellation: written by any thread, read by the device thread
  cancelled: bool = False
  # why it was cancelled when not by its client (e.g. its variant was deleted): it then ends
  # with an ``error`` event carrying this message and ``cancel_code``, not ``done``
  cancel_reason: str | None = None
  cancel_code: str | None = None
  # -- the scheduler's
  key: np.ndarray | None = None  # PRNGKey(seed) folded with the choice (`batch.prng_key`)
  variant_key: tuple = ()  # (slot, load epoch): what its cached prefix pages are keyed by
  order: int = 0  # arrival order (preemption takes the newest)
  group_index: int = 0  # the data group whose scheduler holds it
  tokens: list[int] = dataclasses.field(default_factory=list)
  pages: list[int] = dataclasses.field(default_factory=list)
  hashes: list[bytes] = dataclasses.field(default_factory=list)
  n_cached: int = 0
  finished: bool = False  # its scheduler no longer holds it (pages released)
  choice: int = 0  # index among the prompt's n choices
  leader: Request | None = None  # a choice > 0 until it is forked from choice 0
  followers: list[Request] = dataclasses.field(default_factory=list)
  siblings: list[Request] = dataclasses.field(default_factory=list)  # all n choices
  matcher: object = None  # structured output: the grammar state
  grammar_error: str | None = None  # the grammar refused a sampled token (the request ends)
  # per generated token: (logprob, top ids, top logprobs) when params.logprobs is not None
  token_logprobs: list[tuple] = dataclasses.field(default_factory=list)
  # prompt position p -> (logprob of prompt[p], top ids, top logprobs), p >= 1
  prompt_logprobs: dict[int, tuple] = dataclasses.field(default_factory=dict)
  # when (time.monotonic, scheduler iteration) it was last computed, forked, admitted or deferred
  progress_at: float = 0.0
  progress_step: int = 0
  # -- the engine's (device thread)
  text: object = None  # its `stops.TextStream` once it has produced a token
  t_last: float = 0.0
  logprobs_sent: int = 0  # entries of token_logprobs already attached to an event
  emitted: bool = False
  ended: bool = False  # its last event (done / error) went out; nothing follows it

  @property
  def grammar_done(self) -> bool:
    """The structured output is complete (or its grammar failed): the request ends."""
    return self.matcher is not None and (self.grammar_error is not None
                                         or self.matcher.is_finished())

  @property
  def scores_prompt(self) -> bool:
    return self.params.prompt_logprobs is not None and self.choice == 0

  @property
  def generated(self) -> list[int]:
    return self.tokens[len(self.prompt):]

  @property
  def num_generated(self) -> int:
    return len(self.tokens) - len(self.prompt)

  @property
  def pending(self) -> int:
    return len(self.tokens) - self.n_cached


@dataclasses.dataclass
class Generation:
  """One prompt's result of `Generator.generate`."""

  tokens: list[int]
  finish_reason: str  # "stop" | "length"
  text: str | None = None
  prompt_len: int = 0
