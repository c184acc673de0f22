"""The ``prefill`` stage of `bench/gpu/gpu_check.py`: prompt chunks on the GPU.

Two parts, both kernel vs reference in the same process:

A. **attention**: `pallas_kernels.paged_attention.ragged_paged_attention` on batches of prompt
   chunks only (one idle decode lane), ``implementation="mosaic_gpu"`` (the Mosaic GPU prefill
   kernel for the chunks, `mosaic_gpu_prefill`) vs ``"reference"`` (`reference.packed_prefill`,
   what ran before), SmolLM2 heads (H 9, KV 3, hd 64) and Llama-8B-like (H 32, KV 8, hd 128),
   bf16 pools of 16-token pages: one fresh prompt of 512, 2048 and 8192 tokens, four packed
   prompts of 512, and 1024 new tokens after a 6000-token prefix-cache hit. Numerics: the
   kernel's and the reference's error against float64 numpy on 48 sampled tokens (pass: kernel
   err <= 1.5 x reference err + 2^-12 x max|exact|), and their largest difference over every
   token; time per call (a jitted loop of chained calls, interleaved rounds, medians).
B. **time to first token**: a `Generator` (the engine's host loop and runner) over a 4-layer
   SmolLM2-135M-shaped model with random bf16 weights and one variant slot, one request of a
   512, 2048 or 8192-token prompt with ``max_new_tokens=1``, chunk 8192 (one step per prompt),
   on the base (slot 0) and on the variant (slot 1), rounds interleaved; then the same with
   the reference prefill (``BITDELTA_PAGED_PREFILL_GPU=0``, after ``jax.clear_caches()`` so the
   step is traced again). Reports TTFT, variant - base, and kernel / reference.

``--dry-run``: interpret mode for part A at 64 and 160 tokens, part B at 48 and 112 tokens on
the CPU's own kernels (the script's code paths, not the GPU's numbers). Results go into
``attention_gpu.json`` under ``"prefill"`` (the output folder keeps to 8 files).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

PS = 16
MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # H, KV, hd


def _case(name: str, chunks: list[tuple[int, int]], model: str, rng, key, dtype=jnp.bfloat16):
  """A step of prompt chunks ``(cached, new)`` packed after one idle decode lane."""
  h, kv, d = MODELS[model]
  bp = max(1, 128 // PS)
  lens = [c + m for c, m in chunks]
  need = [-(-n // PS) for n in lens]
  num_pages = sum(need) + 2
  perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  pages_of, at = [], 0
  for k in need:
    pages_of.append(perm[at:at + k])
    at += k
  n_tok = 1 + sum(m for _, m in chunks)
  n_tok = -(-n_tok // 64) * 64
  u = -(-sum(need) // bp) * bp
  pages = np.zeros(u, np.int32)
  page_seq = np.full(u, -2, np.int32)
  page_start = np.zeros(u, np.int32)
  page_fill = np.zeros(u, np.int32)
  token_seq = np.full(n_tok, -1, np.int32)
  positions = np.zeros(n_tok, np.int32)
  col, at = 1, 0
  for j, (cached, m) in enumerate(chunks):
    k = need[j]
    token_seq[col:col + m], positions[col:col + m] = j, np.arange(cached, cached + m)
    pages[at:at + k], page_seq[at:at + k] = pages_of[j], j
    page_start[at:at + k] = np.arange(k) * PS
    page_fill[at:at + k] = np.clip(cached + m - np.arange(k) * PS, 0, PS)
    col, at = col + m, at + k
  k1, k2, k3 = jax.random.split(key, 3)
  shape = (2, num_pages, PS, kv, d)
  meta = dict(lane_pages=jnp.zeros((1, bp), jnp.int32), lane_len=jnp.zeros((1,), jnp.int32),
              pages=jnp.asarray(pages), page_seq=jnp.asarray(page_seq),
              page_start=jnp.asarray(page_start), page_fill=jnp.asarray(page_fill),
              token_seq=jnp.asarray(token_seq), positions=jnp.asarray(positions),
              blocks=jnp.asarray([0, u // bp], jnp.int32))
  return dict(name=name, model=model, chunks=chunks, bp=bp, pages_of=pages_of,
              q=jax.random.normal(k3, (n_tok, h, d), jnp.float32).astype(dtype),
              k_pool=jax.random.normal(k1, shape, jnp.float32).astype(dtype),
              v_pool=jax.random.normal(k2, shape, jnp.float32).astype(dtype), meta=meta,
              token_seq=token_seq, positions=positions)


def _exact(c, tokens) -> np.ndarray:
  """float64 attention of the sampled tokens over their own sequence's keys up to them."""
  q = np.asarray(c["q"].astype(jnp.float32), np.float64)
  kp = np.asarray(c["k_pool"][1].astype(jnp.float32))
  vp = np.asarray(c["v_pool"][1].astype(jnp.float32))
  _, h, d = q.shape
  kv = kp.shape[2]
  out = np.zeros((len(tokens), h, d))
  for i, t in enumerate(tokens):
    j, pos = int(c["token_seq"][t]), int(c["positions"][t])
    k = kp[c["pages_of"][j]].reshape(-1, kv, d)[:pos + 1].astype(np.float64)
    v = vp[c["pages_of"][j]].reshape(-1, kv, d)[:pos + 1].astype(np.float64)
    s = np.einsum("kgd,skd->kgs", q[t].reshape(kv, h // kv, d), k) / math.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[i] = np.einsum("kgs,skd->kgd", p, v).reshape(h, d)
  return out


def _fn(impl: str, bp: int, interpret: bool):
  from pallas_kernels.paged_attention import AttentionInputs, ragged_paged_attention

  def f(q, k_pool, v_pool, meta):
    return ragged_paged_attention(q, k_pool, v_pool, 1, AttentionInputs(**meta, block_pages=bp),
                                  implementation=impl, interpret=interpret)

  return f


def _loop(f, iters: int):
  def loop(q, k_pool, v_pool, meta):
    return jax.lax.fori_loop(0, iters, lambda _, q: f(q, k_pool, v_pool, meta).astype(q.dtype), q)

  return loop


def part_attention(ctx, g) -> tuple[list, list]:
  """Part A; returns (rows, failures)."""
  if ctx.dry:
    plan = [("fresh 64", [(0, 64)]), ("prefix 40+120", [(40, 120)])]
    models, iters, rounds = ("smollm2", "llama8b"), 1, 2
  else:
    plan = [("fresh 512", [(0, 512)]), ("fresh 2048", [(0, 2048)]),
            ("packed 4x512", [(0, 512)] * 4), ("prefix 6000+1024", [(6000, 1024)]),
            ("fresh 8192", [(0, 8192)])]
    models, iters, rounds = ("smollm2", "llama8b"), 5, 5
  rows, failures = [], []
  rng = np.random.default_rng(5)
  key = jax.random.PRNGKey(5)
  for name, chunks in plan:
    for model in models:
      if ctx.over(keep=40):
        g.log(f"  prefill: budget cut before {model} {name}")
        return rows, failures
      key, sub = jax.random.split(key)
      c = _case(name, chunks, model, rng, sub)
      row = {"case": name, "model": model, "tokens": int(sum(m for _, m in chunks)),
             "context": int(max(a + m for a, m in chunks))}
      label = f"prefill {model} {name}"
      args = (c["q"], c["k_pool"], c["v_pool"], c["meta"])
      fns = {impl: _fn(impl, c["bp"], ctx.interpret) for impl in ("reference", "mosaic_gpu")}
      tasks = {impl: (f, args) for impl, f in fns.items()}
      tasks.update({f"{impl}_loop": (_loop(f, iters), args) for impl, f in fns.items()})
      compiled = g._compile_all(tasks, g._threads(ctx))
      bad = {n: g._err(v) for n, v in compiled.items() if isinstance(v, Exception)}
      if bad:
        row["errors"] = bad
        failures.append(f"{label}: {next(iter(bad.items()))}")
        rows.append(row)
        g.log(f"  {label}: errors {bad}")
        continue
      if ctx.dry:  # the kernel path lowered for CUDA with interpret=False
        low = g._cuda_lowering({"k": (_fn("mosaic_gpu", c["bp"], False), args)})["k"]
        row["cuda_lowering"] = low
        if not low.startswith("ok") or "mosaic_gpu" not in low:
          failures.append(f"{label}: CUDA lowering: {low[:150]}")
      live = np.flatnonzero(c["token_seq"] >= 0)
      sample = np.unique(np.concatenate([live[:8], live[-8:], rng.choice(live, 32)]))
      exact = _exact(c, sample)
      out = {impl: np.asarray(compiled[impl](*args).astype(jnp.float32), np.float64)
             for impl in fns}
      err = {impl: float(np.max(np.abs(o[sample] - exact))) for impl, o in out.items()}
      ymax = float(np.max(np.abs(exact)))
      bound = 1.5 * err["reference"] + 2.0**-12 * ymax
      idle = out["mosaic_gpu"][c["token_seq"] < 0]
      ok = (bool(np.isfinite(out["mosaic_gpu"]).all()) and err["mosaic_gpu"] <= bound
            and not np.any(idle))
      row.update(kernel_err=err["mosaic_gpu"], ref_err=err["reference"], bound=bound,
                 kernel_vs_reference=float(np.max(np.abs(out["mosaic_gpu"] - out["reference"]))),
                 numerics="pass" if ok else "FAIL")
      if not ok:
        failures.append(f"{label}: kernel err {err['mosaic_gpu']:.3g} > {bound:.3g} or "
                        "non-finite / non-zero padding")
      try:
        calls = {impl: (lambda c_=compiled[f"{impl}_loop"], a=args: c_(*a)) for impl in fns}
        times = g._interleaved(calls, rounds, ctx, min_rounds=min(3, rounds))
        med = {impl: statistics.median(ts) / iters for impl, ts in times.items()}
        row["ms"] = {impl: 1e3 * v for impl, v in med.items()}
        row["ratio_kernel_to_reference"] = med["mosaic_gpu"] / med["reference"]
      except Exception as e:  # noqa: BLE001
        row["timing_error"] = g._err(e)
        failures.append(f"{label}: timing {g._err(e, 150)}")
      rows.append(row)
      g.log(f"  {label}: err kernel {err['mosaic_gpu']:.2e} ref {err['reference']:.2e} -> "
            f"{row['numerics']}; kernel/ref {row.get('ratio_kernel_to_reference', math.nan):.2f}"
            f" ({row.get('ms', {}).get('mosaic_gpu', math.nan):.3f} ms vs "
            f"{row.get('ms', {}).get('reference', math.nan):.3f} ms)")
      del compiled, c, args, out
  return rows, failures


def _generator(lengths: list[int]):
  from flax import nnx

  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.models.config import ModelConfig
  from bitdelta_jax.models.llama import LlamaForCausalLM

  hf = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
            rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=16384,
            hidden_act="silu")
  cfg = ModelConfig.from_hf_dict(hf, num_slots=2)
  model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  longest = max(lengths)
  return Generator(model, max_rows=4, max_seq_len=longest + 64, prefill_chunk=longest,
                   prefix_caching=False)


def part_ttft(ctx, g) -> tuple[dict, list]:
  """Part B; returns (results, failures)."""
  from bitdelta_jax.engine.sampling_params import SamplingParams

  lengths = [48, 112] if ctx.dry else [512, 2048, 8192]
  rounds = 2 if ctx.dry else 3
  res: dict = {"model": "SmolLM2-135M-shaped, 4 layers, random bf16 weights, 1 variant slot",
               "chunk": max(lengths), "rounds": rounds, "ms": {}}
  failures: list = []
  params = SamplingParams(max_new_tokens=1)
  rng = np.random.default_rng(9)
  prompts = {n: [int(t) for t in rng.integers(10, 49000, n)] for n in lengths}
  prev = os.environ.get("BITDELTA_PAGED_PREFILL_GPU")
  try:
    for path in ("kernel", "reference"):
      os.environ["BITDELTA_PAGED_PREFILL_GPU"] = "1" if path == "kernel" else "0"
      jax.clear_caches()
      gen = _generator(lengths)
      for n in lengths:
        if ctx.over(keep=15):
          failures.append(f"ttft budget cut at {path} {n}")
          return res, failures
        for slot in (0, 1):  # warm: compiles the bucket
          gen.generate([prompts[n]], [slot], params)
        times = {0: [], 1: []}
        for _ in range(rounds):
          for slot in (0, 1):
            t = time.perf_counter()
            gen.generate([prompts[n]], [slot], params)
            times[slot].append(time.perf_counter() - t)
        ms = {("base" if s == 0 else "variant"): 1e3 * statistics.median(v)
              for s, v in times.items()}
        res["ms"].setdefault(path, {})[str(n)] = ms
        g.log(f"  ttft {path} {n} tokens: base {ms['base']:.1f} ms, variant {ms['variant']:.1f}"
              f" ms (+{ms['variant'] - ms['base']:.1f})")
      del gen
  finally:
    if prev is None:
      os.environ.pop("BITDELTA_PAGED_PREFILL_GPU", None)
    else:
      os.environ["BITDELTA_PAGED_PREFILL_GPU"] = prev
    jax.clear_caches()
  k, r = res["ms"].get("kernel", {}), res["ms"].get("reference", {})
  res["kernel_over_reference"] = {n: k[n]["base"] / r[n]["base"] for n in k if n in r}
  res["variant_minus_base_ms"] = {n: k[n]["variant"] - k[n]["base"] for n in k}
  return res, failures


def stage_prefill(ctx, g) -> tuple[bool, str]:
  """The stage: ``g`` is the gpu_check module (its helpers: log, _compile_all, ...)."""
  res: dict = {"page_size": PS, "criteria": "kernel err <= 1.5 x reference err + 2^-12 x "
               "max|exact| on 48 sampled tokens; padding rows exactly 0"}
  ctx.data["prefill"] = res
  rows, failures = part_attention(ctx, g)
  res["attention"] = rows
  ttft, f2 = part_ttft(ctx, g)
  res["ttft"] = ttft
  failures += f2
  res["failures"] = failures
  att = ctx.data.get("attention") or {}
  g._write_json(ctx.out / "attention_gpu.json", {**att, "prefill": res})
  npass = sum(r.get("numerics") == "pass" for r in rows)
  line = f"prefill numerics {npass}/{len(rows)} pass"
  timed = [r for r in rows if "ratio_kernel_to_reference" in r]
  if timed:
    line += "; kernel/ref " + ", ".join(f"{r['model'][:5]} {r['case']} "
                                        f"{r['ratio_kernel_to_reference']:.2f}" for r in timed)
  if ttft.get("kernel_over_reference"):
    line += "; TTFT kernel/ref " + ", ".join(f"{n}: {v:.2f}" for n, v in
                                             ttft["kernel_over_reference"].items())
  if ttft.get("variant_minus_base_ms"):
    line += "; variant-base ms " + ", ".join(f"{n}: {v:+.1f}" for n, v in
                                             ttft["variant_minus_base_ms"].items())
  lows = [r["cuda_lowering"] for r in rows if "cuda_lowering" in r]
  if lows:
    line += f"; CUDA lowering {sum(v.startswith('ok') for v in lows)}/{len(lows)} ok"
  if failures:
    return False, f"{len(failures)} failure(s), first: {failures[0]} | {line}"
  return True, line


def report_lines(ctx) -> list[str]:
  res = ctx.data.get("prefill")
  if not res:
    return []
  L = ["## paged attention, prompt chunks: mosaic_gpu prefill kernel vs reference", "",
       "| model | case | tokens | kernel err | ref err | numerics | kernel ms | ref ms | "
       "kernel/ref |", "|---" * 9 + "|"]
  for r in res.get("attention", []):
    ms = r.get("ms", {})
    L.append(f"| {r['model']} | {r['case']} | {r['tokens']} | {r.get('kernel_err', math.nan):.2e}"
             f" | {r.get('ref_err', math.nan):.2e} | {r.get('numerics') or r.get('errors')} | "
             f"{ms.get('mosaic_gpu', math.nan):.3f} | {ms.get('reference', math.nan):.3f} | "
             f"{r.get('ratio_kernel_to_reference', math.nan):.2f} |")
  t = res.get("ttft") or {}
  if t.get("ms"):
    L += ["", f"Time to first token, {t['model']} (ms, medians of {t['rounds']} rounds):", "",
          "| prompt | kernel base | kernel variant | reference base | reference variant |",
          "|---|---|---|---|---|"]
    k, r = t["ms"].get("kernel", {}), t["ms"].get("reference", {})
    for n in k:
      rr = r.get(n, {})
      L.append(f"| {n} | {k[n]['base']:.1f} | {k[n]['variant']:.1f} | "
               f"{rr.get('base', math.nan):.1f} | {rr.get('variant', math.nan):.1f} |")
  return L + [""]
