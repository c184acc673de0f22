"""The tied LM head on CPU in f32: XLA's ``h · Eᵀ`` vs the f32 NT kernel (SmolLM2-135M).

    python -m bench cpu_head [--rounds 30] [--model-rounds 20] [--no-model]
        → bench/results/kernels/cpu_head.{json,md}

Part 1, the head alone on SmolLM2's shape (E [49152, 576] f32, 113 MB): for 1..32 rows, XLA's
f32 einsum (what `_head_matmul` ran before) and `pallas_kernels.small_matmul.cpu.small_matmul_nt`,
interleaved round by round (the order rotating); medians, the median of the per-round ratios,
GB/s = bytes of E / median time, and the process CPU time per call (all threads). Part 2, one forward of the real SmolLM2-135M-Instruct
(`bitdelta_jax.zoo.real_base.import_real_base()`, f32, one token, no cache) traced with the
kernel and with ``BITDELTA_CPU_HEAD=0`` (XLA's einsum), interleaved the same way.
The machine is shared: the load average is recorded, and only ratios within a round compare.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from bench.common import report
from bench.common.paths import results_dir

VOCAB, DIM = 49152, 576
ROWS = (1, 2, 4, 8, 16, 32)


def _interleaved(fns: dict, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
  """(wall, process CPU) seconds of each ``fn()`` per round (`harness.interleaved`). CPU time
  (all threads) is what a loaded machine makes scarce; on a quiet one the kernel's wall time
  approaches its CPU time over the threads it keeps busy."""
  from bench.common import harness

  t = harness.interleaved(fns, rounds)
  return t.wall, t.cpu


def head_bench(rounds: int) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.small_matmul import cpu

  rng = np.random.default_rng(0)
  e = jnp.asarray((0.05 * rng.standard_normal((VOCAB, DIM))).astype(np.float32))
  xla = jax.jit(lambda h, e: jnp.einsum("md,vd->mv", h, e, preferred_element_type=jnp.float32))
  kernel = jax.jit(cpu.small_matmul_nt)
  hs = {m: jnp.asarray(rng.standard_normal((m, DIM)).astype(np.float32)) for m in ROWS}
  for h in hs.values():  # the kernel is checked before it is timed
    np.testing.assert_allclose(np.asarray(kernel(h, e)), np.asarray(xla(h, e)), rtol=1e-4,
                               atol=1e-4)
  fns = {}
  for m, h in hs.items():
    fns[f"xla_{m}"] = lambda h=h: xla(h, e)
    fns[f"kernel_{m}"] = lambda h=h: kernel(h, e)
  load = os.getloadavg()[0]
  times, cpu_times = _interleaved(fns, rounds)
  out = []
  for m in ROWS:
    tx, tk = np.asarray(times[f"xla_{m}"]), np.asarray(times[f"kernel_{m}"])
    row = {
      "xla_cpu_ms": 1e3 * float(np.median(cpu_times[f"xla_{m}"])),
      "kernel_cpu_ms": 1e3 * float(np.median(cpu_times[f"kernel_{m}"])),
      "rows": m,
      "load": load,
      "xla_ms": 1e3 * float(np.median(tx)),
      "kernel_ms": 1e3 * float(np.median(tk)),
      "xla_min_ms": 1e3 * float(tx.min()),
      "kernel_min_ms": 1e3 * float(tk.min()),
      "kernel_over_xla": float(np.median(tk / tx)),  # median of the per-round ratios
    }
    for n in ("xla", "kernel"):
      row[n + "_gbps"] = VOCAB * DIM * 4 / (row[n + "_ms"] * 1e-3) / 1e9
    out.append(row)
    print(json.dumps(row), flush=True)
  return out


def model_bench(rounds: int) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.zoo.real_base import import_real_base

  model = from_pretrained(import_real_base(), jnp.float32)
  assert model.config.tie_word_embeddings
  graphdef, state = nnx.split(model)
  ids = jnp.asarray([[42]], jnp.int32)

  def program(env: str | None):
    # the dispatch is decided when tracing: trace (and compile) under the switch
    old = os.environ.pop("BITDELTA_CPU_HEAD", None)
    if env is not None:
      os.environ["BITDELTA_CPU_HEAD"] = env
    try:
      f = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
      hlo = f.lower(state, ids).as_text()
      compiled = f.lower(state, ids).compile()
    finally:
      os.environ.pop("BITDELTA_CPU_HEAD", None)
      if old is not None:
        os.environ["BITDELTA_CPU_HEAD"] = old
    return compiled, "@bitdelta_small_matmul_nt(" in hlo

  from pallas_kernels.small_matmul import cpu

  routed_min = cpu.NT_MIN_ROWS
  cpu.NT_MIN_ROWS = 1  # one row is not routed to the kernel by default: force it to compare
  try:
    with_kernel, uses = program(None)
  finally:
    cpu.NT_MIN_ROWS = routed_min
  without, uses_off = program("0")
  assert uses and not uses_off, (uses, uses_off)
  a, b = np.asarray(with_kernel(state, ids)), np.asarray(without(state, ids))
  diff = float(np.abs(a - b).max())
  load = os.getloadavg()[0]
  times, cpu_times = _interleaved({"kernel": lambda: with_kernel(state, ids),
                                   "xla": lambda: without(state, ids)}, rounds)
  tk, tx = np.asarray(times["kernel"]), np.asarray(times["xla"])
  row = {
    "kernel_cpu_ms": 1e3 * float(np.median(cpu_times["kernel"])),
    "xla_cpu_ms": 1e3 * float(np.median(cpu_times["xla"])),
    "rows": 1,
    "load": load,
    "kernel_ms": 1e3 * float(np.median(tk)),
    "xla_ms": 1e3 * float(np.median(tx)),
    "kernel_min_ms": 1e3 * float(tk.min()),
    "xla_min_ms": 1e3 * float(tx.min()),
    "kernel_over_xla": float(np.median(tk / tx)),
    "max_abs_logit_diff": diff,
    "max_abs_logit": float(np.abs(b).max()),
  }
  print(json.dumps(row), flush=True)
  return row


def write_md(res: dict, path: pathlib.Path) -> None:
  m = res["machine"]
  lines = [
    "# The tied LM head on CPU in f32: XLA vs the f32 NT kernel (SmolLM2-135M)",
    "",
    f"`python -m bench cpu_head`; {m['cpu']} ({', '.join(m.get('cpu_flags', []))}), "
    f"{m['cores']} cores, jax {m.get('jax')}. Shared machine: load average "
    f"{res['load_before']:.1f} before, {res['load_after']:.1f} after ({m['cores']} cores), so "
    "absolute times are noisy; the ratios are medians of per-round ratios from the same "
    "interleaved rounds.",
    "",
    f"## The head alone, E [{VOCAB}, {DIM}] f32 = {VOCAB * DIM * 4 / 1e6:.0f} MB "
    f"(median of {res['rounds']} interleaved rounds)",
    "",
    "| rows | XLA f32 ms (GB/s) | kernel ms (GB/s) | kernel / XLA | XLA CPU ms | kernel CPU ms "
    "| routed to the kernel |",
    "|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in res["head"]:
    lines.append(
      f"| {r['rows']} | {r['xla_ms']:.2f} ({r['xla_gbps']:.1f}) | {r['kernel_ms']:.2f} "
      f"({r['kernel_gbps']:.1f}) | {r['kernel_over_xla']:.2f} | {r['xla_cpu_ms']:.2f} | "
      f"{r['kernel_cpu_ms']:.2f} | {'yes' if res.get('nt_min_rows', 1) <= r['rows'] <= res['nt_max_rows'] else 'no'} |"
    )
  if res.get("model"):
    r = res["model"]
    lines += [
      "",
      "## One-row forward of the real SmolLM2-135M-Instruct, f32 (one token, no cache; median "
      f"of {res['model_rounds']} interleaved rounds)",
      "",
      "| head | ms | min ms | CPU ms (all threads) |",
      "|---|---:|---:|---:|",
      f"| XLA (`BITDELTA_CPU_HEAD=0`) | {r['xla_ms']:.1f} | {r['xla_min_ms']:.1f} | "
      f"{r['xla_cpu_ms']:.1f} |",
      f"| f32 NT kernel | {r['kernel_ms']:.1f} | {r['kernel_min_ms']:.1f} | "
      f"{r['kernel_cpu_ms']:.1f} |",
      "",
      f"Kernel / XLA: {r['kernel_over_xla']:.2f} (median of per-round ratios); max |Δlogit| "
      f"{r['max_abs_logit_diff']:.1e} (logits up to {r['max_abs_logit']:.1f}).",
    ]
  if res.get("notes"):
    lines += ["", "## Reading", "", *res["notes"]]
  path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--model-rounds", type=int, default=20)
  p.add_argument("--no-model", action="store_true")
  p.add_argument("--notes", type=pathlib.Path, help="markdown lines appended as the reading")
  args = p.parse_args(argv)
  import jax

  from bench.common.machine import describe
  from pallas_kernels.small_matmul import cpu

  if reason := cpu._load():
    print(reason)
    return 1
  res = {"machine": {**describe(), "jax": jax.__version__}, "rounds": args.rounds,
         "model_rounds": args.model_rounds, "nt_min_rows": cpu.NT_MIN_ROWS,
         "nt_max_rows": cpu.NT_MAX_ROWS,
         "load_before": os.getloadavg()[0]}
  res["head"] = head_bench(args.rounds)
  if not args.no_model:
    res["model"] = model_bench(args.model_rounds)
  res["load_after"] = os.getloadavg()[0]
  if args.notes:
    res["notes"] = args.notes.read_text().splitlines()
  out = results_dir("kernels") / "cpu_head"
  report.write_json(out.with_suffix(".json"), res, indent=1)
  write_md(res, out.with_suffix(".md"))
  print(out.with_suffix(".md").read_text())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
