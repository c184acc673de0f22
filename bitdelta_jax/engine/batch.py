"""One step's data: the batch the scheduler builds and the runner's jitted call reads.

`PagedBatch` is what one jitted call reads (`bitdelta_jax.engine.runner.run_impl`:
``LlamaForCausalLM.forward_paged``, then the sampler with each output row's logit controls, then
raw-logit log probabilities of the sampled tokens and of any prompt positions scored);
`StepOutput` is what it returns; `StepShapes` the static shapes of every program. Host data: no
JAX is imported, so the scheduler runs without it (`bitdelta_jax.engine.pytrees` registers these
types for the step). `prng_key` is a request's sampling key, computed without JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bitdelta_jax.engine.logit_controls import LogitControls
from pallas_kernels.attention_inputs import AttentionInputs


@dataclasses.dataclass(frozen=True)
class PagedBatch:
  """One step's inputs: a ragged batch of N tokens (decode tokens first, then prompt chunks),
  R decode lanes and sampled outputs (R = min(N, max_rows)), U prompt pages. The shapes depend
  on N only; see `pallas_kernels.paged_attention` for how attention reads ``attention``."""

  tokens: np.ndarray  # int32 [N]
  slot_ids: np.ndarray  # int32 [N] each token's variant slot
  write_page: np.ndarray  # int32 [N] where each token's K/V goes (page 0: padding)
  write_offset: np.ndarray  # int32 [N]
  attention: AttentionInputs  # positions, page tables and lengths: what attention reads
  out_index: np.ndarray  # int32 [R] token index of each output (a sequence's last token)
  out_slot_ids: np.ndarray  # int32 [R]
  keys: np.ndarray  # uint32 [R, 2] the request's PRNGKey(seed)
  key_pos: np.ndarray  # int32 [R] position of the token being drawn
  temperature: np.ndarray  # f32 [R]
  top_p: np.ndarray  # f32 [R]
  top_k: np.ndarray  # int32 [R]
  controls: LogitControls  # [R, ...] mask, bias, penalties (neutral rows change nothing)
  want_logprobs: np.ndarray  # bool [R]
  score_target: np.ndarray  # int32 [N] prompt token a position's logits score (-1: none)

  @property
  def num_tokens(self) -> int:
    return self.tokens.shape[0]


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """One step's results: sampled tokens and log probabilities (raw model logits)."""

  tokens: np.ndarray  # int32 [R]
  logprob: np.ndarray  # f32 [R] of the sampled token (0 where not wanted)
  top_ids: np.ndarray  # int32 [R, TOP_LOGPROBS]
  top_logprobs: np.ndarray  # f32 [R, TOP_LOGPROBS]
  score: np.ndarray  # f32 [N] of each score_target (0 where none)
  score_top_ids: np.ndarray  # int32 [N, TOP_LOGPROBS]
  score_top_logprobs: np.ndarray  # f32 [N, TOP_LOGPROBS]


