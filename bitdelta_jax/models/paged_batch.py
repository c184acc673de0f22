"""The paged engine's data: one call's batch and results, a scheduled sequence, host stops.

`PagedBatch` is what one jitted call reads (`run_impl`: ``LlamaForCausalLM.forward_paged``,
then the sampler with each output row's logit controls, then raw-logit log probabilities of the
sampled tokens and of any prompt positions scored); `StepOutput` is what it returns. `Seq` is
one sequence as the scheduler in `bitdelta_jax.models.paged` sees it (n choices of one request
are n `Seq`s, choice 0 leading until its prompt is computed). `finish_reason` applies the
host-side stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.models.controls import LogitControls, logprobs_of
from bitdelta_jax.models.sampling import SamplingParams, row_keys, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
  """One call's inputs. B rows of T new tokens; each row reads P pages; N outputs."""

  tokens: jax.Array  # int32 [B, T]
  positions: jax.Array  # int32 [B, T] position of each token in its own sequence
  seq: jax.Array  # int32 [B, T] sequence index within the row (-1: padding)
  write_page: jax.Array  # int32 [B, T] where each token's K/V goes (page 0: padding)
  write_offset: jax.Array  # int32 [B, T]
  pages: jax.Array  # int32 [B, P] pages the row reads
  page_seq: jax.Array  # int32 [B, P] sequence each page belongs to (-2: padding)
  page_start: jax.Array  # int32 [B, P] position of the page's first token
  page_fill: jax.Array  # int32 [B, P] valid tokens in the page after this call's writes
  slot_ids: jax.Array  # int32 [B]
  out_index: jax.Array  # int32 [N] flat index into [B*T] of each output token
  out_slot_ids: jax.Array  # int32 [N]
  keys: jax.Array  # uint32 [N, 2] the request's PRNGKey(seed)
  key_pos: jax.Array  # int32 [N] position of the token being drawn
  temperature: jax.Array  # f32 [N]
  top_p: jax.Array  # f32 [N]
  top_k: jax.Array  # int32 [N]
  controls: LogitControls  # [N, ...] mask, bias, penalties (neutral rows change nothing)
  want_logprobs: jax.Array  # bool [N]
  score_index: jax.Array  # int32 [M] flat index of each prompt position scored (M may be 0)
  score_slot_ids: jax.Array  # int32 [M]
  score_target: jax.Array  # int32 [M] the prompt token that follows that position


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  """One call's results: sampled tokens and log probabilities (raw model logits)."""

  tokens: jax.Array  # int32 [N]
  logprob: jax.Array  # f32 [N] of the sampled token (0 where not wanted)
  top_ids: jax.Array  # int32 [N, TOP_LOGPROBS]
  top_logprobs: jax.Array  # f32 [N, TOP_LOGPROBS]
  score: jax.Array  # f32 [M] of each score_target
  score_top_ids: jax.Array  # int32 [M, TOP_LOGPROBS]
  score_top_logprobs: jax.Array  # f32 [M, TOP_LOGPROBS]


def run_impl(graphdef, state, k_pool, v_pool, batch: PagedBatch, base_only: bool,
             kv_sharding=None):
  model = nnx.merge(graphdef, state)
  logits, k_pool, v_pool = model.forward_paged(batch, k_pool, v_pool, base_only=base_only,
                                               kv_sharding=kv_sharding)
  n = batch.out_index.shape[0]
  out_logits, score_logits = logits[:n], logits[n:]
  keys = row_keys(batch.keys, batch.key_pos)
  tok = sample(out_logits, keys, batch.temperature, batch.top_p, batch.top_k, batch.controls)
  lp = logprobs_of(out_logits, tok, batch.want_logprobs)
  m = batch.score_target.shape[0]
  sc = logprobs_of(score_logits, batch.score_target, jnp.ones((m,), bool))
  return k_pool, v_pool, StepOutput(tok, *lp, *sc)


def copy_pages_impl(k_pool, v_pool, src, dst):
  """Copies whole pages ``src -> dst`` (a forked sequence's partly filled last page)."""
  return k_pool.at[:, dst].set(k_pool[:, src]), v_pool.at[:, dst].set(v_pool[:, src])


def prng_key(seed: int, choice: int = 0) -> np.ndarray:
  """The key of choice ``choice`` of a request as host data: ``PRNGKey(seed)`` (threefry) for
  the first, ``fold_in(PRNGKey(seed), choice)`` for the others, so that choice 0 of ``n``
  equals the single answer and every choice is reproducible on its own."""
  key = jax.random.PRNGKey(seed)
  if choice:
    key = jax.random.fold_in(key, choice)
  return np.asarray(jax.random.key_data(key), np.uint32)


