"""A short prompt behind a long one: time to first token under this checkout's scheduler and an
earlier commit's, side by side.

    python -m bench prefill_policy --before REF [--gguf FILE] [--rounds 3]
        → bench/results/serving/prefill_policy.{json,md}

Two `bitdelta serve` processes on the same GGUF file (default: the 1B-shaped Q4_0 of
`bench.common.random_models`), one importing this checkout and one a git worktree of REF, every
step bucket compiled before the first request. Each round, on one server and then the other
(who goes first alternates): a ``--long``-token prompt is sent, and ``--delay`` seconds later a
``--short``-token one (fresh random token ids each time, ``max_tokens`` 1, so the response time
is the time to the first token). Medians per server of the short prompt's and the long
prompt's response times, and their ratio now / before.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import tempfile
import threading
import time

from bench.common import report, server
from bench.common.checkouts import checkouts
from bench.common.machine import machine_line
from bench.common.paths import results_dir
from bench.serving.prefill_scaling import ttft


def scenario(url: str, long_n: int, short_n: int, delay: float, rng: random.Random) -> dict:
  """Seconds to the first token of a long prompt and of a short one sent ``delay`` s after."""
  prompts = {k: [rng.randrange(100, 30000) for _ in range(n)]
             for k, n in (("long", long_n), ("short", short_n))}
  out: dict[str, float] = {}

  def send(kind):
    out[kind] = ttft(url, prompts[kind])

  t = threading.Thread(target=send, args=("long",))
  t.start()
  time.sleep(delay)
  send("short")
  t.join()
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--before", required=True, help="the git ref to compare with")
  p.add_argument("--gguf", default=None, help="default: the 1B-shaped Q4_0 (built if missing)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--long", type=int, default=2040)
  p.add_argument("--short", type=int, default=128)
  p.add_argument("--delay", type=float, default=0.3)
  a = p.parse_args(argv)
  if a.gguf is None:
    from bench.common.random_models import DEFAULT_WORK, make

    a.gguf = str(make("1b", ["q4_0"], 0, DEFAULT_WORK)["q4_0"][0])
  work = pathlib.Path(tempfile.mkdtemp(prefix="prefill_policy_"))
  runs = {w: {"long": [], "short": []} for w in ("now", "before")}
  with checkouts(a.before, work) as srcs:
    procs, urls, logs = {}, {}, []
    try:
      for which, src in srcs.items():
        port = server.free_port()
        log = open(work / f"{which}.log", "w")  # noqa: SIM115 (closed at the end)
        logs.append(log)
        procs[which] = server.launch(
          server.serve_command(a.gguf, {}, port, max_batch=4, max_seq_len=2048), log,
          env={"BITDELTA_COMPILE_CACHE": str(work / f"cache-{which}"), "PYTHONPATH": str(src)},
          cwd=src)
        server.wait_healthy(procs[which], port, log)
        urls[which] = server.url_of(port)
        server.wait_all_buckets(urls[which])
      rng = random.Random(0)
      for r in range(a.rounds):
        for which in ("now", "before") if r % 2 == 0 else ("before", "now"):
          got = scenario(urls[which], a.long, a.short, a.delay, rng)
          for k, v in got.items():
            runs[which][k].append(v)
          print(which, {k: round(v, 2) for k, v in got.items()}, flush=True)
    finally:
      for proc in procs.values():
        server.stop_server(proc)
      for log in logs:
        log.close()
  med = {w: {k: statistics.median(v) for k, v in d.items()} for w, d in runs.items()}
  res = {"gguf": a.gguf, "before": a.before, "rounds": a.rounds, "long": a.long,
         "short": a.short, "delay_s": a.delay, "runs": runs, "median_s": med,
         "ratio_now_over_before": {k: med["now"][k] / med["before"][k] for k in ("long", "short")}}
  lines = [
    "# A short prompt behind a long one: the scheduler's prefill policy",
    "",
    f"`python -m bench prefill_policy --before {a.before}` on `{pathlib.Path(a.gguf).name}`: a "
    f"{a.long}-token prompt, then {a.delay:g} s later a {a.short}-token one (max_tokens 1); "
    f"{a.rounds} interleaved rounds, medians (module docstring).",
    "",
    machine_line({}),
    "",
    "| scheduler | short prompt TTFT (s) | long prompt TTFT (s) |",
    "|---|---|---|",
    f"| now (oldest prompt ≥ 1/4 of the budget, the rest fewest-tokens-left first) | "
    f"{med['now']['short']:.2f} | {med['now']['long']:.2f} |",
    f"| before ({a.before}: first come, first served) | {med['before']['short']:.2f} | "
    f"{med['before']['long']:.2f} |",
    f"| now / before | {res['ratio_now_over_before']['short']:.2f} | "
    f"{res['ratio_now_over_before']['long']:.2f} |",
  ]
  md = report.write(results_dir("serving") / "prefill_policy", res, lines)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
