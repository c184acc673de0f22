"""XLA's oneDNN CPU dots on or off, for the serving engine's decode step on the real model.

    python -m bench onednn [--pairs 2] [--steps 24]

Each run is its own process (XLA flags are read once, when jax initialises), alternating
``XLA_FLAGS=--xla_cpu_use_onednn=true`` and the default, ``--pairs`` times each (interleaved).
A run loads the real SmolLM2-135M base (`bitdelta zoo real-base`, dequantized Q4_1, f32) and
the shipped real variant smol-math into `Generator`, compiles the shapes it times, then
times decode steps (the median of ``--steps``) of 1 and 8 concurrent sequences on the base and
on the variant, and the prefill step of a 128-token prompt. Logits are compared too: the
greedy tokens of both settings must agree.
Writes bench/results/engine/onednn.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import report
from bench.common.paths import ROOT, results_dir

OUT = results_dir("engine")
VARIANT = ROOT / "bitdelta_jax" / "zoo" / "shipped_real" / "deltas" / "smol-math"
FLAG = "--xla_cpu_use_onednn=true"


def worker(steps: int) -> dict:
  import jax.numpy as jnp

  import bitdelta_jax as bdj
  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.engine.sampling import SamplingParams
  from bitdelta_jax.zoo.real_base import import_real_base

  model = bdj.from_pretrained(import_real_base(), jnp.float32, num_slots=2, variants=[VARIANT])
  bdj.load_variant(model, 1, bdj.load_delta(VARIANT)[0])
  gen = Generator(model, max_rows=8, max_seq_len=512, prefix_caching=False)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=10_000)
  prompt = [(7 * i + 3) % 40000 + 100 for i in range(16)]
  out: dict = {}
  tokens: dict = {}
  for slot in (0, 1):
    for rows in (1, 8):
      seqs = [gen.add(prompt, slot, greedy) for _ in range(rows)]
      gen.step()  # prefill
      for _ in range(4):  # compiles, then steady state
        gen.step()
      times = []
      for _ in range(steps):
        t = time.perf_counter()
        gen.step()
        times.append(time.perf_counter() - t)
      out[f"{'variant' if slot else 'base'} decode {rows} rows (ms/step)"] = (
        1e3 * statistics.median(times))
      tokens[f"{slot}/{rows}"] = seqs[0].generated[:12]
      for s in seqs:
        gen.finish(s)
    long = [(11 * i + 5) % 40000 + 100 for i in range(128)]
    for _ in range(3):  # the first compiles
      s = gen.add(long, slot, greedy)
      t = time.perf_counter()
      gen.step()
      dt = time.perf_counter() - t
      gen.finish(s)
    out[f"{'variant' if slot else 'base'} prefill 128 tokens (ms)"] = 1e3 * dt
  return {"times": out, "tokens": tokens}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--pairs", type=int, default=2)
  ap.add_argument("--steps", type=int, default=24)
  ap.add_argument("--worker", action="store_true")
  args = ap.parse_args()
  if args.worker:
    print("RESULT " + json.dumps(worker(args.steps)), flush=True)
    return
  from bench.common import machine
  from bench.common.checkouts import run_worker

  runs: dict = {"onednn": [], "default": []}
  for p in range(args.pairs):
    for label in ("onednn", "default"):
      res = run_worker("bench.engine.onednn", ROOT, ["--steps", str(args.steps)],
                       {"XLA_FLAGS": FLAG if label == "onednn" else ""})
      runs[label].append(res)
      print(f"pair {p} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in res["times"].items()),
            flush=True)
  keys = list(runs["default"][0]["times"])
  med = {label: {k: statistics.median(r["times"][k] for r in rs) for k in keys}
         for label, rs in runs.items()}
  same_tokens = all(r["tokens"] == runs["default"][0]["tokens"] for rs in runs.values() for r in rs)
  doc = {"machine": machine.describe(), "pairs": args.pairs, "steps": args.steps, "flag": FLAG,
         "median_ms": med, "speedup": {k: med["default"][k] / med["onednn"][k] for k in keys},
         "greedy_tokens_equal": same_tokens}
  OUT.mkdir(exist_ok=True)
  report.write_json(OUT / "onednn.json", doc, indent=2)
  m = doc["machine"]
  lines = ["# XLA CPU oneDNN dots for the serving engine (real SmolLM2-135M, f32)", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')}. `Generator` with "
           "the real base (dequantized Q4_1) and the shipped variant smol-math (1-bit linear "
           f"layers and embeddings); each setting in its own process, {args.pairs} interleaved "
           f"pairs, median of {args.steps} steps per run, then the median over runs. Greedy tokens "
           f"equal between settings: {same_tokens}. Script: `bench/engine/onednn.py`.", "",
           f"| step | default (ms) | `{FLAG}` (ms) | speed-up |", "|---|---:|---:|---:|"]
  for k in keys:
    lines.append(f"| {k.replace(' (ms/step)', '').replace(' (ms)', '')} | "
                 f"{med['default'][k]:.1f} | {med['onednn'][k]:.1f} | {doc['speedup'][k]:.2f}x |")
  (OUT / "onednn.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
