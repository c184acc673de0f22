"""A layer's q/k/v and gate/up in one GGUF block kernel call each vs one call per projection:
the SmolLM2-135M Q4_1 forward (the shipped file, served as stored) on the CPU.

    python -m bench fused_projections [--rounds 15]
        → bench/results/kernels/fused_projections.{json,md}

The model's jitted forward (`bdj.from_pretrained` on the GGUF file, int8 activations, the
LM head included) traced twice: with ``BITDELTA_QUANT_ROWS_MANY`` on (`layers.dense_many`: 2
kernel calls per layer for those five projections) and off (5 calls). Shapes: one token (a
decode step of one stream), 8 rows of one token (8 streams), one 128-token prompt. Outputs
must be equal bit for bit; then interleaved rounds (`bench.common.harness`), medians, ratio.
"""

from __future__ import annotations

import argparse
import os

from bench.common import harness, report
from bench.common.machine import machine_line
from bench.common.paths import results_dir

SHAPES = {"1 token": (1, 1), "8 rows x 1 token": (8, 1), "1 x 128 tokens": (1, 128)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=15)
  a = p.parse_args(argv)
  import jax
  import numpy as np
  from flax import nnx

  import bitdelta_jax as bdj
  from bitdelta_jax.zoo.real_base import real_gguf

  model = bdj.from_pretrained(real_gguf())
  graphdef, state = nnx.split(model)

  def traced(on: bool):
    os.environ["BITDELTA_QUANT_ROWS_MANY"] = "1" if on else "0"
    f = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
    return f

  rng = np.random.default_rng(0)
  rows = []
  for name, (b, t) in SHAPES.items():
    ids = rng.integers(100, 30000, (b, t)).astype(np.int32)
    fns = {}
    for on in (True, False):
      f = traced(on)
      compiled = f.lower(state, ids).compile()
      calls = f.lower(state, ids).as_text().count("custom_call @bitdelta_quant_rows")
      fns["fused" if on else "separate"] = (compiled, calls)
    os.environ.pop("BITDELTA_QUANT_ROWS_MANY", None)
    outs = {k: np.asarray(c(state, ids)) for k, (c, _) in fns.items()}
    np.testing.assert_array_equal(outs["fused"], outs["separate"])
    t_ = harness.interleaved({k: (lambda c=c, ids=ids: c(state, ids)) for k, (c, _) in fns.items()},
                             a.rounds)
    mf, ms = t_.median("fused"), t_.median("separate")
    rows.append({"shape": name, "fused_ms": 1e3 * mf, "separate_ms": 1e3 * ms,
                 "fused_over_separate": mf / ms, "kernel_calls_fused": fns["fused"][1],
                 "kernel_calls_separate": fns["separate"][1]})
    print(rows[-1], flush=True)
  res = {"rounds": a.rounds, "rows": rows}
  lines = [
    "# q/k/v and gate/up in one GGUF block kernel call each (SmolLM2-135M Q4_1 forward)",
    "",
    f"`python -m bench fused_projections --rounds {a.rounds}` (module docstring): the jitted "
    f"forward with `BITDELTA_QUANT_ROWS_MANY` on and off; medians of {a.rounds} interleaved "
    "rounds; outputs equal bit for bit.",
    "",
    machine_line({}),
    "",
    "| shape | one call each (ms) | fused (ms) | fused / separate | block-kernel calls (separate → fused) |",
    "|---|---|---|---|---|",
  ]
  lines += [f"| {r['shape']} | {r['separate_ms']:.2f} | {r['fused_ms']:.2f} | "
            f"{r['fused_over_separate']:.2f} | {r['kernel_calls_separate']} → "
            f"{r['kernel_calls_fused']} |" for r in rows]
  md = report.write(results_dir("kernels") / "fused_projections", res, lines)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
