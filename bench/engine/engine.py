"""The one engine on the real model: start-up, compiles while serving, and a mesh's overhead.

    python -m bench engine                 # this checkout only (~6 min on 2 cores)
    python -m bench engine --before REF    # and an earlier commit, side by side

On SmolLM2-135M-Instruct (f32, dequantized Q4_1), `bitdelta serve` as a separate process:

1. **start-up**: seconds from launch to a healthy /health, cold (an empty compile cache) and
   warm (the same cache again), and the step programs compiled (`compiled_programs`).
2. **compiles while serving**: one stream generates while, one at a time, prompts of every
   length from 1 to 40 tokens and then every 16 tokens up to the context limit are sent (each
   reaches a new step shape of the old engine). The stream's inter-token gaps are recorded
   (client side, SSE arrival); the growth runs twice, and the second pass meets only shapes
   already seen. A compile shows as a gap of seconds in the first pass. The server runs with
   ``--forbid-compile-after-warmup`` (a compile would fail a request) and reports
   ``compiles_after_warmup`` in /health.
3. **mesh overhead** (this checkout): a decode step on 1 device vs a 1×8 mesh of CPU devices
   (``--xla_force_host_platform_device_count=8``), same greedy tokens. Simulated devices share
   the same 2 cores: this measures the per-step overhead of the sharded program, not speed.

Writes bench/results/engine/engine.{json,md}. Prompts are token ids (the completions endpoint takes
them), ``max_tokens`` 1 for the growing prompts, greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import report, server
from bench.common.checkouts import checkouts
from bench.common.machine import describe
from bench.common.paths import ROOT, results_dir
from bench.common.server import free_port

MAX_SEQ_LEN = 512
PREFILL_CHUNK = 32  # a mixed step stays a few decode steps long on 2 cores
MAX_BATCH = 8


def lengths(max_seq_len: int) -> list[int]:
  return list(range(1, 41)) + list(range(48, max_seq_len - 8, 16))


def start(src: pathlib.Path, base: pathlib.Path, cache: pathlib.Path, log, guard: bool):
  """`bitdelta serve` of ``src`` (its own compile cache): ``(proc, url, seconds to healthy,
  /health)``."""
  port = free_port()
  cmd = [sys.executable, "-m", "bitdelta_jax.cli", "serve", "--base", str(base), "--port",
         str(port), "--max-batch", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN),
         "--prefill-chunk", str(PREFILL_CHUNK), "--base-name", "base"]
  if guard:
    cmd.append("--forbid-compile-after-warmup")
  env = dict(PYTHONPATH=str(src), BITDELTA_CACHE=str(cache), JAX_PLATFORMS="cpu")
  return server.start(cmd, port, log, env=env, cwd=src, poll_s=0.5)


async def _stream(url: str, max_tokens: int, arrivals: list, done: threading.Event):
  import aiohttp

  body = {"model": "base", "prompt": [1] + list(range(100, 130)), "max_tokens": max_tokens,
          "temperature": 0, "ignore_eos": True, "stream": True}
  async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
    assert r.status == 200, await r.text()
    async for line in r.content:
      if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
        arrivals.append(time.perf_counter())
        if done.is_set():
          break


def growth(url: str, lens: list[int]) -> dict:
  """Inter-token gaps of one stream while prompts of ``lens`` tokens arrive one at a time."""
  import requests

  arrivals: list[float] = []
  done = threading.Event()
  t = threading.Thread(target=lambda: asyncio.run(_stream(url, MAX_SEQ_LEN - 40, arrivals,
                                                          done)), daemon=True)
  t.start()
  while len(arrivals) < 5:
    time.sleep(0.05)
  failures, slowest = 0, (0.0, 0)
  start_n = len(arrivals)
  for n in lens:
    body = {"model": "base", "prompt": [1] + [200 + (i % 500) for i in range(n - 1)],
            "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    dt = time.perf_counter() - t0
    failures += r.status_code != 200
    slowest = max(slowest, (dt, n))
  end_n = len(arrivals)
  done.set()
  t.join(120)
  gaps = [b - a for a, b in zip(arrivals[start_n:end_n], arrivals[start_n + 1 : end_n])]
  med = statistics.median(gaps)
  return {"requests": len(lens), "failed": failures, "stream_tokens": len(gaps),
          "gap_median_ms": round(1e3 * med, 1), "gap_max_ms": round(1e3 * max(gaps), 1),
          "gap_max_over_median": round(max(gaps) / med, 2),
          "gaps_over_5x": sum(g >= 5 * med for g in gaps),
          "slowest_request_s": round(slowest[0], 2), "slowest_request_len": slowest[1]}


def server_part(name: str, src: pathlib.Path, base: pathlib.Path, tmp: pathlib.Path) -> dict:

  cache = tmp / f"cache-{name}"
  out: dict = {}
  with open(tmp / f"server-{name}.log", "w") as log:
    proc, url, cold, health = start(src, base, cache, log, guard=name == "now")
    out["cold_start_s"] = round(cold, 1)
    out["compiled_programs"] = health.get("compiled_programs")
    try:
      lens = lengths(MAX_SEQ_LEN)
      out["growth_pass1"] = growth(url, lens)
      out["growth_pass2"] = growth(url, lens)
      # the background compile (issue 47) shares the cores with passes 1-2 of a cold start;
      # pass 3 runs once every bucket is ready: the steady-state speed
      out["all_ready_wait_s"] = round(server.wait_all_buckets(url, poll_s=0.5), 1)
      out["growth_pass3"] = growth(url, lens)
      out["compiles_after_warmup"] = (server.health(url) or {}).get("compiles_after_warmup")
    finally:
      server.stop_server(proc)
    proc, url, warm, _ = start(src, base, cache, log, guard=name == "now")
    server.stop_server(proc)
    out["warm_start_s"] = round(warm, 1)
  print(name, json.dumps(out), flush=True)
  return out


MESH_WORKER = r"""
import json, os, sys, time
import numpy as np, jax
from bitdelta_jax.models.loading import from_pretrained
from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.sharding.mesh import make_mesh
base, shape = sys.argv[1], sys.argv[2]
mesh = None if shape == "1" else make_mesh("data=1,model=8")
model = from_pretrained(base, num_slots=1)
gen = Generator(model, max_rows=8, max_seq_len=256, prefill_chunk=64, mesh=mesh)
out = {}
for rows in (1, 8):
  seqs = [gen.add([1] + list(range(100 + i, 140 + i)), 0, SamplingParams(max_new_tokens=60))
          for i in range(rows)]
  gen.step(); gen.step(); gen.step()
  ts = []
  for _ in range(30):
    t = time.perf_counter(); gen.step(); ts.append(time.perf_counter() - t)
  out[f"step_ms_{rows}"] = round(1e3 * float(np.median(ts)), 1)
  out[f"tokens_{rows}"] = [s.generated[:20] for s in seqs]
  for s in seqs:
    gen.finish(s)
