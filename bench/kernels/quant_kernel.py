"""The quantized-base CPU kernel (`quant_matmul` cpu_rows) at decode sizes: f32 against int8
activations, and against f32 weights.

    python -m bench quant_kernel [--rounds 15]   → bench/results/kernels/quant_kernel.{json,md}
    python -m bench quant_kernel --quick         # smoke run: small sizes, 1 round, no files
    python -m bench quant_kernel --rows 1 8 64 --bf16   # + a prefill chunk, bf16 W
    python -m bench quant_kernel --amx --rows 2 4 8 16 32 128 512   # AMX vs VNNI builds

Rows 1 and 8 (decode), shapes SmolLM2's MLP (K=576, N=1536 and K=1536, N=576), K=2048, N=8192
and K=N=4096. Candidates, jitted with every array an argument, interleaved round by round
(`harness.interleaved`, one process: the ratios compare runs under the same load), medians:

* ``q8_0`` / ``q4_0`` / ``q4_1``: ``cpu_rows.rows_call(..., activations="f32")``: x stays f32,
  each block dequantized to f32 in registers; ``+var``: one 1-bit variant (bits read in place).
* ``q8_0:int8`` / ...: ``activations="int8"``: x quantized per row and 32-block (ggml's Q8_0
  rule, f32 scale), integer products summed in int32 per block; ``+var`` likewise (the delta
  term keeps f32 x).
* ``xla_f32``: ``x @ W`` on dense f32 W (XLA's GEMV / GEMM), no delta.
* with ``--bf16``: ``delta_bf16`` / ``delta_bf16+var``: `pallas_kernels.delta_matmul` on bf16 W.

GB/s: the stored bytes each candidate must read (blocks, or f32 W; + the variant's bits) per
second. Ratios: int8 to f32 activations (same format, same variant), and each to ``xla_f32``.
The machine is shared with other workers: the load average is recorded per row.
"""

from __future__ import annotations

import argparse
import os

from bench.common import (
  harness,
  report,
)
from bench.common.machine import machine_line
from bench.common.paths import results_dir

FORMATS = ("q8_0", "q4_0", "q4_1")


AVX2_TARGET = "bitdelta_quant_rows_avx2"


def _candidates(m: int, k: int, n: int, bf16: bool):
  """{name: (fn, bytes read)}."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.bits import group_k_for, packed_rows
  from pallas_kernels.delta_matmul import delta_matmul
  from pallas_kernels.quant_matmul import blocks, cpu_rows

  rng = np.random.default_rng(0)
  g = group_k_for(k)
  w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  bits = jnp.asarray(rng.integers(0, 256, (packed_rows(k, g), n)), jnp.uint8)
  scale = jnp.asarray(rng.uniform(0.001, 0.01, (n,)), jnp.float32)
  wj = jnp.asarray(w)
  out = {}
  # one copy of each format's blocks for every candidate: separately allocated copies timed
  # differently (placement: a Q8_0 copy ran 1.1-1.6x the other's time with the same code)
  qks = {fmt: jax.tree.map(jnp.asarray, blocks.quantize(w, fmt)) for fmt in FORMATS}
  for act, tag in (("f32", ""), ("int8", ":int8")):
    qmm = jax.jit(lambda x, q, act=act: cpu_rows.rows_call(x, q, group_k=g, activations=act))
    qmv = jax.jit(lambda x, q, b, s, act=act: cpu_rows.rows_call(x, q, b, s, group_k=g,
                                                                 activations=act))
    for fmt in FORMATS:
      qk = qks[fmt]
      out[fmt + tag] = (lambda qk=qk, f=qmm: f(x, qk), qk.nbytes)
      out[f"{fmt}{tag}+var"] = (lambda qk=qk, f=qmv: f(x, qk, bits, scale),
                                qk.nbytes + bits.nbytes)
  gemv = jax.jit(lambda x, w: x @ w)
  out["xla_f32"] = (lambda: gemv(x, wj), wj.nbytes)
  if bf16:
    wb = wj.astype(jnp.bfloat16)
    plain = jax.jit(lambda x, w: delta_matmul(x, w, group_k=g))
    delta = jax.jit(lambda x, w, b, s: delta_matmul(x, w, b, s, group_k=g))
    out["delta_bf16"] = (lambda: plain(x, wb), wb.nbytes)
    out["delta_bf16+var"] = (lambda: delta(x, wb, bits, scale), wb.nbytes + bits.nbytes)
  return out


def avx2_ab(rows: tuple[int, ...], shapes, rounds: int) -> list[dict]:
  """This machine's build against the same kernel built without AVX-512 (its 8-column tiles)
  and against a second copy of this build (the noise floor), f32 activations, per format: three
  candidates on the same arrays, interleaved. In the full candidate set the formats' separately
  allocated blocks were timed 1.1-2x apart by placement alone."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.bits import group_k_for
  from pallas_kernels.quant_matmul import blocks, cpu_rows

  targets = {"native": "bitdelta_quant_rows", "native_copy": "bitdelta_quant_rows_copy",
             "avx2": "bitdelta_quant_rows_avx2"}
  cpu_rows.build_target(("-march=native",), targets["native_copy"])
  cpu_rows.build_target(("-march=native", "-mno-avx512f"), targets["avx2"])
  res = []
  for k, n in shapes:
    rng = np.random.default_rng(0)
    g = group_k_for(k)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    qks = {fmt: jax.tree.map(jnp.asarray, blocks.quantize(w, fmt)) for fmt in FORMATS}
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      for fmt, qk in qks.items():
        fns = {}
        for name, t in targets.items():
          f = jax.jit(lambda x, q, t=t, g=g: cpu_rows.rows_call(x, q, group_k=g,
                                                                activations="f32", target=t))
          fns[name] = lambda f=f, qk=qk, x=x: f(x, qk)
        med = harness.interleaved(fns, rounds, min_rounds=rounds).medians()
        res.append({"rows": m, "k": k, "n": n, "format": fmt, "load": os.getloadavg()[0],
                    **{f"{c}_us": 1e6 * v for c, v in med.items()},
                    "native_vs_avx2": med["native"] / med["avx2"],
                    "copy_vs_native": med["native_copy"] / med["native"]})
        print(res[-1], flush=True)
  return res


