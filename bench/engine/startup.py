"""Start-up: seconds from launch to a serving `bitdelta serve`, cold and warm, with the larger step
programs compiled in the background (the default) or all before serving (--compile-all-first).

    python -m bench startup                      # SmolLM2-135M Q4_1 (the shipped file), 1B Q4_0
    python -m bench startup --models smollm2 --rounds 1

Per model and mode, interleaved over ``--rounds``: a **cold** start (an empty compile cache:
every program compiled) and a **warm** one (the same cache again: every program loaded from the
step cache). Each records the seconds to a 200 from /health ("ready"), to every token bucket
ready (/health "buckets" compiling empty), and the time to the first token of a 128-token
prompt sent at ready (greedy, 8 tokens) -- what a user's first request meets while programs
may still be compiling. The 1B model is the random-weight 1B-shaped Llama of
`bench.common.random_models` (built once). Writes bench/results/engine/startup.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import tempfile
import time

import requests

from bench.common import report, server
from bench.common.paths import results_dir
from bench.common.random_models import DEFAULT_WORK, make

MODES = {"background": (), "compile-all-first": ("--compile-all-first",)}


def models(names: list[str]) -> dict[str, pathlib.Path]:
  out = {}
  for name in names:
    if name == "smollm2":
      from bitdelta_jax.zoo.real_base import real_gguf

      out[name] = real_gguf()
    elif name == "1b_q4_0":
      out[name] = make("1b", ["q4_0"], 0, DEFAULT_WORK)["q4_0"][0]
    else:
      raise SystemExit(f"unknown model {name!r} (smollm2, 1b_q4_0)")
  return out


def first_token_s(url: str, prompt_ids: list[int]) -> float:
  t = time.perf_counter()
  with requests.post(url + "/v1/completions", stream=True, timeout=600, json={
      "model": "base", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0,
      "stream": True}) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if line.startswith(b"data:") and b'"text"' in line:
        return time.perf_counter() - t
  raise RuntimeError("no token")


def one_start(gguf: pathlib.Path, mode: str, cache: pathlib.Path, log) -> dict:
  port = server.free_port()
  cmd = server.serve_command(gguf, {}, port, extra=MODES[mode])
  proc, url, ready_s, health = server.start(cmd, port, log, poll_s=0.05,
                                            env={"BITDELTA_COMPILE_CACHE": str(cache)})
  t_ready = time.time()
  try:
    ttft = first_token_s(url, [1] + [100 + i for i in range(127)])
    server.wait_all_buckets(url)
    all_s = ready_s + time.time() - t_ready
    h = server.health(url) or {}
  finally:
    server.stop_server(proc)
  return {"ready_s": round(ready_s, 2), "all_buckets_s": round(all_s, 2),
          "ttft_at_ready_s": round(ttft, 3), "programs_at_ready": health.get("compiled_programs"),
          "programs": h.get("compiled_programs"),
          "compiles_after_warmup": h.get("compiles_after_warmup")}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="smollm2,1b_q4_0")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--out", default=str(results_dir("engine") / "startup"))
  a = p.parse_args(argv)
  files = models(a.models.split(","))
  runs: dict = {m: {mode: {"cold": [], "warm": []} for mode in MODES} for m in files}
  work = pathlib.Path(tempfile.mkdtemp(prefix="bitdelta_startup_"))
  log = open(work / "servers.log", "w")  # noqa: SIM115
  try:
    for r in range(a.rounds):
      for m, gguf in files.items():
        for mode in MODES:
          cache = work / f"cache_{m}_{mode}_{r}"
          for kind in ("cold", "warm"):
            res = one_start(gguf, mode, cache, log)
            runs[m][mode][kind].append(res)
            print(f"round {r} {m} {mode} {kind}: {json.dumps(res)}", flush=True)
          shutil.rmtree(cache, ignore_errors=True)
  finally:
    log.close()
  med = lambda xs, k: round(statistics.median(x[k] for x in xs), 2)  # noqa: E731
  summary = {m: {mode: {kind: {k: med(v, k) for k in ("ready_s", "all_buckets_s",
                                                       "ttft_at_ready_s")}
                        for kind, v in kinds.items()} for mode, kinds in modes.items()}
             for m, modes in runs.items()}
  lines = ["# Start-up: background compile vs every program first", "",
           f"`python -m bench startup --models {a.models} --rounds {a.rounds}`; medians of "
           f"{a.rounds} interleaved rounds. ready = launch to /health 200; all = every token "
           "bucket ready; TTFT = a 128-token prompt sent at ready (8 tokens, greedy).", "",
           "| model | start | ready: background | ready: all first | ratio | all buckets: "
           "background | TTFT at ready: background | TTFT: all first |",
           "|---|---|---|---|---|---|---|---|"]
  for m, modes in summary.items():
    for kind in ("cold", "warm"):
      b, f = modes["background"][kind], modes["compile-all-first"][kind]
      lines.append(f"| {m} | {kind} | {b['ready_s']} s | {f['ready_s']} s | "
                   f"{b['ready_s'] / f['ready_s']:.2f}x | {b['all_buckets_s']} s | "
                   f"{b['ttft_at_ready_s']} s | {f['ttft_at_ready_s']} s |")
  res = {"rounds": a.rounds, "models": {m: str(g) for m, g in files.items()}, "runs": runs,
         "median": summary}
  md = report.write(pathlib.Path(a.out), res, lines)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
