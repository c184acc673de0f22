"""The CPU 1-bit delta kernel on SmolLM2-135M's real shapes: before vs after, against the base GEMM.

Per matrix of one SmolLM2 decoder layer (q 576x576, k/v 576x192, o 576x576, gate/up 576x1536,
down 1536x576; groups of 64 rows for K=576, 128 for K=1536, as `group_k_for` picks) and rows
M in {1, 8, 32, 128, 512}, f32, times
  base        jnp.dot(x, W)
  before_*    jnp.dot + the kernel at git commit --before (built from that commit's source)
  after_*     jnp.dot + the kernel in this tree (`cpu.fused_call`, default strategy choice)
  lut/expand  the kernel in this tree forced to one strategy (expand_rows = huge / 1)
with a bank of 4 slots and either every row in slot 1 (*_one) or rows spread over slots 1-3
(*_mixed). All functions of one (shape, M) run interleaved, one call each per round, medians
over the rounds, so a loaded machine moves them alike; ratios are to base. Shapes that occur
twice in a layer (q/o, k/v, gate/up) are timed once and counted twice in the layer total.

Results: bench/results/kernels/cpu_delta.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.common.machine import describe
from bench.common.paths import ROOT, results_dir
from bitdelta_jax.delta.format import group_k_for, pack
from pallas_kernels.delta_matmul import cpu
from pallas_kernels.native import build as native

RESULTS = results_dir("kernels")
LAYER = [
  ("q", 576, 576),
  ("k", 576, 192),
  ("v", 576, 192),
  ("o", 576, 576),
  ("gate", 576, 1536),
  ("up", 576, 1536),
  ("down", 1536, 576),
]
ROWS = (1, 8, 32, 128, 512)
N_SLOTS = 4
_BEFORE_TARGET = "bitdelta_delta_matmul_before"


def _build_before(commit: str) -> None:
  """Builds the kernel source of ``commit`` and registers it as `_BEFORE_TARGET`."""
  src = subprocess.run(
    ["git", "show", f"{commit}:pallas_kernels/delta_matmul/cpu_kernel.cc"],
    cwd=ROOT,
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  tmp = pathlib.Path(tempfile.mkdtemp()) / "cpu_kernel_before.cc"
  tmp.write_text(src)
  lib, reason = native.build(
    tmp,
    "delta_term_before",
    include_dirs=(jax.ffi.include_dir(),),
    key_extra=jax.__version__.encode(),
  )
  if lib is None:
    raise RuntimeError(reason)
  jax.ffi.register_ffi_target(
    _BEFORE_TARGET, jax.ffi.pycapsule(lib.BitdeltaDeltaMatmul), platform="cpu"
  )


def _before_call(x, bits, scale, slots, base, *, group_k: int):
  call = jax.ffi.ffi_call(
    _BEFORE_TARGET,
    jax.ShapeDtypeStruct(base.shape, jnp.float32),
    vmap_method="sequential",
    input_output_aliases={4: 0},
  )
  return call(x, bits, scale, slots, base, group_k=np.int64(group_k))


def _fns(g: int) -> dict:
  def with_base(kernel, **kw):
    return jax.jit(lambda x, w, b, s, sl: kernel(x, b, s, sl, jnp.dot(x, w), group_k=g, **kw))

  def after(x, w, b, s, sl):  # as `cpu.delta_matmul_cpu`, with jnp.dot as the base for few rows
    if x.shape[0] >= cpu.MERGED_MIN_ROWS:
      return cpu.merged_call(x, w, b, s, sl, group_k=g)
    return cpu.fused_call(x, b, s, sl, jnp.dot(x, w), group_k=g)

  return {
    "base": jax.jit(lambda x, w, b, s, sl: jnp.dot(x, w)),
    "before": with_base(_before_call),
    "after": jax.jit(after),
    "merged": jax.jit(lambda x, w, b, s, sl: cpu.merged_call(x, w, b, s, sl, group_k=g)),
    "lut": with_base(cpu.fused_call, expand_rows=1 << 30),
    "expand": with_base(cpu.fused_call, expand_rows=1),
  }


def _interleaved(calls: dict, rounds: int) -> dict[str, float]:
  from bench.common import harness

  return harness.interleaved(calls, rounds).medians()


def bench(rows, rounds: int) -> list[dict]:
  rng = np.random.default_rng(0)
  out = []
  for k, n in dict.fromkeys((k, n) for _, k, n in LAYER):
    g = group_k_for(k)
    packs = [
      pack(rng.standard_normal((k, n)).astype(np.float32), "column", g) for _ in range(N_SLOTS)
    ]
    bits = jnp.asarray(np.stack([p.bits for p in packs]))
    scale = jnp.asarray(np.stack([p.scale for p in packs]).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))
    fns = _fns(g)
    for m in rows:
      x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
      layouts = {
        "one": jnp.ones((m,), jnp.int32),
        "mixed": jnp.asarray(1 + np.arange(m) % 3, jnp.int32),
      }
      args = (x, w, bits, scale)
      calls = {"base": lambda f=fns["base"], a=args, sl=layouts["one"]: f(*a, sl)}
      for lay, sl in layouts.items():
        for name in ("before", "after", "merged", "lut", "expand"):
          calls[f"{name}_{lay}"] = lambda f=fns[name], a=args, sl=sl: f(*a, sl)
      t = _interleaved(calls, rounds)
      row = {
        "K": k,
        "N": n,
        "group_k": g,
        "M": m,
        "ms": {c: round(v * 1e3, 4) for c, v in t.items()},
        "ratio": {c: round(v / t["base"], 3) for c, v in t.items() if c != "base"},
      }
      print(
        f"K{k} N{n} M{m}: base {t['base'] * 1e3:.3f} ms  "
        + "  ".join(f"{c} {r:.2f}x" for c, r in row["ratio"].items()),
        flush=True,
      )
      out.append(row)
  return out


def _layer_totals(rows: list[dict]) -> list[dict]:
  by = {(r["K"], r["N"], r["M"]): r for r in rows}
  totals = []
  for m in sorted({r["M"] for r in rows}):
    ms = {}
    for _, k, n in LAYER:
      for c, v in by[(k, n, m)]["ms"].items():
        ms[c] = ms.get(c, 0.0) + v
    totals.append(
      {
        "M": m,
        "ms": {c: round(v, 4) for c, v in ms.items()},
        "ratio": {c: round(v / ms["base"], 3) for c, v in ms.items() if c != "base"},
      }
    )
  return totals


def write(rows, totals, meta, out: pathlib.Path):
  out.mkdir(parents=True, exist_ok=True)
  (out / "cpu_delta.json").write_text(
    json.dumps({"meta": meta, "rows": rows, "layer_totals": totals}, indent=1)
  )
  cols = [
    "before_one",
    "after_one",
    "merged_one",
    "lut_one",
    "expand_one",
    "before_mixed",
    "after_mixed",
    "merged_mixed",
  ]
  lines = [
    "# CPU 1-bit delta kernel on SmolLM2-135M shapes (f32)",
    "",
    f"Machine: {meta['machine'].get('cpu')}, {meta['machine'].get('cores')} cores, flags "
    f"{meta['machine'].get('cpu_flags')}, jax {meta['machine'].get('jax')}. **The machine was "
    f"loaded** (another CPU-heavy job; load average {meta['loadavg']:.1f} at the start): absolute "
    "times are noisy, ratios come from interleaved rounds (one call of each function per round, "
    f"{meta['rounds']} rounds, medians).",
    "",
    f"Ratio = (jnp.dot + delta kernel) / jnp.dot alone, so 1.00 is a free delta. *before*: the "
    f"kernel at commit {meta['before']}; *after*: what `delta_matmul_cpu` runs in this "
    "tree (jnp.dot + the delta kernel below `MERGED_MIN_ROWS` rows, else the merged kernel that "
    "does the base GEMM too); *merged*: the merged kernel at every M; *lut* / *expand*: "
    "jnp.dot + this tree's delta kernel forced to one strategy. *one*: every row in slot 1 of a 4-slot bank; *mixed*: rows spread over slots 1-3.",
    "",
    "## One decoder layer (7 matrices; q/o, k/v, gate/up share timings)",
    "",
    "| M | base ms | " + " | ".join(cols) + " |",
    "|" + "---|" * (len(cols) + 2),
  ]
  for t in totals:
    lines.append(
      f"| {t['M']} | {t['ms']['base']:.3f} | "
      + " | ".join(f"{t['ratio'][c]:.2f}" for c in cols)
      + " |"
    )
  lines += [
    "",
    "## Per shape",
    "",
    "| K x N | G | M | base ms | " + " | ".join(cols) + " |",
    "|" + "---|" * (len(cols) + 4),
  ]
  for r in rows:
    lines.append(
      f"| {r['K']}x{r['N']} | {r['group_k']} | {r['M']} | {r['ms']['base']:.3f} | "
      + " | ".join(f"{r['ratio'][c]:.2f}" for c in cols)
      + " |"
    )
  if meta.get("notes"):
    lines += ["", "## Reading", "", *meta["notes"]]
  (out / "cpu_delta.md").write_text("\n".join(lines) + "\n")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--before", default="ca5405a", help="git commit of the 'before' kernel")
  ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
  ap.add_argument("--rounds", type=int, default=21)
  ap.add_argument("--notes", type=pathlib.Path, help="a text file appended as 'Reading'")
  ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
  args = ap.parse_args()
  reason = cpu.unavailable_reason()
  if reason:
    raise SystemExit(reason)
  _build_before(args.before)
  rows = bench(args.rows, args.rounds)
  totals = _layer_totals(rows)
  for t in totals:
    print(f"layer M{t['M']}: " + "  ".join(f"{c} {r:.2f}x" for c, r in t["ratio"].items()))
  meta = {
    "machine": describe(),
    "loadavg": os.getloadavg()[0],
    "rounds": args.rounds,
    "before": args.before,
    "isa": cpu.isa(),
    "threads": os.cpu_count(),
    "notes": args.notes.read_text().splitlines() if args.notes else [],
  }
  write(rows, totals, meta, args.out)


if __name__ == "__main__":
  main()
