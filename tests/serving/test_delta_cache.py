"""DeltaCache without a model: fake reads and slot writes, real asyncio scheduling."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from serving.cache import DeltaCache, LoadError
from serving.config import ServerConfig
from serving.metrics import Metrics
from serving.registry import Registry


class Entry:
  def __init__(self, n):
    self.nbytes = n


class Fake:
  """Disk reads and device writes that count calls and can be slowed down or made to fail."""

  def __init__(self, sizes: dict[str, int], read_delay: float = 0.0):
    self.sizes, self.read_delay = sizes, read_delay
    self.reads: dict[str, int] = {}
    self.writes: list[tuple[int, str]] = []
    self.fail: set[str] = set()
    self.lock = threading.Lock()

  def read(self, v):
    time.sleep(self.read_delay)
    with self.lock:
      self.reads[v.name] = self.reads.get(v.name, 0) + 1
    if v.name in self.fail:
      raise OSError(f"{v.path}: corrupt")
    return {"w": Entry(self.sizes[v.name]), "name": Entry(0)}

  def write(self, slot, delta):
    f = concurrent.futures.Future()
    self.writes.append((slot, delta))
    f.set_result(None)
    return f


def make(sizes, *, slots=2, host_bytes=10**9, pins=(), top_n=0, read_delay=0.0, half_life=60.0,
         retry=5.0):
  names = list(sizes)
  cfg = ServerConfig(base="/nonexistent/base", variants=tuple((n, f"/d/{n}") for n in names),
                     device_slots=slots, host_cache_mb=host_bytes / (1 << 20), pins=tuple(pins),
                     top_n_pin=top_n, rate_half_life_s=half_life, load_retry_s=retry)
  reg = Registry("base")
  for n in names:
    reg.add(n, Path(f"/d/{n}"), sizes[n], source="config")
  fake = Fake(sizes, read_delay)
  pool = concurrent.futures.ThreadPoolExecutor(2)
  cache = DeltaCache(cfg, Metrics(), read_delta=fake.read, write_slot=fake.write, io_pool=pool)
  return cache, reg, fake


def check_invariants(cache: DeltaCache):
  assert cache.host_used <= cache.cfg.host_cache_bytes
  assert cache.host_used == sum(v.host_bytes for v, _ in cache.host.values())
  occupants = [s for s in cache.slots if s is not None]
  assert len(occupants) == len({id(s) for s in occupants}) <= cache.cfg.device_slots
  assert all(r >= 0 for r in cache.refs)


def test_single_flight_100_concurrent():
  cache, reg, fake = make({"a": 100, "b": 100}, read_delay=0.2)

  async def main():
    v = reg.get("a")
    slots = await asyncio.gather(*(cache.acquire(v) for _ in range(100)))
    assert set(slots) == {v.slot}
    assert cache.refs[v.slot - 1] == 100
    for _ in range(100):
      cache.release(v)

  asyncio.run(main())
  assert fake.reads == {"a": 1} and len(fake.writes) == 1
  assert reg.get("a").loads == 1


def test_failed_load_fails_waiters_only_and_retries_later():
  cache, reg, fake = make({"bad": 10, "good": 10}, read_delay=0.05, retry=0.3)
  fake.fail.add("bad")

  async def main():
    bad, good = reg.get("bad"), reg.get("good")
    res = await asyncio.gather(*(cache.acquire(bad) for _ in range(10)), cache.acquire(good),
                               return_exceptions=True)
    errs = res[:10]
    assert all(isinstance(e, LoadError) and "corrupt" in str(e) for e in errs)
    assert res[10] == good.slot
    cache.release(good)
    assert fake.reads["bad"] == 1
    with pytest.raises(LoadError):  # within load_retry_s: fails fast, no new read
      await cache.acquire(bad)
    assert fake.reads["bad"] == 1
    await asyncio.sleep(0.35)
    fake.fail.clear()
    assert await cache.acquire(bad) == bad.slot  # retried after the window
    assert cache.tier(bad) == "device" and bad.load_error is None

  asyncio.run(main())


def test_eviction_prefers_low_rate_and_never_touches_held_slots():
  cache, reg, fake = make({"hot": 10, "cold": 10, "new": 10, "new2": 10}, slots=2)

  async def main():
    hot, cold, new, new2 = (reg.get(n) for n in ("hot", "cold", "new", "new2"))
    for _ in range(5):
      await cache.acquire(hot)
      cache.release(hot)
    await cache.acquire(cold)
    cache.release(cold)
    await cache.acquire(hot)  # used again last: LRU alone would evict cold too, rate decides
    cache.release(hot)
    await cache.acquire(new)
    assert cache.tier(cold) != "device" and cache.tier(hot) == "device"
    # hot held by a request; new held: new2 must wait, not evict a held slot
    await cache.acquire(hot)
    t = asyncio.ensure_future(cache.acquire(new2))
    await asyncio.sleep(0.1)
    assert not t.done() and cache.tier(new2) != "device"
    cache.release(new)  # frees one slot -> new2 gets it
    slot = await asyncio.wait_for(t, 2)
    assert slot == new.slot or cache.slots[slot - 1] is new2
    assert cache.tier(new) != "device" and cache.tier(hot) == "device"
    cache.release(hot)
    cache.release(new2)

  asyncio.run(main())


def test_explicit_pins_are_never_evicted():
  cache, reg, fake = make({"p": 10, "a": 10, "b": 10, "c": 10}, slots=2, pins=("p",))

  async def main():
    await cache.preload(reg.get("p"))
    for n in ["a", "b", "c", "a", "c", "b"]:
      v = reg.get(n)
      await cache.acquire(v)
      cache.release(v)
      assert cache.tier(reg.get("p")) == "device"

  asyncio.run(main())


def test_all_slots_pinned_is_an_error_not_a_hang():
  cache, reg, fake = make({"p": 10, "a": 10}, slots=1, pins=("p",))

  async def main():
    await cache.preload(reg.get("p"))
    with pytest.raises(LoadError, match="pinned"):
      await asyncio.wait_for(cache.acquire(reg.get("a")), 2)

  asyncio.run(main())


def test_top_n_pinning_keeps_busiest():
  cache, reg, fake = make({"busy": 10, "x": 10, "y": 10, "z": 10}, slots=2, top_n=1)

  async def main():
    busy = reg.get("busy")
    for _ in range(10):
      await cache.acquire(busy)
      cache.release(busy)
    for n in ["x", "y", "z", "x", "y", "z"]:  # each newer than busy, but busy is top-1
      for _ in range(2):
        v = reg.get(n)
        await cache.acquire(v)
        cache.release(v)
      assert cache.tier(busy) == "device"

  asyncio.run(main())


def test_host_budget_never_exceeded_random_traffic():
  rng = random.Random(0)
  sizes = {f"v{i}": int(s) for i, s in enumerate(np.random.default_rng(0).integers(50, 400, 12))}
  sizes["huge"] = 5000  # larger than the whole budget: device only, never cached
  cache, reg, fake = make(sizes, slots=3, host_bytes=1000)

  async def one(name):
    v = reg.get(name)
    await cache.acquire(v)
    check_invariants(cache)
    await asyncio.sleep(rng.random() * 0.005)
    cache.release(v)
    check_invariants(cache)

  async def main():
    names = list(sizes)
    for _ in range(20):
      await asyncio.gather(*(one(rng.choice(names)) for _ in range(8)))
    assert "huge" not in cache.host

  asyncio.run(main())
  assert sum(fake.reads.values()) > len(sizes)  # evictions forced re-reads


def test_host_tier_hit_avoids_disk():
  cache, reg, fake = make({"a": 10, "b": 10}, slots=1)

  async def main():
    for n in ["a", "b", "a"]:
      v = reg.get(n)
      await cache.acquire(v)
      cache.release(v)
    assert reg.get("a").last_load_source == "host"

  asyncio.run(main())
  assert fake.reads == {"a": 1, "b": 1} and len(fake.writes) == 3


def test_drop_frees_slot_and_host():
  cache, reg, fake = make({"a": 10, "b": 10}, slots=1)

  async def main():
    a = reg.get("a")
    await cache.acquire(a)
    cache.release(a)
    await reg.remove("a", cache.drop)
    assert cache.slots == [None] and cache.host_used == 0 and reg.get("a") is None

  asyncio.run(main())


def test_a_load_waiting_for_a_slot_reads_nothing_until_it_has_one():
  """The slot is claimed before the disk read: loads queued behind held slots hold no deltas in
  memory (at 7B each is 772 MiB; read first, 6 loads waiting for 8 busy slots held 4.6 GB)."""
  cache, reg, fake = make({"a": 10, "b": 10, "c": 10}, slots=1)

  async def main():
    a, b, c = reg.get("a"), reg.get("b"), reg.get("c")
    assert await cache.acquire(a) == a.slot
    waiting = [asyncio.ensure_future(cache.acquire(v)) for v in (b, c)]
    await asyncio.sleep(0.1)
    assert not any(t.done() for t in waiting)
    assert set(fake.reads) == {"a"}  # b and c wait for the slot without reading
    cache.release(a)
    done, _ = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    done = done.pop()
    assert len(fake.reads) == 2  # the one that got the slot read its delta, the other did not
    held = b if done is waiting[0] else c
    cache.release(held)
    await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert fake.reads == {"a": 1, "b": 1, "c": 1}
    check_invariants(cache)

  asyncio.run(main())


def test_at_most_io_threads_deltas_are_between_disk_and_slot():
  """Loads into free slots read their deltas only as earlier ones are written: 14 loads into
  14 free slots read 14 deltas (10.8 GB at 7B) faster than the device thread wrote them."""
  cache, reg, fake = make({f"v{i}": 10 for i in range(4)}, slots=4)
  pending: list[concurrent.futures.Future] = []

  def slow_write(slot, delta):  # the device thread's writes, completed by the test
    f = concurrent.futures.Future()
    pending.append(f)
    return f

  cache._write_slot = slow_write

  async def main():
    vs = [reg.get(f"v{i}") for i in range(4)]
    tasks = [asyncio.ensure_future(cache.acquire(v)) for v in vs]
    await asyncio.sleep(0.1)
    assert len(fake.reads) == cache.cfg.io_threads == 2 and len(pending) == 2
    pending[0].set_result(None)  # one written: one more read starts
    await asyncio.sleep(0.1)
    assert len(fake.reads) == 3
    for _ in range(3):
      await asyncio.sleep(0.05)
      for f in pending:
        if not f.done():
          f.set_result(None)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len(fake.reads) == 4
    check_invariants(cache)

  asyncio.run(main())
