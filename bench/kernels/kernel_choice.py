"""The public `delta_matmul` at one row against the model's path and XLA's GEMV (issue 37).

    python -m bench kernel_choice [--rounds 30] [--k 4096] [--n 4096]
        → bench/results/kernels/kernel_choice.{json,md}
    python -m bench kernel_choice --quick    # smoke run: tiny sizes, 1 round, no results

One row x, W ``[K, N]`` in f32 and in bf16 (x in W's dtype, as in a model), one 1-bit variant.
Candidates, jitted with every array an argument, interleaved round by round (the order
rotating, `harness.interleaved`), medians and ratios to XLA's GEMV ``x @ W``:

* ``xla_gemv``: ``x @ W``, the floor (it reads W once, no delta).
* ``api_one_variant``: ``delta_matmul(x, W, bits, α)``, one variant's bits ``[KP, N]``.
* ``api_bank_slot1``: ``delta_matmul(x, W, bank, α, slot_ids=[1])``, a bank of base + 1 slot.
* ``api_bank_base_row``: the same bank, the row on the base (slot 0).
* ``model_delta_dense``: `DeltaDense` with that bank, its row on slot 1 (the model's path).
* ``api_cpu_named``: ``implementation="cpu"`` (XLA's GEMV + the fused delta kernel: what the
  public API ran at one row before it took the few-rows kernel; 1.33x XLA's GEMV then).

The machine is shared: the load average is recorded, and only ratios within a run compare.
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


def _candidates(k: int, n: int, dtype):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from bitdelta_jax.models.layers import DeltaDense
  from pallas_kernels.bits import group_k_for, packed_rows
  from pallas_kernels.delta_matmul.api import delta_matmul

  rng = np.random.default_rng(0)
  g = group_k_for(k)
  x = jnp.asarray(rng.standard_normal((1, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, dtype)
  bits = jnp.asarray(rng.integers(0, 256, (packed_rows(k, g), n)), jnp.uint8)
  scale = jnp.asarray(rng.uniform(0.001, 0.01, (n,)), jnp.float32)
  bank = jnp.stack([jnp.zeros_like(bits), bits])
  scales = jnp.stack([jnp.zeros_like(scale), scale])
  one, zero = jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)

  layer = DeltaDense(k, n, use_bias=False, num_slots=2, dtype=dtype, rngs=nnx.Rngs(0))
  layer.kernel[...], layer.delta_bits[...], layer.delta_scale[...] = w, bank, scales
  graphdef, state = nnx.split(layer)
  model = jax.jit(lambda st, x, ids: nnx.merge(graphdef, st)(x[None], ids))

  gemv = jax.jit(lambda x, w: x @ w)
  api = jax.jit(lambda *a: delta_matmul(*a, group_k=g))
  named = jax.jit(lambda *a: delta_matmul(*a, group_k=g, implementation="cpu"))
  return {
    "xla_gemv": lambda: gemv(x, w),
    "api_one_variant": lambda: api(x, w, bits, scale),
    "api_bank_slot1": lambda: api(x, w, bank, scales, one),
    "api_bank_base_row": lambda: api(x, w, bank, scales, zero),
    "model_delta_dense": lambda: model(state, x, one),
    "api_cpu_named": lambda: named(x, w, bits, scale),
  }


def run(k: int, n: int, rounds: int) -> list[dict]:
  import jax.numpy as jnp

  rows = []
  for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
    t = harness.interleaved(_candidates(k, n, dtype), rounds, min_rounds=rounds)
    med = t.medians()
    row = {"weights": name, "k": k, "n": n, "rounds": rounds, "load": os.getloadavg()[0],
           **{f"{c}_us": 1e6 * s for c, s in med.items()},
           **{f"{c}_vs_xla": s / med["xla_gemv"] for c, s in med.items()}}
    rows.append(row)
    print({c: round(v, 3) for c, v in row.items() if c.endswith("_vs_xla")}, name, flush=True)
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", type=int, default=4096)
  ap.add_argument("--quick", action="store_true", help="smoke run: K=N=256, 1 round, no files")
  args = ap.parse_args()
  if args.quick:
    run(256, 256, 1)
    return
  rows = run(args.k, args.n, args.rounds)
  names = [c[:-3] for c in rows[0] if c.endswith("_us")]
  lines = [
    "# Kernel choice: the public delta_matmul at one row",
    "",
    f"One row, K={args.k}, N={args.n}, one 1-bit variant; medians of {args.rounds} interleaved "
    "rounds; ratio = time / XLA's GEMV `x @ W` (bench/kernels/kernel_choice.py).",
    "",
    machine_line({}),
    "",
    "| W | " + " | ".join(names) + " | load |",
    "|---|" + "---|" * (len(names) + 1),
  ]
  for r in rows:
    cells = [f"{r[c + '_us']:.0f} us ({r[c + '_vs_xla']:.2f}x)" for c in names]
    lines.append(f"| {r['weights']} | " + " | ".join(cells) + f" | {r['load']:.1f} |")
  md = report.write(results_dir("kernels") / "kernel_choice", {"rows": rows}, lines)
  print(md)


if __name__ == "__main__":
  main()