def vnni_ab(rows: tuple[int, ...], shapes, rounds: int) -> list[dict]:
  """int8 activations: this machine's build (AVX-512 VNNI + VBMI: the vpdpbusd tiles) against
  the kernel built with ``-mno-avx512vnni`` (the AVX2 vpmaddubsw / vpmaddwd tiles), and both
  against f32 activations (the default) and XLA's f32 GEMV / GEMM on the same weights, per
  format: candidates on the same arrays, interleaved."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.bits import group_k_for
  from pallas_kernels.quant_matmul import blocks, cpu_rows

  novnni = "bitdelta_quant_rows_novnni"
  cpu_rows.build_target(("-march=native", "-mno-avx512vnni"), novnni)
  cands = {"int8_vnni": ("int8", cpu_rows._TARGET), "int8_avx2": ("int8", novnni),
           "f32": ("f32", cpu_rows._TARGET)}
  res = []
  for k, n in shapes:
    rng = np.random.default_rng(0)
    g = group_k_for(k)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    wj = jnp.asarray(w)
    qks = {fmt: jax.tree.map(jnp.asarray, blocks.quantize(w, fmt)) for fmt in FORMATS}
    gemv = jax.jit(lambda x, w: x @ w)
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      for fmt, qk in qks.items():
        fns = {}
        for name, (act, t) in cands.items():
          f = jax.jit(lambda x, q, t=t, g=g, act=act: cpu_rows.rows_call(
            x, q, group_k=g, activations=act, target=t))
          fns[name] = lambda f=f, qk=qk, x=x: f(x, qk)
        fns["xla_f32"] = lambda x=x, gemv=gemv, wj=wj: gemv(x, wj)
        med = harness.interleaved(fns, rounds, min_rounds=rounds).medians()
        res.append({"rows": m, "k": k, "n": n, "format": fmt, "load": os.getloadavg()[0],
                    **{f"{c}_us": 1e6 * v for c, v in med.items()},
                    "gbps_int8_vnni": qk.nbytes / med["int8_vnni"] / 1e9,
                    "gbps_xla_f32": wj.nbytes / med["xla_f32"] / 1e9,
                    "vnni_vs_avx2": med["int8_vnni"] / med["int8_avx2"],
                    "vnni_vs_f32": med["int8_vnni"] / med["f32"]})
        print(res[-1], flush=True)
  return res


def run(rows: tuple[int, ...], shapes: tuple[tuple[int, int], ...], rounds: int,
        bf16: bool = False) -> list[dict]:
  res = []
  for k, n in shapes:
    for m in rows:
      cands = _candidates(m, k, n, bf16)
      t = harness.interleaved({c: f for c, (f, _) in cands.items()}, rounds, min_rounds=rounds)
      med = t.medians()
      row = {"rows": m, "k": k, "n": n, "rounds": rounds, "load": os.getloadavg()[0]}
      for c, (_, nbytes) in cands.items():
        row[f"{c}_us"] = 1e6 * med[c]
        row[f"{c}_gbps"] = nbytes / med[c] / 1e9
        row[f"{c}_vs_xla"] = med[c] / med["xla_f32"]
        if ":int8" in c:
          row[f"{c}_vs_f32act"] = med[c] / med[c.replace(":int8", "")]
      res.append(row)
      print(f"M={m} K={k} N={n}:", {c: f"{row[c + '_us']:.0f}us {row[c + '_gbps']:.1f}GB/s"
                                     for c in cands}, flush=True)
      print("  int8 / f32 activations:", {c: f"{row[c + '_vs_f32act']:.2f}" for c in cands
                                          if ":int8" in c}, flush=True)
  return res


PROMPTS = (
  "The capital of France is",
  "def fibonacci(n):\n    if n < 2:\n        return n\n",
  "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
  "Once upon a time, in a small village by the sea, there lived an old fisherman who",
  "Photosynthesis converts light energy into",
)


def logit_error() -> dict:
  """The real SmolLM2 Q4_1 GGUF, every prompt's teacher-forced logits with f32 and with int8
  activations (each row's numbers do not depend on how many rows a call has, so these are the
  decode logits too): max |Δlogit|, its scale, next-token argmax agreement."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from tokenizers import Tokenizer

  from bitdelta_jax.hf.gguf_checkpoint import resolve_base
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.zoo.real_base import real_gguf

  path = real_gguf()
  tok = Tokenizer.from_file(str(resolve_base(path) / "tokenizer.json"))
  model = from_pretrained(path)
  per = []
  for prompt in PROMPTS:
    ids = jnp.asarray([tok.encode(prompt).ids], jnp.int32)
    out = {}
    for act in ("f32", "int8"):
      os.environ["BITDELTA_QUANT_ACTIVATIONS"] = act  # read when the program is traced
      fwd = nnx.jit(lambda m, ids: m(ids))
      out[act] = np.asarray(fwd(model, ids)[0], np.float64)  # [T, V]
    os.environ.pop("BITDELTA_QUANT_ACTIVATIONS")
    d = np.abs(out["int8"] - out["f32"])
    agree = out["int8"].argmax(-1) == out["f32"].argmax(-1)
    lp = {a: v - np.log(np.exp(v - v.max(-1, keepdims=True)).sum(-1, keepdims=True))
             - v.max(-1, keepdims=True) for a, v in out.items()}
    kl = np.sum(np.exp(lp["f32"]) * (lp["f32"] - lp["int8"]), -1)
    per.append({"prompt": prompt, "tokens": int(ids.shape[1]), "max_abs_dlogit": float(d.max()),
                "mean_abs_dlogit": float(d.mean()), "logit_scale": float(np.abs(out["f32"]).max()),
                "argmax_agree": int(agree.sum()), "kl_max": float(kl.max()),
                "kl_mean": float(kl.mean())})
    print(per[-1], flush=True)
  # one step's linear layers and head at 1 and 8 rows: the model on [rows, 1] token ids (no KV
  # cache: attention over one position), both modes interleaved round by round
  step = {}
  for rows in (1, 8):
    ids = jnp.asarray(np.arange(rows)[:, None] * 97 + 13, jnp.int32)
    fns = {}
    for act in ("f32", "int8"):
      os.environ["BITDELTA_QUANT_ACTIVATIONS"] = act
      f = nnx.jit(lambda m, ids: m(ids))
      f(model, ids).block_until_ready()  # traced now, under this mode
      fns[act] = lambda f=f, ids=ids: f(model, ids)
    os.environ.pop("BITDELTA_QUANT_ACTIVATIONS")
    med = harness.interleaved(fns, 30, min_rounds=30).medians()
    step[rows] = {"f32_ms": 1e3 * med["f32"], "int8_ms": 1e3 * med["int8"],
                  "ratio": med["int8"] / med["f32"], "load": os.getloadavg()[0]}
    print(rows, step[rows], flush=True)
  tokens = sum(p["tokens"] for p in per)
  summary = {"model": path.name, "positions": tokens,
             "max_abs_dlogit": max(p["max_abs_dlogit"] for p in per),
             "argmax_agree": sum(p["argmax_agree"] for p in per),
             "kl_max": max(p["kl_max"] for p in per),
             "kl_mean": sum(p["kl_mean"] * p["tokens"] for p in per) / tokens,
             "step": {str(r): v for r, v in step.items()}, "jax": jax.__version__}
  lines = [
    "# int8 vs f32 activations on the real SmolLM2-135M Q4_1 GGUF",
    "",
    f"`python -m bench quant_kernel --logits`: {path.name} loaded with its blocks "
    "(`models.from_pretrained`), every linear layer and the tied head through the cpu_rows "
    "kernel; each prompt's teacher-forced logits at every position with "
    "`BITDELTA_QUANT_ACTIVATIONS=f32` and `=int8`. KL(f32 ‖ int8) of the next-token "
    "distributions, nats.",
    "",
    f"Over all {tokens} positions: max |Δlogit| {summary['max_abs_dlogit']:.3g}, argmax agrees "
    f"at {summary['argmax_agree']}/{tokens}, KL mean {summary['kl_mean']:.2e}, max "
    f"{summary['kl_max']:.2e}.",
    "",
    "Forward time of the whole model on `[rows, 1]` token ids (every linear layer and the head "
    "at that many rows; attention over one position), medians of 30 interleaved rounds, the "
    "machine shared with other workers' benchmarks:",
    "",
    "| rows | f32 x (ms) | int8 x (ms) | int8 / f32 | load |",
    "|---|---|---|---|---|",
    *[f"| {r} | {v['f32_ms']:.2f} | {v['int8_ms']:.2f} | {v['ratio']:.2f} | {v['load']:.1f} |"
      for r, v in step.items()],
    "",
    "| prompt | tokens | max abs dlogit | mean abs dlogit | max abs logit | argmax agree | KL mean | KL max |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for p in per:
    lines.append(f"| {p['prompt'][:40]!r} | {p['tokens']} | {p['max_abs_dlogit']:.3g} | "
                 f"{p['mean_abs_dlogit']:.3g} | {p['logit_scale']:.3g} | "
                 f"{p['argmax_agree']}/{p['tokens']} | {p['kl_mean']:.2e} | {p['kl_max']:.2e} |")
  md = report.write(results_dir("kernels") / "quant_kernel_logits", {"summary": summary, "prompts": per}, lines)
  print(md.read_text())
  return summary


def vnni_report(rows: tuple[int, ...], rounds: int, quick: bool) -> None:
  shapes = ((256, 200),) if quick else ((576, 1536), (1536, 576), (2048, 8192), (4096, 4096),
                                        (4096, 11008), (11008, 4096))
  res = vnni_ab(rows, shapes, 3 if quick else max(rounds, 31))
  if quick:
    return
  lines = [
    "# int8 activations: AVX-512 VNNI tiles vs AVX2 int8 tiles vs f32 activations",
    "",
    f"`python -m bench quant_kernel --vnni --rows {' '.join(map(str, rows))}`: per shape "
    f"and format, four candidates on the same arrays, interleaved ({max(rounds, 31)} rounds), "
    "medians. `int8_vnni`: this build's int8-activation path (vpdpbusd on byte-permuted "
    "quads); `int8_avx2`: the same kernel built with `-mno-avx512vnni` (vpmaddubsw / vpmaddwd "
    "tiles, the int8 path before); `f32`: f32 activations (the default); `xla_f32`: XLA's "
    "`x @ W` on the dense f32 matrix. GB/s: stored bytes read per second (blocks; f32 W for "
    "XLA). No variant term (the delta is the same code in every candidate).",
    "",
    machine_line({}),
    "",
    "| M | K x N | format | int8 VNNI (us) | int8 AVX2 (us) | f32 x (us) | XLA f32 (us) | "
    "VNNI / AVX2 | VNNI / f32 x | VNNI GB/s | XLA GB/s | load |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in res:
    lines.append(f"| {r['rows']} | {r['k']}x{r['n']} | {r['format']} | {r['int8_vnni_us']:.0f} | "
                 f"{r['int8_avx2_us']:.0f} | {r['f32_us']:.0f} | {r['xla_f32_us']:.0f} | "
                 f"{r['vnni_vs_avx2']:.2f} | {r['vnni_vs_f32']:.2f} | {r['gbps_int8_vnni']:.1f} | "
                 f"{r['gbps_xla_f32']:.1f} | {r['load']:.1f} |")
  md = report.write(results_dir("kernels") / "quant_vnni", {"rows": res}, lines)
  print(md.read_text())


def builds_ab(builds: dict[str, tuple[str, ...]], shapes, rows: tuple[int, ...],
              n_rounds: int) -> list[dict]:
  """int8 activations: the kernel built two ways (``builds``: name -> extra compiler flags on
  top of ``-march=native``; the first is the candidate, the second the baseline) and XLA's f32
  GEMM on the same arrays, interleaved per shape, format and row count; the two builds' outputs
  compared exactly."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.bits import group_k_for
  from pallas_kernels.quant_matmul import blocks, cpu_rows

  (new, _), (old, _) = builds.items()
  for name, flags in builds.items():
    cpu_rows.build_target(("-march=native", *flags), f"bitdelta_quant_rows_{name}")
  res = []
  for k, n in shapes:
    rng = np.random.default_rng(0)
    g = group_k_for(k)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    wj = jnp.asarray(w)
    qks = {fmt: jax.tree.map(jnp.asarray, blocks.quantize(w, fmt)) for fmt in FORMATS}
    gemm = jax.jit(lambda x, w: x @ w)
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      for fmt, qk in qks.items():
        fns = {}
        for name in builds:
          f = jax.jit(lambda x, q, t=f"bitdelta_quant_rows_{name}", g=g: cpu_rows.rows_call(
              x, q, group_k=g, activations="int8", target=t))
          fns[name] = lambda f=f, qk=qk, x=x: f(x, qk)
        fns["xla_f32"] = lambda x=x, wj=wj, gemm=gemm: gemm(x, wj)
        med = harness.interleaved(fns, n_rounds, min_rounds=n_rounds).medians()
        same = bool(np.array_equal(np.asarray(fns[new]()), np.asarray(fns[old]())))
        res.append({"rows": m, "k": k, "n": n, "format": fmt, "load": os.getloadavg()[0],
                    **{f"{c}_us": 1e6 * v for c, v in med.items()},
                    f"{new}_vs_{old}": med[new] / med[old],
                    f"{new}_vs_xla": med[new] / med["xla_f32"],
                    "gmac_s": m * k * n / med[new] / 1e9, "bit_identical": same})
        print(res[-1], flush=True)
  return res


def ab_table(res: list[dict], new: str, old: str) -> list[str]:
  lines = [f"| M | K x N | format | {new} (us) | {old} (us) | XLA f32 (us) | {new} / {old} | "
           f"{new} / XLA | {new} GMAC/s | same bits | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res:
    lines.append(f"| {r['rows']} | {r['k']}x{r['n']} | {r['format']} | {r[new + '_us']:.0f} | "
                 f"{r[old + '_us']:.0f} | {r['xla_f32_us']:.0f} | {r[f'{new}_vs_{old}']:.2f} | "
                 f"{r[f'{new}_vs_xla']:.2f} | {r['gmac_s']:.0f} | {r['bit_identical']} | "
                 f"{r['load']:.1f} |")
  import numpy as np

  ratios = [r[f"{new}_vs_{old}"] for r in res]
  return lines + ["", f"{new} / {old} over all rows: median {np.median(ratios):.2f} "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})."]


def strips_report(rows: tuple[int, ...], rounds: int, quick: bool) -> None:
  """int8 activations: the kernel built to take strips at every row count (AVX-512 VNNI:
  64-column strips over a once-transposed copy of each block) against the same source built
  with the strips out of reach (every 4-row tile transposes the block again) and XLA's f32
  GEMM, interleaved: where the strips pay (the default takes them above kStripRows rows).
  AMX is out of reach in both (it would take the rows first)."""
  no_amx = ("-DBITDELTA_QROWS_AMX_ROWS=1000000", "-DBITDELTA_QROWS_AMX_FEW_ROWS=1000000")
  shapes = ((256, 200),) if quick else ((2048, 2048), (2048, 8192), (8192, 2048), (576, 1536))
  n_rounds = 3 if quick else max(rounds, 21)
  res = builds_ab({"strips": ("-DBITDELTA_QROWS_STRIP_ROWS=0", *no_amx),
                   "tiles": ("-DBITDELTA_QROWS_STRIP_ROWS=1000000", *no_amx)},
                  shapes, rows, n_rounds)
  if quick:
    return
  lines = [
    "# int8 activations, prefill and batched rows: strips vs per-tile transposes",
    "",
    f"`python -m bench quant_kernel --strips --rows {' '.join(map(str, rows))}`: per shape, "
    f"format and row count, three candidates on the same arrays, interleaved ({n_rounds} "
    "rounds), medians. `strips`: the kernel built to walk 64-column strips at every row "
    "count (each block's strip is transposed for vpdpbusd once and read from L1 by every "
    "4-row tile; the default build takes them above 8 rows); `tiles`: the same source built "
    "with the strip threshold out of "
    "reach (each 4-row tile transposes the block again: the path before); `xla_f32`: XLA's "
    "`x @ W` on the dense f32 matrix. Same bits: the two builds' outputs compared exactly. "
    "Both builds keep AMX out of reach.",
    "",
    machine_line({}),
    "",
    *ab_table(res, "strips", "tiles"),
  ]
  md = report.write(results_dir("kernels") / "quant_strips", {"rows": res}, lines)
  print(md.read_text())


def amx_report(rows: tuple[int, ...], rounds: int, quick: bool) -> None:
  """int8 activations: the default build (AMX-INT8 tiles from 6 rows where the CPU has them)
  against the same source built with both AMX thresholds out of reach (the VNNI paths) and
  XLA's f32 GEMM, interleaved."""
  from pallas_kernels.quant_matmul import cpu_rows

  shapes = ((256, 200),) if quick else ((2048, 8192), (8192, 2048), (2048, 512), (576, 1536))
  n_rounds = 3 if quick else max(rounds, 11)
  res = builds_ab({"amx": (), "vnni": ("-DBITDELTA_QROWS_AMX_ROWS=1000000",
                                       "-DBITDELTA_QROWS_AMX_FEW_ROWS=1000000")},
                  shapes, rows, n_rounds)
  if quick:
    return
  lines = [
    "# int8 activations: AMX-INT8 tiles vs the AVX-512 VNNI paths",
    "",
    f"`python -m bench quant_kernel --amx --rows {' '.join(map(str, rows))}`: per shape, format "
    f"and row count, three candidates on the same arrays, interleaved ({n_rounds} rounds), "
    "medians. `amx`: the default build (6-16 rows `BaseAmxFew`, more `BaseAmx` in passes of "
    "up to 512 rows; AMX in use here: "
    f"{cpu_rows.amx_in_use()}); `vnni`: the same source built with both AMX thresholds out of "
    "reach (VNNI per-tile paths up to 8 rows, strips above); `xla_f32`: XLA's `x @ W` on the "
    "dense f32 matrix (oneDNN). Same bits: the two builds' outputs compared exactly. The "
    "matrices are a few MB: they stay in the last-level cache between rounds, so the 1-16-row "
    "times are compute, not DRAM (`--stream` measures a decode step's streaming). At 2-4 rows "
    "both builds run the same VNNI code: those ratios are this machine's spread.",
    "",
    machine_line({}),
    "",
    *ab_table(res, "amx", "vnni"),
  ]
  md = report.write(results_dir("kernels") / "quant_amx", {"rows": res}, lines)
  print(md.read_text())


def stream_report(rows: tuple[int, ...], rounds: int, quick: bool) -> None:
  """int8 activations over a whole 1B-shaped model's worth of Q4_0 blocks (16 layers of q, k,
  v, o, gate, up, down: 0.55 GB, past any cache, as a decode step streams them): one jitted
  program calling the kernel on every matrix in turn, on a copy of the blocks collapsed into
  2 MiB pages (`engine.heap.huge_pages`, what the CPU runner does) against a copy in 4 KiB
  pages, interleaved."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bitdelta_jax.engine import heap
  from pallas_kernels.quant_matmul import blocks, cpu_rows

  d, f, kv, layers = (256, 512, 64, 2) if quick else (2048, 8192, 512, 16)
  shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]
  rng = np.random.default_rng(0)
  base = {}
  for k, n in set(shapes):  # quantized once per shape, then copied per layer (own memory)
    base[k, n] = blocks.quantize((rng.standard_normal((k, n)) * 0.02).astype(np.float32), "q4_0")

  def copies():
    return [jax.tree.map(lambda a: jnp.asarray(np.array(a, copy=True)), base[s])
            for _ in range(layers) for s in shapes]

  sets = {"huge_pages": copies(), "4k_pages": copies()}
  collapsed = sum(heap.huge_pages(a.unsafe_buffer_pointer(), a.nbytes)
                  for w in sets["huge_pages"] for a in jax.tree.leaves(w) if a.nbytes >= 4 << 20)
  nbytes = sum(w.nbytes for w in sets["4k_pages"])
  n_rounds = 3 if quick else max(rounds, 15)

  @jax.jit
  def step(xs, ws):
    tot = jnp.float32(0)
    for w in ws:
      tot = tot + cpu_rows.rows_call(xs[w.shape[0]], w, activations="int8")[0, 0]
    return tot

  res = []
  for m in rows:
    xs = {k: jnp.asarray(rng.standard_normal((m, k)), jnp.float32) for k in (d, f)}
    fns = {name: (lambda ws=ws, xs=xs: step(xs, ws)) for name, ws in sets.items()}
    med = harness.interleaved(fns, n_rounds, min_rounds=n_rounds).medians()
    res.append({"rows": m, "bytes": nbytes, "collapsed": collapsed, "load": os.getloadavg()[0],
                **{f"{c}_ms": 1e3 * v for c, v in med.items()},
                **{f"{c}_gbps": nbytes / v / 1e9 for c, v in med.items()},
                "ratio": med["huge_pages"] / med["4k_pages"]})
    print(res[-1], flush=True)
  if quick:
    return
  lines = [
    "# Streaming a model's blocks: 2 MiB pages vs 4 KiB pages",
    "",
    f"`python -m bench quant_kernel --stream --rows {' '.join(map(str, rows))}`: one jitted "
    f"program calls the int8 kernel on each of {len(shapes) * layers} Q4_0 matrices (a "
    f"1B-shaped Llama's 16 layers, {nbytes / 1e9:.2f} GB of blocks, more than the caches hold: "
    f"each call reads its weights from DRAM, as a decode step does), {n_rounds} interleaved "
    "rounds, medians. `huge_pages`: a copy of the blocks collapsed into transparent huge pages "
    f"(`engine.heap.huge_pages`, {collapsed / 2**20:.0f} MiB of them: the arrays of 4 MiB or "
    "more, as the CPU runner does); `4k_pages`: another copy as allocated. GB/s: block bytes "
    "per second. (A software prefetch ahead of each column chunk, tried on the 4 KiB copy "
    "the same way, gained nothing: 1.05/0.96/1.02x at 1/4/8 rows.)",
    "",
    machine_line({}),
    "",
    "| M | huge pages (ms) | 4 KiB pages (ms) | ratio | huge GB/s | 4 KiB GB/s | load |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in res:
    lines.append(f"| {r['rows']} | {r['huge_pages_ms']:.1f} | {r['4k_pages_ms']:.1f} | "
                 f"{r['ratio']:.2f} | {r['huge_pages_gbps']:.1f} | {r['4k_pages_gbps']:.1f} | "
                 f"{r['load']:.1f} |")
  md = report.write(results_dir("kernels") / "quant_stream", {"rows": res}, lines)
  print(md.read_text())


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--bf16", action="store_true", help="also delta_matmul on bf16 W")
  ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 round, no files")
  ap.add_argument("--avx2", action="store_true",
                  help="also the kernel built without AVX-512 (f32 activations): the 16- vs "
                  "8-column tiles in one run")
  ap.add_argument("--vnni", action="store_true",
                  help="only int8 activations' VNNI tiles vs the AVX2 int8 tiles vs f32 "
                  "activations (bench/results/kernels/quant_vnni.{json,md})")
  ap.add_argument("--strips", action="store_true",
                  help="only int8 activations' strips vs per-tile transposes at >4 rows "
                  "(bench/results/kernels/quant_strips.{json,md})")
  ap.add_argument("--amx", action="store_true",
                  help="only int8 activations' AMX tiles vs the VNNI paths "
                  "(bench/results/kernels/quant_amx.{json,md})")
  ap.add_argument("--stream", action="store_true",
                  help="only a 1B model's worth of blocks streamed from 2 MiB vs 4 KiB pages "
                  "(bench/results/kernels/quant_stream.{json,md})")
  ap.add_argument("--logits", action="store_true",
                  help="only the real SmolLM2 Q4_1 model's logit error, int8 vs f32 activations")
  args = ap.parse_args()
  if args.logits:
    logit_error()
    return
  if args.stream:
    stream_report(tuple(args.rows), args.rounds, args.quick)
    return
  if args.amx:
    amx_report(tuple(args.rows), args.rounds, args.quick)
    return
  if args.strips:
    strips_report(tuple(args.rows), args.rounds, args.quick)
    return
  if args.vnni:
    vnni_report(tuple(args.rows), args.rounds, args.quick)
    return
  if args.quick:
    run((1, 8, 20), ((256, 200),), 1, args.bf16)
    if args.avx2:
      avx2_ab((1, 8), ((256, 200),), 3)
    return
  shapes = ((576, 1536), (1536, 576), (2048, 8192), (4096, 4096))
  rows = run(tuple(args.rows), shapes, args.rounds, args.bf16)
  ab = avx2_ab(tuple(args.rows), shapes, max(args.rounds, 101)) if args.avx2 else []
  names = [c[:-3] for c in rows[0] if c.endswith("_us")]
  pairs = [c for c in names if ":int8" in c]
  lines = [
    "# Quantized-base CPU kernel (quant_matmul cpu_rows): f32 vs int8 activations",
    "",
    f"Medians of {args.rounds} interleaved rounds (bench/kernels/quant_kernel.py), all candidates "
    "in one process, round by round; compare the ratios (taken within each round's medians) "
    "and the load column (other work on the 2 cores makes single times noisy).",
    "",
    machine_line({}),
    "",
    "## int8 / f32 activations (time ratio; < 1: int8 faster)",
    "",
    "| M | K x N | " + " | ".join(c.replace(":int8", "") for c in pairs) + " | load |",
    "|---|---|" + "---|" * (len(pairs) + 1),
  ]
  for r in rows:
    lines.append(f"| {r['rows']} | {r['k']}x{r['n']} | "
                 + " | ".join(f"{r[c + '_vs_f32act']:.2f}" for c in pairs)
                 + f" | {r['load']:.1f} |")
  if ab:
    lines += ["", "## 16-column (AVX-512) / 8-column (AVX2) tiles, f32 activations",
              "", "`--avx2`: per format, this build, a second copy of it (the noise floor) and "
              "the kernel built with `-mno-avx512f`, on the same arrays, interleaved "
              f"({max(args.rounds, 101)} rounds). Q8_0 at 1-2 rows runs the AVX2 tiles in "
              "both builds (its 16-lane tiles were slower there).", "",
              "| M | K x N | format | native (us) | AVX2 build (us) | native / AVX2 | copy / native | load |",
              "|---|---|---|---|---|---|---|---|",
              *[f"| {r['rows']} | {r['k']}x{r['n']} | {r['format']} | {r['native_us']:.0f} | "
                f"{r['avx2_us']:.0f} | {r['native_vs_avx2']:.2f} | {r['copy_vs_native']:.2f} | "
                f"{r['load']:.1f} |" for r in ab]]
  lines += [
    "",
    "## Times",
    "",
    "Per cell: time, GB/s of the stored bytes read (blocks or f32 W, + the variant's bits), "
    "ratio to XLA's f32 `x @ W`. `+var`: one 1-bit variant; `:int8`: int8 activations.",
    "",
    "| M | K x N | " + " | ".join(names) + " | load |",
    "|---|---|" + "---|" * (len(names) + 1),
  ]
  for r in rows:
    cells = [f"{r[c + '_us']:.0f} us, {r[c + '_gbps']:.1f} GB/s ({r[c + '_vs_xla']:.2f}x)"
             for c in names]
    lines.append(f"| {r['rows']} | {r['k']}x{r['n']} | " + " | ".join(cells)
                 + f" | {r['load']:.1f} |")
  md = report.write(results_dir("kernels") / "quant_kernel", {"rows": rows, "avx2_ab": ab}, lines)
  print(md)


if __name__ == "__main__":
  main()
