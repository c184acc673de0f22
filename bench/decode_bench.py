"""Decode-step latency: base vs BitDelta variants, interleaved in one process.

For each model config (``tiny``: hidden 64, 2 layers; ``100m``: hidden 768, 12 layers, vocab
16k, ~100M parameters) and batch size (1, 8) it times `Generator.step` for:

* ``base``: the plain model (no variant bank, ``num_slots=1``) — the reference cost;
* ``bank_base``: the model with a 9-slot bank, every row on slot 0 (base requests in a server
  that also holds variants);
* ``variant``: the banked model, every row on slot 1;
* ``mixed``: (batch 8 only) rows on slots 1..8, eight different variants.

Steps of all setups are interleaved (base, bank_base, variant, mixed, base, ...), so drift of
the machine hits them alike; each number is the median of ``--steps`` (>= 20) timed steps after
warm-up. Variants are random sign bits with a per-matrix scale: the cost does not depend on
the values. Results go to ``bench/results/decode_bench.{json,md}``.

    python bench/decode_bench.py [--configs tiny 100m] [--steps 30] [--implementation NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import machine  # noqa: E402

from bitdelta_jax.delta.format import PackedDelta  # noqa: E402
from bitdelta_jax.models import LlamaForCausalLM, ModelConfig  # noqa: E402
from bitdelta_jax.models.generate import Generator  # noqa: E402
from bitdelta_jax.models.layers import DeltaDense  # noqa: E402
from bitdelta_jax.models.sampling import SamplingParams  # noqa: E402
from bitdelta_jax.models.slots import load_variant, slot_bank_bytes  # noqa: E402

CONFIGS = {
  "tiny": ModelConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
  ),
  "100m": ModelConfig(
    model_type="llama",
    vocab_size=16000,
    hidden_size=768,
    intermediate_size=2048,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
  ),
}
NUM_SLOTS = 9  # slot 0 = base + 8 variants
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def random_variant(model, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  delta = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, DeltaDense):
      kp, n = node.delta_bits.shape[1:]
      delta[".".join(map(str, path)) + ".weight"] = PackedDelta(
        bits=rng.integers(0, 256, (kp, n), dtype=np.uint8),
        scale=np.full((1,), 1e-3, np.float32),
        shape=(node.in_features, node.out_features),
        group_k=node.group_k,
      )
  return delta


def filled_state(gen: Generator, slots: list[int]):
  state = gen.init_state()
  prompt = list(range(1, 9))
  for row, slot in enumerate(slots):
    state = gen.insert(state, gen.prefill(prompt, slot, SamplingParams()), row)
  return state


def bench_config(name: str, steps: int, warmup: int, implementation: str | None) -> list[dict]:
  cfg = CONFIGS[name]
  base_model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  bank_cfg = dataclasses.replace(cfg, num_slots=NUM_SLOTS, delta_implementation=implementation)
  bank_model = LlamaForCausalLM(bank_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  for slot in range(1, NUM_SLOTS):
    load_variant(bank_model, slot, random_variant(bank_model, slot))
  rows_out = []
  max_len = 8 + warmup + steps + 8
  for batch in (1, 8):
    base_gen = Generator(base_model, buckets=(8,), max_seq_len=max_len, max_rows=batch)
    bank_gen = Generator(bank_model, buckets=(8,), max_seq_len=max_len, max_rows=batch)
    setups = {
      "base": (base_gen, [0] * batch),
      "bank_base": (bank_gen, [0] * batch),
      "variant": (bank_gen, [1] * batch),
    }
    if batch == 8:
      setups["mixed"] = (bank_gen, list(range(1, 9)))
    states = {k: filled_state(g, s) for k, (g, s) in setups.items()}
    times: dict[str, list[float]] = {k: [] for k in setups}
    for i in range(warmup + steps):
      for k, (g, _) in setups.items():
        t0 = time.perf_counter()
        states[k], toks = g.step(states[k])
        toks.block_until_ready()
        if i >= warmup:
          times[k].append(time.perf_counter() - t0)
    base_ms = statistics.median(times["base"]) * 1e3
    for k, ts in times.items():
      ms = statistics.median(ts) * 1e3
      rows_out.append(
        dict(
          config=name,
          params_m=round(cfg.num_params / 1e6, 1),
          batch=batch,
          setup=k,
          distinct_variants=len({s for s in setups[k][1] if s}),
          median_ms=round(ms, 3),
          p10_ms=round(float(np.percentile(ts, 10)) * 1e3, 3),
          p90_ms=round(float(np.percentile(ts, 90)) * 1e3, 3),
          ratio_vs_base=round(ms / base_ms, 3),
          steps=len(ts),
        )
      )
      print(f"{name:5s} b={batch} {k:10s} {ms:9.3f} ms  x{ms / base_ms:.3f}", flush=True)
  rows_out.append(dict(config=name, bank_bytes=slot_bank_bytes(bank_model), num_slots=NUM_SLOTS))
  return rows_out


def to_markdown(rows: list[dict], meta: dict) -> str:
  lines = [
    "# Decode-step latency: base vs BitDelta variants",
    "",
    f"Machine: {meta['machine'].get('cpu')} ({meta['machine'].get('cores')} cores), backend "
    f"{meta['machine'].get('backend')}, jax {meta['machine'].get('jax')}; f32; delta_matmul "
    f"implementation: {meta['implementation'] or 'default (best available)'}; median of "
    f"{meta['steps']} interleaved steps after {meta['warmup']} warm-up; load average at start "
    f"{meta['loadavg_at_start']} (a shared machine: compare ratios, not absolute times).",
    "",
    "`base` = plain model without a bank; `bank_base` = 9-slot banked model, rows on slot 0; "
    "`variant` = all rows on one variant; `mixed` = 8 rows on 8 different variants.",
    "",
    "| config | params (M) | batch | setup | median ms | p10 | p90 | ratio vs base |",
    "|---|---:|---:|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "setup" in r:
      lines.append(
        f"| {r['config']} | {r['params_m']} | {r['batch']} | {r['setup']} | {r['median_ms']} | "
        f"{r['p10_ms']} | {r['p90_ms']} | {r['ratio_vs_base']} |"
      )
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--implementation", default=None, help="force a delta_matmul implementation")
  ap.add_argument("--out", default="decode_bench", help="basename under bench/results/")
  args = ap.parse_args(argv)
  if args.steps < 20:
    ap.error("--steps must be >= 20")
  loadavg = [round(x, 2) for x in os.getloadavg()]
  rows = []
  for name in args.configs:
    rows += bench_config(name, args.steps, args.warmup, args.implementation)
  meta = dict(
    machine=machine.describe(),
    steps=args.steps,
    warmup=args.warmup,
    implementation=args.implementation,
    num_slots=NUM_SLOTS,
    time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    loadavg_at_start=loadavg,
  )
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / f"{args.out}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  md = to_markdown(rows, meta)
  (RESULTS / f"{args.out}.md").write_text(md)
  print(md)


if __name__ == "__main__":
  main()
