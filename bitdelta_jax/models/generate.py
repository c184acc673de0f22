"""Generation with a preallocated KV cache, JetStream-style: prefill → insert → step.

Step-level API (what a serving engine drives; all shapes static, state donated):

    gen = Generator(model, buckets=(32, 64, 128), max_seq_len=256, max_rows=8, tokenizer=tok)
    state = gen.init_state()                                   # DecodeState, max_rows rows
    prefix = gen.prefill(prompt_ids, slot=1, params=SamplingParams(...))
    state = gen.insert(state, prefix, row=3)                   # row 3 now decodes that request
    state, tokens = gen.step(state)                            # one token for every row
    first_token = int(prefix.token[0])

* `prefill` pads the prompt to the smallest bucket that holds it (right padding), runs the
  prompt with its variant slot, and samples the first token; one compile per bucket.
* `insert` copies the prefix's KV rows into a decode row and sets the row's length, last
  token, slot id, sampling parameters and key; one compile per bucket, row index traced.
* `step` feeds every row's last token at its own position, writes K/V into the cache, attends,
  and samples with per-row temperature / top-p / top-k / key; the `DecodeState` is donated.
  Rows not in use keep computing harmlessly (their length is clamped to the cache).

`Generator.generate(prompts, slot_ids, params)` runs a continuous-batching loop over those
three (free rows are refilled as requests finish) and applies stops on the host: stop token
ids (the stop token is not returned), stop strings (needs a tokenizer; the returned text is cut
before the stop string, tokens keep the one that completed it), ``max_new_tokens`` and the
cache length (``finish_reason`` "stop" or "length").

Keys: a request's key is ``PRNGKey(seed)``; the token at sequence position ``p`` is drawn with
``fold_in(key, p)`` (see `sampling`). Variant slots: `Generator.load_variant` / `clear_slot`
update the model's banks and re-read its state; the compiled functions are reused as is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.models import slots as slots_lib
from bitdelta_jax.models.sampling import SamplingParams, row_keys, sample

DEFAULT_BUCKETS = (32, 64, 128, 256)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParams:
  """Per-row request parameters on device (leading axis = rows)."""

  slot_ids: jax.Array  # int32 [R]
  keys: jax.Array  # uint32 [R, 2]
  temperature: jax.Array  # f32 [R]
  top_p: jax.Array  # f32 [R]
  top_k: jax.Array  # int32 [R]

  @staticmethod
  def of(slots: Sequence[int], params: Sequence[SamplingParams]) -> RowParams:
    return RowParams(
      slot_ids=np.asarray(slots, np.int32),
      keys=np.stack([np.asarray(jax.random.PRNGKey(p.seed), np.uint32) for p in params]),
      temperature=np.asarray([p.temperature for p in params], np.float32),
      top_p=np.asarray([p.top_p for p in params], np.float32),
      top_k=np.asarray([p.top_k for p in params], np.int32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything one decode step reads and writes; donated through `Generator.step`.

  ``lengths[r]`` is the number of tokens in row r's cache, i.e. the position at which the next
  step writes ``tokens[r]`` (the row's last sampled token).
  """

  k: jax.Array  # [L, R, max_len, kv_heads, head_dim]
  v: jax.Array
  lengths: jax.Array  # int32 [R]
  tokens: jax.Array  # int32 [R]
  row: RowParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
  """The result of prefilling B prompts padded to one bucket."""

  k: jax.Array  # [L, B, bucket, kv_heads, head_dim]
  v: jax.Array
  lengths: jax.Array  # int32 [B]
  token: jax.Array  # int32 [B], first generated token
  logits: jax.Array  # f32 [B, V], logits that produced it
  row: RowParams


@dataclasses.dataclass
class Generation:
  tokens: list[int]
  finish_reason: str  # "stop" | "length"
  text: str | None = None
  prompt_len: int = 0


