"""The realistic-variant server of `bench/serving/portable.py` measured by guidellm, an established load
generator anyone can install (issue 49 item 7) → bench/results/serving/portable_guidellm.{json,md}.

    python -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm==0.8.1   # pinned, package registry
    python -m bench portable --build-only                          # the models (cached)
    python -m bench guidellm --guidellm /tmp/gl/bin/guidellm [--rounds 2]

One `bitdelta serve` of the Q4_0 release with its 4 realistic variants (portable deltas) and the
default (int8) activations; guidellm's synthetic text (128 prompt tokens, 64 output tokens,
tokenized by the release's own tokenizer) against ``/v1/completions`` at concurrency 1 and 8, on
the base and on the variant ``v0``, each run ``--requests`` requests, the four runs in
interleaved rounds (order rotating). Reported: guidellm's output tokens/s, TTFT and ITL
medians, and the variant / base ratios.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import time

from bench.common.paths import ROOT, results_dir


def run_guidellm(exe: str, url: str, model: str, streams: int, requests: int, tokenizer,
                 out: pathlib.Path) -> dict:
  cmd = [exe, "run",
         "--backend", f"kind=openai_http,target={url},model={model},"
                      "request_format=/v1/completions",
         "--profile", f"kind=concurrent,streams={streams}",
         "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
         "--constraint", f"kind=max_requests,count={requests}",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"]
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  return summarize(json.loads(out.read_text()))


def summarize(report: dict) -> dict:
  """guidellm's report → output tokens/s (every successful request's output tokens over the
  run's duration), TTFT and ITL (mean and median over requests)."""
  b = report["benchmarks"][0]
  m = b["metrics"]
  tokens = m["output_token_count"]["successful"]["total_sum"]
  out = {"output_tok_s": {"mean": tokens / b["duration"], "median": tokens / b["duration"]},
         "requests": m["output_token_count"]["successful"]["count"]}
  for key, name in (("time_to_first_token_ms", "ttft_ms"), ("inter_token_latency_ms", "itl_ms")):
    succ = m[key]["successful"]
    out[name] = {"mean": succ["mean"], "median": succ["median"]}
  return out


def main(argv=None) -> int:
  from bench.common.server import free_port, launch_server, stop_server, wait_healthy
  from bench.serving.portable import DEFAULT_WORK

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--guidellm", required=True, help="the guidellm executable (0.8.1)")
  p.add_argument("--work", default=str(DEFAULT_WORK))
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--requests", type=int, default=16)
  p.add_argument("--summarize-only", action="store_true",
                 help="rebuild the results from the guidellm reports already in --work")
  a = p.parse_args(argv)
  work = pathlib.Path(a.work)
  if a.summarize_only:
    res = json.loads((results_dir("serving") / "portable_guidellm.json").read_text())
    res["runs"] = {}
    for k in dict.fromkeys(res["order"]):
      res["runs"][k] = [summarize(json.loads(f.read_text()))
                        for f in sorted(work.glob(f"guidellm_{k}_*.json"))]
    return write_report(res, a)
  g = work / "release.Q4_0.gguf"
  variants = {f"v{i}": str(work / f"v{i}-portable") for i in range(4)}
  port = free_port()
  log = open(work / "guidellm_server.log", "w")
  t0 = time.time()
  proc = launch_server(g, variants, port, log, device_slots=4)
  res: dict = {"runs": {}, "order": []}
  try:
    res["server_start_s"] = wait_healthy(proc, port, log, t0, timeout_s=3600)
    url = f"http://127.0.0.1:{port}"
    keys = [("base", 1), ("v0", 1), ("base", 8), ("v0", 8)]
    version = subprocess.run([a.guidellm, "--version"], capture_output=True,
                             text=True).stdout.strip()
    res["guidellm"] = version
    for r in range(a.rounds):
      for model, streams in keys[r % len(keys):] + keys[:r % len(keys)]:
        k = f"{model}_c{streams}"
        out = work / f"guidellm_{k}_{r}.json"
        s = run_guidellm(a.guidellm, url, model, streams, a.requests, work / "release-bf16", out)
        res["runs"].setdefault(k, []).append(s)
        res["order"].append(k)
        print(k, s.get("output_tok_s"), flush=True)
  finally:
    stop_server(proc)
  return write_report(res, a)


def write_report(res: dict, a) -> int:
  from bench.common import report
  from bench.common.machine import machine_line

  def med(k, metric, stat="mean"):
    vals = [r[metric][stat] for r in res["runs"][k] if metric in r and r[metric][stat] is not None]
    return statistics.median(vals) if vals else float("nan")

  res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=ROOT).stdout.strip()
  L = ["# guidellm on realistic variants over a Q4_0 base (1B-shaped)", "",
       machine_line(res) + f" Commit {res['commit']}; {res['guidellm']}.", "",
       "`python -m bench guidellm --guidellm /tmp/gl/bin/guidellm` (module docstring). "
       f"Synthetic text 128 prompt / 64 output tokens, {a.requests} requests a run, "
       f"{a.rounds} interleaved rounds (median of the runs' values); default activations (int8).",
       "", "| model | concurrency | output tok/s | TTFT median (ms) | ITL median (ms) |",
       "|---|---:|---:|---:|---:|"]
  for k in res["runs"]:
    model, c = k.split("_c")
    L.append(f"| {model} | {c} | {med(k, 'output_tok_s'):.1f} | "
             f"{med(k, 'ttft_ms', 'median'):.0f} | {med(k, 'itl_ms', 'median'):.1f} |")
  for c in (1, 8):
    ratio = med(f"v0_c{c}", "output_tok_s") / med(f"base_c{c}", "output_tok_s")
    res[f"variant_over_base_c{c}"] = ratio
    L.append(f"\nVariant / base output tokens/s at concurrency {c}: {ratio:.2f}x")
  report.write(results_dir("serving") / "portable_guidellm", res, L)
  print("\n".join(L))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