@dataclasses.dataclass(eq=False)
class Seq:
  """One sequence in the scheduler. ``tokens`` = prompt + generated; the first ``n_cached``
  have their K/V in ``pages``."""

  prompt: list[int]
  slot: int
  params: SamplingParams
  key: np.ndarray
  variant_key: tuple
  order: int
  tag: object = None
  tokens: list[int] = dataclasses.field(default_factory=list)
  pages: list[int] = dataclasses.field(default_factory=list)
  hashes: list[bytes] = dataclasses.field(default_factory=list)
  n_cached: int = 0
  finished: bool = False
  choice: int = 0  # index among the request's n choices
  leader: Seq | None = None  # a choice > 0 until it is forked from choice 0 after the prefill
  followers: list[Seq] = dataclasses.field(default_factory=list)
  matcher: object = None  # structured output: the grammar state of this sequence
  grammar_error: str | None = None  # the grammar refused a sampled token (the sequence ends)
  # per generated token: (logprob, top ids, top logprobs) when params.logprobs is not None
  token_logprobs: list[tuple] = dataclasses.field(default_factory=list)
  # prompt position p -> (logprob of prompt[p], top ids, top logprobs), p >= 1
  prompt_logprobs: dict[int, tuple] = dataclasses.field(default_factory=dict)
  # when (time.monotonic, scheduler iteration) it was last computed, forked, admitted or deferred
  progress_at: float = 0.0
  progress_step: int = 0

  @property
  def grammar_done(self) -> bool:
    """The structured output is complete (or its grammar failed): the sequence ends."""
    return self.matcher is not None and (self.grammar_error is not None
                                         or self.matcher.is_finished())

  @property
  def scores_prompt(self) -> bool:
    return self.params.prompt_logprobs is not None and self.choice == 0

  @property
  def generated(self) -> list[int]:
    return self.tokens[len(self.prompt):]

  @property
  def pending(self) -> int:
    return len(self.tokens) - self.n_cached


@dataclasses.dataclass
class StepResult:
  tokens: list[tuple[Seq, int]]  # a new token of each sequence that produced one
  errors: list[tuple[Seq, str]]  # sequences dropped by the scheduler (they hold no pages)
  prefill_tokens: int = 0


def fill_masks(matchers, mask_RxW: np.ndarray) -> None:
  """Each row's allowed tokens into ``mask_RxW`` (int32 ``[R, ceil(V / 32)]``, pre-filled with
  all ones): rows with a matcher get its bitmask, the words past its tokenizer's vocabulary
  cleared (a model's padded ids are never allowed). Grammar matchers of one tokenizer are filled
  together on llguidance's thread pool (`grammar.fill_bitmask_batch`), others one by one."""
  rows = [(j, m) for j, m in enumerate(matchers) if m is not None]
  if not rows:
    return
  try:
    from bitdelta_jax.models.grammar import Matcher, fill_bitmask_batch

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


def finish_reason(s: Seq, max_seq_len: int, tokenizer=None):
  """(reason, tokens, text) when ``s``'s last token ends it, else None. A stop token is not
  returned; text is cut before a stop string. A finished grammar stops the sequence."""
  p, gen = s.params, s.generated
  if p.max_new_tokens == 0:  # scoring only: the token drawn after the prompt is not kept
    return "length", [], "" if tokenizer is not None else None
  if gen[-1] in p.stop_token_ids:
    toks = gen[:-1]
    return "stop", toks, tokenizer.decode(toks) if tokenizer is not None else None
  text = tokenizer.decode(gen) if tokenizer is not None else None
  if p.stop_strings:
    hits = [text.find(x) for x in p.stop_strings if x and x in text]
    if hits:
      return "stop", list(gen), text[: min(hits)]
  if s.grammar_done:
    return "stop", list(gen), text
  if len(gen) >= p.max_new_tokens or len(s.tokens) >= max_seq_len:
    return "length", list(gen), text
  return None


@dataclasses.dataclass
class Generation:
  """One prompt's result of `PagedGenerator.generate`."""

  tokens: list[int]
  finish_reason: str  # "stop" | "length"
  text: str | None = None
  prompt_len: int = 0


def per_request(prompts, slot_ids, params, tokenizer) -> tuple[list[int], list[SamplingParams]]:
  """``generate``'s arguments as one slot id and one `SamplingParams` per prompt."""
  n = len(prompts)
  if slot_ids is None:
    slots = [0] * n
  elif isinstance(slot_ids, int):
    slots = [slot_ids] * n
  else:
    slots = list(slot_ids)
  plist = [params or SamplingParams()] * n if not isinstance(params, Sequence) else list(params)
  if len(slots) != n or len(plist) != n:
    raise ValueError("slot_ids and params must have one entry per prompt")
  if any(p.stop_strings for p in plist) and tokenizer is None:
    raise ValueError("stop_strings need a tokenizer (Generator(..., tokenizer=...))")
  return slots, plist