print("RESULT " + json.dumps(out))
"""


def mesh_part(base: pathlib.Path) -> dict:
  res = {}
  for shape in ("1", "1x8"):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, "-c", MESH_WORKER, str(base), shape], env=env,
                       capture_output=True, text=True, timeout=1800)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
      raise SystemExit(f"mesh worker {shape} failed:\n{p.stderr[-3000:]}")
    res[shape] = json.loads(line[-1][7:])
  one, eight = res["1"], res["1x8"]
  return {"step_ms": {k: {"1": one[f"step_ms_{k}"], "1x8": eight[f"step_ms_{k}"]}
                      for k in (1, 8)},
          "same_tokens": all(one[f"tokens_{k}"] == eight[f"tokens_{k}"] for k in (1, 8))}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--before", metavar="REF", help="also run an earlier commit, side by side")
  ap.add_argument("--skip-mesh", action="store_true")
  ap.add_argument("--out", default=str(results_dir("engine")))
  ap.add_argument("--render", action="store_true", help="rewrite engine.md from engine.json")
  args = ap.parse_args(argv)
  if args.render:
    res = json.loads((pathlib.Path(args.out) / "engine.json").read_text())
    (pathlib.Path(args.out) / "engine.md").write_text(render(res))
    plot(res, pathlib.Path(args.out) / "engine.png")
    return 0
  from bitdelta_jax.zoo.real_base import import_real_base

  base = pathlib.Path(import_real_base())
  res = {"machine": describe(), "model": "SmolLM2-135M-Instruct f32 (dequantized Q4_1)",
         "server": {"max_batch": MAX_BATCH, "max_seq_len": MAX_SEQ_LEN,
                    "prefill_chunk": PREFILL_CHUNK}, "before_ref": args.before}
  with tempfile.TemporaryDirectory() as tmp, checkouts(args.before, pathlib.Path(tmp)) as srcs:
    for name, src in srcs.items():
      res[name] = server_part(name, src, base, pathlib.Path(tmp))
  if not args.skip_mesh:
    res["mesh"] = mesh_part(base)
  out = pathlib.Path(args.out)
  report.write_json(out / "engine.json", res, indent=1)
  (out / "engine.md").write_text(render(res))
  plot(res, out / "engine.png")
  print(render(res))
  return 0


def plot(res: dict, path: pathlib.Path) -> None:
  """Start-up (cold, warm) and the longest stream gap (× the median) before and now, against
  the goals."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cols = [c for c in ("before", "now") if c in res]
  panels = [("start-up, s", [("cold", "cold_start_s", 60), ("warm", "warm_start_s", 10)]),
            ("longest stream gap / median", [("pass 1", "growth_pass1", 5),
                                             ("pass 2", "growth_pass2", 5),
                                             ("pass 3", "growth_pass3", 5)])]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
  for ax, (title, items) in zip(axes, panels):
    for j, c in enumerate(cols):
      vals = [res[c].get(k) if not k.startswith("growth") else res[c][k]["gap_max_over_median"]
              for _, k, _ in items]
      xs = [i + 0.38 * j for i in range(len(items))]
      label = f"before ({res.get('before_ref')})" if c == "before" else c
      bars = ax.bar(xs, [v or 0 for v in vals], width=0.36, label=label)
      ax.bar_label(bars, fmt="%.1f", fontsize=8)
    for i, (_, _, goal) in enumerate(items):
      ax.hlines(goal, i - 0.2, i + 0.58, colors="k", linestyles="dashed", linewidth=1)
    ax.set_xticks([i + 0.19 for i in range(len(items))], [n for n, _, _ in items])
    ax.set_title(title + " (dashed: goal)", fontsize=10)
  axes[0].legend(fontsize=8)
  fig.suptitle(f"bitdelta serve, SmolLM2-135M, {res['machine']['cpu']}, "
               f"{res['machine']['cores']} cores", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def render(res: dict) -> str:
  m = res["machine"]
  cols = [c for c in ("before", "now") if c in res]
  head = " | ".join(f"{c} ({res['before_ref']})" if c == "before" else c for c in cols)
  lines = [
    "# The one engine: start-up, compiles while serving, mesh overhead", "",
    f"{res['model']}; `bitdelta serve --max-batch {MAX_BATCH} --max-seq-len {MAX_SEQ_LEN} "
    f"--prefill-chunk {PREFILL_CHUNK}`; `python -m bench engine"
    f"{' --before ' + res['before_ref'] if res.get('before_ref') else ''}`. Machine: {m['cpu']}, "
    f"{m['cores']} cores, jax {m.get('jax')} ({m.get('backend')}).", "",
    f"| | {head} |", "|---|" + "---|" * len(cols)]

  def row(label, f):
    vals = []
    for c in cols:
      try:
        vals.append(str(f(res[c])))
      except (KeyError, TypeError):
        vals.append("–")
    lines.append(f"| {label} | " + " | ".join(vals) + " |")

  row("cold start (empty compile cache), s", lambda r: r["cold_start_s"])
  row("warm start (same cache), s", lambda r: r["warm_start_s"])
  row("step programs compiled at start", lambda r: r["compiled_programs"])
  row("cold: still compiling after pass 2, s (waited before pass 3)",
      lambda r: r["all_ready_wait_s"])
  for p in ("pass1", "pass2", "pass3"):
    g = f"growth_{p}"
    row(f"growth {p[-1]}: stream gap median, ms", lambda r, g=g: r[g]["gap_median_ms"])
    row(f"growth {p[-1]}: longest gap, ms (× median)",
        lambda r, g=g: f"{r[g]['gap_max_ms']} ({r[g]['gap_max_over_median']}×)")
    row(f"growth {p[-1]}: gaps ≥ 5× median", lambda r, g=g: r[g]["gaps_over_5x"])
    row(f"growth {p[-1]}: slowest 1-token request, s (prompt tokens)",
        lambda r, g=g: f"{r[g]['slowest_request_s']} ({r[g]['slowest_request_len']})")
    row(f"growth {p[-1]}: failed requests", lambda r, g=g: r[g]["failed"])
  row("compiles after warm-up (/health)", lambda r: r["compiles_after_warmup"])
  now = res["now"]
  g1 = now["growth_pass1"]
  lines += ["", "## Goals (issue 18)", "", "| goal | now | |", "|---|---|---|",
            f"| cold start ≤ 60 s | {now['cold_start_s']} s | "
            f"{'met' if now['cold_start_s'] <= 60 else '**missed**'} |",
            f"| warm start ≤ 10 s | {now['warm_start_s']} s | "
            f"{'met' if now['warm_start_s'] <= 10 else '**missed**'} |",
            f"| no stream gap ≥ 5× the median while contexts grow (no compile) | "
            f"{g1['gaps_over_5x']} gaps, longest {g1['gap_max_over_median']}× | "
            f"{'met' if g1['gaps_over_5x'] == 0 else '**missed**'} |",
            f"| no compile after warm-up (guard on) | {now.get('compiles_after_warmup')} | "
            f"{'met' if now.get('compiles_after_warmup') == 0 else '**missed**'} |"]
  n = res["now"]["growth_pass1"]["requests"]
  lines += ["", f"Growth: {n} prompts of 1–40 tokens and then every 16 up to {MAX_SEQ_LEN - 16}, "
            "one at a time, `max_tokens` 1, while one stream decodes; its inter-token gaps "
            "are timed on arrival at the client. Passes 1 and 2 start as soon as /health "
            "answers on a cold start, so they share the two cores with the background "
            "compile of the larger buckets (and run long prompts in smaller chunks until "
            "those are ready); pass 3 starts once /health lists no bucket compiling: the "
            "steady-state speed to compare with `before`.", ""]
  if "mesh" in res:
    ms = res["mesh"]
    lines += ["## Mesh overhead (simulated CPU devices)", "",
              "| decode step | 1 device, ms | 1×8 mesh, ms | ratio |", "|---|---|---|---|"]
    for k, v in ms["step_ms"].items():
      lines.append(f"| {k} row(s) | {v['1']} | {v['1x8']} | {v['1x8'] / v['1']:.2f} |")
    lines += ["", f"Same greedy tokens on both: {ms['same_tokens']}. The 8 devices are "
              "simulated on the same 2 cores (`--xla_force_host_platform_device_count=8`): the "
              "ratio is the sharded program's overhead here (collectives, partitioned "
              "programs), not a speed-up or slow-down a real 8-GPU node would see.", ""]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  raise SystemExit(main())