def _prefill_impl(graphdef, state, tokens_BxT, lengths_B, row: RowParams) -> Prefix:
  model = nnx.merge(graphdef, state)
  logits, k, v = model.prefill(tokens_BxT, lengths_B, row.slot_ids)
  keys = row_keys(row.keys, lengths_B)
  token = sample(logits, keys, row.temperature, row.top_p, row.top_k)
  return Prefix(k, v, lengths_B, token, logits, row)


def _insert_impl(state: DecodeState, prefix: Prefix, rows_B) -> DecodeState:
  k, v = state.k, state.v
  for b in range(prefix.k.shape[1]):
    at = (0, rows_B[b], 0, 0, 0)
    k = jax.lax.dynamic_update_slice(k, prefix.k[:, b : b + 1].astype(k.dtype), at)
    v = jax.lax.dynamic_update_slice(v, prefix.v[:, b : b + 1].astype(v.dtype), at)
  row = jax.tree.map(lambda a, b: a.at[rows_B].set(b), state.row, prefix.row)
  return DecodeState(
    k,
    v,
    state.lengths.at[rows_B].set(prefix.lengths),
    state.tokens.at[rows_B].set(prefix.token),
    row,
  )


def _step_impl(graphdef, params_state, state: DecodeState) -> tuple[DecodeState, jax.Array]:
  model = nnx.merge(graphdef, params_state)
  max_len = state.k.shape[2]
  pos = jnp.minimum(state.lengths, max_len - 1)
  logits, k, v = model.decode(state.tokens, pos, state.row.slot_ids, state.k, state.v)
  r = state.row
  nxt = sample(logits, row_keys(r.keys, pos + 1), r.temperature, r.top_p, r.top_k)
  return DecodeState(k, v, jnp.minimum(pos + 1, max_len), nxt, r), nxt


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


def fixed_rows_refusal(params: SamplingParams) -> str | None:
  """Why the fixed-row generator (meshes, several processes) cannot serve ``params``, or None:
  logit controls, log probabilities and structured output exist only in the paged engine."""
  used = [name for name, on in (
    ("presence/frequency/repetition penalties", params.penalised),
    ("logit_bias", bool(params.logit_bias)), ("min_tokens", params.min_tokens > 0),
    ("logprobs", params.logprobs is not None or params.prompt_logprobs is not None),
    ("response_format", params.grammar is not None),
    ("max_tokens=0", params.max_new_tokens == 0)) if on]
  if not used:
    return None
  return (f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} not supported by the "
          "fixed-row engine (a mesh or several processes); the single-device engine has them")


