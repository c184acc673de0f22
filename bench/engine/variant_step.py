"""Decode-step cost of a variant against the base, in the serving engine, on the real model;
this checkout against an earlier commit (each run its own process, interleaved).

    python -m bench variant_step [--pairs 2] [--steps 20] [--before REF]

A run loads the real SmolLM2-135M base (`bitdelta zoo real-base`, dequantized Q4_1, f32) with
the shipped real variants smol-math (1-bit linear layers and 1-bit embeddings) and smol-upper
(1-bit linear layers, embeddings unchanged) into `Generator`, and times decode steps (the
median of ``--steps`` after 4 untimed) of 1 and 8 concurrent sequences on each. Greedy tokens
must agree between the two checkouts. Writes bench/results/engine/variant_step.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

from bench.common import report
from bench.common.paths import ROOT, results_dir

OUT = results_dir("engine")
DELTAS = ROOT / "bitdelta_jax" / "zoo" / "shipped_real" / "deltas"
VARIANTS = ("smol-math", "smol-upper")


def worker(steps: int) -> dict:
  import jax.numpy as jnp

  import bitdelta_jax as bdj
  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.engine.sampling import SamplingParams
  from bitdelta_jax.zoo.real_base import import_real_base

  dirs = [DELTAS / v for v in VARIANTS]
  model = bdj.from_pretrained(import_real_base(), jnp.float32, num_slots=3, variants=dirs)
  for i, d in enumerate(dirs):
    bdj.load_variant(model, i + 1, bdj.load_delta(d)[0])
  gen = Generator(model, max_rows=8, max_seq_len=512, prefix_caching=False)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=10_000)
  prompt = [(7 * i + 3) % 40000 + 100 for i in range(16)]
  times, tokens = {}, {}
  for rows in (1, 8):
    for slot, name in enumerate(("base", *VARIANTS)):
      seqs = [gen.add(prompt, slot, greedy) for _ in range(rows)]
      for _ in range(5):  # prefill, compiles, steady state
        gen.step()
      ts = []
      for _ in range(steps):
        t = time.perf_counter()
        gen.step()
        ts.append(time.perf_counter() - t)
      times[f"{name}, {rows} rows"] = 1e3 * statistics.median(ts)
      tokens[f"{name}/{rows}"] = seqs[0].generated[:10]
      for s in seqs:
        gen.finish(s)
  return {"times": times, "tokens": tokens}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--pairs", type=int, default=2)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--before", help="a git ref to compare with")
  ap.add_argument("--worker", action="store_true")
  args = ap.parse_args()
  if args.worker:
    print("RESULT " + json.dumps(worker(args.steps)), flush=True)
    return
  from bench.common import machine
  from bench.common.checkouts import checkouts, run_worker

  with tempfile.TemporaryDirectory(prefix="variant_step_") as tmp, \
       checkouts(args.before, pathlib.Path(tmp)) as srcs:
    runs: dict = {k: [] for k in srcs}
    for p in range(args.pairs):
      for label, src in srcs.items():
        res = run_worker("bench.engine.variant_step", src, ["--steps", str(args.steps)])
        runs[label].append(res)
        print(f"pair {p} {label}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                res["times"].items()), flush=True)
  keys = list(runs["now"][0]["times"])
  med = {label: {k: statistics.median(r["times"][k] for r in rs) for k in keys}
         for label, rs in runs.items()}
  same = all(r["tokens"] == runs["now"][0]["tokens"] for rs in runs.values() for r in rs)
  doc = {"machine": machine.describe(), "pairs": args.pairs, "steps": args.steps,
         "before": args.before, "median_ms": med, "greedy_tokens_equal": same}
  OUT.mkdir(exist_ok=True)
  report.write_json(OUT / "variant_step.json", doc, indent=2)
  m = doc["machine"]
  lines = ["# Decode step of a variant against the base (real SmolLM2-135M, f32, Generator)",
           "", f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')}. Each checkout in its "
           f"own process, {args.pairs} interleaved pairs, median of {args.steps} steps per run, "
           f"then over runs. Greedy tokens equal across runs: {same}. Script: "
           "`bench/engine/variant_step.py" + (f" --before {args.before}`." if args.before else "`."),
           ""]
  head = "| step | this commit (ms) | / base |"
  if args.before:
    head += f" {args.before} (ms) | / base | speed-up |"
  lines += [head, "|" + "---|" * (head.count("|") - 1)]
  for k in keys:
    rows = k.split(", ")[1]
    row = f"| {k} | {med['now'][k]:.1f} | {med['now'][k] / med['now'][f'base, {rows}']:.2f}x |"
    if args.before:
      b = med["before"][k]
      row += (f" {b:.1f} | {b / med['before'][f'base, {rows}']:.2f}x | "
              f"{b / med['now'][k]:.2f}x |")
    lines.append(row)
  (OUT / "variant_step.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
