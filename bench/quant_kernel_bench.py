"""The quantized-base CPU kernel (`quant_matmul` cpu_rows) against f32 weights at decode sizes.

    python bench/quant_kernel_bench.py [--rounds 30]   → bench/results/quant_kernel.{json,md}
    python bench/quant_kernel_bench.py --quick         # smoke run: small sizes, 1 round, no files

Rows 1 and 8 (decode) and 64 (a prefill chunk), shapes K=N=4096 and SmolLM2's MLP (K=576,
N=1536 and K=1536, N=576). Candidates, jitted with every array an argument, interleaved round by round
(`harness.interleaved`), medians:

* ``q8_0`` / ``q4_0`` / ``q4_1``: ``quant_matmul(..., implementation="cpu_rows")``, no variant,
  and ``+var``: one 1-bit variant (bits ``[KP, N]`` read in place).
* ``xla_f32``: ``x @ W`` on dense f32 W (XLA's GEMV / GEMM), no delta.
* ``delta_bf16`` / ``delta_bf16+var``: `pallas_kernels.delta_matmul.delta_matmul` on bf16 W
  (x f32), without and with the same variant: the unquantized base at half of f32's bytes.

GB/s: the stored bytes each candidate must read (blocks, or f32 W; + the variant's bits) per
second. Ratios are to ``xla_f32``. The machine is shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

FORMATS = ("q8_0", "q4_0", "q4_1")


def _candidates(m: int, k: int, n: int):
  """{name: (fn, bytes read)}."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.bits import group_k_for, packed_rows
  from pallas_kernels.delta_matmul import delta_matmul
  from pallas_kernels.quant_matmul import blocks, quant_matmul

  rng = np.random.default_rng(0)
  g = group_k_for(k)
  w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  bits = jnp.asarray(rng.integers(0, 256, (packed_rows(k, g), n)), jnp.uint8)
  scale = jnp.asarray(rng.uniform(0.001, 0.01, (n,)), jnp.float32)
  wj = jnp.asarray(w)
  wb = wj.astype(jnp.bfloat16)
  out = {}
  qmm = jax.jit(lambda x, q: quant_matmul(x, q, group_k=g, implementation="cpu_rows"))
  qmv = jax.jit(lambda x, q, b, s: quant_matmul(x, q, b, s, group_k=g,
                                                implementation="cpu_rows"))
  for fmt in FORMATS:
    qk = jax.tree.map(jnp.asarray, blocks.quantize(w, fmt))
    out[fmt] = (lambda qk=qk: qmm(x, qk), qk.nbytes)
    out[f"{fmt}+var"] = (lambda qk=qk: qmv(x, qk, bits, scale), qk.nbytes + bits.nbytes)
  gemv = jax.jit(lambda x, w: x @ w)
  plain = jax.jit(lambda x, w: delta_matmul(x, w, group_k=g))
  delta = jax.jit(lambda x, w, b, s: delta_matmul(x, w, b, s, group_k=g))
  out["xla_f32"] = (lambda: gemv(x, wj), wj.nbytes)
  out["delta_bf16"] = (lambda: plain(x, wb), wb.nbytes)
  out["delta_bf16+var"] = (lambda: delta(x, wb, bits, scale), wb.nbytes + bits.nbytes)
  return out


def run(rows: tuple[int, ...], shapes: tuple[tuple[int, int], ...], rounds: int) -> list[dict]:
  res = []
  for k, n in shapes:
    for m in rows:
      cands = _candidates(m, k, n)
      t = harness.interleaved({c: f for c, (f, _) in cands.items()}, rounds, min_rounds=rounds)
      med = t.medians()
      row = {"rows": m, "k": k, "n": n, "rounds": rounds, "load": os.getloadavg()[0]}
      for c, (_, nbytes) in cands.items():
        row[f"{c}_us"] = 1e6 * med[c]
        row[f"{c}_gbps"] = nbytes / med[c] / 1e9
        row[f"{c}_vs_xla"] = med[c] / med["xla_f32"]
      res.append(row)
      print(f"M={m} K={k} N={n}:", {c: f"{row[c + '_us']:.0f}us {row[c + '_gbps']:.1f}GB/s"
                                     for c in cands}, flush=True)
  return res


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 round, no files")
  args = ap.parse_args()
  if args.quick:
    run((1, 8, 20), ((256, 200),), 1)
    return
  rows = run((1, 8, 64), ((4096, 4096), (576, 1536), (1536, 576)), args.rounds)
  names = [c[:-3] for c in rows[0] if c.endswith("_us")]
  lines = [
    "# Quantized-base CPU kernel (quant_matmul cpu_rows) vs f32 weights",
    "",
    f"Medians of {args.rounds} interleaved rounds (bench/quant_kernel_bench.py); per cell: time, "
    "GB/s of the stored bytes read (blocks or f32 W, + the variant's bits), ratio to XLA's "
    "f32 `x @ W`. `+var`: one 1-bit variant. x and y f32.",
    "",
    harness.machine_line({}),
    "",
    "| M | K x N | " + " | ".join(names) + " | load |",
    "|---|---|" + "---|" * (len(names) + 1),
  ]
  for r in rows:
    cells = [f"{r[c + '_us']:.0f} us, {r[c + '_gbps']:.1f} GB/s ({r[c + '_vs_xla']:.2f}x)"
             for c in names]
    lines.append(f"| {r['rows']} | {r['k']}x{r['n']} | " + " | ".join(cells)
                 + f" | {r['load']:.1f} |")
  md = harness.write_results("quant_kernel", {"rows": rows}, lines)
  print(md)


if __name__ == "__main__":
  main()
