"""The engine as a library object: schedulers and runners, one pair per data group.

    gen = Generator(model, max_rows=32, max_seq_len=2048, tokenizer=tok, mesh=mesh)
    gen.generate(prompts, slot_ids, params)            # the whole loop, stops included
    reqs = gen.add_n(prompt_ids, 1, params, tags=[...])  # or step by step:
    while gen.has_work:
      for req, token in gen.step().tokens: ...         # the caller checks stops, then
      gen.finish(req)                                  # frees (and caches) its pages

A step is one iteration of every data group: each group's `scheduler.Scheduler` plans its batch
and its `runner.PagedRunner` launches it (asynchronously), then each group's results are read
back. On a mesh ``data=D, model=M`` each group is a ``1 × M`` sub-mesh with its own requests,
KV pools and programs (its parameters are the same device buffers, viewed on the sub-mesh:
`mesh_layout.data_groups`), so the data groups split the work instead of repeating it; a new
prompt goes to the group holding the fewest requests. Variant slots are mirrored: a load
writes every group's banks. The rows (``max_rows``) divide over the groups; ``num_pages`` is
each group's pool.

Stops are one rule (`stops.check_stop`), applied by the caller: `generate` here, the
device-thread `engine.Engine` when serving.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

import numpy as np

from bitdelta_jax.engine.batch import StepShapes
from bitdelta_jax.engine.kv_pages import PagePool
from bitdelta_jax.engine.request import Generation, Request
from bitdelta_jax.engine.sampling_params import SamplingParams
from bitdelta_jax.engine.scheduler import Scheduler, StepResult
from bitdelta_jax.engine.stops import check_stop, kept_tokens

log = logging.getLogger("bitdelta_jax.engine")


class Generator:
  """Continuous batching over paged KV caches on one device, a mesh or several processes; see
  the module docstring."""

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
    groups = [(model, mesh)]
    if runner is None and mesh is not None:
      from bitdelta_jax.engine.mesh_layout import data_groups

      groups = data_groups(model, mesh, rules)
    if max_rows % len(groups):
      raise ValueError(f"max_rows {max_rows} does not divide over {len(groups)} data groups "
                       "(--max-batch must be a multiple of the mesh's data size)")
    self.model = groups[0][0]
    self.tokenizer = tokenizer
    self.max_rows = int(max_rows)
    self.max_seq_len = int(max_seq_len)
    self.page_size = int(page_size)
    self.prefill_chunk = int(prefill_chunk)
    rows = self.max_rows // len(groups)
    self.max_pages_per_seq = -(-self.max_seq_len // self.page_size)
    if num_pages is None:  # room for every row at full length, plus the reserved page
      num_pages = rows * self.max_pages_per_seq + 1
    cfg = model.config
    self.vocab_size = cfg.vocab_size + cfg.extra_vocab  # the width of the logits
    self.shapes = StepShapes(
      max_rows=rows, max_step_tokens=rows + self.prefill_chunk,
      max_pages_per_seq=self.max_pages_per_seq, page_size=self.page_size,
      block_pages=int(block_pages or max(1, 128 // self.page_size)),
      vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)
    self.slot_epoch = [0] * cfg.num_slots
    order = itertools.count().__next__
    self.schedulers = [
      Scheduler(self.shapes, PagePool(int(num_pages), self.page_size, prefix_caching),
                self.slot_epoch, prefill_chunk=self.prefill_chunk, base_only=self.base_only,
                group_index=i, order=order)
      for i in range(len(groups))]
    if runner is None:  # the device side; the schedulers never import JAX
      from bitdelta_jax.engine.runner import PagedRunner

      self.runners = [
        PagedRunner(m, shapes=self.shapes, num_pages=int(num_pages), mesh=sub, rules=rules,
                    scan_layers=scan_layers, step_cache_dir=step_cache_dir)
        for m, sub in groups]
    else:
      self.runners = [runner]
    self._mesh = mesh
    self.shapes_run: set[tuple] = set()  # (tokens bucket, base_only) of every step run
    self.steps = 0
    self._compiler: threading.Thread | None = None  # `warmup(background=True)`'s, until done
    self._compile_thread: threading.Thread | None = None
    self._stop_compiling = threading.Event()

  # -- one data group's parts (most programs have one) ----------------------------------------
  @property
  def data_groups(self) -> int:
    return len(self.schedulers)

  def _one(self, what: str):
    if len(self.schedulers) != 1:
      raise AttributeError(f"a Generator over {len(self.schedulers)} data groups has one {what} "
                           f"per group: use `{what}s[i]`")

  @property
  def runner(self):
    self._one("runner")
    return self.runners[0]

  @runner.setter
  def runner(self, runner) -> None:  # e.g. multi-process: the leader's runner wraps it
    self._one("runner")
    self.runners[0] = runner

  @property
  def scheduler(self) -> Scheduler:
    self._one("scheduler")
    return self.schedulers[0]

  @property
  def pool(self) -> PagePool:
    return self.scheduler.pool

  @property
  def running(self) -> list[Request]:
    if len(self.schedulers) == 1:
      return self.schedulers[0].running
    return [s for g in self.schedulers for s in g.running]

  @property
  def waiting(self) -> list[Request]:
    if len(self.schedulers) == 1:
      return self.schedulers[0].waiting
    return [s for g in self.schedulers for s in g.waiting]

  @property
  def base_only(self) -> bool:
    """The model has no variant slots: its step is the base's alone."""
    return len(self.slot_epoch) == 1

  @property
  def mesh(self):
    return self._mesh if self._mesh is not None else self.runners[0].mesh

  @property
  def lost(self) -> str | None:
    """Why a runner cannot go on (multi-process: a worker was lost), or None."""
    return next((r.lost for r in self.runners if getattr(r, "lost", None)), None)

  # -- variants (every group holds every slot) ------------------------------------------------
  def refresh(self) -> None:
    """Re-reads the model's state (after its banks or parameters changed)."""
    for r in self.runners:
      r.refresh()

  def load_variant(self, slot: int, delta) -> None:
    """``delta``: an in-memory delta dict, or (on a mesh) also a delta directory, written
    shard by shard."""
    for r in self.runners:
      r.load_variant(slot, delta)
    self.slot_epoch[slot] += 1  # cached prefixes of the old contents are never matched again

  def clear_slot(self, slot: int) -> None:
    for r in self.runners:
      r.clear_slot(slot)
    self.slot_epoch[slot] += 1

  @property
  def kv_bytes(self) -> int:
    return sum(r.kv_bytes for r in self.runners)

  @property
  def compiles(self) -> int:
    return sum(r.compiles for r in self.runners)

  # -- requests -------------------------------------------------------------------------------
  def add(self, prompt: Sequence[int], slot: int = 0, params: SamplingParams = SamplingParams(),
          *, tag=None) -> Request:
    return self.add_n(prompt, slot, params, [tag])[0]

  def add_n(self, prompt: Sequence[int], slot: int, params: SamplingParams,
            tags: Sequence) -> list[Request]:
    """``len(tags)`` choices of one prompt that share its prefill (`Scheduler.add_n`)."""
    if not tags:
      raise ValueError("at least one choice")
    group = [Request(list(prompt), slot, params, tag=t) for t in tags]
    self.add_group(group)
    return group

  def add_group(self, group: Sequence[Request]) -> None:
    """Schedules the ``n`` choices of one prompt (same prompt, slot and params) on the data
    group holding the fewest requests; ValueError names what is wrong with them."""
    if not group:
      raise ValueError("at least one choice")
    lead = group[0]
    n = len(lead.prompt)
    if n == 0:
      raise ValueError("empty prompt")
    if n >= self.max_seq_len:
      raise ValueError(f"prompt of {n} tokens leaves no room in max_seq_len {self.max_seq_len}")
    if not 0 <= lead.slot < len(self.slot_epoch):
      raise ValueError(f"slot {lead.slot} out of range [0, {len(self.slot_epoch)})")
    width = getattr(lead.params.grammar, "tokenizer_vocab_size", 0)
    if width > self.vocab_size:
      raise ValueError(f"the grammar's tokenizer has {width} tokens, more than the model's "
                       f"{self.vocab_size} logits")
    min(self.schedulers, key=lambda g: g.load).add_n(group)

  def finish(self, s: Request) -> None:
    """Drops a request (finished or cancelled) and releases its pages."""
    self.schedulers[s.group_index].finish(s)

  @property
  def has_work(self) -> bool:
    return any(g.has_work for g in self.schedulers)

  def stalled(self, limit_s: float, now: float | None = None) -> list[Request]:
    """`Scheduler.stalled` of every group."""
    return [s for g in self.schedulers for s in g.stalled(limit_s, now)]

  def recover(self) -> list[Request]:
    """Makes the engine usable again after `step` raised, and returns the requests of that
    step (every group's), now dropped: the caller fails them. The other running requests are
    recomputed later, cached prefixes are forgotten, and the KV pools are rebuilt, since the
    failed call may have consumed the pools donated to it."""
    failed = []
    for g, r in zip(self.schedulers, self.runners):
      failed += g.recover()
      r.reset_pools()
    return failed

  # -- one iteration --------------------------------------------------------------------------
  def step(self) -> StepResult:
    """One iteration: every group's batch is planned and launched, then every group's results
    are read (the groups' devices work at the same time)."""
    self.steps += 1
    if self._compiler is not None:
      self.promote(limit=1)  # one first run per step: requests are not held up by all of them
    launched = []
    for g, r in zip(self.schedulers, self.runners):
      plan = g.schedule()
      out = None
      if plan.batch is not None:
        out = r.run(plan.batch, plan.base_only)
        self.shapes_run.add((plan.batch.num_tokens, plan.base_only))
      launched.append((g, r, plan, out))
    total = StepResult([], [], 0)
    for g, r, plan, out in launched:
      res, copies = g.update(plan, out, r.fetch)
      total.tokens += res.tokens
      total.errors += res.errors
      total.prefill_tokens += res.prefill_tokens
      if copies:
        src, dst = zip(*copies)
        r.copy_pages(np.asarray(src, np.int32), np.asarray(dst, np.int32))
    return total

  def warmup(self, *, threads: int = 2, progress=None, background: bool = False,
             on_compiled=None) -> float:
    """Compiles every step program the schedulers can ask for (one per token bucket, per
    group) ahead of time; returns the seconds it took. After it, the runners count (or, with
    ``runner.guard``, refuse) any step they did not compile.

    ``background``: only two programs now, the smallest bucket (one stream decoding) and the
    bucket of ``max_rows`` tokens (every row decoding, or a short prompt chunk); the others
    compile on a background thread, the decode buckets first, each made ready between steps
    (`promote`). Until then a step is padded to the smallest ready bucket that holds it and
    holds at most the largest ready one's tokens, so a long prompt runs in smaller chunks; no
    step waits for a compile, and none runs a program that has not run once. (A step padded
    to a larger bucket computes the same values; kernels that pick their path by row count
    may round them differently.) ``on_compiled()`` is called
    from the background thread after each program (the engine then promotes it at once)."""
    if not background:
      return sum(r.compile_all((self.base_only,), threads=threads, progress=progress)
                 for r in self.runners)
    sh = self.shapes
    first = sorted({sh.buckets()[0], sh.bucket(sh.max_rows)})
    took = sum(r.compile_all((self.base_only,), threads=threads, progress=progress,
                             buckets=first) for r in self.runners)
    self._limit_schedulers()
    if any(r.pending for r in self.runners):
      def compile_rest():
        for r in self.runners:
          try:
            r.compile_pending(progress, stop=self._stop_compiling, on_compiled=on_compiled)
          except Exception as e:  # noqa: BLE001  serving goes on with the ready buckets
            log.warning("background compile stopped (%s: %s); serving with the ready buckets "
                        "%s", type(e).__name__, e, list(r.ready_buckets(self.base_only)))
            return

      self._compiler = self._compile_thread = threading.Thread(
        target=compile_rest, name="bitdelta-compile", daemon=True)
      self._compiler.start()
    return took

  def promote(self, progress=None, limit: int | None = None) -> bool:
    """Makes the programs the background compile finished ready (each runs once first, on
    the caller's thread: the device thread; at most ``limit`` per group) and lets the
    schedulers use them. True if any."""
    promoted = any([r.promote(progress, limit) for r in self.runners])
    if promoted:
      self._limit_schedulers()
      if not self.pending_buckets:
        self._compiler = None  # all ready: steps stop asking
    return promoted

  def stop_compiling(self, timeout_s: float = 60.0) -> None:
    """Ends the background compile after its current program and waits for it (the engine's
    shutdown): a process that exits while that thread is inside XLA's compiler aborts
    ("terminate called ... FATAL: exception not rethrown")."""
    self._stop_compiling.set()
    if self._compile_thread is not None:
      self._compile_thread.join(timeout_s)

  @property
  def promotable(self) -> bool:
    """Programs compiled in the background and waiting for `promote`."""
    return self._compiler is not None and any(getattr(r, "arrived", False)
                                              for r in self.runners)

  @property
  def pending_buckets(self) -> list[int]:
    """Token buckets still compiling in the background (of any group)."""
    return sorted({n for r in self.runners for n, _ in list(getattr(r, "pending", ()))})

  def _limit_schedulers(self) -> None:
    for g, r in zip(self.schedulers, self.runners):
      g.buckets = r.ready_buckets(self.base_only) if r.pending else None

  # -- the whole loop -------------------------------------------------------------------------
  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | int | None = None,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
  ) -> list[Generation]:
    """Generates for every prompt and applies the stops (`stops.check_stop`): stop token ids
    (the stop token is not returned), stop strings (needs a tokenizer; the text is cut before
    the stop string, the tokens keep the one that completed it), ``max_new_tokens`` and
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
      for r, _ in res.tokens:
        reason = check_stop(r, self.max_seq_len, self.tokenizer)
        if reason is not None:
          text = None
          if self.tokenizer is not None:
            text = "" if r.text is None else r.text.final()
          results[r.tag] = Generation(kept_tokens(r), reason, text, len(r.prompt))
          self.finish(r)
    return results  # type: ignore[return-value]


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
