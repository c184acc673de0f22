"""Interleaved timing: every candidate once per round, medians, ratios within one run.

    t = interleaved({"ours": f, "xla": g}, rounds=15)       # each fn() once per round
    t.median("ours") / t.median("xla")                        # seconds; a ratio within one run

`interleaved` runs every candidate once per round, the order rotating from round to round, so a
shared, noisy machine slows them alike and their ratio holds; each is called (and waited for)
twice first, to compile and warm. It records wall time and process CPU time (all threads: what a
loaded machine makes scarce). Results are written with `bench.common.report.write`.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Mapping


def _block(out):
  try:
    import jax
  except ImportError:  # a bench of something else than JAX
    return out
  return jax.block_until_ready(out)


@dataclasses.dataclass
class Timings:
  """Seconds per call of each candidate, one entry per round."""

  wall: dict[str, list[float]]
  cpu: dict[str, list[float]]

  def median(self, name: str) -> float:
    return statistics.median(self.wall[name])

  def min(self, name: str) -> float:
    return min(self.wall[name])

  def medians(self) -> dict[str, float]:
    return {n: self.median(n) for n in self.wall}


def interleaved(fns: Mapping[str, Callable[[], object]], rounds: int, *,
                budget_s: float | None = None, min_rounds: int = 5,
                block: Callable = _block) -> Timings:
  """Times each ``fn()`` (its result waited for with ``block``) once per round, the order
  changing; stops early once ``budget_s`` seconds have passed and ``min_rounds`` are done.
  Up to 4 candidates the rounds walk every order (so each follows each other equally often:
  with a plain rotation of 3, the first always ran right after the third, and on inputs that
  fit the caches that decided which one found the shared arrays warm); more, a rotation."""
  names = list(fns)
  orders = (list(itertools.permutations(names)) if len(names) <= 4 else
            [names[r:] + names[:r] for r in range(len(names))])
  for f in fns.values():  # compile, then warm
    block(f())
    block(f())
  wall: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  start = time.perf_counter()
  for r in range(rounds):
    for n in orders[r % len(orders)]:
      c, t = time.process_time(), time.perf_counter()
      block(fns[n]())
      wall[n].append(time.perf_counter() - t)
      cpu[n].append(time.process_time() - c)
    if budget_s is not None and r + 1 >= min_rounds and time.perf_counter() - start > budget_s:
      break
  return Timings(wall, cpu)