@dataclasses.dataclass(frozen=True)
class StepShapes:
  """The static shapes of a step, a function of its token bucket N alone: the scheduler builds
  batches of these shapes and the runner compiles one program per bucket (and form) before
  serving. N is a power of two up to ``max_step_tokens``, or ``max_step_tokens`` itself."""

  max_rows: int  # sequences that can run at once: decode lanes and outputs, R = min(N, max_rows)
  max_step_tokens: int  # the token budget of a step (max_rows decode tokens + a prefill chunk)
  max_pages_per_seq: int
  page_size: int
  block_pages: int  # pages per attention block
  vocab_size: int  # logits width (controls' mask)
  max_seq_len: int  # controls' history

  @property
  def lane_width(self) -> int:
    """Pages in a decode lane's table: ``max_pages_per_seq`` rounded up to whole blocks."""
    return -(-self.max_pages_per_seq // self.block_pages) * self.block_pages

  def buckets(self) -> list[int]:
    out, b = [], 1
    while b < self.max_step_tokens:
      out.append(b)
      b *= 2
    return out + [self.max_step_tokens]

  def bucket(self, n: int) -> int:
    if not 1 <= n <= self.max_step_tokens:
      raise ValueError(f"a step of {n} tokens is outside [1, {self.max_step_tokens}]")
    return next(b for b in self.buckets() if b >= n)

  def lanes(self, n_bucket: int) -> int:
    return min(n_bucket, self.max_rows)

  def empty(self, n_bucket: int) -> PagedBatch:
    """A batch of N padding tokens (host arrays, neutral controls as None): the template the
    scheduler fills in, and what the warm-up compiles with."""
    n, r = n_bucket, self.lanes(n_bucket)
    i32 = lambda shape, v=0: np.full(shape, v, np.int32)  # noqa: E731
    return PagedBatch(
      tokens=i32(n), slot_ids=i32(n), write_page=i32(n), write_offset=i32(n),
      attention=AttentionInputs.empty(n, r, self.lane_width, self.block_pages),
      out_index=i32(r), out_slot_ids=i32(r), keys=np.zeros((r, 2), np.uint32), key_pos=i32(r),
      temperature=np.zeros((r,), np.float32), top_p=np.ones((r,), np.float32), top_k=i32(r),
      controls=None, want_logprobs=np.zeros((r,), bool), score_target=i32(n, -1))


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(key: tuple[int, int], x: tuple[int, int]) -> tuple[int, int]:
  """JAX's threefry-2x32 hash (20 rounds) of one 2-word block, in plain integers."""
  mask = 0xFFFFFFFF
  ks = (key[0], key[1], key[0] ^ key[1] ^ 0x1BD11BDA)
  x0, x1 = (x[0] + ks[0]) & mask, (x[1] + ks[1]) & mask
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = (x0 + x1) & mask
      x1 = ((x1 << r) | (x1 >> (32 - r))) & mask
      x1 ^= x0
    x0 = (x0 + ks[(i + 1) % 3]) & mask
    x1 = (x1 + ks[(i + 2) % 3] + i + 1) & mask
  return x0, x1


def prng_key(seed: int, choice: int = 0) -> np.ndarray:
  """The key of choice ``choice`` of a request as host data, computed without JAX (the
  scheduler never touches a device): ``PRNGKey(seed)`` (threefry) for the first,
  ``fold_in(PRNGKey(seed), choice)`` for the others, so that choice 0 of ``n`` equals the
  single answer and every choice is reproducible on its own."""
  key = (0, int(seed) & 0xFFFFFFFF)  # PRNGKey(seed) with 32-bit integers (jax's default)
  if choice:
    key = _threefry2x32(key, (0, int(choice) & 0xFFFFFFFF))
  return np.asarray(key, np.uint32)


def fill_masks(matchers, mask_RxW: np.ndarray) -> None:
  """Each row's allowed tokens into ``mask_RxW`` (int32 ``[R, ceil(V / 32)]``, pre-filled with
  all ones): rows with a matcher get its bitmask, the words past its tokenizer's vocabulary
  cleared (a model's padded ids are never allowed). Grammar matchers of one tokenizer are filled
  together on llguidance's thread pool (`grammar.fill_bitmask_batch`), others one by one."""
  rows = [(j, m) for j, m in enumerate(matchers) if m is not None]
  if not rows:
    return
  try:
    from bitdelta_jax.engine.grammar import Matcher, fill_bitmask_batch

    if all(isinstance(m, Matcher) for _, m in rows):
      sub = np.full((len(rows), mask_RxW.shape[1]), -1, np.int32)
      fill_bitmask_batch([m for _, m in rows], sub)
      mask_RxW[[j for j, _ in rows]] = sub
      return
  except (ImportError, ValueError):  # no llguidance, or matchers of different tokenizers
    pass
  for j, m in rows:
    mask_RxW[j] = 0
    m.fill_bitmask(mask_RxW[j])
