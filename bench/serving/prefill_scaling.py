"""Time to first token against prompt length on one server: how much of a long prompt is
attention (quadratic in its length) and how much the per-token work (linear).

    python -m bench prefill_scaling [--gguf FILE] [--lengths 512 1024 2040] [--rounds 3]
        [--llama-server PATH]   → bench/results/serving/prefill_scaling.{json,md}

`bitdelta serve` on the GGUF file (default: the 1B-shaped Q4_0 of `bench.common.random_models`,
``--max-seq-len 2048``), every step bucket compiled before the first request; then, round after
round, one request per length (random token ids, ``max_tokens`` 1, nothing else running), the
lengths in turn. Per length the median seconds to the response; then a least-squares fit
T(n) = a·n + b·n² over the medians: a·n is the work that grows with the tokens (the GEMMs, the
LM head's last row, the per-step overhead), b·n² the attention of the prompt's chunks over the
pages before them. The split at the longest length is the fit's, not a profile.

With ``--llama-server`` (default ``$LLAMA_SERVER``), llama.cpp's server on the same file (2
threads, one slot of ``--max-seq-len`` tokens) answers the same prompts, the two servers taking
turns request by request (who goes first alternates by round); every prompt is new random ids,
so neither side's prompt cache holds any of it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import tempfile
import time
import urllib.request

from bench.common import peers, report, server
from bench.common.machine import machine_line
from bench.common.paths import results_dir


def ttft(url: str, prompt: list[int], model: str = "base") -> float:
  body = {"model": model, "prompt": prompt, "max_tokens": 1}
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
  p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                 help="llama.cpp's llama-server, timed on the same prompts (default $LLAMA_SERVER)")
  a = p.parse_args(argv)
  if a.gguf is None:
    from bench.common.random_models import DEFAULT_WORK, make

    a.gguf = str(make("1b", ["q4_0"], 0, DEFAULT_WORK)["q4_0"][0])
  work = pathlib.Path(tempfile.mkdtemp(prefix="prefill_scaling_"))
  sides = ["ours"] + (["llama"] if a.llama_server else [])
  procs, urls, logs = {}, {}, []
  runs: dict[str, dict[int, list[float]]] = {w: {n: [] for n in a.lengths} for w in sides}
  try:
    for which in sides:
      port = server.free_port()
      log = open(work / f"{which}.log", "w")  # noqa: SIM115 (closed at the end)
      logs.append(log)
      if which == "ours":
        procs[which] = server.launch(
          server.serve_command(a.gguf, {}, port, max_batch=4, max_seq_len=a.max_seq_len), log,
          env={"BITDELTA_COMPILE_CACHE": str(work / "cache")})
      else:
        procs[which] = peers.launch_llama_server(a.llama_server, a.gguf, port, log, parallel=1,
                                                 ctx=a.max_seq_len)
      server.wait_healthy(procs[which], port, log)
      urls[which] = server.url_of(port)
    server.wait_all_buckets(urls["ours"])
    rng = random.Random(0)
    for r in range(a.rounds):
      for n in a.lengths:
        for which in sides if r % 2 == 0 else sides[::-1]:
          prompt = [rng.randrange(100, 30000) for _ in range(n)]
          runs[which][n].append(ttft(urls[which], prompt, "base" if which == "ours" else "model"))
          print(which, n, round(runs[which][n][-1], 3), flush=True)
  finally:
    for proc in procs.values():
      server.stop_server(proc)
    for log in logs:
      log.close()
  med = {n: statistics.median(v) for n, v in runs["ours"].items()}
  lin, quad = fit(list(med), list(med.values()))
  top = max(a.lengths)
  res = {"gguf": str(a.gguf), "lengths": a.lengths, "rounds": a.rounds, "runs": runs["ours"],
         "median_s": med, "a_s_per_token": lin, "b_s_per_token2": quad,
         "fit_s": {n: lin * n + quad * n * n for n in a.lengths},
         "attention_share_at_longest": quad * top * top / (lin * top + quad * top * top)}
  if "llama" in runs:
    lmed = {n: statistics.median(v) for n, v in runs["llama"].items()}
    res["llama_server"] = {"runs": runs["llama"], "median_s": lmed,
                           "ratio_ours_over_llama": {n: med[n] / lmed[n] for n in a.lengths}}
  lines = [
    "# Time to first token against prompt length",
    "",
    f"`python -m bench prefill_scaling --lengths {' '.join(map(str, a.lengths))}"
    f"{' --llama-server PATH' if 'llama' in runs else ''}` on "
    f"`{pathlib.Path(a.gguf).name}`: one request at a time, max_tokens 1, {a.rounds} rounds, "
    "medians; fit T(n) = a·n + b·n² (module docstring).",
    "",
    machine_line({}),
    "",
  ]
  if "llama" in runs:
    lines += ["| prompt tokens | TTFT median (s) | fit (s) | a·n (s) | b·n² (s) | llama-server (s) "
              "| ours / llama |", "|---|---|---|---|---|---|---|"]
  else:
    lines += ["| prompt tokens | TTFT median (s) | fit (s) | a·n (s) | b·n² (s) |",
              "|---|---|---|---|---|"]
  for n in a.lengths:
    row = (f"| {n} | {med[n]:.2f} | {res['fit_s'][n]:.2f} | {lin * n:.2f} | "
           f"{quad * n * n:.2f} |")
    if "llama" in runs:
      row += f" {lmed[n]:.2f} | {med[n] / lmed[n]:.2f} |"
    lines.append(row)
  lines += ["", f"a = {lin * 1e3:.2f} ms per token, b = {quad * 1e6:.3f} us per token²: at "
            f"{top} tokens the quadratic part is {100 * res['attention_share_at_longest']:.0f}% "
            "of the time to the first token."]
  md = report.write(results_dir("serving") / "prefill_scaling", res, lines)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
