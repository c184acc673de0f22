"""The device thread: it alone touches JAX. Continuous batching, mixed variants in one batch.

    engine = Engine(EngineConfig(base="ckpt"), metrics, tokenizer)   # `engine.config`
    ready = engine.start()                     # concurrent.futures.Future: model loaded, compiled
    engine.submit(Request(prompt, slot, params, model="name", emit=on_event))  # thread-safe
    await asyncio.wrap_future(engine.call(lambda gen: gen.load_variant(slot, delta)))

One engine on every deployment (one device, a mesh, several processes): a
`bitdelta_jax.engine.generator.Generator`, whose scheduler runs here and whose runner owns
the device state (on a mesh spanning processes, a `bitdelta_jax.engine.multihost.leader.LeaderRunner` that sends
every call to the other processes first). Each iteration runs queued calls (slot loads), adds
new requests, drops cancelled ones, then one ``step``: one call over a ragged token batch of
the live sequences' decode tokens and of waiting prompts' chunks (several at once, mixed
variants, long prompts chunked across iterations, shared prefixes reused), padded to a token
bucket whose program the warm-up compiled. Each token's slot id mixes variants in the batch.

Stops (EOS, stop strings, max tokens, context) are applied here on the host, so a finished
sequence is freed at once. The loop takes a request's ``n`` choices of one
prompt as a group (`Engine.submit_group` → ``Generator.add_n``: one prefill), attaches each
token's log probabilities to the events that carry its text (and an echo's prompt log
probabilities to a choice's first event), and ends a sequence whose grammar is complete.

Each request's ``emit`` is called on this thread with `Event`s; the server's ``emit`` forwards
them to the event loop with ``loop.call_soon_threadsafe``. The last event is always ``done``
or ``error``, sent once the row no longer reads the request's variant slot.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from bitdelta_jax.engine.build import build_generator, enable_compile_cache
from bitdelta_jax.engine.config import EngineConfig, Metrics
from bitdelta_jax.engine.generator import per_request
from bitdelta_jax.engine.multihost.runtime import WorkerLost
from bitdelta_jax.engine.request import Event, Generation, Request
from bitdelta_jax.engine.stops import check_stop, kept_tokens, num_kept
from bitdelta_jax.models.banks import Banks

log = logging.getLogger("bitdelta_jax.engine.engine")


class _NoMetrics:
  """Metrics nobody reads (the engine used as a library): every call does nothing."""

  def __getattr__(self, name):
    return self

  def __call__(self, *args, **kwargs):
    return self


class Engine:
  """The device thread; see the module docstring. ``metrics``: what to record into (the
  server's `serving.metrics.Metrics`), or None."""

  IDLE_PING_S = 5.0  # multi-process: an idle engine checks its workers this often

  def __init__(self, cfg: EngineConfig, metrics: Metrics | None = None, tokenizer=None, *,
               banks: Banks = Banks(), model_factory: Callable | None = None):
    if not isinstance(cfg, EngineConfig):
      raise TypeError(f"Engine takes an EngineConfig, got {type(cfg).__name__} (a server's: "
                      "ServerConfig.engine_config())")
    self.cfg, self.tokenizer = cfg, tokenizer
    self.metrics = metrics if metrics is not None else _NoMetrics()
    self.banks = banks  # the per-slot banks every variant the server may load needs
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
    self._live: set[Request] = set()  # paged loop: choices added and not yet ended
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

  def submit(self, req: Request) -> None:
    self.submit_group([req])

  def submit_group(self, reqs: list[Request]) -> None:
    """The ``n`` choices of one prompt (same prompt, slot and params): one prefill, then each
    its own stream."""
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

  def generate(self, prompts, slot_ids=None, params=None, *,
               timeout: float | None = None) -> list[Generation]:
    """Offline generation through the running engine (after `start`): each prompt a request
    of the device thread, batched with whatever else it serves, its stops applied as for the
    server's; returns one `Generation` per prompt (its text decoded with the engine's
    tokenizer, when it has one). On several processes this is process 0's call; the others run
    `multihost.leader.run_follower(cfg)`. Raises RuntimeError naming the first request that failed."""
    slots, plist = per_request(prompts, slot_ids, params, self.tokenizer)
    reqs, done = [], []
    for p, slot, sp in zip(prompts, slots, plist):
      fut: concurrent.futures.Future = concurrent.futures.Future()
      texts: list[str] = []

      def emit(ev, fut=fut, texts=texts):
        if ev.kind == "token":
          texts.append(ev.text)
        elif ev.kind == "done":
          fut.set_result(("".join(texts) + ev.text, ev.finish_reason))
        else:
          fut.set_exception(RuntimeError(f"generation failed: {ev.message}"))

      r = Request(list(p), slot, sp, model=f"slot {slot}", emit=emit)
      reqs.append(r)
      done.append(fut)
      self.submit(r)
    out = []
    for r, fut in zip(reqs, done):
      text, reason = fut.result(timeout)
      out.append(Generation(kept_tokens(r), reason, text if self.tokenizer else None,
                            len(r.prompt)))
    return out

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
      from bitdelta_jax.engine.multihost import leader as multihost

      sender = multihost.lead(cfg, multihost.build_options(self))
    gen = build_generator(cfg, self.banks, tokenizer=self.tokenizer,
                          model_factory=self._model_factory)
    self.vocab_size = gen.model.config.vocab_size
    if sender is not None:
      # (several processes hold one data group: `mesh_layout.data_groups`)
      gen.runner = multihost.LeaderRunner(gen.runner, sender.send, timeout_s=cfg.step_timeout_s)
    return gen

  def _main(self) -> None:
    try:
      gen = self.gen = self._build()
      if self.cfg.warmup:
        background = self.cfg.background_compile and not self.cfg.multi_process
        took = gen.warmup(progress=log.info, background=background,
                          on_compiled=self._promote_soon)
        rs = gen.runners
        later = gen.pending_buckets
        log.info("warm-up: %d step programs in %.1f s (%d from the step cache; each run once "
                 "in %.2f s, %d failed that run and were recompiled)%s", gen.compiles, took,
                 sum(r.loaded_programs for r in rs), sum(r.probe_s for r in rs),
                 sum(r.probe_failures for r in rs),
                 f"; buckets of {later} tokens compile in the background" if later else "")
        for r in rs:
          r.guard = self.cfg.forbid_compile_after_warmup
    except BaseException as e:  # noqa: BLE001  report to whoever awaits readiness
      if getattr(self, "gen", None) is not None:
        for r in self.gen.runners:
          r.release()
      self._ready.set_exception(e)
      return
    self.alive = True
    self._ready.set_result(gen)
    try:
      self._loop(gen)
    finally:
      gen.stop_compiling()  # waits for a compile in progress (alive meanwhile: see serving.cli)
      self.alive = False
      for r in gen.runners:
        close = getattr(r, "close", None)
        if close is not None:  # multi-process: release the followers
          close()
        r.release()  # the compiled programs (and their memory mappings) go now

  def _promote_soon(self) -> None:
    """From the background compile: a program is ready to be run once and used. This wakes
    an idle device thread, which does that (`Generator.promote`) one program per loop; a busy
    one does it one program per step (`Generator.step`), so requests are not held up behind
    every first run."""
    self._inbox.put(("call", lambda gen: None, concurrent.futures.Future()))

  def _drain_inbox(self, block: bool, on_request: Callable) -> bool:
    """Takes queued requests and runs queued calls; False when asked to stop. Blocking and
    idle for `IDLE_PING_S` with several processes, it pings the workers (a dead one shows up
    while nothing runs)."""
    ping = getattr(self.gen.runners[0], "ping", None)
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

    def on_request(reqs: list[Request]) -> None:
      try:
        gen.add_group(reqs)
      except ValueError as e:
        for q in reqs:
          self._emit(q, Event("error", message=str(e)))
        return
      self._live.update(reqs)

    while True:
      idle = not gen.has_work and not self._live
      if not self._drain_inbox(idle and not gen.promotable, on_request):
        for r in list(self._live):
          self._emit(r, Event("error", message="server shutting down"))
        return
      self._sweep(gen)
      if not gen.has_work:
        self._gauges(0, 0, gen.max_rows)
        if gen.promotable:  # idle: the next program compiled in the background
          gen.promote(log.info, limit=1)
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
      for r, msg in res.errors:
        self._emit(r, Event("error", message=msg))
      now = time.perf_counter()
      for r, _ in res.tokens:
        if r.ended:  # already failed (e.g. by the stall watchdog) while its step ran
          gen.finish(r)
          continue
        if not r.t_last:
          m.ttft.labels(r.model).observe(now - r.arrival)
        else:
          m.itl.labels(r.model).observe(now - r.t_last)
        r.t_last = now
        if self._accept(r):
          gen.finish(r)
      self._gauges(len(gen.running), len(gen.waiting), gen.max_rows)

  def _step_failed(self, gen, e: Exception) -> bool:
    """A step raised. Its requests end with an error event and the engine recovers
    (`Generator.recover`: their pages released, the KV pools rebuilt, cached prefixes
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
      for r in list(gen.running) + list(gen.waiting):
        gen.finish(r)
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
      for r in failed:
        self._emit(r, Event("error", message=message, code="step_failed"))
      return True
    self.fatal = (f"{self.failures_in_row} engine steps failed in a row (last: "
                  f"{self.last_step_error}); the server stops so that it can be restarted")
    log.critical("%s", self.fatal)
    self.alive = False  # new requests get a 503 from now on
    # on_fatal first: it and the events below are queued onto the event loop in order, so a
    # client that reads its 503 finds the server already stopping (engine_failed set)
    if self.on_fatal is not None:
      try:
        self.on_fatal(self.fatal)
      except Exception:  # noqa: BLE001
        log.exception("on_fatal failed")
    for r in failed + list(self._live):  # a 503: retry on another replica
      self._emit(r, Event("error", message=self.fatal, code="engine_failed"))
    self._refuse_queued()
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
    moved for ``stall_timeout_s`` (`Generator.stalled`: an engine bug, failed with
    ``code="stalled"``), and choices whose sequence ended without one."""
    for r in [r for r in self._live if r.cancelled]:
      if r.ended:
        continue
      lead = r.leader or r  # a choice not forked yet goes with the choice it waits for
      group = [lead, *lead.followers]
      gen.finish(lead)
      for q in group:
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
                len(group), s.model)
      self.stalled_total += len(group)
      self.last_stall = now
      self.metrics.stalled.inc(len(group))
      for x in group:
        self._emit(x, Event("error", code="stalled", message=(
          f"the engine made no progress on this request for {limit:g} s; it was stopped "
          "(a server fault, please report it)")))
    self.stuck = sum(1 + len(s.followers) for s in slow if not s.finished)
    for r in [r for r in self._live if r.finished and not r.ended]:
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
  def _accept(self, r: Request) -> bool:
    """Takes ``r``'s new token (the last of ``r.tokens``): emits the text that became final, or
    ``done`` when `stops.check_stop` ends it (then returns True)."""
    reason = check_stop(r, self.cfg.max_seq_len, self.tokenizer)
    kept = r.params.max_new_tokens > 0 and r.tokens[-1] not in r.params.stop_token_ids
    if kept:
      self.metrics.generated_tokens.labels(r.model).inc()
    if reason is not None:
      self._emit(r, Event("done", text=r.text.take(final=True) if r.text else "",
                          finish_reason=reason, completion_tokens=num_kept(r)))
      return True
    text = r.text.take()
    if text:
      self._emit(r, Event("token", text=text))
    return False

  def _emit(self, r: Request, ev: Event) -> None:
    if r.ended:  # exactly one last event per request
      return
    if ev.kind in ("done", "error"):
      r.ended = True
      self._live.discard(r)
    if ev.kind in ("token", "done"):
      if r.params.logprobs is not None:
        ev.logprobs = self._logprob_entries(r)
      if not r.emitted:
        ev.prompt_logprobs = _prompt_entries(r)
      r.emitted = True
    try:
      r.emit(ev)
    except Exception:  # noqa: BLE001  e.g. the event loop is closed
      log.debug("dropping event for a closed request", exc_info=True)

  @staticmethod
  def _logprob_entries(r: Request) -> list | None:
    """The entries of the kept tokens not attached to an event yet (a stop token's is not)."""
    kept = min(len(r.token_logprobs), num_kept(r) if r.ended else r.num_generated)
    base = len(r.prompt)
    out = [(r.tokens[base + i], lp, list(zip(ids, vals)))
           for i, (lp, ids, vals) in enumerate(r.token_logprobs[r.logprobs_sent:kept],
                                               r.logprobs_sent)]
    r.logprobs_sent = max(r.logprobs_sent, kept)
    return out or None


def _prompt_entries(r: Request) -> list | None:
  """The prompt's log-probability entries (echo), from choice 0, which scored it."""
  if getattr(r.params, "prompt_logprobs", None) is None:
    return None
  lead = r.siblings[0] if r.siblings else r
  scores = lead.prompt_logprobs
  out = [(r.prompt[0], None, None)]
  for i in range(1, len(r.prompt)):
    lp, ids, vals = scores.get(i, (None, [], []))
    out.append((r.prompt[i], lp, list(zip(ids, vals))))
  return out


def _code(e: BaseException) -> str | None:
  """The error code of a failed step's requests: ``worker_lost`` (HTTP 503) when a worker
  process was lost."""
  return "worker_lost" if isinstance(e, WorkerLost) else None
