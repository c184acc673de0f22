"""What every benchmark here shares: interleaved timing and the results files.

    t = interleaved({"ours": f, "xla": g}, rounds=15)       # each fn() once per round
    t.median("ours") / t.median("xla")                        # seconds; a ratio within one run
    write_results("kernel", res, lines, fig=fig)              # bench/results/kernel.{json,md,png}

`interleaved` runs every candidate once per round, the order rotating from round to round, so a
shared, noisy machine slows them alike and their ratio holds; each is called (and waited for)
twice first, to compile and warm. It records wall time and process CPU time (all threads: what a
loaded machine makes scarce). `write_results` adds the machine (`machine.describe`) to the
JSON and writes the markdown (and a matplotlib figure, when given) beside it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import time
from collections.abc import Callable, Mapping

import machine

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


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
  rotating; stops early once ``budget_s`` seconds have passed and ``min_rounds`` are done."""
  names = list(fns)
  for f in fns.values():  # compile, then warm
    block(f())
    block(f())
  wall: dict[str, list[float]] = {n: [] for n in names}
  cpu: dict[str, list[float]] = {n: [] for n in names}
  start = time.perf_counter()
  for r in range(rounds):
    for n in names[r % len(names):] + names[: r % len(names)]:
      c, t = time.process_time(), time.perf_counter()
      block(fns[n]())
      wall[n].append(time.perf_counter() - t)
      cpu[n].append(time.process_time() - c)
    if budget_s is not None and r + 1 >= min_rounds and time.perf_counter() - start > budget_s:
      break
  return Timings(wall, cpu)


def write_results(name: str, res: dict, lines: list[str], *, fig=None) -> pathlib.Path:
  """``res`` (the machine added) to ``bench/results/<name>.json``, ``lines`` to ``.md``, ``fig``
  (a matplotlib figure) to ``.png``; returns the markdown's path."""
  RESULTS.mkdir(exist_ok=True)
  res = {"machine": machine.describe(), **res} if "machine" not in res else res
  (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2))
  md = RESULTS / f"{name}.md"
  md.write_text("\n".join(lines) + "\n")
  if fig is not None:
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
  return md


def machine_line(res: dict) -> str:
  """"Machine: <cpu>, <n> cores, jax <version> (<backend>)." for a results table's header."""
  m = res.get("machine") or machine.describe()
  return f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')} ({m.get('backend')})."
