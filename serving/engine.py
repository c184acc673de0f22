"""The device thread: it alone touches JAX. Continuous batching, mixed variants in one batch.

    engine = Engine(cfg, metrics, tokenizer)
    ready = engine.start()                     # concurrent.futures.Future: model loaded, compiled
    engine.submit(GenRequest(...))             # thread-safe; events come back via req.emit
    await asyncio.wrap_future(engine.call(lambda gen: gen.load_variant(slot, delta)))

One engine on every deployment (one device, a mesh, several processes): a
`bitdelta_jax.models.paged.PagedGenerator`, whose scheduler runs here and whose runner owns
the device state (on a mesh spanning processes, a `serving.multihost.LeaderRunner` that sends
every call to the other processes first). Each iteration runs queued calls (slot loads), adds
new requests, drops cancelled ones, then one ``step``: one call over a ragged token batch of
the live sequences' decode tokens and of waiting prompts' chunks (several at once, mixed
variants, long prompts chunked across iterations, shared prefixes reused), padded to a token
bucket whose program the warm-up compiled. Each token's slot id mixes variants in the batch.

Stops (EOS, stop strings, max tokens, context) are applied here on the host, so a finished
sequence is freed at once. The loop takes a request's ``n`` choices of one
prompt as a group (`Engine.submit_group` → ``PagedGenerator.add_n``: one prefill), attaches each
token's log probabilities to the events that carry its text (and an echo's prompt log
probabilities to a choice's first event), and ends a sequence whose grammar is complete.

Each request's ``emit`` is called on this thread with `Event`s; the server's ``emit`` forwards
them to the event loop with ``loop.call_soon_threadsafe``. The last event is always ``done``
or ``error``, sent once the row no longer reads the request's variant slot.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from bitdelta_jax.distributed import WorkerLost
from serving.config import ServerConfig
from serving.metrics import Metrics

log = logging.getLogger("serving.engine")


@dataclasses.dataclass
class Event:
  kind: str  # "token" | "done" | "error"
  text: str = ""
  finish_reason: str | None = None
  completion_tokens: int = 0
  message: str | None = None
  code: str | None = None  # "worker_lost": a multi-process step lost a worker (HTTP 503)
  # (token id, logprob, [(alternative id, logprob)]) of each token behind this event's text
  logprobs: list | None = None
  # a choice's first event with echo + logprobs: the prompt's entries (the first logprob None)
  prompt_logprobs: list | None = None


@dataclasses.dataclass(eq=False)
class GenRequest:
  """One generation. ``params`` is a `bitdelta_jax.models.sampling.SamplingParams` whose
  ``max_new_tokens`` is already capped by the context; stop strings are handled here."""

  prompt: list[int]
  slot: int
  params: object
  model: str
  emit: Callable[[Event], None]
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  tokenizer: object = None  # the variant's own (decodes its tokens); None: the engine's (base)
  cancelled: bool = False
  # why it was cancelled, when not by its client (e.g. its variant was deleted): it then ends
  # with an ``error`` event carrying this message and ``cancel_code``, not ``done``
  cancel_reason: str | None = None
  cancel_code: str | None = None
  # engine-side
  tokens: list[int] = dataclasses.field(default_factory=list)
  sent: int = 0  # characters of the decoded text already emitted
  t_last: float = 0.0
  seq: object = None  # the paged engine's sequence of this choice
  group: list = dataclasses.field(default_factory=list)  # the n choices of one prompt
  pending_logprobs: list = dataclasses.field(default_factory=list)  # not yet emitted
  emitted: bool = False
  ended: bool = False  # its last event (done / error) went out; nothing follows it


class Engine:
  IDLE_PING_S = 5.0  # multi-process: an idle engine checks its workers this often
  def __init__(self, cfg: ServerConfig, metrics: Metrics, tokenizer, *,
               embedding_slots: bool = False, lora_rank: int = 0, extra_vocab: int = 0,
               packed_embedding_slots: bool = False,
               model_factory: Callable | None = None):
    self.cfg, self.metrics, self.tokenizer = cfg, metrics, tokenizer
    self.extra_vocab = extra_vocab
    self.packed_embedding_slots = packed_embedding_slots
    self.embedding_slots = embedding_slots
    self.lora_rank = lora_rank
    self._model_factory = model_factory
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self._ready: concurrent.futures.Future = concurrent.futures.Future()
    self.gen = None
    self.vocab_size = 0
    # read (not written) by the event loop: plain ints are safe to read across threads
    self.active_rows = 0
    self.queue_depth = 0
    self.steps = 0
    self.alive = False
    self.step_started: float | None = None  # time.monotonic() of the step in progress
    self.stuck = 0  # live sequences without progress for half the stall timeout (last sweep)
    self.stalled_total = 0  # sequences failed by the stall watchdog
    self.last_stall: float | None = None  # time.monotonic() of the last one
    self._live: set[GenRequest] = set()  # paged loop: choices added and not yet ended
    self.step_failures = 0  # steps that raised (the engine recovered from each)
    self.failures_in_row = 0  # since the last step that succeeded
    self.last_step_error: str | None = None
    self.fatal: str | None = None  # why the engine gave up (too many failed steps in a row)
    # called on the device thread when the engine gives up (the CLI exits non-zero)
    self.on_fatal: Callable[[str], None] | None = None

  # -- public (any thread) -----------------------------------------------------------------
  def start(self) -> concurrent.futures.Future:
    self._thread = threading.Thread(target=self._main, name="bitdelta-device", daemon=True)
    self._thread.start()
    return self._ready

  def submit(self, req: GenRequest) -> None:
    self.submit_group([req])

  def submit_group(self, reqs: list[GenRequest]) -> None:
    """The ``n`` choices of one prompt (same prompt, slot and params): one prefill, then each
    its own stream."""
    for r in reqs:
      r.group = list(reqs)
    self.queue_depth += 1  # approximate (racy by one at worst); the device thread corrects it
    self._inbox.put(("req", reqs))
    if self.fatal is not None:  # the device thread is gone (or going): nothing would answer
      self._refuse_queued()

  def call(self, fn: Callable) -> concurrent.futures.Future:
    """Runs ``fn(generator)`` on the device thread between decode steps."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put(("call", fn, fut))
    if self.fatal is not None:
      self._refuse_queued()
    return fut

  def stop(self, timeout: float = 30.0) -> None:
    if self._thread is not None and self._thread.is_alive():
      self._inbox.put(("stop",))
      self._thread.join(timeout)

  def stall_report(self) -> dict | None:
    """Why `/health` should say "degraded" (None: it need not): sequences without progress
    for half the stall timeout, a step running longer than the whole of it, or sequences the
    watchdog failed within the last timeout."""
    limit, now = self.cfg.stall_timeout_s, time.monotonic()
    out: dict = {}
    if self.stuck:
      out["sequences_without_progress"] = self.stuck
    started = self.step_started
    if started is not None and now - started > limit:
      out["step_running_s"] = round(now - started, 1)
    if self.last_stall is not None and now - self.last_stall <= limit:
      out["failed_recently"] = self.stalled_total
    return out or None

  @property
  def lost(self) -> str | None:
    """Why the engine is degraded (a worker process was lost), or None."""
    return getattr(self.gen, "lost", None)

  # -- device thread -----------------------------------------------------------------------
  def _build(self):
    cfg = self.cfg
    enable_compile_cache()
    sender = None
    if cfg.multi_process:  # process 0: every runner call becomes a plan for the followers too
      from serving import multihost

      sender = multihost.lead(cfg, multihost.build_options(self))
    gen = build_generator(cfg, embedding_slots=self.embedding_slots, lora_rank=self.lora_rank,
                          extra_vocab=self.extra_vocab,
                          packed_embedding_slots=self.packed_embedding_slots,
                          tokenizer=self.tokenizer,
                          model_factory=self._model_factory)
    self.vocab_size = gen.model.config.vocab_size
    if sender is not None:
      gen.runner = multihost.LeaderRunner(gen.runner, sender.send, timeout_s=cfg.step_timeout_s)
    return gen

  def _main(self) -> None:
    try:
      gen = self.gen = self._build()
      if self.cfg.warmup:
        took = gen.warmup(progress=log.info)
        r = gen.runner
        log.info("warm-up: %d step programs in %.1f s (%d from the step cache; each run once "
                 "in %.2f s, %d failed that run and were recompiled)", gen.compiles, took,
                 r.loaded_programs, r.probe_s, r.probe_failures)
        gen.runner.guard = self.cfg.forbid_compile_after_warmup
    except BaseException as e:  # noqa: BLE001  report to whoever awaits readiness
      if getattr(self, "gen", None) is not None:
        self.gen.runner.release()
      self._ready.set_exception(e)
      return
    self.alive = True
    self._ready.set_result(gen)
    try:
      self._loop(gen)
    finally:
      self.alive = False
      close = getattr(gen.runner, "close", None)
      if close is not None:  # multi-process: release the followers
        close()
      gen.runner.release()  # the compiled programs (and their memory mappings) go now

  def _drain_inbox(self, block: bool, on_request: Callable) -> bool:
    """Takes queued requests and runs queued calls; False when asked to stop. Blocking and
    idle for `IDLE_PING_S` with several processes, it pings the workers (a dead one shows up
    while nothing runs)."""
    ping = getattr(self.gen.runner, "ping", None)
    while True:
      try:
        item = self._inbox.get(block=block, timeout=self.IDLE_PING_S if block and ping else None)
      except queue.Empty:
        if block and ping is not None and not self.lost:
          try:
            ping()
          except WorkerLost:
            pass
        return True
      block = False
      if item[0] == "stop":
        return False
      if item[0] == "req":
        on_request(item[1])
      else:
        _, fn, fut = item
        if fut.set_running_or_notify_cancel():
          try:
            fut.set_result(fn(self.gen))
          except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)

  def _loop(self, gen) -> None:
    m = self.metrics

    def on_request(reqs: list[GenRequest]) -> None:
      r = reqs[0]
      try:
        for q, s in zip(reqs, gen.add_n(r.prompt, r.slot, r.params, reqs)):
          q.seq = s
      except ValueError as e:
        for q in reqs:
          self._emit(q, Event("error", message=str(e)))
        return
      self._live.update(reqs)

    while True:
      if not self._drain_inbox(not gen.has_work and not self._live, on_request):
        for r in list(self._live):
          self._emit(r, Event("error", message="server shutting down"))
        return
      self._sweep(gen)
      if not gen.has_work:
        self._gauges(0, 0, gen.max_rows)
        continue
      self.step_started = time.monotonic()
      try:
        res = gen.step()
      except Exception as e:  # noqa: BLE001  one failed step must not stop the engine
        if not self._step_failed(gen, e):
          return
        continue
      finally:
        self.step_started = None
      self.steps += 1
      self.failures_in_row = 0
      for s, msg in res.errors:
        self._emit(s.tag, Event("error", message=msg))
      now = time.perf_counter()
      for s, tok in res.tokens:
        r = s.tag
        if r.ended:  # already failed (e.g. by the stall watchdog) while its step ran
          gen.finish(s)
          continue
        if not r.tokens:
          m.ttft.labels(r.model).observe(now - r.arrival)
        else:
          m.itl.labels(r.model).observe(now - r.t_last)
        r.t_last = now
        if self._accept(r, tok, now, s):
          gen.finish(s)
      self._gauges(len(gen.running), len(gen.waiting), gen.max_rows)

  def _step_failed(self, gen, e: Exception) -> bool:
    """A step raised. Its requests end with an error event and the engine recovers
    (`PagedGenerator.recover`: their pages released, the KV pools rebuilt, cached prefixes
    dropped), so the next request is served; `/health` says "degraded" until a step succeeds.
    After ``cfg.max_step_failures`` failures in a row the engine gives up: every live request
    ends, `fatal` says why and ``on_fatal`` is called (the CLI then exits non-zero, for a
    supervisor to restart it). Returns False when the loop must end."""
    log.exception("engine step failed")
    self.step_failures += 1
    self.failures_in_row += 1
    self.last_step_error = f"{type(e).__name__}: {str(e)[:500]}"
    self.metrics.step_failures.inc()
    message = f"engine step failed: {e}"
    if gen.lost:  # a lost worker: nothing can run again (/health says why)
      for s in list(gen.running) + list(gen.waiting):
        gen.finish(s)
      for r in list(self._live):
        self._emit(r, Event("error", message=message, code=_code(e)))
      return True
    try:
      failed = gen.recover()
    except Exception as again:  # noqa: BLE001  cannot even rebuild the pools
      log.exception("engine could not recover from a failed step")
      failed, self.failures_in_row = [], max(self.failures_in_row, self.cfg.max_step_failures)
      message = f"{message} (recovery failed: {again})"
    if self.failures_in_row < self.cfg.max_step_failures:
      for s in failed:
        self._emit(s.tag, Event("error", message=message, code="step_failed"))
      return True
    self.fatal = (f"{self.failures_in_row} engine steps failed in a row (last: "
                  f"{self.last_step_error}); the server stops so that it can be restarted")
    log.critical("%s", self.fatal)
    self.alive = False  # new requests get a 503 from now on
    for r in [s.tag for s in failed] + list(self._live):  # a 503: retry on another replica
      self._emit(r, Event("error", message=self.fatal, code="engine_failed"))
    self._refuse_queued()
    if self.on_fatal is not None:
      try:
        self.on_fatal(self.fatal)
      except Exception:  # noqa: BLE001
        log.exception("on_fatal failed")
    return False

  def _refuse_queued(self) -> None:
    """After the engine gave up: queued requests end with its reason, queued calls raise."""
    while True:
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return
      if item[0] == "req":
        for r in item[1]:
          self._emit(r, Event("error", message=self.fatal, code="engine_failed"))
      elif item[0] == "call" and item[2].set_running_or_notify_cancel():
        item[2].set_exception(RuntimeError(self.fatal))

  def failure_report(self) -> dict | None:
    """The failed steps since the last step that succeeded (`/health` says "degraded" while
    there are any), or None."""
    if not self.failures_in_row and self.fatal is None:
      return None
    return {"in_a_row": self.failures_in_row, "total": self.step_failures,
            "last_error": self.last_step_error, **({"fatal": self.fatal} if self.fatal else {})}

  def _sweep(self, gen) -> None:
    """Gives every live choice that can no longer produce tokens its last event, so that none
    holds pages or its variant slot: cancelled ones (their client left, or their variant was
    deleted; choices not forked yet go with their leader), sequences the scheduler has not
    moved for ``stall_timeout_s`` (`PagedGenerator.stalled`: an engine bug, failed with
    ``code="stalled"``), and choices whose sequence ended without one."""
    for r in [r for r in self._live if r.cancelled]:
      if r.ended:
        continue
      group = [r.seq, *r.seq.followers]
      gen.finish(r.seq)
      for x in group:
        q = x.tag
        if q.cancel_reason is not None:
          self._emit(q, Event("error", message=q.cancel_reason, code=q.cancel_code))
        elif q.cancelled:
          self._emit(q, Event("done", finish_reason="cancelled",
                              completion_tokens=len(q.tokens)))
    limit = self.cfg.stall_timeout_s
    now = time.monotonic()
    slow = gen.stalled(limit / 2, now)
    for s in slow:
      if now - s.progress_at <= limit:
        continue
      group = [s, *s.followers]
      gen.finish(s)
      log.error("no progress for %.0f s: failing %d sequence(s) of %r", now - s.progress_at,
                len(group), s.tag.model)
      self.stalled_total += len(group)
      self.last_stall = now
      self.metrics.stalled.inc(len(group))
      for x in group:
        self._emit(x.tag, Event("error", code="stalled", message=(
          f"the engine made no progress on this request for {limit:g} s; it was stopped "
          "(a server fault, please report it)")))
    self.stuck = sum(1 + len(s.followers) for s in slow if not s.finished)
    for r in [r for r in self._live if r.seq.finished and not r.ended]:
      log.error("a choice of %r ended without a result", r.model)
      self._emit(r, Event("error", code="stalled",
                          message="the engine dropped this choice (a server fault, please "
                                  "report it)"))

  def _gauges(self, active: int, pending: int, max_rows: int) -> None:
    m = self.metrics
    self.queue_depth = pending + self._inbox.qsize()
    self.active_rows = active
    m.queue_depth.set(self.queue_depth)
    m.batch_rows.set(active)
    m.batch_occupancy.set(active / max_rows)

  # -- per-token host logic --------------------------------------------------------------------
  def _accept(self, r: GenRequest, tok: int, now: float, seq=None) -> bool:
    """Adds a token to ``r``; emits text; returns True (after emitting ``done``) when finished.
    ``seq``: the sequence, whose log probabilities and grammar state are read."""
    p = r.params
    if p.max_new_tokens == 0:  # echo only: the token drawn after the prompt is not kept
      return self._finish(r, "length", "")
    if tok in p.stop_token_ids:
      return self._finish(r, "stop", None)
    r.tokens.append(tok)
    if seq is not None and p.logprobs is not None and seq.token_logprobs:
      lp, ids, vals = seq.token_logprobs[-1]
      r.pending_logprobs.append((tok, lp, list(zip(ids, vals))))
    self.metrics.generated_tokens.labels(r.model).inc()
    tk = r.tokenizer or self.tokenizer
    text = tk.decode(r.tokens) if tk is not None else ""
    if p.stop_strings:
      hits = [i for i in (text.find(s, max(0, r.sent - len(s))) for s in p.stop_strings) if i >= 0]
      if hits:
        return self._finish(r, "stop", text[: min(hits)])
    if seq is not None and seq.grammar_done:
      return self._finish(r, "stop", text)  # the structured output is complete
    if len(r.tokens) >= p.max_new_tokens or len(r.prompt) + len(r.tokens) >= self.cfg.max_seq_len:
      return self._finish(r, "length", text)
    hold = max((len(s) for s in p.stop_strings), default=1) - 1
    safe = len(text) - hold
    while safe > r.sent and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
      safe -= 1
    if safe > r.sent:
      self._emit(r, Event("token", text=text[r.sent:safe]))
      r.sent = safe
    return False

  def _finish(self, r: GenRequest, reason: str, text: str | None) -> bool:
    if text is None:
      tk = r.tokenizer or self.tokenizer
      text = tk.decode(r.tokens) if tk is not None else ""
    self._emit(r, Event("done", text=text[r.sent:], finish_reason=reason,
                        completion_tokens=len(r.tokens)))
    return True

  def _emit(self, r: GenRequest, ev: Event) -> None:
    if r.ended:  # exactly one last event per request
      return
    if ev.kind in ("done", "error"):
      r.ended = True
      self._live.discard(r)
    if ev.kind in ("token", "done"):
      if r.pending_logprobs:
        ev.logprobs, r.pending_logprobs = r.pending_logprobs, []
      if not r.emitted:
        ev.prompt_logprobs = _prompt_entries(r)
      r.emitted = True
    try:
      r.emit(ev)
    except Exception:  # noqa: BLE001  e.g. the event loop is closed
      log.debug("dropping event for a closed request", exc_info=True)


