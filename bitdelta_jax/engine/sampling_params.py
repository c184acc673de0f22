"""Per-request decoding parameters (host data, no JAX); `bitdelta_jax.engine.sampling` draws
the tokens they describe."""

from __future__ import annotations

import dataclasses

from bitdelta_jax.engine.logit_controls import BIAS_SLOTS

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request decoding parameters.

  ``max_new_tokens = 0`` generates nothing (a scoring request: its prompt log probabilities
  only). ``min_tokens``: the stop token ids cannot be drawn before that many tokens.
  ``logprobs``: the number of top alternatives to report with each generated token's log
  probability (None: no log probabilities); ``prompt_logprobs`` likewise for the prompt's
  tokens (the engine then computes every prompt token, without prefix reuse). ``grammar``: an
  object with ``matcher()`` (`bitdelta_jax.engine.grammar.CompiledGrammar`) that constrains the
  output.
  """

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  max_new_tokens: int = 16
  stop_token_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()
  min_tokens: int = 0
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  grammar: object = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
    if not -INT32_MAX <= self.top_k <= INT32_MAX:
      raise ValueError(f"top_k must be an int32, got {self.top_k}")
    if not self.repetition_penalty > 0:
      raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
    if self.min_tokens < 0:
      raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
    if len(self.logit_bias) + len(self.stop_token_ids) > BIAS_SLOTS:
      raise ValueError(f"logit_bias and stop_token_ids may hold at most {BIAS_SLOTS} entries "
                       "together")
    for name in ("logprobs", "prompt_logprobs"):
      k = getattr(self, name)
      if k is not None and not 0 <= k <= 20:
        raise ValueError(f"{name} must be in [0, 20], got {k}")

  @property
  def penalised(self) -> bool:
    return (self.presence_penalty != 0 or self.frequency_penalty != 0
            or self.repetition_penalty != 1)

  @property
  def controlled(self) -> bool:
    """Whether this request needs any `LogitControls` (else the neutral ones serve it)."""
    return bool(self.penalised or self.logit_bias or self.min_tokens or self.grammar is not None)
