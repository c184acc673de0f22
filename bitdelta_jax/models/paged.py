"""Continuous batching over a paged KV cache: cost proportional to the live work.

    gen = PagedGenerator(model, max_rows=32, max_seq_len=2048, tokenizer=tok)
    seq = gen.add(prompt_ids, slot=1, params=SamplingParams(...))
    seqs = gen.add_n(prompt_ids, 1, params, tags=[...])   # n choices, one prefill
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

Per request (`SamplingParams`): **n choices** (`add_n`) share one prefill: choice 0 computes
the prompt, the others draw their first token from the same logits with their own keys and
take copies of its page table (full pages by reference count, the last partial page copied on
device). **Logit controls** (token mask of a grammar, logit bias, min_tokens, penalties) are
per-row fixed-shape arrays of the same call (`bitdelta_jax.models.controls`); a batch without
any reuses cached neutral device arrays, so plain decoding pays nothing for them. **Log
probabilities** of the sampled tokens come back from the same call when a row asks; prompt
log probabilities (``echo``) are computed at extra output positions of the prefill calls (such
a prompt is always computed in full, never taken from the prefix cache). A grammar's
``Matcher`` fills its row's mask before each call and accepts the token after it.

Compiles are bounded by the buckets: (rows, 1, pages) for decode and (slots, tokens, pages) for
prefill, each also in a base-only form (no variant rows: the delta kernels are skipped), plus
one per bucket of scored prompt positions (16, 32, ...) for echo requests. The greedy/sampled
choice is per row inside the step (`bitdelta_jax.models.sampling.sample`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from bitdelta_jax.models.controls import LogitControls
from bitdelta_jax.models.kv_pages import OutOfPages, PagePool, page_hashes
from bitdelta_jax.models.paged_batch import (
  Generation,
  PagedBatch,
  Seq,
  StepResult,
  fill_masks,
  finish_reason,
  per_request,
  prng_key,
)
from bitdelta_jax.models.paged_runner import PagedRunner
from bitdelta_jax.models.sampling import SamplingParams


def _pow2(n: int, lo: int = 1) -> int:
  b = lo
  while b < n:
    b *= 2
  return b


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
    mesh=None,
    rules=None,
    runner=None,
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
    self.runner = runner if runner is not None else PagedRunner(
      model, num_pages=int(num_pages), page_size=self.page_size, max_seq_len=self.max_seq_len,
      mesh=mesh, rules=rules)
    self.vocab_size = cfg.vocab_size + cfg.extra_vocab  # the width of the logits
    self.slot_epoch = [0] * cfg.num_slots
    self.waiting: deque[Seq] = deque()
    self.running: list[Seq] = []
    self._order = itertools.count()
    self.shapes_run: set[tuple] = set()
    self.steps = 0  # scheduler iterations run (the clock of `Seq.progress_step`)

  # -- variants ------------------------------------------------------------------------------
  @property
  def mesh(self):
    return self.runner.mesh

  @property
  def lost(self) -> str | None:
    """Why the runner cannot go on (multi-process: a worker was lost), or None."""
    return getattr(self.runner, "lost", None)

  def refresh(self) -> None:
    """Re-reads the model's state (after its banks or parameters changed)."""
    self.runner.refresh()

  def load_variant(self, slot: int, delta) -> None:
    """``delta``: an in-memory delta dict, or (on a mesh) also a delta directory, written
    shard by shard."""
    self.runner.load_variant(slot, delta)
    self.slot_epoch[slot] += 1  # cached prefixes of the old contents are never matched again

  def clear_slot(self, slot: int) -> None:
    self.runner.clear_slot(slot)
    self.slot_epoch[slot] += 1

  @property
  def kv_bytes(self) -> int:
    return self.runner.kv_bytes

  @property
  def compiles(self) -> int:
    return self.runner.compiles

  # -- scheduling API -------------------------------------------------------------------------
  def add(self, prompt: Sequence[int], slot: int = 0, params: SamplingParams = SamplingParams(),
          *, tag=None) -> Seq:
    return self.add_n(prompt, slot, params, [tag])[0]

  def add_n(self, prompt: Sequence[int], slot: int, params: SamplingParams,
            tags: Sequence) -> list[Seq]:
    """``len(tags)`` choices of one prompt that share its prefill: choice 0 computes the
    prompt; when it is done every other choice draws its first token from the same logits (its
    own key, `prng_key`) and takes a copy of choice 0's page table (full pages shared by
    reference count, the partly filled last page copied)."""
    n = len(prompt)
    if n == 0:
      raise ValueError("empty prompt")
    if n >= self.max_seq_len:
      raise ValueError(f"prompt of {n} tokens leaves no room in max_seq_len {self.max_seq_len}")
    if not 0 <= slot < len(self.slot_epoch):
      raise ValueError(f"slot {slot} out of range [0, {len(self.slot_epoch)})")
    if not tags:
      raise ValueError("at least one choice")
    width = getattr(params.grammar, "tokenizer_vocab_size", 0)
    if width > self.vocab_size:
      raise ValueError(f"the grammar's tokenizer has {width} tokens, more than the model's "
                       f"{self.vocab_size} logits")
    vkey = (slot, self.slot_epoch[slot]) if slot else (0,)
    group = []
    for i, tag in enumerate(tags):
      s = Seq(list(prompt), slot, params, prng_key(params.seed, i), vkey, next(self._order), tag,
              choice=i, leader=group[0] if group else None)
      s.tokens = list(prompt)
      if params.grammar is not None:
        s.matcher = params.grammar.matcher()
      self._progress(s)
      group.append(s)
    group[0].followers = group[1:]
    self.waiting.append(group[0])
    return group

  def _progress(self, s: Seq) -> None:
    """Records that ``s`` was computed, forked, admitted, or deliberately deferred (queued
    behind older prompts, preempted) now: the clock of `stalled`."""
    s.progress_at, s.progress_step = time.monotonic(), self.steps

  def stalled(self, limit_s: float, now: float | None = None) -> list[Seq]:
    """Sequences (a leader stands for its unforked choices) that the scheduler has neither
    computed nor deferred for ``limit_s`` seconds and at least two iterations (so one slow
    step, e.g. a compile, never counts): running ones, and waiting ones while a row is free.
    The scheduler never leaves a sequence so; a caller fails these rather than let a bug hold
    pages and a variant slot forever."""
    now = time.monotonic() if now is None else now
    cands = list(self.running)
    if len(self.running) < self.max_rows:
      cands += self.waiting
    return [s for s in cands
            if now - s.progress_at > limit_s and self.steps - s.progress_step >= 2]

  def finish(self, s: Seq) -> None:
    """Drops a sequence (finished or cancelled) and releases its pages. Choices not yet forked
    from it are dropped with it."""
    if s.finished:
      return
    s.finished = True
    if s.leader is not None and s in s.leader.followers:  # not forked yet
      s.leader.followers.remove(s)
      return
    for f in s.followers:
      f.finished = True
    s.followers = []
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
      if not s.pages and s.n_cached == 0 and not s.scores_prompt:
        # reuse cached full pages, always leaving at least one token to compute
        full = (len(s.tokens) - 1) // self.page_size
        s.hashes = page_hashes(s.tokens, self.page_size, s.variant_key, full)
        s.pages = self.pool.lookup(s.hashes)
        s.hashes = s.hashes[: len(s.pages)]
        s.n_cached = len(s.pages) * self.page_size
      self._progress(s)
      self.running.append(s)
    for s in self.waiting:  # queued for a row: deferred, not stuck
      self._progress(s)

  def _preempt_newest(self) -> Seq:
    victim = max(self.running, key=lambda x: x.order)
    self.running.remove(victim)
    self.pool.release(victim.pages)
    victim.pages, victim.hashes, victim.n_cached = [], [], 0
    self._progress(victim)
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
      # a leader whose choices are not forked yet always runs as prefill, even with one token
      # left (a 1-token prompt, a prefix-cache hit): only a prefill call's outputs carry the
      # choices' first tokens, which is where they fork
      as_decode = s.pending == 1 and not s.followers
      n = 1 if as_decode else min(s.pending, budget)
      if n == 0:  # older prompts took this iteration's prefill budget
        self._progress(s)
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
          msg = (f"the KV cache ({self.pool.num_pages - 1} pages of {self.page_size}) cannot "
                 f"hold a sequence of {len(s.tokens)} tokens")
          errors.extend((x, msg) for x in [s, *s.followers])
          self.finish(s)
        break
      if as_decode:
        decode.append((s, 1))
      else:
        prefill.append((s, n))
        budget -= n
    # planned sequences are never preempted later in the loop: a victim is the newest running
    # sequence, so it is at least as new as the one being planned, and all planned ones are older
    return decode, prefill, errors

  def step(self) -> StepResult:
    """One scheduler iteration: admit, plan, run decode rows and prefill chunks."""
    self.steps += 1
    self._admit()
    decode, prefill, errors = self._plan()
    calls = []
    if decode:
      calls.append((decode, self._decode_batch(decode)))
    if prefill:
      for group in self._prefill_groups(prefill):
        calls.append((group, self._prefill_batch(group)))
    pending_out = []
    for work, (batch, outputs, scored, base_only) in calls:
      out = self.runner.run(batch, base_only)
      self.shapes_run.add((batch.tokens.shape, batch.pages.shape[1], len(outputs), base_only))
      pending_out.append((work, outputs, scored, out))
    result = StepResult([], errors, sum(n for _, n in prefill))
    copies: list[tuple[int, int]] = []
    fetch = self.runner.fetch
    for work, outputs, scored, out in pending_out:
      tok = fetch(out.tokens)
      if any(s.params.logprobs is not None for s in outputs):
        lp, ids, vals = (fetch(a) for a in (out.logprob, out.top_ids, out.top_logprobs))
        for j, s in enumerate(outputs):
          if s.params.logprobs is not None:
            k = s.params.logprobs
            s.token_logprobs.append((float(lp[j]), ids[j, :k].tolist(), vals[j, :k].tolist()))
      if scored:
        lp, ids, vals = (fetch(a) for a in (out.score, out.score_top_ids,
                                            out.score_top_logprobs))
        for j, (s, p) in enumerate(scored):
          k = s.params.prompt_logprobs
          s.prompt_logprobs[p] = (float(lp[j]), ids[j, :k].tolist(), vals[j, :k].tolist())
      for s, n in work:
        self._advance(s, n)
      for j, s in enumerate(outputs):
        if s.leader is not None and s in s.leader.followers:
          self._fork(s, copies)
        t = int(tok[j])
        s.tokens.append(t)
        if s.matcher is not None and not s.grammar_done:
          try:
            s.matcher.accept(t)
          except ValueError as e:  # only if the mask was empty; never fail the whole step
            s.grammar_error = str(e)
        result.tokens.append((s, t))
    if copies:
      n = _pow2(len(copies))
      src = np.zeros((n,), np.int32)  # padding copies the reserved page 0 onto itself
      dst = np.zeros((n,), np.int32)
      src[: len(copies)], dst[: len(copies)] = zip(*copies)
      self.runner.copy_pages(src, dst)
    return result

  def _fork(self, s: Seq, copies: list) -> None:
    """Gives choice ``s`` its leader's prompt pages (now computed): full pages by reference,
    the partly filled last page as a copy (queued in ``copies``). With no page left for the
    copy it starts from nothing instead (recomputed later, like a preempted sequence)."""
    lead = s.leader
    lead.followers.remove(s)
    s.leader = None
    full = lead.n_cached // self.page_size
    shared = lead.pages[:full]
    tail = []
    if lead.n_cached % self.page_size:
      try:
        tail = [self.pool.allocate()]
      except OutOfPages:
        self._progress(s)
        self.waiting.appendleft(s)
        return
      copies.append((lead.pages[full], tail[0]))
    self.pool.share(shared)
    s.pages = shared + tail
    s.hashes = lead.hashes[:full]
    s.n_cached = lead.n_cached
    self._progress(s)
    self.waiting.appendleft(s)  # admitted (with its pages) before anything new

  def _advance(self, s: Seq, n: int) -> None:
    """Marks ``n`` more tokens cached and publishes pages that became full."""
    s.n_cached += n
    self._progress(s)
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
    outputs += [f for s in outputs for f in s.followers]  # n > 1: their first tokens
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
    scored: list[tuple[Seq, int]] = []  # (seq, prompt position whose logprob is computed)
    score_index: list[int] = []
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
        if s.scores_prompt:  # position q's logits score prompt token q + 1
          for q in range(s.n_cached, min(s.n_cached + n, len(s.prompt) - 1)):
            scored.append((s, q + 1))
            score_index.append(r * t + col + q - s.n_cached)
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
    want_lp = np.zeros((nout,), bool)
    for j, s in enumerate(outputs):
      out_index[j] = out_at[id(s if s.leader is None else s.leader)]
      out_slot[j] = s.slot
      keys[j] = s.key
      key_pos[j] = len(s.tokens)
      temp[j], top_p[j], top_k[j] = s.params.temperature, s.params.top_p, s.params.top_k
      want_lp[j] = s.params.logprobs is not None
    m = _pow2(len(scored), 16) if scored else 0
    s_index = np.zeros((m,), np.int32)
    s_slot = np.zeros((m,), np.int32)
    s_target = np.zeros((m,), np.int32)
    for j, ((s, p_), i) in enumerate(zip(scored, score_index)):
      s_index[j], s_slot[j], s_target[j] = i, s.slot, s.prompt[p_]
    batch = PagedBatch(tokens, positions, seq, wpage, woff, pages, page_seq, page_start,
                       page_fill, slot_ids, out_index, out_slot, keys, key_pos, temp, top_p, top_k,
                       self._controls(outputs, nout), want_lp, s_index, s_slot, s_target)
    base_only = not any(s.slot for work in rows for s, _ in work)
    return batch, outputs, scored, base_only

  def _controls(self, outputs: Sequence[Seq], nout: int) -> LogitControls | None:
    """The outputs' logit controls: None (the runner's cached neutral arrays) when no output
    uses any, else host arrays with each controlled row filled in."""
    if not any(s.params.controlled for s in outputs):
      return None
    c = LogitControls.neutral(nout, self.vocab_size, self.max_seq_len)
    fill_masks([s.matcher for s in outputs], c.mask)
    for j, s in enumerate(outputs):
      p = s.params
      bias = list(p.logit_bias)
      if len(s.generated) < p.min_tokens:
        bias += [(t, -np.inf) for t in p.stop_token_ids]
      if bias:
        c.bias_ids[j, : len(bias)], c.bias_vals[j, : len(bias)] = zip(*bias)
      if p.penalised:
        c.history[j, : len(s.tokens)] = s.tokens
        c.prompt_len[j] = len(s.prompt)
        c.presence[j], c.frequency[j] = p.presence_penalty, p.frequency_penalty
        c.repetition[j] = p.repetition_penalty
    return c

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
    """Generates for every prompt and applies the stops on the host: stop token ids (the stop
    token is not returned), stop strings (needs a tokenizer; the text is cut before the stop
    string, the tokens keep the one that completed it), ``max_new_tokens`` and
    ``max_seq_len`` (``finish_reason`` "stop" or "length")."""
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