class Generator:
  """Bucketed prefill + batched decode over a `LlamaForCausalLM`; see the module docstring."""

  def __init__(
    self,
    model,
    *,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    max_seq_len: int | None = None,
    max_rows: int = 8,
    tokenizer=None,
  ):
    self.model = model
    self.buckets = tuple(sorted(set(int(b) for b in buckets)))
    self.max_seq_len = int(max_seq_len or 2 * self.buckets[-1])
    if self.buckets[-1] > self.max_seq_len:
      raise ValueError(f"largest bucket {self.buckets[-1]} exceeds max_seq_len {self.max_seq_len}")
    self.max_rows = max_rows
    self.tokenizer = tokenizer
    self.graphdef, self.state = nnx.split(model)
    self._prefill = jax.jit(functools.partial(_prefill_impl, self.graphdef))
    self._insert = jax.jit(_insert_impl, donate_argnums=0)
    self._step = jax.jit(functools.partial(_step_impl, self.graphdef), donate_argnums=1)

  # -- variants -----------------------------------------------------------------------------
  def refresh(self) -> None:
    """Re-reads the model's state (after its banks or parameters changed)."""
    self.state = nnx.state(self.model)

  def load_variant(self, slot: int, delta) -> None:
    slots_lib.load_variant(self.model, slot, delta)
    self.refresh()

  def clear_slot(self, slot: int) -> None:
    slots_lib.clear_slot(self.model, slot)
    self.refresh()

  # -- compile accounting ------------------------------------------------------------------
  @property
  def prefill_compiles(self) -> int:
    return self._prefill._cache_size()

  @property
  def step_compiles(self) -> int:
    return self._step._cache_size()

  # -- step-level API ----------------------------------------------------------------------
  def bucket_for(self, n: int) -> int:
    for b in self.buckets:
      if n <= b:
        return b
    raise ValueError(f"prompt of {n} tokens exceeds the largest bucket {self.buckets[-1]}")

  def init_state(self) -> DecodeState:
    cfg = self.model.config
    shape = (cfg.num_layers, self.max_rows, self.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    r = self.max_rows
    return DecodeState(
      k=jnp.zeros(shape, self.model.dtype),
      v=jnp.zeros(shape, self.model.dtype),
      lengths=jnp.zeros((r,), jnp.int32),
      tokens=jnp.zeros((r,), jnp.int32),
      row=jax.tree.map(jnp.asarray, RowParams.of([0] * r, [SamplingParams()] * r)),
    )

  def prefill(
    self, prompt: Sequence[int], slot: int = 0, params: SamplingParams = SamplingParams()
  ) -> Prefix:
    n = len(prompt)
    if n == 0:
      raise ValueError("empty prompt")
    if not 0 <= slot < self.model.config.num_slots:
      raise ValueError(f"slot {slot} out of range [0, {self.model.config.num_slots})")
    why = fixed_rows_refusal(params)
    if why:
      raise ValueError(why)
    bucket = self.bucket_for(n)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = prompt
    return self._prefill(
      self.state, tokens, np.asarray([n], np.int32), RowParams.of([slot], [params])
    )

  def insert(self, state: DecodeState, prefix: Prefix, row: int) -> DecodeState:
    return self._insert(state, prefix, np.asarray([row], np.int32))

  def step(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
    return self._step(self.state, state)

  # -- the whole loop -----------------------------------------------------------------------
  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | int | None = None,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
  ) -> list[Generation]:
    """Generates for every prompt (continuous batching over ``max_rows`` decode rows)."""
    n = len(prompts)
    slots, plist = per_request(prompts, slot_ids, params, self.tokenizer)
    self.refresh()
    results: list[Generation | None] = [None] * n
    pending = deque(range(n))
    free = list(range(self.max_rows))[::-1]
    active: dict[int, int] = {}  # row -> request index
    out: dict[int, list[int]] = {}
    state = self.init_state()

    def accept(i: int, tok: int) -> bool:
      """Appends a token; True when the request is finished."""
      p, toks = plist[i], out[i]
      if tok in p.stop_token_ids:
        return self._finish(results, i, toks, "stop", prompts)
      toks.append(tok)
      if p.stop_strings:
        text = self.tokenizer.decode(toks)
        hits = [text.find(s) for s in p.stop_strings if s and s in text]
        if hits:
          return self._finish(results, i, toks, "stop", prompts, text[: min(hits)])
      if len(toks) >= p.max_new_tokens or len(prompts[i]) + len(toks) >= self.max_seq_len:
        return self._finish(results, i, toks, "length", prompts)
      return False

    while pending or active:
      while pending and free:
        i = pending.popleft()
        out[i] = []
        prefix = self.prefill(prompts[i], slots[i], plist[i])
        if not accept(i, int(prefix.token[0])):
          row = free.pop()
          state = self.insert(state, prefix, row)
          active[row] = i
      if not active:
        continue
      state, toks = self.step(state)
      toks = np.asarray(toks)
      for row, i in list(active.items()):
        if accept(i, int(toks[row])):
          del active[row]
          free.append(row)
    return results  # type: ignore[return-value]

  def _finish(self, results, i, toks, reason, prompts, text=None) -> bool:
    if text is None and self.tokenizer is not None:
      text = self.tokenizer.decode(toks)
    results[i] = Generation(list(toks), reason, text, len(prompts[i]))
    return True
