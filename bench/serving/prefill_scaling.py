"""Time to first token against prompt length on one server: how much of a long prompt is
attention (quadratic in its length) and how much the per-token work (linear).

    python -m bench prefill_scaling [--gguf FILE] [--lengths 512 1024 2040] [--rounds 3]
        → bench/results/serving/prefill_scaling.{json,md}

`bitdelta serve` on the GGUF file (default: the 1B-shaped Q4_0 of `bench.common.random_models`,
``--max-seq-len 2048``), every step bucket compiled before the first request; then, round after
round, one request per length (random token ids, ``max_tokens`` 1, nothing else running), the
lengths in turn. Per length the median seconds to the response; then a least-squares fit
T(n) = a·n + b·n² over the medians: a·n is the work that grows with the tokens (the GEMMs, the
LM head's last row, the per-step overhead), b·n² the attention of the prompt's chunks over the
pages before them. The split at the longest length is the fit's, not a profile.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile
import time
import urllib.request

from bench.common import report, server
from bench.common.machine import machine_line
from bench.common.paths import results_dir


def ttft(url: str, n: int, rng: random.Random) -> float:
  body = {"model": "base", "prompt": [rng.randrange(100, 30000) for _ in range(n)],
          "max_tokens": 1}
  req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
  t = time.perf_counter()
  urllib.request.urlopen(req, timeout=1800).read()
  return time.perf_counter() - t


def fit(lengths: list[int], seconds: list[float]) -> tuple[float, float]:
  """Least squares a, b of T(n) = a·n + b·n² (no constant: an empty prompt costs nothing)."""
  import numpy as np

  n = np.asarray(lengths, float)
  (a, b), *_ = np.linalg.lstsq(np.stack([n, n * n], 1), np.asarray(seconds), rcond=None)
  return float(a), float(b)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gguf", default=None, help="default: the 1B-shaped Q4_0 (built if missing)")
  p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2040])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--max-seq-len", type=int, default=2048)
  a = p.parse_args(argv)
  if a.gguf is None:
    from bench.common.random_models import DEFAULT_WORK, make

    a.gguf = str(make("1b", ["q4_0"], 0, DEFAULT_WORK)["q4_0"][0])
  work = pathlib.Path(tempfile.mkdtemp(prefix="prefill_scaling_"))
  port = server.free_port()
  with open(work / "server.log", "w") as log:
    proc = server.launch(server.serve_command(a.gguf, {}, port, max_batch=4,
                                              max_seq_len=a.max_seq_len), log,
                         env={"BITDELTA_COMPILE_CACHE": str(work / "cache")})
    try:
      server.wait_healthy(proc, port, log)
      url = server.url_of(port)
      server.wait_all_buckets(url)
      rng = random.Random(0)
      runs: dict[int, list[float]] = {n: [] for n in a.lengths}
      for _ in range(a.rounds):
        for n in a.lengths:
          runs[n].append(ttft(url, n, rng))
          print(n, round(runs[n][-1], 3), flush=True)
    finally:
      server.stop_server(proc)
  med = {n: statistics.median(v) for n, v in runs.items()}
  lin, quad = fit(list(med), list(med.values()))
  top = max(a.lengths)
  res = {"gguf": str(a.gguf), "lengths": a.lengths, "rounds": a.rounds, "runs": runs,
         "median_s": med, "a_s_per_token": lin, "b_s_per_token2": quad,
         "fit_s": {n: lin * n + quad * n * n for n in a.lengths},
         "attention_share_at_longest": quad * top * top / (lin * top + quad * top * top)}
  lines = [
    "# Time to first token against prompt length",
    "",
    f"`python -m bench prefill_scaling --lengths {' '.join(map(str, a.lengths))}` on "
    f"`{pathlib.Path(a.gguf).name}`: one request at a time, max_tokens 1, {a.rounds} rounds, "
    "medians; fit T(n) = a·n + b·n² (module docstring).",
    "",
    machine_line({}),
    "",
    "| prompt tokens | TTFT median (s) | fit (s) | a·n (s) | b·n² (s) |",
    "|---|---|---|---|---|",
  ]
  for n in a.lengths:
    lines.append(f"| {n} | {med[n]:.2f} | {res['fit_s'][n]:.2f} | {lin * n:.2f} | "
                 f"{quad * n * n:.2f} |")
  lines += ["", f"a = {lin * 1e3:.2f} ms per token, b = {quad * 1e6:.3f} us per token²: at "
            f"{top} tokens the quadratic part is {100 * res['attention_share_at_longest']:.0f}% "
            "of the time to the first token."]
  md = report.write(results_dir("serving") / "prefill_scaling", res, lines)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
