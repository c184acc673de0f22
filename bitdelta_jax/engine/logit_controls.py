"""The per-row logit controls of one step as host data (no JAX): what the scheduler fills in
and the runner turns into device arrays; `bitdelta_jax.engine.controls` applies them."""

from __future__ import annotations

import dataclasses

import numpy as np

TOP_LOGPROBS = 20  # the most top alternatives a request may ask for (OpenAI's limit)
BIAS_SLOTS = 320  # logit_bias entries (<= 300) + stop ids blocked by min_tokens


def mask_words(vocab_size: int) -> int:
  return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True)
class LogitControls:
  """Per-row controls (`bitdelta_jax.engine.controls` says what each does). Leading axis =
  rows; host arrays from the scheduler, device arrays inside the step."""

  mask: np.ndarray  # int32 [R, W]
  bias_ids: np.ndarray  # int32 [R, K]
  bias_vals: np.ndarray  # f32 [R, K]
  history: np.ndarray  # int32 [R, H]
  prompt_len: np.ndarray  # int32 [R]
  presence: np.ndarray  # f32 [R]
  frequency: np.ndarray  # f32 [R]
  repetition: np.ndarray  # f32 [R]

  @staticmethod
  def neutral(rows: int, vocab_size: int, history_len: int) -> LogitControls:
    """Host arrays that change nothing."""
    return LogitControls(
      mask=np.full((rows, mask_words(vocab_size)), -1, np.int32),
      bias_ids=np.full((rows, BIAS_SLOTS), -1, np.int32),
      bias_vals=np.zeros((rows, BIAS_SLOTS), np.float32),
      history=np.full((rows, history_len), -1, np.int32),
      prompt_len=np.zeros((rows,), np.int32),
      presence=np.zeros((rows,), np.float32),
      frequency=np.zeros((rows,), np.float32),
      repetition=np.ones((rows,), np.float32),
    )