def _prompt_entries(r: GenRequest) -> list | None:
  """The prompt's log-probability entries (echo), from choice 0's sequence, which scored it."""
  if getattr(r.params, "prompt_logprobs", None) is None:
    return None
  lead = (r.group[0] if r.group else r).seq
  scores = lead.prompt_logprobs if lead is not None else {}
  out = [(r.prompt[0], None, None)]
  for i in range(1, len(r.prompt)):
    lp, ids, vals = scores.get(i, (None, [], []))
    out.append((r.prompt[i], lp, list(zip(ids, vals))))
  return out


def _cache_root() -> str:
  import os

  return os.environ.get("BITDELTA_CACHE") or os.path.expanduser("~/.cache/bitdelta_jax")


def step_cache_dir() -> str | None:
  """Where compiled step programs are kept whole (`bitdelta_jax.models.step_cache`):
  ``$BITDELTA_CACHE/steps``; None with ``BITDELTA_COMPILE_CACHE=0``."""
  import os

  if os.environ.get("BITDELTA_COMPILE_CACHE", "1") == "0":
    return None
  return os.path.join(_cache_root(), "steps")


def enable_compile_cache() -> None:
  """Keeps compiled executables on disk (``$BITDELTA_CACHE/xla``, default
  ``~/.cache/bitdelta_jax/xla``) so a restarted server skips most of its warm-up compiles.
  ``BITDELTA_COMPILE_CACHE=0`` turns it off."""
  import os

  import jax

  if os.environ.get("BITDELTA_COMPILE_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", os.path.join(_cache_root(), "xla"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _code(e: BaseException) -> str | None:
  return "worker_lost" if isinstance(e, WorkerLost) else None


def build_generator(cfg: ServerConfig, *, embedding_slots: bool = False, lora_rank: int = 0,
                    extra_vocab: int = 0, packed_embedding_slots: bool = False, tokenizer=None,
                    model_factory: Callable | None = None):
  """The engine's `PagedGenerator`, on one device or, with ``--mesh`` or several processes,
  over a device mesh (the base restored straight into its shardings). Every process of a
  multi-process server builds it with the same arguments (the same JAX computations in the
  same order); only process 0's scheduler is used."""
  import jax.numpy as jnp

  from bitdelta_jax.models.paged import PagedGenerator

  dtype = getattr(jnp, cfg.dtype)
  mesh = None
  if cfg.sharded:
    from bitdelta_jax import sharding

    mesh = sharding.make_mesh(cfg.mesh)
    log.info("sharded over mesh %s (%d processes)", sharding.mesh_spec(mesh), cfg.num_processes)
  if model_factory is not None:
    model = model_factory()
  elif mesh is not None:
    model = sharding.restore_base(cfg.base, mesh, dtype, num_slots=cfg.device_slots + 1,
                                  dense_embedding_slots=embedding_slots, lora_rank=lora_rank,
                                  extra_vocab=extra_vocab,
                                  packed_embedding_slots=packed_embedding_slots)
  else:
    from bitdelta_jax.models import from_pretrained

    model = from_pretrained(cfg.base, dtype, num_slots=cfg.device_slots + 1,
                            dense_embedding_slots=embedding_slots, lora_rank=lora_rank,
                            extra_vocab=extra_vocab,
                            packed_embedding_slots=packed_embedding_slots)
  mc = model.config
  token_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * model.dtype.itemsize
  pages_per_seq = -(-cfg.max_seq_len // cfg.page_size)
  budget_pages = int(cfg.kv_cache_mb * (1 << 20)) // (token_bytes * cfg.page_size)
  num_pages = max(2, min(cfg.max_batch * pages_per_seq, budget_pages) + 1)
  return PagedGenerator(model, max_rows=cfg.max_batch, max_seq_len=cfg.max_seq_len,
                        page_size=cfg.page_size, num_pages=num_pages,
                        prefill_chunk=cfg.prefill_chunk, prefix_caching=cfg.prefix_caching,
                        tokenizer=tokenizer, mesh=mesh, step_cache_dir=step_cache_dir())
