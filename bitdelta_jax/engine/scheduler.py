"""The host half of a step: which tokens run, where their K/V go, what comes back.

    sched = Scheduler(shapes, pool, slot_epoch)
    sched.add_n(requests)                    # n choices of one prompt, one prefill
    plan = sched.schedule()                  # admit, plan, allocate pages: a `ScheduledStep`
    out = runner.run(plan.batch, plan.base_only)        # the device half (`runner`)
    result = sched.update(plan, out, runner.fetch)      # tokens back into the requests

One `schedule` is one iteration: a **ragged token batch** (`batch.PagedBatch`) of every running
request's work, decode tokens first, then prompt chunks:

* **decode**: every request whose next token is known adds one token, in a *decode lane* that
  reads only its own pages, as far as its length.
* **prefill**: waiting prompts, several at once, up to ``prefill_chunk`` tokens per iteration;
  a longer prompt is cut into chunks over successive iterations (chunked prefill), so decode
  keeps stepping while it fills. The oldest prompt gets up to a quarter of the budget, the rest
  goes to the prompts with the fewest tokens left (`_prefill_shares`): a short prompt does not
  wait behind all of a long one's chunks. Prompt tokens of every variant slot share the batch.

The batch is padded to a **token bucket** (`batch.StepShapes`), whose program the warm-up
compiled. Pages are allocated as tokens arrive (`kv_pages.PagePool`); full pages are published
for prefix reuse per variant and load epoch. When the pool runs dry the newest request is
preempted (its pages freed; it is recomputed later from its tokens so far).

**n choices** share one prefill: choice 0 computes the prompt; when it draws its first token
the others fork: they take its page table but the last prompt token (full pages by reference
count, the partly filled last page copied on device: `ScheduledStep` returns the copies) and
each computes that token in a decode lane, drawing with its own key. Logit controls (grammar
mask, bias, min_tokens, penalties) are filled per output (`controls`); a batch without any
passes None (the runner's cached neutral arrays).

Numpy only: the scheduler never imports JAX (process 0 of a multi-process server schedules; the
plan it builds is what every process runs).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from bitdelta_jax.engine.batch import PagedBatch, StepShapes, fill_masks, prng_key
from bitdelta_jax.engine.kv_pages import OutOfPages, PagePool, page_hashes
from bitdelta_jax.engine.logit_controls import LogitControls
from bitdelta_jax.engine.request import Request


@dataclasses.dataclass
class StepResult:
  tokens: list[tuple[Request, int]]  # a new token of each request that produced one
  errors: list[tuple[Request, str]]  # requests dropped by the scheduler (they hold no pages)
  prefill_tokens: int = 0


@dataclasses.dataclass
class ScheduledStep:
  """One iteration's plan: the batch (None: nothing to run) and how to read its outputs."""

  batch: PagedBatch | None
  base_only: bool
  decode: list[tuple[Request, int]]
  prefill: list[tuple[Request, int]]
  outputs: list[Request]  # the request of each output row
  scored: list[tuple[Request, int, int]]  # (request, prompt position scored, token index)
  errors: list[tuple[Request, str]]


