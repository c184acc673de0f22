"""Continuous batching over a paged KV cache: cost proportional to the live work.

    gen = PagedGenerator(model, max_rows=32, max_seq_len=2048, tokenizer=tok)
    seq = gen.add(prompt_ids, slot=1, params=SamplingParams(...))
    seqs = gen.add_n(prompt_ids, 1, params, tags=[...])   # n choices, one prefill
    while gen.has_work:
      for seq, token in gen.step().tokens: ...        # the caller applies stops, then
      gen.finish(seq)                                  # frees (and caches) its pages
    gen.generate(prompts, slot_ids, params)            # the whole loop, stops included

Each `step` is one scheduler iteration and one device call: a **ragged token batch**
(`bitdelta_jax.models.paged_batch.PagedBatch`) of every running sequence's work, decode tokens
first, then prompt chunks:

* **decode**: every sequence whose next token is known adds one token, in a *decode lane*
  that reads only its own pages, as far as its length (a lone stream costs one token, a short
  context a short attention).
* **prefill**: waiting prompts, several at once, up to ``prefill_chunk`` tokens per iteration;
  a longer prompt is cut into chunks over successive iterations, so decode tokens keep
  stepping while it fills (chunked prefill), and prompts may be as long as ``max_seq_len``.
  Prompt tokens of every variant slot share the batch (each token carries its own slot and
  attends only to its own sequence).

The batch is padded to a **token bucket** (powers of two up to ``max_rows + prefill_chunk``,
and that budget itself; `StepShapes`), and nothing else in its shapes varies: the page tables
have a fixed width and the attention loops run as far as the live lengths
(`pallas_kernels.paged_attention`). So the programs are one per bucket (a batch without a
variant's token skips the delta kernels inside the same program), and `warmup` compiles them
all ahead of time; prompt log probabilities are a branch of the same programs.

Pages are allocated as tokens arrive (`bitdelta_jax.models.kv_pages.PagePool`). Full pages are
published for prefix reuse per variant: a prompt that starts like an earlier one (a system
prompt, a few-shot header, a previous turn) skips those pages. When the pool runs dry the newest
sequence is preempted (its pages freed, and it is recomputed later from its tokens so far).

Per request (`SamplingParams`): **n choices** (`add_n`) share one prefill: choice 0 computes
the prompt; when it draws its first token the others fork: they take its page table but the
last prompt token (full pages by reference count, the partly filled last page copied on
device) and each computes that token in a decode lane of the next step, drawing its first token
with its own key. **Logit controls** (token mask of a grammar, logit bias, min_tokens,
penalties) are per-output fixed-shape arrays of the same call (`bitdelta_jax.models.controls`);
a batch without any reuses cached neutral device arrays, so plain decoding pays nothing for
them. **Log probabilities** of the sampled tokens come back from the same call when an output
asks; prompt log probabilities (``echo``) score the prompt positions of the step (such a prompt
is always computed in full, never taken from the prefix cache). A grammar's ``Matcher`` fills
its output's mask before each call and accepts the token after it. The greedy/sampled choice is
per output inside the step (`bitdelta_jax.models.sampling.sample`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from bitdelta_jax.models.kv_pages import OutOfPages, PagePool, page_hashes
from bitdelta_jax.models.logit_controls import LogitControls
from bitdelta_jax.models.paged_batch import (
  Generation,
  Seq,
  StepResult,
  StepShapes,
  fill_masks,
  finish_reason,
  per_request,
  prng_key,
)
from bitdelta_jax.models.sampling_params import SamplingParams


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
    tokenizer=None,
    mesh=None,
    rules=None,
    runner=None,
    block_pages: int | None = None,
    scan_layers: bool | None = None,
    step_cache_dir=None,
  ):
    if page_size < 1 or prefill_chunk < 1 or max_rows < 1:
      raise ValueError("page_size, prefill_chunk and max_rows must be >= 1")
    self.model = model
    self.tokenizer = tokenizer
    self.max_rows = int(max_rows)
    self.max_seq_len = int(max_seq_len)
    self.page_size = int(page_size)
    self.prefill_chunk = int(prefill_chunk)
    self.max_pages_per_seq = -(-self.max_seq_len // self.page_size)
    if num_pages is None:  # room for every row at full length, plus the reserved page
      num_pages = self.max_rows * self.max_pages_per_seq + 1
    self.pool = PagePool(int(num_pages), self.page_size, prefix_caching)
    cfg = model.config
    self.vocab_size = cfg.vocab_size + cfg.extra_vocab  # the width of the logits
    self.shapes = StepShapes(
      max_rows=self.max_rows, max_step_tokens=self.max_rows + self.prefill_chunk,
      max_pages_per_seq=self.max_pages_per_seq, page_size=self.page_size,
      block_pages=int(block_pages or max(1, 128 // self.page_size)),
      vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
    if runner is None:  # the device side; the scheduler itself never imports JAX
      from bitdelta_jax.models.paged_runner import PagedRunner

      runner = PagedRunner(
        model, shapes=self.shapes, num_pages=int(num_pages), mesh=mesh, rules=rules,
        scan_layers=scan_layers, step_cache_dir=step_cache_dir)
    self.runner = runner
    self.slot_epoch = [0] * cfg.num_slots
    self.waiting: deque[Seq] = deque()
    self.running: list[Seq] = []
    self._order = itertools.count()
    self.shapes_run: set[tuple] = set()  # (tokens bucket, base_only) of every step run
    self.steps = 0  # scheduler iterations run (the clock of `Seq.progress_step`)
    self._in_step: list[Seq] = []  # the sequences of the step in progress (`recover`)

  @property
  def base_only(self) -> bool:
    """The model has no variant slots: its step is the base's alone."""
    return len(self.slot_epoch) == 1

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
    self._preempt(victim)
    return victim

  def _preempt(self, s: Seq) -> None:
    """Frees ``s``'s pages and queues it first: it is recomputed later from its tokens."""
    self.running.remove(s)
    self.pool.release(s.pages)
    s.pages, s.hashes, s.n_cached = [], [], 0
    self._progress(s)
    self.waiting.appendleft(s)

  def recover(self) -> list[Seq]:
    """Makes the engine usable again after `step` raised, and returns the sequences of that
    step (with their choices not yet forked), now dropped: the caller fails them. The other
    running sequences are preempted (recomputed from their tokens, as after running out of
    pages), every cached prefix is forgotten, and the runner's KV pools are rebuilt, since the
    failed call may have consumed the pools donated to it."""
    failed = []
    for s in self._in_step:
      if not s.finished:
        failed += [s, *s.followers]
        self.finish(s)
    self._in_step = []
    for s in sorted(self.running, key=lambda x: x.order, reverse=True):
      self._preempt(s)  # newest first, so the oldest ends up first in the queue
    self.pool.clear_cache()
    self.runner.reset_pools()
    return failed

  def _plan(self) -> tuple[list[tuple[Seq, int]], list[tuple[Seq, int]], list[tuple[Seq, str]]]:
    """Chooses this iteration's work and allocates its pages: (decode, prefill, errors), the
    first two as (seq, number of new tokens)."""
    decode, prefill, errors = [], [], []
    budget = self.prefill_chunk
    for s in sorted(self.running, key=lambda x: x.order):
      if s not in self.running:  # preempted while planning an older one
        continue
      as_decode = s.pending == 1  # (choices fork when their leader's first token is drawn,
      n = 1 if as_decode else min(s.pending, budget)  # in a decode lane or after a prompt)
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
    """One scheduler iteration: admit, plan, and run one ragged batch of decode tokens and
    prompt chunks (one device call)."""
    self.steps += 1
    self._admit()
    decode, prefill, errors = self._plan()
    self._in_step = [s for s, _ in decode + prefill]  # what `recover` fails if this raises
    result = StepResult([], errors, sum(n for _, n in prefill))
    if not decode and not prefill:
      return result
    batch, outputs, scored, base_only = self._batch(decode, prefill)
    out = self.runner.run(batch, base_only)
    self.shapes_run.add((batch.num_tokens, base_only))
    fetch = self.runner.fetch
    tok = fetch(out.tokens)
    if any(s.params.logprobs is not None for s in outputs):
      lp, ids, vals = (fetch(a) for a in (out.logprob, out.top_ids, out.top_logprobs))
      for j, s in enumerate(outputs):
        if s.params.logprobs is not None:
          k = s.params.logprobs
          s.token_logprobs.append((float(lp[j]), ids[j, :k].tolist(), vals[j, :k].tolist()))
    if scored:
      lp, ids, vals = (fetch(a) for a in (out.score, out.score_top_ids, out.score_top_logprobs))
      for s, p, i in scored:
        k = s.params.prompt_logprobs
        s.prompt_logprobs[p] = (float(lp[i]), ids[i, :k].tolist(), vals[i, :k].tolist())
    for s, n in decode + prefill:
      self._advance(s, n)
    copies: list[tuple[int, int]] = []
    for j, s in enumerate(outputs):
      t = int(tok[j])
      s.tokens.append(t)
      if s.matcher is not None and not s.grammar_done:
        try:
          s.matcher.accept(t)
        except ValueError as e:  # only if the mask was empty; never fail the whole step
          s.grammar_error = str(e)
      result.tokens.append((s, t))
      for f in list(s.followers):  # its prompt is computed: the other choices fork now
        self._fork(f, copies)
    if copies:
      src, dst = zip(*copies)
      self.runner.copy_pages(np.asarray(src, np.int32), np.asarray(dst, np.int32))
    self._in_step = []
    return result

  def _fork(self, s: Seq, copies: list) -> None:
    """Gives choice ``s`` its leader's prompt pages but the last token (now computed): full
    pages by reference, the partly filled last one as a copy (queued in ``copies``). It then
    computes the prompt's last token itself, in a decode lane, and draws its first token from
    those logits with its own key (as a prefix-cache hit would). With no page left for the copy
    it starts from nothing instead (recomputed later, like a preempted sequence)."""
    lead = s.leader
    lead.followers.remove(s)
    s.leader = None
    keep = len(s.prompt) - 1  # tokens taken over; the last prompt token is recomputed
    full = keep // self.page_size
    shared = lead.pages[:full]
    tail = []
    if keep % self.page_size:
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
    s.n_cached = keep
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
  def _batch(self, decode, prefill):
    """The step's ragged batch: decode tokens in the first positions (each a decode lane),
    then the prompt chunks; padded to the token bucket (`StepShapes`)."""
    ps, sh = self.page_size, self.shapes
    n_tok = len(decode) + sum(n for _, n in prefill)
    b = sh.empty(sh.bucket(n_tok))
    out_at: dict[int, int] = {}
    for r, (s, _) in enumerate(decode):
      pos = s.n_cached
      b.tokens[r], b.positions[r], b.slot_ids[r] = s.tokens[pos], pos, s.slot
      b.write_page[r], b.write_offset[r] = s.pages[pos // ps], pos % ps
      b.lane_pages[r, : len(s.pages)] = s.pages
      b.lane_len[r] = pos + 1
      out_at[id(s)] = r
    col, u = len(decode), 0
    scored: list[tuple[Seq, int, int]] = []  # (seq, prompt position scored, token index)
    for j, (s, n) in enumerate(prefill):
      pos = np.arange(s.n_cached, s.n_cached + n)
      sl = slice(col, col + n)
      b.tokens[sl] = s.tokens[s.n_cached : s.n_cached + n]
      b.positions[sl], b.slot_ids[sl], b.token_seq[sl] = pos, s.slot, j
      b.write_page[sl] = np.asarray(s.pages, np.int32)[pos // ps]
      b.write_offset[sl] = pos % ps
      k = len(s.pages)
      b.pages[u : u + k], b.page_seq[u : u + k] = s.pages, j
      b.page_start[u : u + k] = np.arange(k) * ps
      b.page_fill[u : u + k] = np.clip(s.n_cached + n - np.arange(k) * ps, 0, ps)
      if s.n_cached + n == len(s.tokens):
        out_at[id(s)] = col + n - 1
      if s.scores_prompt:  # position q's logits score prompt token q + 1
        for q in range(s.n_cached, min(s.n_cached + n, len(s.prompt) - 1)):
          i = col + q - s.n_cached
          b.score_target[i] = s.prompt[q + 1]
          scored.append((s, q + 1, i))
      col += n
      u += k
    # padding tokens take the last real token's slot: a prefill chunk of one variant's prompt
    # is then all one slot, which the many-row CPU delta path runs as one dot on W + α⊙S
    # (`delta_matmul.cpu`); they read and write no page, and their outputs are never used
    if 0 < n_tok < len(b.slot_ids):
      b.slot_ids[n_tok:] = b.slot_ids[n_tok - 1]
    bk = sh.block_pages * ps
    b.blocks[:] = (-(-int(b.lane_len.max(initial=0)) // bk), -(-u // sh.block_pages))
    outputs = [s for s, _ in decode + prefill if id(s) in out_at]
    for j, s in enumerate(outputs):
      b.out_index[j], b.out_slot_ids[j], b.keys[j] = out_at[id(s)], s.slot, s.key
      b.key_pos[j] = len(s.tokens)
      b.temperature[j], b.top_p[j], b.top_k[j] = (s.params.temperature, s.params.top_p,
                                                  s.params.top_k)
      b.want_logprobs[j] = s.params.logprobs is not None
    batch = dataclasses.replace(b, controls=self._controls(outputs, b.out_index.shape[0]))
    # One form of the step serves every batch: the delta kernels are skipped at run time when
    # no token is a variant's (`DeltaDense`); a model without variant slots has only the base's.
    return batch, outputs, scored, self.base_only

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
  def warmup(self, *, threads: int = 2, progress=None) -> float:
    """Compiles every step program the scheduler can ask for (one per token bucket) ahead of
    time; returns the seconds it took. After it, the runner counts (or, with
    ``runner.guard``, refuses) any step it did not compile."""
    return self.runner.compile_all((self.base_only,), threads=threads, progress=progress)

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


