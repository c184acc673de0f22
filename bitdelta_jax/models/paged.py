"""Continuous batching over a paged KV cache: cost proportional to the live work.

    gen = PagedGenerator(model, max_rows=32, max_seq_len=2048, tokenizer=tok)
    seq = gen.add(prompt_ids, slot=1, params=SamplingParams(...))
    while gen.has_work:
      for seq, token in gen.step().tokens: ...        # the caller applies stops, then
      gen.finish(seq)                                  # frees (and caches) its pages
    gen.generate(prompts, slot_ids, params)            # the whole loop, stops included

Each `step` is one scheduler iteration and at most two device calls, both of them the same
jitted function (`LlamaForCausalLM.forward_paged` + the batched sampler) at different static
shapes:

* **decode**: every row whose next token is known runs one token; the batch is padded to a
  row bucket (1, 2, 4, ... ``max_rows``) and each row gathers only its own pages, padded to a
  power-of-two page count (length buckets), so a lone stream costs one row and a short context
  costs a short attention.
* **prefill**: waiting prompts, several at once, up to ``prefill_chunk`` tokens per iteration;
  a longer prompt is cut into chunks over successive iterations, so decode rows keep
  stepping while it fills (chunked prefill), and prompts may be as long as ``max_seq_len``.
  Prompts of the same variant slot are packed into one row (each token attends only to its
  own sequence), one call per slot.

Pages are allocated as tokens arrive (`bitdelta_jax.models.kv_pages.PagePool`). Full pages are
published for prefix reuse per variant: a prompt that starts like an earlier one (a system
prompt, a few-shot header, a previous turn) skips those pages. When the pool runs dry the newest
sequence is preempted (its pages freed, and it is recomputed later from its tokens so far).

Compiles are bounded by the buckets: (rows, 1, pages) for decode and (slots, tokens, pages) for
prefill, each also in a base-only form (no variant rows: the delta kernels are skipped). The
greedy/sampled choice is per row inside the step (`bitdelta_jax.models.sampling.sample`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import deque
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.models import slots as slots_lib
from bitdelta_jax.models.generate import Generation, per_request
from bitdelta_jax.models.kv_pages import OutOfPages, PagePool, page_hashes
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


def _run_impl(graphdef, state, k_pool, v_pool, batch: PagedBatch, base_only: bool):
  model = nnx.merge(graphdef, state)
  logits, k_pool, v_pool = model.forward_paged(batch, k_pool, v_pool, base_only=base_only)
  keys = row_keys(batch.keys, batch.key_pos)
  tok = sample(logits, keys, batch.temperature, batch.top_p, batch.top_k)
  return k_pool, v_pool, tok


def _pow2(n: int, lo: int = 1) -> int:
  b = lo
  while b < n:
    b *= 2
  return b


def prng_key(seed: int) -> np.ndarray:
  """``jax.random.PRNGKey(seed)`` (threefry) as host data."""
  return np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)), np.uint32)


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


class PagedGenerator:
  """Paged-KV continuous batching over a `LlamaForCausalLM`; see the module docstring."""

  def __init__(
    self,
    model,
    *,
    max_rows: int = 32,
    max_seq_len: int = 2048,
    page_size: int = 16,
    num_pages: int | None = None,
    prefill_chunk: int = 512,
    prefix_caching: bool = True,
    min_pages_bucket: int = 16,
    tokenizer=None,
  ):
    if page_size < 1 or prefill_chunk < 1 or max_rows < 1:
      raise ValueError("page_size, prefill_chunk and max_rows must be >= 1")
    self.model = model
    self.tokenizer = tokenizer
    self.max_rows = int(max_rows)
    self.max_seq_len = int(max_seq_len)
    self.page_size = int(page_size)
    self.prefill_chunk = int(prefill_chunk)
    self.min_pages_bucket = int(min_pages_bucket)
    self.max_pages_per_seq = -(-self.max_seq_len // self.page_size)
    if num_pages is None:  # room for every row at full length, plus the reserved page
      num_pages = self.max_rows * self.max_pages_per_seq + 1
    self.pool = PagePool(int(num_pages), self.page_size, prefix_caching)
    cfg = model.config
    shape = (cfg.num_layers, int(num_pages), self.page_size, cfg.num_kv_heads, cfg.head_dim)
    self.k_pool = jnp.zeros(shape, model.dtype)
    self.v_pool = jnp.zeros(shape, model.dtype)
    self.graphdef, self.state = nnx.split(model)
    self._run = jax.jit(functools.partial(_run_impl, self.graphdef),
                        static_argnames=("base_only",), donate_argnums=(1, 2))
    self.slot_epoch = [0] * cfg.num_slots
    self.waiting: deque[Seq] = deque()
    self.running: list[Seq] = []
    self._order = itertools.count()
    self.shapes_run: set[tuple] = set()

  # -- variants ------------------------------------------------------------------------------
  def refresh(self) -> None:
    """Re-reads the model's state (after its banks or parameters changed)."""
    self.state = nnx.state(self.model)

  def load_variant(self, slot: int, delta) -> None:
    slots_lib.load_variant(self.model, slot, delta)
    self._slot_changed(slot)

  def clear_slot(self, slot: int) -> None:
    slots_lib.clear_slot(self.model, slot)
    self._slot_changed(slot)

  def _slot_changed(self, slot: int) -> None:
    self.slot_epoch[slot] += 1  # cached prefixes of the old contents are never matched again
    self.refresh()

  @property
  def kv_bytes(self) -> int:
    return 2 * self.k_pool.size * self.k_pool.dtype.itemsize

  @property
  def compiles(self) -> int:
    return self._run._cache_size()

  # -- scheduling API -------------------------------------------------------------------------
  def add(self, prompt: Sequence[int], slot: int = 0, params: SamplingParams = SamplingParams(),
          *, tag=None) -> Seq:
    n = len(prompt)
    if n == 0:
      raise ValueError("empty prompt")
    if n >= self.max_seq_len:
      raise ValueError(f"prompt of {n} tokens leaves no room in max_seq_len {self.max_seq_len}")
    if not 0 <= slot < len(self.slot_epoch):
      raise ValueError(f"slot {slot} out of range [0, {len(self.slot_epoch)})")
    s = Seq(list(prompt), slot, params, prng_key(params.seed),
            (slot, self.slot_epoch[slot]) if slot else (0,), next(self._order), tag)
    s.tokens = list(prompt)
    self.waiting.append(s)
    return s

  def finish(self, s: Seq) -> None:
    """Drops a sequence (finished or cancelled) and releases its pages."""
    if s.finished:
      return
    s.finished = True
    if s in self.running:
      self.running.remove(s)
    else:
      try:
        self.waiting.remove(s)
      except ValueError:
        pass
    self.pool.release(s.pages)
    s.pages = []

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def _admit(self) -> None:
    while self.waiting and len(self.running) < self.max_rows:
      s = self.waiting.popleft()
      if not s.pages and s.n_cached == 0:
        # reuse cached full pages, always leaving at least one token to compute
        full = (len(s.tokens) - 1) // self.page_size
        s.hashes = page_hashes(s.tokens, self.page_size, s.variant_key, full)
        s.pages = self.pool.lookup(s.hashes)
        s.hashes = s.hashes[: len(s.pages)]
        s.n_cached = len(s.pages) * self.page_size
      self.running.append(s)

  def _preempt_newest(self) -> Seq:
    victim = max(self.running, key=lambda x: x.order)
    self.running.remove(victim)
    self.pool.release(victim.pages)
    victim.pages, victim.hashes, victim.n_cached = [], [], 0
    self.waiting.appendleft(victim)
    return victim

  def _plan(self) -> tuple[list[tuple[Seq, int]], list[tuple[Seq, int]], list[tuple[Seq, str]]]:
    """Chooses this iteration's work and allocates its pages: (decode, prefill, errors), the
    first two as (seq, number of new tokens)."""
    decode, prefill, errors = [], [], []
    budget = self.prefill_chunk
    for s in sorted(self.running, key=lambda x: x.order):
      if s not in self.running:  # preempted while planning an older one
        continue
      n = 1 if s.pending == 1 else min(s.pending, budget)
      if n == 0:
        continue
      need = -(-(s.n_cached + n) // self.page_size) - len(s.pages)
      ok = True
      while need > 0:
        try:
          s.pages.append(self.pool.allocate())
          need -= 1
        except OutOfPages:
          victim = self._preempt_newest()
          if victim is s:
            ok = False
            break
      if not ok:
        if not self.running and len(s.tokens) > (self.pool.num_pages - 1) * self.page_size:
          self.waiting.remove(s)
          s.finished = True
          errors.append((s, f"the KV cache ({self.pool.num_pages - 1} pages of "
                            f"{self.page_size}) cannot hold a sequence of {len(s.tokens)} tokens"))
        break
      if s.pending == 1:
        decode.append((s, 1))
      else:
        prefill.append((s, n))
        budget -= n
    # planned sequences are never preempted later in the loop: a victim is the newest running
    # sequence, so it is at least as new as the one being planned, and all planned ones are older
    return decode, prefill, errors

  def step(self) -> StepResult:
    """One scheduler iteration: admit, plan, run decode rows and prefill chunks."""
    self._admit()
    decode, prefill, errors = self._plan()
    calls = []
    if decode:
      calls.append((decode, self._decode_batch(decode)))
    if prefill:
      for group in self._prefill_groups(prefill):
        calls.append((group, self._prefill_batch(group)))
    pending_out = []
    for work, (batch, outputs, base_only) in calls:
      self.k_pool, self.v_pool, tok = self._run(self.state, self.k_pool, self.v_pool, batch,
                                                base_only=base_only)
      self.shapes_run.add((batch.tokens.shape, batch.pages.shape[1], len(outputs), base_only))
      pending_out.append((work, outputs, tok))
    result = StepResult([], errors, sum(n for _, n in prefill))
    for work, outputs, tok in pending_out:
      tok = np.asarray(tok)
      for s, n in work:
        self._advance(s, n)
      for j, s in enumerate(outputs):
        s.tokens.append(int(tok[j]))
        result.tokens.append((s, int(tok[j])))
    return result

  def _advance(self, s: Seq, n: int) -> None:
    """Marks ``n`` more tokens cached and publishes pages that became full."""
    s.n_cached += n
    full = s.n_cached // self.page_size
    if full > len(s.hashes):
      start = s.hashes[-1] if s.hashes else b""
      first = len(s.hashes)
      new = page_hashes(s.tokens[first * self.page_size :], self.page_size, s.variant_key,
                        full - first, start)
      for i, h in enumerate(new):
        self.pool.publish(s.pages[first + i], h)
      s.hashes.extend(new)

  # -- batch construction ---------------------------------------------------------------------
  def _pages_bucket(self, n: int) -> int:
    return min(_pow2(n, self.min_pages_bucket), _pow2(self.max_pages_per_seq * self.max_rows))

  def _prefill_groups(self, prefill):
    """One prefill call per variant slot (its prompts packed into one row), so that prefill
    shapes depend only on the token and page buckets."""
    by_slot: dict[int, list] = {}
    for s, n in prefill:
      by_slot.setdefault(s.slot, []).append((s, n))
    return list(by_slot.values())

  def _decode_batch(self, decode):
    b = min(_pow2(len(decode)), _pow2(self.max_rows))
    p = self._pages_bucket(max(len(s.pages) for s, _ in decode))
    rows = [[(s, 1)] for s, _ in decode]
    return self._batch(rows, b, 1, p, [s for s, _ in decode], out_rows=True)

  def _prefill_batch(self, prefill):
    by_slot: dict[int, list] = {}
    for s, n in prefill:
      by_slot.setdefault(s.slot, []).append((s, n))
    rows = list(by_slot.values())
    t = _pow2(max(sum(n for _, n in r) for r in rows), 16)
    # pages tied to the token bucket (room for as many cached prefix pages as new ones), so the
    # prefill shapes are few and the warm-up covers them
    pages = max(sum(len(s.pages) for s, _ in r) for r in rows)
    p = self._pages_bucket(max(pages, 2 * t // self.page_size))
    outputs = [s for r in rows for s, n in r if s.n_cached + n == len(s.tokens)]
    return self._batch(rows, _pow2(len(rows)), t, p, outputs, out_rows=False)

  def _batch(self, rows, b: int, t: int, p: int, outputs, *, out_rows: bool):
    ps = self.page_size
    tokens = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    seq = np.full((b, t), -1, np.int32)
    wpage = np.zeros((b, t), np.int32)
    woff = np.zeros((b, t), np.int32)
    pages = np.zeros((b, p), np.int32)
    page_seq = np.full((b, p), -2, np.int32)
    page_start = np.zeros((b, p), np.int32)
    page_fill = np.zeros((b, p), np.int32)
    slot_ids = np.zeros((b,), np.int32)
    out_at: dict[int, int] = {}
    for r, work in enumerate(rows):
      slot_ids[r] = work[0][0].slot
      col = pcol = 0
      for j, (s, n) in enumerate(work):
        pos = np.arange(s.n_cached, s.n_cached + n)
        tokens[r, col : col + n] = s.tokens[s.n_cached : s.n_cached + n]
        positions[r, col : col + n] = pos
        seq[r, col : col + n] = j
        wpage[r, col : col + n] = np.asarray(s.pages, np.int32)[pos // ps]
        woff[r, col : col + n] = pos % ps
        k = len(s.pages)
        pages[r, pcol : pcol + k] = s.pages
        page_seq[r, pcol : pcol + k] = j
        page_start[r, pcol : pcol + k] = np.arange(k) * ps
        page_fill[r, pcol : pcol + k] = np.clip(s.n_cached + n - np.arange(k) * ps, 0, ps)
        out_at[id(s)] = r * t + col + n - 1
        col += n
        pcol += k
    nout = _pow2(len(outputs)) if not out_rows else b
    out_index = np.zeros((nout,), np.int32)
    out_slot = np.zeros((nout,), np.int32)
    keys = np.zeros((nout, 2), np.uint32)
    key_pos = np.zeros((nout,), np.int32)
    temp = np.zeros((nout,), np.float32)
    top_p = np.ones((nout,), np.float32)
    top_k = np.zeros((nout,), np.int32)
    for j, s in enumerate(outputs):
      out_index[j] = out_at[id(s)]
      out_slot[j] = s.slot
      keys[j] = s.key
      key_pos[j] = len(s.tokens)
      temp[j], top_p[j], top_k[j] = s.params.temperature, s.params.top_p, s.params.top_k
    batch = PagedBatch(tokens, positions, seq, wpage, woff, pages, page_seq, page_start,
                       page_fill, slot_ids, out_index, out_slot, keys, key_pos, temp, top_p, top_k)
    base_only = not any(s.slot for work in rows for s, _ in work)
    return batch, outputs, base_only

  # -- warm-up --------------------------------------------------------------------------------
  def warmup(self, *, decode_rows: Sequence[int] | None = None, prompt_tokens=(16,),
             progress=None) -> None:
    """Compiles the common shapes by running throwaway sequences (base and variant forms)."""
    rows = decode_rows or sorted({min(_pow2(r), _pow2(self.max_rows))
                                  for r in (1, 2, 4, 8, 16, 32, 64) if r <= self.max_rows})
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=2)
    for slot in sorted({0, min(1, len(self.slot_epoch) - 1)}):
      for n in prompt_tokens:
        n = min(n, self.max_seq_len - 2)
        for r in rows:
          seqs = [self.add([1] * n, slot, params) for _ in range(r)]
          while any(len(s.generated) < 2 for s in seqs):
            self.step()
          for s in seqs:
            self.finish(s)
          if progress:
            progress(f"compiled {'variant' if slot else 'base'} prefill {n} + decode rows {r}")
    self.pool.clear_cache()

  # -- the whole loop -------------------------------------------------------------------------
  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | int | None = None,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
  ) -> list[Generation]:
    """Generates for every prompt; stops as in `bitdelta_jax.models.generate.Generator`."""
    n = len(prompts)
    slots, plist = per_request(prompts, slot_ids, params, self.tokenizer)
    self.refresh()
    results: list[Generation | None] = [None] * n
    for i in range(n):
      self.add(prompts[i], slots[i], plist[i], tag=i)
    while self.has_work:
      res = self.step()
      for _, msg in res.errors:
        raise RuntimeError(msg)
      for s, _ in res.tokens:
        done = finish_reason(s, self.max_seq_len, self.tokenizer)
        if done is not None:
          reason, toks, text = done
          results[s.tag] = Generation(toks, reason, text, len(s.prompt))
          self.finish(s)
    return results  # type: ignore[return-value]


def finish_reason(s: Seq, max_seq_len: int, tokenizer=None):
  """(reason, tokens, text) when ``s``'s last token ends it, else None. A stop token is not
  returned; text is cut before a stop string."""
  p, gen = s.params, s.generated
  if gen[-1] in p.stop_token_ids:
    toks = gen[:-1]
    return "stop", toks, tokenizer.decode(toks) if tokenizer is not None else None
  text = tokenizer.decode(gen) if tokenizer is not None else None
  if p.stop_strings:
    hits = [text.find(x) for x in p.stop_strings if x and x in text]
    if hits:
      return "stop", list(gen), text[: min(hits)]
  if len(gen) >= p.max_new_tokens or len(s.tokens) >= max_seq_len:
    return "length", list(gen), text
  return None
