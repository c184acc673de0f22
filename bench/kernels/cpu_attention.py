"""CPU decode-lane attention: the jnp reference vs the C++ kernel, one layer call each.

    python -m bench cpu_attention    → bench/results/kernels/cpu_attention.{json,md}

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), the engine's page
size (16) and block (8 pages: `PagedEngine`'s ``128 // page_size``), pages scrambled through
the pool; 1 and 8 lanes, every lane at the context length (128, 512, 2048 tokens); f32 and bf16
pools. Each round times `reference.decode_lanes` (blocks from the lengths, as the host sets
them) and `cpu.decode_lanes`, interleaved; medians over the rounds. Outputs are checked
against each other before timing.
"""

from __future__ import annotations

import sys
import time

from bench.common import report
from bench.common.paths import results_dir

HEADS, KV, HD, PS, BP, LAYERS = 9, 3, 64, 16, 8, 2
ROUNDS = 40


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bench.common.machine import describe
  from pallas_kernels.paged_attention import cpu, reference

  rng = np.random.default_rng(0)
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    for lanes in (1, 8):
      for ctx in (128, 512, 2048):
        per = ctx // PS
        num_pages = lanes * per + 1
        k = jnp.asarray(rng.standard_normal((LAYERS, num_pages, PS, KV, HD)), dtype)
        v = jnp.asarray(rng.standard_normal((LAYERS, num_pages, PS, KV, HD)), dtype)
        pages = jnp.asarray(
          rng.permutation(num_pages)[: lanes * per].reshape(lanes, per), jnp.int32
        )
        lens = jnp.full((lanes,), ctx, jnp.int32)
        q = jnp.asarray(rng.standard_normal((lanes, HEADS, HD)), dtype)
        blocks = jnp.asarray([-(-ctx // (BP * PS)), 0], jnp.int32)
        layer = jnp.int32(1)
        ref = jax.jit(
          lambda q, k, v, i, pg, n, b: reference.decode_lanes(
            q, k, v, i, lane_pages=pg, lane_len=n, blocks=b, block_pages=BP
          )
        )
        ker = jax.jit(
          lambda q, k, v, i, pg, n: cpu.decode_lanes(q, k, v, i, lane_pages=pg, lane_len=n)
        )
        a = np.asarray(ref(q, k, v, layer, pages, lens, blocks), np.float32)
        b = np.asarray(ker(q, k, v, layer, pages, lens), np.float32)
        tol = 2e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
        ta, tb = [], []
        for _ in range(ROUNDS):
          t = time.perf_counter()
          jax.block_until_ready(ref(q, k, v, layer, pages, lens, blocks))
          ta.append(time.perf_counter() - t)
          t = time.perf_counter()
          jax.block_until_ready(ker(q, k, v, layer, pages, lens))
          tb.append(time.perf_counter() - t)
        ma, mb = float(np.median(ta)), float(np.median(tb))
        rows.append(
          {
            "dtype": jnp.dtype(dtype).name,
            "lanes": lanes,
            "context": ctx,
            "reference_us": 1e6 * ma,
            "kernel_us": 1e6 * mb,
            "reference_over_kernel": ma / mb,
          }
        )
        print(rows[-1], flush=True)
  m = describe()
  res = {
    "machine": m,
    "loaded": True,
    "rounds": ROUNDS,
    "shapes": {"heads": HEADS, "kv_heads": KV, "head_dim": HD, "page_size": PS, "block_pages": BP},
    "rows": rows,
  }
  out = results_dir("kernels") / "cpu_attention"
  report.write_json(out.with_suffix(".json"), res, indent=1)
  lines = [
    "# CPU decode-lane attention: jnp reference vs C++ kernel (SmolLM2-135M shapes)",
    "",
    f"`python -m bench cpu_attention`; {m['cpu']} ({', '.join(m.get('cpu_flags', []))}), "
    f"{m['cores']} cores, jax {m.get('jax')}. The machine was loaded: other jobs (tests, other "
    "benches) ran at the same time, so absolute times are noisy; rounds are interleaved so both "
    "sides see the same load.",
    "",
    f"One layer's decode pass: 9 query heads, 3 KV heads, head_dim 64, page size {PS}, "
    f"{BP}-page blocks for the reference, pages scrambled; every lane at the context length. "
    f"Median of {ROUNDS} interleaved rounds (one jitted call each, dispatch included).",
    "",
    "| pools | lanes | context | reference, µs | kernel, µs | reference / kernel |",
    "|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {r['dtype']} | {r['lanes']} | {r['context']} | {r['reference_us']:.0f} | "
    f"{r['kernel_us']:.0f} | {r['reference_over_kernel']:.2f} |"
    for r in rows
  ]
  lines += [
    "",
    "`api.ragged_paged_attention` with ``implementation=None`` on the CPU takes the "
    "kernel for the decode lanes (the packed-prefill pass stays the reference's).",
  ]
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