class Scheduler:
  """Requests, KV pages and the batches of one data group; see the module docstring."""

  def __init__(self, shapes: StepShapes, pool: PagePool, slot_epoch: list[int], *,
               prefill_chunk: int, base_only: bool = False, group_index: int = 0,
               order: Callable[[], int] | None = None):
    self.shapes = shapes
    self.pool = pool
    self.slot_epoch = slot_epoch  # shared by every data group: (slot, epoch) keys prefixes
    self.max_rows = shapes.max_rows
    self.max_seq_len = shapes.max_seq_len
    self.page_size = shapes.page_size
    self.prefill_chunk = int(prefill_chunk)
    self.vocab_size = shapes.vocab_size
    self.base_only = base_only
    self.group_index = group_index
    self._order = order or itertools.count().__next__
    self.waiting: deque[Request] = deque()
    self.running: list[Request] = []
    self.steps = 0  # iterations scheduled (the clock of `Request.progress_step`)
    self._in_step: list[Request] = []  # the requests of the step in progress (`recover`)
    # token buckets whose program is ready, ascending (None: all of `shapes.buckets()`); set
    # while larger ones compile in the background (`Generator.warmup`): a step is padded to
    # the smallest ready bucket and holds at most the largest one's tokens
    self.buckets: tuple[int, ...] | None = None

  @property
  def load(self) -> int:
    """Requests held (running, waiting, and choices not forked yet): where new work goes."""
    return sum(1 + len(s.followers) for s in itertools.chain(self.running, self.waiting))

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  # -- requests -------------------------------------------------------------------------------
  def add_n(self, group: Sequence[Request]) -> None:
    """The ``n`` choices of one prompt (validated by the caller): choice 0 computes the prompt;
    when it is done every other choice draws its first token from the same logits (its own key,
    `prng_key`) and takes a copy of choice 0's page table."""
    lead = group[0]
    vkey = (lead.slot, self.slot_epoch[lead.slot]) if lead.slot else (0,)
    for i, s in enumerate(group):
      s.choice, s.key, s.variant_key, s.order = i, prng_key(s.params.seed, i), vkey, self._order()
      s.group_index, s.leader = self.group_index, (lead if i else None)
      s.tokens = list(s.prompt)
      s.siblings = list(group)
      if s.params.grammar is not None:
        s.matcher = s.params.grammar.matcher()
      self._progress(s)
    lead.followers = list(group[1:])
    self.waiting.append(lead)

  def _progress(self, s: Request) -> None:
    """Records that ``s`` was computed, forked, admitted, or deliberately deferred (queued
    behind older prompts, preempted) now: the clock of `stalled`."""
    s.progress_at, s.progress_step = time.monotonic(), self.steps

  def stalled(self, limit_s: float, now: float | None = None) -> list[Request]:
    """Requests (a leader stands for its unforked choices) that the scheduler has neither
    computed nor deferred for ``limit_s`` seconds and at least two iterations (so one slow
    step, e.g. a compile, never counts): running ones, and waiting ones while a row is free.
    The scheduler never leaves a request so; a caller fails these rather than let a bug hold
    pages and a variant slot forever."""
    now = time.monotonic() if now is None else now
    cands = list(self.running)
    if len(self.running) < self.max_rows:
      cands += self.waiting
    return [s for s in cands
            if now - s.progress_at > limit_s and self.steps - s.progress_step >= 2]

  def finish(self, s: Request) -> None:
    """Drops a request (finished or cancelled) and releases its pages. Choices not yet forked
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

  def _preempt_newest(self) -> Request:
    victim = max(self.running, key=lambda x: x.order)
    self._preempt(victim)
    return victim

  def _preempt(self, s: Request) -> None:
    """Frees ``s``'s pages and queues it first: it is recomputed later from its tokens."""
    self.running.remove(s)
    self.pool.release(s.pages)
    s.pages, s.hashes, s.n_cached = [], [], 0
    self._progress(s)
    self.waiting.appendleft(s)

  def recover(self) -> list[Request]:
    """After a step raised: returns the requests of that step (with their choices not yet
    forked), now dropped (the caller fails them). The other running requests are preempted
    (recomputed from their tokens, as after running out of pages) and every cached prefix is
    forgotten; the caller rebuilds the runner's KV pools, which the failed call may have
    consumed."""
    failed = []
    for s in self._in_step:
      if not s.finished:
        failed += [s, *s.followers]
        self.finish(s)
    self._in_step = []
    for s in sorted(self.running, key=lambda x: x.order, reverse=True):
      self._preempt(s)  # newest first, so the oldest ends up first in the queue
    self.pool.clear_cache()
    return failed

  # -- one iteration --------------------------------------------------------------------------
  def _plan(self) -> tuple[list[tuple[Request, int]], list[tuple[Request, int]],
                           list[tuple[Request, str]]]:
    """Chooses this iteration's work and allocates its pages: (decode, prefill, errors), the
    first two as (request, number of new tokens)."""
    decode, prefill, errors = [], [], []
    budget = self.prefill_chunk
    if self.buckets is not None:  # the largest ready bucket holds this step; decode comes first
      decoding = sum(1 for s in self.running if s.pending == 1)
      budget = max(0, min(budget, self.buckets[-1] - decoding))
    share = self._prefill_shares(budget)
    for s in sorted(self.running, key=lambda x: x.order):
      if s not in self.running:  # preempted while planning an older one
        continue
      as_decode = s.pending == 1  # (choices fork when their leader's first token is drawn,
      n = 1 if as_decode else min(share.get(id(s), 0), budget)  # in a lane or after a prompt)
      if n == 0:  # other prompts took this iteration's prefill budget (`_prefill_shares`)
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
    # planned requests are never preempted later in the loop: a victim is the newest running
    # request, so it is at least as new as the one being planned, and all planned ones are older
    return decode, prefill, errors

  def _prefill_shares(self, budget: int) -> dict[int, int]:
    """Prompt tokens each unfinished prompt computes this iteration (by ``id``): the oldest
    takes up to a quarter of ``budget`` first (so none waits forever: each becomes the oldest),
    then the rest goes to the prompts with the fewest tokens left, oldest first among equals.
    So a short prompt that arrives behind a long one is computed within an iteration instead of
    after all of the long one's chunks (first come, first served, it waited ~6 s behind a
    2k-token prompt at 1B); a lone prompt still takes the whole budget. The plan then walks the requests oldest first
    as before (preemption takes the newest, never one already planned)."""
    prompts = sorted((s for s in self.running if s.pending > 1), key=lambda x: x.order)
    if not prompts:
      return {}
    first = prompts[0]
    share = {id(first): min(first.pending, budget if len(prompts) == 1 else max(1, budget // 4))}
    left = budget - share[id(first)]
    for s in sorted(prompts, key=lambda x: (x.pending - share.get(id(x), 0), x.order)):
      if left <= 0:
        break
      n = min(s.pending - share.get(id(s), 0), left)
      share[id(s)] = share.get(id(s), 0) + n
      left -= n
    return share

  def schedule(self) -> ScheduledStep:
    """One iteration's host work: admit, plan, allocate pages and build the batch (None when
    nothing runs)."""
    self.steps += 1
    self._admit()
    decode, prefill, errors = self._plan()
    self._in_step = [s for s, _ in decode + prefill]  # what `recover` fails if this raises
    if not decode and not prefill:
      return ScheduledStep(None, self.base_only, decode, prefill, [], [], errors)
    batch, outputs, scored = self._batch(decode, prefill)
    return ScheduledStep(batch, self.base_only, decode, prefill, outputs, scored, errors)

  def update(self, plan: ScheduledStep, out, fetch: Callable) -> tuple[StepResult, list]:
    """Reads the step's results (``fetch(device array) -> numpy``) into the requests: sampled
    tokens, log probabilities, grammar state; publishes filled pages; forks the choices whose
    leader drew its first token. Returns the result and the page copies ``[(src, dst)]`` the
    forks need (the caller runs them before the next step)."""
    result = StepResult([], plan.errors, sum(n for _, n in plan.prefill))
    copies: list[tuple[int, int]] = []
    if plan.batch is None:
      return result, copies
    outputs = plan.outputs
    tok = fetch(out.tokens)
    if any(s.params.logprobs is not None for s in outputs):
      lp, ids, vals = (fetch(a) for a in (out.logprob, out.top_ids, out.top_logprobs))
      for j, s in enumerate(outputs):
        if s.params.logprobs is not None:
          k = s.params.logprobs
          s.token_logprobs.append((float(lp[j]), ids[j, :k].tolist(), vals[j, :k].tolist()))
    if plan.scored:
      lp, ids, vals = (fetch(a) for a in (out.score, out.score_top_ids, out.score_top_logprobs))
      for s, p, i in plan.scored:
        k = s.params.prompt_logprobs
        s.prompt_logprobs[p] = (float(lp[i]), ids[i, :k].tolist(), vals[i, :k].tolist())
    for s, n in plan.decode + plan.prefill:
      self._advance(s, n)
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
    self._in_step = []
    return result, copies

  def _fork(self, s: Request, copies: list) -> None:
    """Gives choice ``s`` its leader's prompt pages but the last token (now computed): full
    pages by reference, the partly filled last one as a copy (queued in ``copies``). It then
    computes the prompt's last token itself, in a decode lane, and draws its first token from
    those logits with its own key (as a prefix-cache hit would). With no page left for the copy
    it starts from nothing instead (recomputed later, like a preempted request)."""
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

  def _advance(self, s: Request, n: int) -> None:
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
    b = sh.empty(sh.bucket(n_tok) if self.buckets is None
                 else next(n for n in self.buckets if n >= n_tok))
    a = b.attention
    out_at: dict[int, int] = {}
    for r, (s, _) in enumerate(decode):
      pos = s.n_cached
      b.tokens[r], a.positions[r], b.slot_ids[r] = s.tokens[pos], pos, s.slot
      b.write_page[r], b.write_offset[r] = s.pages[pos // ps], pos % ps
      a.lane_pages[r, : len(s.pages)] = s.pages
      a.lane_len[r] = pos + 1
      out_at[id(s)] = r
    col, u = len(decode), 0
    scored: list[tuple[Request, int, int]] = []  # (seq, prompt position scored, token index)
    for j, (s, n) in enumerate(prefill):
      pos = np.arange(s.n_cached, s.n_cached + n)
      sl = slice(col, col + n)
      b.tokens[sl] = s.tokens[s.n_cached : s.n_cached + n]
      a.positions[sl], b.slot_ids[sl], a.token_seq[sl] = pos, s.slot, j
      b.write_page[sl] = np.asarray(s.pages, np.int32)[pos // ps]
      b.write_offset[sl] = pos % ps
      k = len(s.pages)
      a.pages[u : u + k], a.page_seq[u : u + k] = s.pages, j
      a.page_start[u : u + k] = np.arange(k) * ps
      a.page_fill[u : u + k] = np.clip(s.n_cached + n - np.arange(k) * ps, 0, ps)
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
    a.blocks[:] = (-(-int(a.lane_len.max(initial=0)) // bk), -(-u // sh.block_pages))
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
    return batch, outputs, scored

  def _controls(self, outputs: Sequence[Request], nout: int) -> LogitControls | None:
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
