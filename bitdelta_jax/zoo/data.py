"""Chat-formatted task examples as token arrays with a loss mask on the answer."""

from __future__ import annotations

import numpy as np

from bitdelta_jax.zoo.corpus import encode_bytes
from bitdelta_jax.zoo.tokenizer_build import ASSISTANT, BOS, EOS, PAD, USER


def encode_example(prompt: str, answer: str) -> tuple[np.ndarray, int]:
  """``<bos><|user|>prompt<|assistant|>answer<eos>`` (the chat template's rendering) and the
  index of the first answer token."""
  p = np.concatenate([[BOS, USER], encode_bytes(prompt.encode()), [ASSISTANT]]).astype(np.int32)
  a = np.concatenate([encode_bytes(answer.encode()), [EOS]]).astype(np.int32)
  return np.concatenate([p, a]), len(p)


def example_ids(examples) -> list[np.ndarray]:
  """Each (prompt, answer) example's tokens (`encode_example`): what `distill_checkpoint` takes
  as calibration."""
  return [encode_example(p, a)[0] for p, a in examples]


def encode_prompt(prompt: str) -> list[int]:
  return encode_example(prompt, "")[0][:-1].tolist()


def batch_examples(examples, seq: int) -> tuple[np.ndarray, np.ndarray]:
  """→ tokens ``[B, seq]`` (right-padded) and a float mask ``[B, seq]`` marking positions whose
  *next* token is part of the answer (answer bytes and <eos>)."""
  toks = np.full((len(examples), seq), PAD, np.int32)
  mask = np.zeros((len(examples), seq), np.float32)
  for i, (p, a) in enumerate(examples):
    t, start = encode_example(p, a)
    if len(t) > seq:
      raise ValueError(f"example longer than {seq} tokens: {p!r} -> {a!r}")
    toks[i, :len(t)] = t
    mask[i, start - 1:len(t) - 1] = 1.0
  return toks, mask
