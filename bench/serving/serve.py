"""Serving bench: many variants behind one endpoint vs the base alone vs one model per variant.

    python -m bench serve                 # built-in family if shipped, else synthetic
    python -m bench serve --quick         # fewer requests (smoke run)

Runs the real server (`serving.app.ServerThread`) on a loopback port and drives it over HTTP
with streaming requests (concurrency 16):

1. **base-only** vs **mixed** (8 variants, uniformly mixed, all resident in device slots):
   completion tokens/s, TTFT p50/p99 overall and per variant. ``ignore_eos`` keeps every
   request at ``max_tokens`` so both runs generate the same number of tokens.
2. **resident-variant TTFT**: sequential requests (concurrency 1), base vs a resident variant.
3. **cold load**: a freshly registered variant, disk → device slot (``last_load_seconds``),
   against a plain read of the same directory's bytes.
4. **one full model per variant** (what users deploy otherwise): memory = N full copies; speed
   when only one full model fits and weights are swapped from disk whenever the next batch
   needs another variant (same requests, batched per variant up to ``max_batch``, in-process).
5. **memory for 14 variants**: base + 14 deltas vs the base, and vs 14 full copies (checkpoint
   bytes), plus the device bytes of the slot bank.

Writes bench/results/serving/serve_bench.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

from bench.common import report
from bench.common.paths import results_dir

# A synthetic family big enough that weights, not overheads, dominate (~12M params, bf16).
BENCH_SYNTH = dict(vocab_size=264, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)


def pct(xs, p):
  if not xs:
    return None
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def dir_bytes(d: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in pathlib.Path(d).rglob("*") if p.is_file())


def get_family(kind: str, work: pathlib.Path, n: int):
  if kind in ("auto", "zoo"):
    try:
      from bitdelta_jax.zoo import shipped_family

      base, variants = shipped_family()
      if len(variants) >= 1:
        return "built-in", base, dict(sorted(variants.items()))
    except (ImportError, OSError) as e:
      if kind == "zoo":
        raise
      print(f"built-in family unavailable ({e}); using the synthetic family", file=sys.stderr)
  from bitdelta_jax.synthetic import SyntheticConfig
  from serving.testing import synthetic_family

  base, variants = synthetic_family(work / "family", n=n, config=SyntheticConfig(**BENCH_SYNTH),
                                    rel=0.05)
  return "synthetic", base, variants


# -- load generation --------------------------------------------------------------------------
async def drive(url: str, models: list[str], prompts: list[str], concurrency: int,
                max_tokens: int, key: str) -> dict:
  import aiohttp

  sem = asyncio.Semaphore(concurrency)
  recs = []

  async def one(session, i, model):
    body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
            "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with sem:
      t0 = time.perf_counter()
      ttft, tokens = None, 0
      async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
          line = line.strip()
          if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
          ev = json.loads(line[6:])
          if ttft is None and ev.get("choices"):
            ttft = time.perf_counter() - t0
          if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
      recs.append({"model": model, "ttft": ttft, "tokens": tokens,
                   "latency": time.perf_counter() - t0})

  conn = aiohttp.TCPConnector(limit=concurrency * 2)
  async with aiohttp.ClientSession(connector=conn,
                                   headers={"Authorization": f"Bearer {key}"}) as s:
    t0 = time.perf_counter()
    await asyncio.gather(*(one(s, i, m) for i, m in enumerate(models)))
    wall = time.perf_counter() - t0
  toks = sum(r["tokens"] for r in recs)
  per = {}
  for m in sorted(set(models)):
    rs = [r for r in recs if r["model"] == m]
    tt = [r["ttft"] for r in rs if r["ttft"] is not None]
    per[m] = {"requests": len(rs), "tokens": sum(r["tokens"] for r in rs),
              "tokens_per_s": sum(r["tokens"] for r in rs) / wall,
              "ttft_p50_ms": 1e3 * pct(tt, 50), "ttft_p99_ms": 1e3 * pct(tt, 99)}
  tt = [r["ttft"] for r in recs if r["ttft"] is not None]
  return {"requests": len(recs), "wall_s": wall, "tokens": toks, "tokens_per_s": toks / wall,
          "ttft_p50_ms": 1e3 * pct(tt, 50), "ttft_p99_ms": 1e3 * pct(tt, 99),
          "latency_p50_s": pct([r["latency"] for r in recs], 50), "per_model": per}


ADMIN_KEY = "bench-admin"


def http(url, method, path, key, body=None):
  import requests

  if path.startswith("/v1/variants"):  # the admin routes take the admin key
    key = ADMIN_KEY
  r = getattr(requests, method)(url + path, json=body, timeout=300,
                                headers={"Authorization": f"Bearer {key}"})
  r.raise_for_status()
  return r.json()


def cold_loads(h, key: str, delta_dir: pathlib.Path, reps: int) -> dict:
  """Disk → device slot for a freshly registered variant vs a plain read of its bytes."""
  loads, reads = [], []
  for i in range(reps):
    name = f"cold{i}"
    http(h.url, "post", "/v1/variants", key, {"name": name, "path": str(delta_dir.resolve())})
    http(h.url, "post", "/v1/completions", key, {"model": name, "prompt": "a", "max_tokens": 1})
    info = {v["id"]: v for v in http(h.url, "get", "/v1/variants", key)["data"]}[name]
    assert info["last_load_source"] == "disk"
    loads.append(info["last_load_seconds"])
    http(h.url, "delete", f"/v1/variants/{name}", key)
    t0 = time.perf_counter()
    n = 0
    for p in sorted(pathlib.Path(delta_dir).rglob("*")):
      if p.is_file():
        with open(p, "rb") as f:
          n += len(f.read())
    reads.append(time.perf_counter() - t0)
  nbytes = info["bytes"]
  load_s, read_s = statistics.median(loads), statistics.median(reads)
  return {"delta_bytes": nbytes, "dir_bytes": dir_bytes(delta_dir), "load_s": load_s,
          "plain_read_s": read_s, "load_MBps": nbytes / load_s / 1e6,
          "plain_read_MBps": dir_bytes(delta_dir) / read_s / 1e6,
          "throughput_ratio": (nbytes / load_s) / (dir_bytes(delta_dir) / read_s),
          "reps": reps, "note": "page cache warm for both (no root to drop caches)"}


# -- one full model per variant, swapping weights ---------------------------------------------
def swap_baseline(base: pathlib.Path, variants: dict, models: list[str], prompts: list[str],
                  max_tokens: int, max_batch: int, max_seq_len: int, work: pathlib.Path,
                  dtype: str) -> dict:
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from bitdelta_jax.delta.stream import apply_checkpoint
  from bitdelta_jax.engine import Generator
  from bitdelta_jax.engine.sampling import SamplingParams
  from bitdelta_jax.hf.safetensors_io import CheckpointReader
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.models.loading import hf_name
  from bitdelta_jax.models.tokenizer import Tokenizer

  full = {}
  for name in sorted(set(models)):
    out = work / "full" / name
    if not (out / "config.json").exists():
      apply_checkpoint(base, variants[name], out, overwrite=True, progress=False)
    full[name] = out
  tok = Tokenizer.from_dir(base)
  model = from_pretrained(base, getattr(jnp, dtype), num_slots=1)
  gen = Generator(model, max_rows=max_batch, max_seq_len=max_seq_len, tokenizer=tok)
  params = {hf_name(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

  def swap(d):
    with CheckpointReader(d) as r:
      for (name, transpose), var in params.items():
        a = np.asarray(r.read(name))
        var.set_value(jnp.asarray(a.T if transpose else a, var[...].dtype))
    gen.refresh()
    jnp.zeros(()).block_until_ready()

  swap(full[models[0]])  # warm: compile
  gen.generate([tok.encode(prompts[0])], params=SamplingParams(max_new_tokens=2))
  loaded, swaps, swap_s, tokens = None, 0, 0.0, 0
  t0 = time.perf_counter()
  queue = list(enumerate(models))
  while queue:
    window, queue = queue[:16], queue[16:]  # what 16 concurrent clients have outstanding
    by = {}
    for i, m in window:
      by.setdefault(m, []).append(i)
    order = sorted(by, key=lambda m: m != loaded)  # the loaded model first
    for m in order:
      if m != loaded:
        ts = time.perf_counter()
        swap(full[m])
        swap_s += time.perf_counter() - ts
        swaps += 1
        loaded = m
      idx = by[m]
      res = gen.generate([tok.encode(prompts[i % len(prompts)]) for i in idx],
                         params=[SamplingParams(temperature=0.7, seed=i, max_new_tokens=max_tokens)
                                 for i in idx])
      tokens += sum(len(g.tokens) for g in res)
  wall = time.perf_counter() - t0
  return {"requests": len(models), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
          "swaps": swaps, "swap_s_total": swap_s, "swap_s_mean": swap_s / max(1, swaps),
          "full_model_bytes": dir_bytes(full[models[0]]), "resident_full_models": 1}


# -- memory -----------------------------------------------------------------------------------
def memory(base: pathlib.Path, variants: dict, server, n: int = 14) -> dict:
  from bitdelta_jax.delta.store import read_manifest
  from bitdelta_jax.delta.variant import manifest_bytes
  from bitdelta_jax.models.slots import slot_bank_bytes

  base_b = sum(p.stat().st_size for p in base.glob("*.safetensors"))
  deltas = [manifest_bytes(read_manifest(d)) for d in variants.values()]
  delta_b = statistics.mean(deltas)
  model = server.engine.gen.model
  bank = slot_bank_bytes(model)
  import jax
  from flax import nnx

  params_dev = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  per_slot = bank / model.config.num_slots
  return {
    "variants": n, "base_checkpoint_bytes": base_b, "delta_bytes_mean": delta_b,
    "base_plus_n_deltas_bytes": base_b + n * delta_b,
    "ratio_vs_base": (base_b + n * delta_b) / base_b,
    "n_full_copies_bytes": n * base_b,
    "saving_vs_n_copies": 1 - (base_b + n * delta_b) / (n * base_b),
    "device_param_bytes": params_dev, "device_bank_bytes_per_slot": per_slot,
    "device_ratio_n_slots_vs_base": (params_dev + n * per_slot) / params_dev,
    "device_dtype": str(server.cfg.dtype),
  }


# -- report -------------------------------------------------------------------------------------
def write(res: dict, out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  report.write_json(out / "serve_bench.json", res, indent=1)
  b, m, s, c, mem, tt = (res["base_only"], res["mixed"], res["swap_full_models"], res["cold_load"],
                         res["memory"], res["resident_ttft"])
  g = res["goals"]
  lines = [
    "# Serving bench", "",
    f"Family: {res['family']} ({len(res['variants'])} variants), {res['requests']} requests per "
    f"run, concurrency {res['concurrency']}, max_tokens {res['max_tokens']} (ignore_eos), "
    f"max_batch {res['max_batch']}, dtype {res['dtype']}. Machine: {res['machine'].get('cpu')} "
    f"({res['machine'].get('cores')} cores, backend {res['machine'].get('backend')}).", "",
    "| run | tokens/s | TTFT p50 ms | TTFT p99 ms | vs base-only |", "|---|---|---|---|---|",
    f"| base only | {b['tokens_per_s']:.1f} | {b['ttft_p50_ms']:.1f} | {b['ttft_p99_ms']:.1f} | 1.00 |",
    f"| {len(res['variants'])} variants mixed (one endpoint) | {m['tokens_per_s']:.1f} | "
    f"{m['ttft_p50_ms']:.1f} | {m['ttft_p99_ms']:.1f} | {m['tokens_per_s'] / b['tokens_per_s']:.2f} |",
    f"| one full model per variant, swapping ({s['swaps']} swaps) | {s['tokens_per_s']:.1f} | – | – | "
    f"{s['tokens_per_s'] / b['tokens_per_s']:.2f} |", "",
    "Per variant (mixed run):", "", "| model | requests | tokens/s | TTFT p50 ms | TTFT p99 ms |",
    "|---|---|---|---|---|",
  ]
  for name, r in m["per_model"].items():
    lines.append(f"| {name} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.1f} | "
                 f"{r['ttft_p99_ms']:.1f} |")
  lines += [
    "", f"Resident-variant TTFT (sequential): base p50 {tt['base_p50_ms']:.2f} ms, variant "
    f"p50 {tt['variant_p50_ms']:.2f} ms (ratio {tt['ratio']:.3f}).", "",
    f"Cold load (disk → device slot) of a {c['delta_bytes'] / 1e6:.2f} MB delta: "
    f"{c['load_s'] * 1e3:.1f} ms ({c['load_MBps']:.0f} MB/s) vs plain read of its directory "
    f"{c['plain_read_s'] * 1e3:.1f} ms ({c['plain_read_MBps']:.0f} MB/s): ratio "
    f"{c['throughput_ratio']:.2f}. ({c['note']})", "",
    f"Memory for {mem['variants']} variants: base {mem['base_checkpoint_bytes'] / 1e6:.1f} MB + "
    f"{mem['variants']} × {mem['delta_bytes_mean'] / 1e6:.2f} MB = "
    f"{mem['ratio_vs_base']:.3f}× the base; {mem['variants']} full copies = "
    f"{mem['n_full_copies_bytes'] / 1e6:.0f} MB (saving {100 * mem['saving_vs_n_copies']:.1f}%). "
    f"On the device ({mem['device_dtype']} base, bank incl. f32 norm rows): "
    f"{mem['device_ratio_n_slots_vs_base']:.3f}× the base.", "",
    "| goal | target | measured | met |", "|---|---|---|---|",
  ]
  for k, v in g.items():
    lines.append(f"| {k} | {v['target']} | {v['value']:.3f} | {'yes' if v['met'] else 'no'} |")
  if res.get("notes"):
    lines += ["", *[f"- {n}" for n in res["notes"]]]
  (out / "serve_bench.md").write_text("\n".join(lines) + "\n")
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    names = ["base only", "mixed\n(one endpoint)", "full model\nper variant\n(swapping)"]
    ax[0].bar(names, [b["tokens_per_s"], m["tokens_per_s"], s["tokens_per_s"]],
              color=["#888", "#2a7", "#c54"])
    ax[0].set_ylabel("completion tokens / s")
    ax[0].set_title(f"throughput, concurrency {res['concurrency']}")
    per = m["per_model"]
    xs = list(per)
    ax[1].bar(xs, [per[x]["ttft_p50_ms"] for x in xs], label="p50")
    ax[1].bar(xs, [per[x]["ttft_p99_ms"] - per[x]["ttft_p50_ms"] for x in xs],
              bottom=[per[x]["ttft_p50_ms"] for x in xs], alpha=0.5, label="p99")
    ax[1].axhline(b["ttft_p50_ms"], color="k", ls="--", label="base-only p50")
    ax[1].set_ylabel("TTFT ms")
    ax[1].set_title("TTFT per variant (mixed run)")
    ax[1].tick_params(axis="x", rotation=45)
    ax[1].legend()
    n = mem["variants"]
    ax[2].bar(["base", f"base + {n} deltas", f"{n} full copies"],
              [1, mem["ratio_vs_base"], n], color=["#888", "#2a7", "#c54"])
    ax[2].set_ylabel("× base checkpoint bytes")
    ax[2].set_title(f"memory for {n} variants")
    fig.tight_layout()
    fig.savefig(out / "serve_bench.png", dpi=110)
  except ImportError:
    pass


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--family", choices=("auto", "zoo", "synthetic"), default="auto")
  ap.add_argument("--variants", type=int, default=8)
  ap.add_argument("--requests", type=int, default=256)
  ap.add_argument("--concurrency", type=int, default=16)
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--max-batch", type=int, default=16)
  ap.add_argument("--max-seq-len", type=int, default=128)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--cold-reps", type=int, default=5)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--work", default=None, help="where the synthetic family is built (cached)")
  ap.add_argument("--out", default=str(results_dir("serving")))
  a = ap.parse_args(argv)
  if a.quick:
    a.requests, a.cold_reps = 64, 2

  from bench.common.machine import describe
  from serving.app import ServerThread
  from serving.config import ServerConfig

  work = pathlib.Path(a.work or os.path.join(tempfile.gettempdir(), "bitdelta-serve-bench"))
  work.mkdir(parents=True, exist_ok=True)
  fam, base, variants = get_family(a.family, work, a.variants)
  names = list(variants)[: a.variants]
  sel = {n: variants[n] for n in names}
  key = "bench"
  prompts = ["Write a short story about a robot.", "What is 12 + 30?", "Translate: bonjour",
             "List three colors.", "def fib(n):", "The capital of France is"]
  cfg = ServerConfig(base=str(base), base_name="base", port=0, api_key=key,
                     admin_key=ADMIN_KEY,
                     variants=tuple((n, str(p)) for n, p in sel.items()),
                     device_slots=len(sel) + 1, max_batch=a.max_batch, max_seq_len=a.max_seq_len,
                     dtype=a.dtype, host_cache_mb=4096)
  rng = random.Random(0)
  mixed_models = [names[i % len(names)] for i in range(a.requests)]
  rng.shuffle(mixed_models)
  res = {"family": fam, "variants": names, "requests": a.requests, "concurrency": a.concurrency,
         "max_tokens": a.max_tokens, "max_batch": a.max_batch, "dtype": a.dtype,
         "machine": describe(), "notes": []}
  print(f"family: {fam}, base {base}, variants {names}", flush=True)
  with ServerThread(cfg) as h:
    for n in names:  # make every variant resident first (the mixed run measures serving)
      http(h.url, "post", "/v1/completions", key, {"model": n, "prompt": "a", "max_tokens": 1})
    warm = ["base"] * a.concurrency
    asyncio.run(drive(h.url, warm, prompts, a.concurrency, 4, key))
    res["base_only"] = asyncio.run(drive(h.url, ["base"] * a.requests, prompts, a.concurrency,
                                         a.max_tokens, key))
    print("base-only", json.dumps({k: v for k, v in res["base_only"].items() if k != "per_model"}),
          flush=True)
    res["mixed"] = asyncio.run(drive(h.url, mixed_models, prompts, a.concurrency, a.max_tokens, key))
    print("mixed", json.dumps({k: v for k, v in res["mixed"].items() if k != "per_model"}),
          flush=True)
    # sequential TTFT: base vs a resident variant, interleaved
    tb, tv = [], []
    for i in range(24):
      for model, acc in (("base", tb), (names[0], tv)):
        r = asyncio.run(drive(h.url, [model], prompts[i % 3:], 1, 1, key))
        acc.append(r["ttft_p50_ms"])
    res["resident_ttft"] = {"base_p50_ms": statistics.median(tb),
                            "variant_p50_ms": statistics.median(tv),
                            "ratio": statistics.median(tv) / statistics.median(tb)}
    res["cold_load"] = cold_loads(h, key, sel[names[0]], a.cold_reps)
    print("cold", json.dumps(res["cold_load"]), flush=True)
    res["memory"] = memory(pathlib.Path(base), sel, h.server)
  res["swap_full_models"] = swap_baseline(
    pathlib.Path(base), sel, mixed_models, prompts, a.max_tokens, a.max_batch, a.max_seq_len,
    work, a.dtype)
  print("swap", json.dumps(res["swap_full_models"]), flush=True)
  res["memory"]["one_model_per_variant_bytes"] = len(names) * res["memory"]["base_checkpoint_bytes"]
  b, m = res["base_only"], res["mixed"]
  res["goals"] = {
    "mixed tokens/s ÷ base-only": {"target": ">= 0.7", "value": m["tokens_per_s"] / b["tokens_per_s"]},
    "cold-load ÷ plain-read throughput": {"target": ">= 0.8",
                                          "value": res["cold_load"]["throughput_ratio"]},
    "memory, 14 variants ÷ base": {"target": "<= 1.9", "value": res["memory"]["ratio_vs_base"]},
    "resident-variant TTFT ÷ base": {"target": "<= 1.1", "value": res["resident_ttft"]["ratio"]},
  }
  for v in res["goals"].values():
    t = v["target"]
    v["met"] = v["value"] >= float(t[3:]) if t.startswith(">=") else v["value"] <= float(t[3:])
  write(res, pathlib.Path(a.out))
  print((pathlib.Path(a.out) / "serve_bench.md").read_text())


if __name__ == "__main__":
  main()
