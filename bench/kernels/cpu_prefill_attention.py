"""CPU packed-prefill attention: the jnp reference vs the C++ kernel, one layer call each.

    python -m bench cpu_prefill_attention [--rounds 9]
        → bench/results/kernels/cpu_prefill_attention.{json,md}

One prompt chunk of 512 tokens (the engine's ``prefill_chunk``) at the end of a prompt of 512,
1024 or 2048 tokens: the chunk's queries against every page of its sequence so far, pages of 16
tokens scrambled through the pool, the reference walking 8-page blocks (`PagedEngine`'s
``128 // page_size``) as many as the host would ask for. Shapes of the 1B-shaped Llama (32 query
heads, 8 KV heads, head_dim 64) and of SmolLM2-135M (9, 3, 64); f32 and bf16 pools. Outputs are
checked against each other before timing (bf16: P is rounded after other running maxima, so to
2e-2); then interleaved rounds (`bench.common.harness`), medians and the ratio. Multiply-adds: the causal ones only (2 · H · hd per query-key pair).
"""

from __future__ import annotations

import argparse

from bench.common import harness, report
from bench.common.machine import machine_line
from bench.common.paths import results_dir

SHAPES = {"1b": (32, 8, 64), "smollm2": (9, 3, 64)}  # heads, KV heads, head_dim
PS, BP, CHUNK, LAYERS = 16, 8, 512, 2


def case(heads, kv, hd, ctx, dtype, rng):
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.paged_attention import AttentionInputs

  npg = ctx // PS
  pool = (LAYERS, npg + 3, PS, kv, hd)
  k = jnp.asarray(rng.standard_normal(pool), dtype)
  v = jnp.asarray(rng.standard_normal(pool), dtype)
  u = -(-npg // BP) * BP
  i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
  pages, seq, start, fill = (np.zeros(u, np.int32), np.full(u, -2, np.int32),
                             np.zeros(u, np.int32), np.zeros(u, np.int32))
  pages[:npg] = rng.permutation(npg + 3)[:npg]
  seq[:npg], start[:npg], fill[:npg] = 0, np.arange(npg) * PS, PS
  inputs = AttentionInputs(
    positions=i32(np.arange(ctx - CHUNK, ctx)), token_seq=i32(np.zeros(CHUNK)),
    lane_pages=i32(np.zeros((0, 1))), lane_len=i32(np.zeros(0)), pages=i32(pages),
    page_seq=i32(seq), page_start=i32(start), page_fill=i32(fill), blocks=i32([0, u // BP]),
    block_pages=BP)
  q = jnp.asarray(rng.standard_normal((CHUNK, heads, hd)), jnp.float32)
  return q, k, v, inputs


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=9)
  p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
  a = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.paged_attention import cpu, reference

  ref = jax.jit(lambda q, k, v, t: reference.packed_prefill(q, k, v, 1, t))
  ker = jax.jit(lambda q, k, v, t: cpu.packed_prefill(q, k, v, 1, t))
  rng = np.random.default_rng(0)
  rows = []
  for shape, (heads, kv, hd) in SHAPES.items():
    for dtype in (jnp.float32, jnp.bfloat16):
      for ctx in a.contexts:
        args = case(heads, kv, hd, ctx, dtype, rng)
        want, got = np.asarray(ref(*args)), np.asarray(ker(*args))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 if dtype == jnp.float32 else 2e-2)
        t = harness.interleaved({"reference": lambda x=args: ref(*x), "kernel": lambda x=args: ker(*x)},
                                a.rounds)
        mr, mk = t.median("reference"), t.median("kernel")
        macs = 2 * heads * hd * CHUNK * (ctx - CHUNK + (CHUNK + 1) / 2)
        rows.append({"shape": shape, "dtype": jnp.dtype(dtype).name, "context": ctx,
                     "reference_ms": 1e3 * mr, "kernel_ms": 1e3 * mk, "kernel_over_reference":
                     mk / mr, "kernel_gmac_s": macs / mk / 1e9})
        print(rows[-1], flush=True)
  res = {"rounds": a.rounds, "chunk": CHUNK, "page_size": PS, "block_pages": BP, "rows": rows}
  lines = [
    "# CPU packed-prefill attention: jnp reference vs C++ kernel",
    "",
    f"`python -m bench cpu_prefill_attention --rounds {a.rounds}`: one layer's prompt pass for a "
    f"{CHUNK}-token chunk ending at the context length (module docstring); medians of "
    f"{a.rounds} interleaved rounds, one jitted call each.",
    "",
    machine_line({}),
    "",
    "| shape | pools | context | reference, ms | kernel, ms | kernel / reference | kernel GMAC/s |",
    "|---|---|---|---|---|---|---|",
  ]
  lines += [f"| {r['shape']} | {r['dtype']} | {r['context']} | {r['reference_ms']:.1f} | "
            f"{r['kernel_ms']:.1f} | {r['kernel_over_reference']:.2f} | "
            f"{r['kernel_gmac_s']:.0f} |" for r in rows]
  md = report.write(results_dir("kernels") / "cpu_prefill_attention", res, lines)
  print(md.read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
