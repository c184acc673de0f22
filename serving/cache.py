"""The delta cache in three tiers: disk (delta dirs) → host memory (byte budget) → device slots.

    slot = await cache.acquire(variant)     # the variant is in a device slot, held for you
    ...                                     # generate with that slot id
    cache.release(variant)                  # once the engine no longer reads the slot

* **Device**: the model's slot bank (``device_slots`` fixed rows; slot 0 is the base). A slot
  is held (reference-counted) from `acquire` until `release`, i.e. while any request of that
  variant is queued or decoding; a held slot is never evicted or rewritten.
* **Host**: loaded deltas (numpy) up to ``host_cache_bytes``; a variant larger than the whole
  budget goes disk → device without being cached. The budget is never exceeded.
* **Disk**: the registered delta directory.

Single flight: one load task per variant; every request for it awaits that task (shielded,
so a client that goes away does not cancel the load). A load claims its device slot before it
reads (one waiting for a slot holds no delta in memory), and at most ``io_threads`` deltas are
between the disk and their slot at once; disk reads run in the IO thread pool,
the slot write runs on the device thread between decode steps; the event loop only does
bookkeeping, so requests for resident variants never wait on a load. A failed load fails the
requests waiting for it with `LoadError`; requests within ``load_retry_s`` fail fast with the
same error, later ones try again.

Eviction (both tiers) is LRU weighted by request rate: each variant has a counter that decays
with half-life ``rate_half_life_s`` and gains 1 per request; the victim is the evictable
variant with the lowest decayed rate (ties: least recently used). Explicit pins are never
evicted from a device slot; the ``top_n_pin`` variants with the highest rates are evicted only
when no other candidate exists.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable

from bitdelta_jax.engine import heap
from serving.config import ServerConfig
from serving.metrics import Metrics
from serving.registry import Variant

log = logging.getLogger("serving.cache")


class LoadError(RuntimeError):
  """A variant could not be brought into a device slot."""

  def __init__(self, variant: str, message: str):
    super().__init__(f"variant {variant!r} could not be loaded: {message}")
    self.variant = variant


class DeltaCache:
  def __init__(self, cfg: ServerConfig, metrics: Metrics, *, read_delta: Callable,
               write_slot: Callable, io_pool: concurrent.futures.Executor,
               clock: Callable[[], float] = time.monotonic):
    """``read_delta(variant) -> {name: entry}`` runs in ``io_pool``; ``write_slot(slot, delta)``
    returns a concurrent future completed by the device thread."""
    self.cfg, self.metrics = cfg, metrics
    self._read_delta, self._write_slot, self._io = read_delta, write_slot, io_pool
    self.clock = clock
    self.slots: list[Variant | None] = [None] * cfg.device_slots  # index i ↔ model slot i + 1
    self.refs = [0] * cfg.device_slots
    self.host: dict[str, tuple[Variant, dict]] = {}
    self.host_used = 0
    self.loading: dict[str, asyncio.Future] = {}
    self.load_count = 0
    self._slot_waiters: list[asyncio.Future] = []
    # deltas between the disk and their slot at once: a delta read waits until one written
    # frees its place (14 loads into 14 free slots read 14 deltas, 10.8 GB at 7B, faster than
    # the device thread wrote them, and the server was OOM-killed)
    self._in_flight = asyncio.Semaphore(cfg.io_threads)
    self.explicit_pins = set(cfg.pins)
    metrics.host_budget.set(cfg.host_cache_bytes)
    metrics.slots_total.set(cfg.device_slots)

  # -- queries -------------------------------------------------------------------------------
  def tier(self, v: Variant) -> str:
    if v.slot is not None and v.name not in self.loading:
      return "device"
    return "host" if v.name in self.host else "disk"

  def top_n(self) -> set[str]:
    n = self.cfg.top_n_pin
    if n <= 0:
      return set()
    now, hl = self.clock(), self.cfg.rate_half_life_s
    live = {v.name: v for v in self.slots if v is not None}
    live.update({name: v for name, (v, _) in self.host.items()})
    ranked = sorted(live.values(), key=lambda v: -v.decayed_rate(now, hl))
    return {v.name for v in ranked[:n] if v.rate > 0}

  def _score(self, v: Variant, top: set[str]) -> tuple:
    now = self.clock()
    return (v.name in self.explicit_pins, v.name in top,
            v.decayed_rate(now, self.cfg.rate_half_life_s), v.last_used)

  # -- the request path --------------------------------------------------------------------
  async def acquire(self, v: Variant) -> int:
    """Brings ``v`` into a device slot (single flight) and holds it; returns the slot id."""
    m = self.metrics
    v.touch(self.clock(), self.cfg.rate_half_life_s)
    first = True
    while True:
      if v.slot is not None and v.name not in self.loading:
        if first:
          m.cache_hits.labels(v.name, "device").inc()
        self.refs[v.slot - 1] += 1
        return v.slot
      if first:
        m.cache_misses.labels(v.name, "device").inc()
        first = False
      # a variant being deleted still loads for the requests accepted before the DELETE (the
      # router admits no new ones); the DELETE waits for them, then drops it
      task = self.loading.get(v.name)
      if task is None:
        if self.clock() - v.load_failed_at < self.cfg.load_retry_s and v.load_error:
          raise LoadError(v.name, v.load_error)
        task = self.loading[v.name] = asyncio.ensure_future(self._load(v))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
      v.waiting += 1
      m.waiting.inc()
      try:
        await asyncio.shield(task)
      finally:
        v.waiting -= 1
        m.waiting.dec()

  def release(self, v: Variant) -> None:
    if v.slot is None:
      return
    i = v.slot - 1
    self.refs[i] -= 1
    if self.refs[i] == 0:
      self._wake()

  async def preload(self, v: Variant) -> None:
    """Loads ``v`` into a device slot without holding it (pins at startup)."""
    await self.acquire(v)
    self.release(v)

  # -- loading -------------------------------------------------------------------------------
  async def _load(self, v: Variant) -> None:
    m, loop = self.metrics, asyncio.get_running_loop()
    t0 = time.perf_counter()
    claimed: int | None = None
    try:
      cached = self.host.get(v.name)
      source = "disk" if cached is None else "host"
      if cached is None:
        m.cache_misses.labels(v.name, "host").inc()
      else:
        self._host_touch(v.name)
      m.cache_hits.labels(v.name, source).inc()
      # the slot first, then the read: a variant waiting for a slot holds no delta in memory
      # (read first, 14 loads behind 8 busy slots held 6 deltas of 772 MiB at once at 7B)
      claimed = await self._claim_slot(v)
      if cached is not None:
        await asyncio.wrap_future(self._write_slot(claimed, cached[1]))
      else:
        async with self._in_flight:
          delta = await loop.run_in_executor(self._io, self._read_delta, v)
          if not v.deleting:
            self._host_put(v, delta)
          await asyncio.wrap_future(self._write_slot(claimed, delta))
          # written: unless the host tier keeps it, the read's buffers (a few MB per tensor,
          # freed into the IO thread's malloc arena) go back to the OS
          del delta
          await loop.run_in_executor(self._io, heap.trim)
      v.slot = claimed
      claimed = None
      dt = time.perf_counter() - t0
      v.loads += 1
      self.load_count += 1
      v.last_load_time, v.last_load_seconds, v.last_load_source = time.time(), dt, source
      v.load_error = None
      m.loads.labels(v.name, "ok").inc()
      m.load_seconds.labels(v.name, source).observe(dt)
      log.info("loaded %s into slot %d from %s in %.3fs", v.name, v.slot, source, dt)
    except Exception as e:
      msg = str(e) if isinstance(e, LoadError) else f"{type(e).__name__}: {e}"
      v.load_error, v.load_failed_at = msg, self.clock()
      m.loads.labels(v.name, "error").inc()
      log.warning("loading %s failed: %s", v.name, msg)
      if claimed is not None:
        self.slots[claimed - 1] = None
        self._wake()
      raise e if isinstance(e, LoadError) else LoadError(v.name, msg) from e
    finally:
      self.loading.pop(v.name, None)
      self._update_gauges(v)

  async def _claim_slot(self, v: Variant) -> int:
    """Reserves a device slot for ``v`` (evicting if needed; waits while all are held)."""
    while True:
      for i, occupant in enumerate(self.slots):
        if occupant is None:
          self.slots[i] = v
          return i + 1
      top = self.top_n()
      cands = [(self._score(u, top), i) for i, u in enumerate(self.slots)
               if u is not None and self.refs[i] == 0 and u.waiting == 0
               and u.name not in self.loading and u.name not in self.explicit_pins]
      if cands:
        _, i = min(cands, key=lambda c: c[0])
        victim = self.slots[i]
        victim.slot = None
        self.slots[i] = v
        self.metrics.evictions.labels(victim.name, "device").inc()
        self._update_gauges(victim)
        return i + 1
      if not any(self.refs) and not self.loading.keys() - {v.name}:
        raise LoadError(v.name, f"all {len(self.slots)} device slots hold pinned variants")
      fut = asyncio.get_running_loop().create_future()
      self._slot_waiters.append(fut)
      await fut

  def _wake(self) -> None:
    waiters, self._slot_waiters = self._slot_waiters, []
    for f in waiters:
      if not f.done():
        f.set_result(None)

  # -- host tier -------------------------------------------------------------------------------
  def _host_touch(self, name: str) -> None:
    self.host[name] = self.host.pop(name)

  def _host_put(self, v: Variant, delta: dict) -> None:
    nbytes = sum(int(e.nbytes) for e in delta.values())
    budget = self.cfg.host_cache_bytes
    if nbytes > budget:
      return  # goes straight to the device, uncached
    top = self.top_n()
    while self.host_used + nbytes > budget:
      name = min(self.host, key=lambda n: self._score(self.host[n][0], top))
      self._host_drop(name)
    self.host[v.name] = (v, delta)
    self.host_used += nbytes
    v.host_bytes = nbytes
    self.metrics.host_bytes.set(self.host_used)

  def _host_drop(self, name: str) -> None:
    u, _ = self.host.pop(name)
    self.host_used -= u.host_bytes
    u.host_bytes = 0
    self.metrics.evictions.labels(u.name, "host").inc()
    self.metrics.host_bytes.set(self.host_used)
    self._update_gauges(u)

  # -- removal ---------------------------------------------------------------------------------
  async def drop(self, v: Variant) -> None:
    """Forgets ``v`` in every tier (its requests have finished). The slot needs no clearing:
    the next load rewrites every bank row of it."""
    if v.name in self.host:
      self._host_drop(v.name)
    if v.slot is not None and self.slots[v.slot - 1] is v:
      self.slots[v.slot - 1] = None
      self._wake()
    v.slot = None
    self.metrics.forget(v.name)
    self._update_gauges(None)

  def _update_gauges(self, v: Variant | None) -> None:
    if v is not None and not v.deleting:
      self.metrics.set_tier(v.name, self.tier(v))
    self.metrics.slots_used.set(sum(s is not None for s in self.slots))

  def snapshot(self) -> dict:
    return {
      "device_slots": {"total": len(self.slots),
                       "used": sum(s is not None for s in self.slots),
                       "slots": [{"slot": i + 1, "variant": None if s is None else s.name,
                                  "in_use": self.refs[i]} for i, s in enumerate(self.slots)]},
      "host_cache": {"used_bytes": self.host_used, "budget_bytes": self.cfg.host_cache_bytes,
                     "variants": list(self.host)},
      "loads": self.load_count,
    }
