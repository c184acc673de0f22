"""Bit-plane group size fitted to K (64 rows for SmolLM2's K = 576) against the old fixed 128
(K padded to 640): bytes per variant and the CPU delta kernel's time, one process, interleaved.

    python -m bench group_size   → bench/results/kernels/group_size.{json,md}

Shapes: the 7 linear layers of one SmolLM2-135M decoder layer (f32 [in, out] kernels), a bank
of 4 slots with a per-column α, rows in slots 1-3 (slot 0, the base, is skipped by the kernel),
M = 1, 8 and 64 rows. Both group sizes go through the same kernel (`delta_matmul`'s ``cpu``
implementation); the 128 form is called with the bits packed to 640 rows, as deltas written
before the fitted group sizes were. The outputs are checked equal to each other and to the
float64 formula before timing.
"""

from __future__ import annotations

import time

from bench.common import report
from bench.common.paths import results_dir

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
SLOTS = 4
ROUNDS = 60


def main() -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from bench.common.machine import describe
  from bitdelta_jax.delta.format import _pack_bits, group_k_for
  from pallas_kernels.delta_matmul import api

  rng = np.random.default_rng(0)
  layers = []
  for k, n in SHAPES:
    w = rng.normal(size=(k, n)).astype(np.float32) / np.sqrt(k)
    delta = rng.normal(size=(SLOTS, k, n)).astype(np.float32)
    scale = np.abs(rng.normal(size=(SLOTS, n))).astype(np.float32) * 1e-2
    forms = {}
    for g in (group_k_for(k, 128), 128):
      bits = np.stack([_pack_bits(d >= 0, k, g, np) for d in delta])
      forms[g] = jnp.asarray(bits)
    layers.append((jnp.asarray(w), forms, jnp.asarray(scale), delta))

  def run_all(xs, slots, g_of):
    return [api._run("cpu", x, w, forms[g_of(w.shape[0])], s, slots, g=g_of(w.shape[0]),
                     interpret=False, config=None)
            for x, (w, forms, s, _) in zip(xs, layers)]

  fitted = jax.jit(lambda xs, slots: run_all(xs, slots, lambda k: group_k_for(k, 128)))
  fixed = jax.jit(lambda xs, slots: run_all(xs, slots, lambda k: 128))
  rows = []
  for m in (1, 8, 64):
    xs = [jnp.asarray(rng.normal(size=(m, k)), jnp.float32) for k, _ in SHAPES]
    slots = jnp.asarray(1 + np.arange(m) % (SLOTS - 1), jnp.int32)
    a, b = jax.block_until_ready(fitted(xs, slots)), jax.block_until_ready(fixed(xs, slots))
    for x, (w, _, s, d), ya, yb in zip(xs, layers, a, b):
      sign = np.where(d >= 0, 1.0, -1.0)
      sl = np.asarray(slots)
      want = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)
              + np.asarray(s, np.float64)[sl] * np.einsum("mk,mkn->mn", np.asarray(x, np.float64),
                                                          sign[sl]))
      np.testing.assert_allclose(np.asarray(ya), want, rtol=1e-4, atol=1e-4)
      np.testing.assert_allclose(np.asarray(yb), want, rtol=1e-4, atol=1e-4)
    ta, tb = [], []
    for _ in range(ROUNDS):
      t = time.perf_counter()
      jax.block_until_ready(fitted(xs, slots))
      ta.append(time.perf_counter() - t)
      t = time.perf_counter()
      jax.block_until_ready(fixed(xs, slots))
      tb.append(time.perf_counter() - t)
    rows.append({"rows": m, "fitted_ms": 1e3 * float(np.median(ta)),
                 "fixed128_ms": 1e3 * float(np.median(tb)),
                 "fitted_over_fixed": float(np.median(ta) / np.median(tb))})
  size = {"fitted": sum(int(forms[group_k_for(w.shape[0], 128)].nbytes) // SLOTS
                        for w, forms, _, _ in layers),
          "fixed128": sum(int(forms[128].nbytes) // SLOTS for _, forms, _, _ in layers)}
  res = {"machine": describe(), "shapes": SHAPES, "slots": SLOTS, "rounds": ROUNDS,
         "bits_bytes_per_variant_layer": size, "rows": rows}
  out = results_dir("kernels") / "group_size"
  report.write_json(out.with_suffix(".json"), res, indent=1)
  mc = res["machine"]
  lines = [
    "# Bit-plane groups fitted to K vs fixed 128-row groups (SmolLM2-135M shapes, CPU kernel)", "",
    f"`python -m bench group_size`; {mc['cpu']}, {mc['cores']} cores, jax {mc.get('jax')}. "
    f"One decoder layer's 7 linear layers, a bank of {SLOTS} slots with per-column α, rows in "
    f"slots 1-3; median of {ROUNDS} interleaved rounds. Fitted: 64-row groups for K = 576 (no "
    "padding), 128 for K = 1536; fixed: 128-row groups, K = 576 padded to 640 (deltas written "
    "before the fitted sizes).", "",
    f"Sign bits per variant per decoder layer: fitted {size['fitted'] / 1024:.1f} KiB, fixed "
    f"{size['fixed128'] / 1024:.1f} KiB ({size['fitted'] / size['fixed128']:.3f}x).", "",
    "| rows | fitted, ms | fixed 128, ms | fitted / fixed |", "|---|---|---|---|",
  ]
  lines += [f"| {r['rows']} | {r['fitted_ms']:.3f} | {r['fixed128_ms']:.3f} | "
            f"{r['fitted_over_fixed']:.2f} |" for r in rows]
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
