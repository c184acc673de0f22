"""CPU small-M matmul kernel vs XLA's dot on SmolLM2-135M's layer shapes (one process, interleaved).

    python -m bench small_matmul    → bench/results/kernels/small_matmul_cpu.{json,md}

For M = 1..32 rows: the median time of the 7 linear layers of one decoder layer (q, k, v, o,
gate, up, down; f32, [in, out] kernels) through `jnp.dot` and through
`pallas_kernels.small_matmul`, and their ratio. `DeltaDense` uses the kernel for 2-16 rows.
"""

from __future__ import annotations

import sys
import time

from bench.common import report
from bench.common.paths import results_dir

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bench.common.machine import describe
  from pallas_kernels.small_matmul.cpu import small_matmul

  rng = np.random.default_rng(0)
  ws = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in SHAPES]
  xla = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])
  ker = jax.jit(lambda xs, ws: [small_matmul(x, w) for x, w in zip(xs, ws)])
  rows = []
  for m in (1, 2, 4, 8, 16, 32):
    xs = [jnp.asarray(rng.normal(size=(m, s[0])), jnp.float32) for s in SHAPES]
    jax.block_until_ready(xla(xs, ws))
    jax.block_until_ready(ker(xs, ws))
    a, b = [], []
    for _ in range(50):
      t = time.perf_counter()
      jax.block_until_ready(xla(xs, ws))
      a.append(time.perf_counter() - t)
      t = time.perf_counter()
      jax.block_until_ready(ker(xs, ws))
      b.append(time.perf_counter() - t)
    ta, tb = float(np.median(a)), float(np.median(b))
    rows.append({"rows": m, "xla_ms": 1e3 * ta, "kernel_ms": 1e3 * tb, "kernel_over_xla": tb / ta})
  out = results_dir("kernels") / "small_matmul_cpu"
  res = {"machine": describe(), "shapes": SHAPES, "rows": rows}
  report.write_json(out.with_suffix(".json"), res, indent=1)
  m = res["machine"]
  lines = ["# CPU small-M matmul kernel vs XLA dot (one SmolLM2-135M decoder layer, f32)", "",
           f"`python -m bench small_matmul`; {m['cpu']}, {m['cores']} cores, jax "
           f"{m.get('jax')}. Median of 50 interleaved runs of the 7 linear layers.", "",
           "| rows | XLA dot, ms | kernel, ms | kernel / XLA |", "|---|---|---|---|"]
  lines += [f"| {r['rows']} | {r['xla_ms']:.3f} | {r['kernel_ms']:.3f} | {r['kernel_over_xla']:.2f} |"
            for r in rows]
  lines += ["", "`DeltaDense` takes the kernel for 2-16 rows (`MIN_ROWS`, `MAX_ROWS` in "
            "`pallas_kernels/small_matmul/cpu.py`), XLA's dot elsewhere."]
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
