"""Benchmark of the fused 1-bit delta GEMM (`pallas_kernels.delta_matmul`) against the base GEMM.

CPU (default): one linear layer, f32, K=N in {2048, 4096}, batch M in {1, 8, 64}. All
implementations of one shape are timed interleaved (one call of each per round), medians over
the rounds, so a noisy shared machine moves base and variant alike. Variant modes:
  cpu_one     one variant for every row (bits [K/8, N])
  cpu_bank    the model's call: a bank of 9 slots, every row in slot 1
  cpu_mixed   a bank, rows spread over min(M, 8) distinct slots
  xla         the pure-XLA fallback, one variant
  naive       unpack signs to f32, then dot (the starting point: ~11x at batch 1)

GPU (``--gpu``, H100/H200, bf16): M in {1, 16, 64, 256, 4096}, K=N in {4096, 8192}:
fused / base jnp.dot, unfused (materialise W_eff, then dot) / fused, 16 variants in a batch of
16 / base, GB/s against a device-to-device copy, and a Triton port of BitDelta's
``binary_bmm`` (int32-packed signs, α applied outside) with torch, side by side. Where no GPU
is present the results say so.

``--model-step``: a whole decode step of the model, base vs one variant (hook; runs only if
``bitdelta_jax.models`` provides ``bench_decode_step``).

Results: bench/results/kernels/kernel_{cpu,gpu}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import report
from bench.common.paths import results_dir
from bitdelta_jax.delta.format import pack, unpack_signs
from pallas_kernels.delta_matmul import delta_matmul

try:
  from bench.common.machine import describe
except ImportError:  # pragma: no cover

  def describe() -> dict:
    return {"jax": jax.__version__}


RESULTS = results_dir("kernels")


def _cpu_flags() -> list[str]:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("flags"):
        return sorted({f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma"))})
  except OSError:
    pass
  return []


def _machine() -> dict:
  m = describe()
  m["cpu_flags"] = _cpu_flags()
  m["loadavg_at_start"] = os.getloadavg()
  m["threads_env"] = {k: os.environ.get(k) for k in ("BITDELTA_CPU_THREADS", "XLA_FLAGS")}
  return m


def _interleaved(fns: dict, args: dict, rounds: int, budget_s: float) -> dict[str, float]:
  """Median seconds per call, one call of every fn per round (`harness.interleaved`)."""
  from bench.common import harness

  calls = {name: (lambda f=f, a=args[name]: f(*a)) for name, f in fns.items()}
  return harness.interleaved(calls, rounds, budget_s=budget_s).medians()


def _delta_fn(implementation: str, group_k: int):
  def fn(x, w, bits, scale, slot_ids=None):
    return delta_matmul(x, w, bits, scale, slot_ids, group_k=group_k, implementation=implementation)

  return fn


def bench_cpu(sizes, batches, rounds: int, budget_s: float) -> list[dict]:
  rng = np.random.default_rng(0)
  rows = []
  for k in sizes:
    n = k
    w = jnp.asarray(rng.standard_normal((k, n), np.float32))
    pd = pack(rng.standard_normal((k, n)).astype(np.float32), "column")
    bits, scale = jnp.asarray(pd.bits), jnp.asarray(pd.scale)
    n_slots = 9
    bank = jnp.asarray(
      np.stack(
        [
          pack(rng.standard_normal((k, n)).astype(np.float32), "column").bits
          for _ in range(n_slots)
        ]
      )
    )
    bank_scale = jnp.asarray(np.abs(rng.standard_normal((n_slots, n))).astype(np.float32) * 0.01)
    g = pd.group_k
    base = jax.jit(lambda x, w: jnp.dot(x, w))
    impl = lambda name, g=g: jax.jit(_delta_fn(name, g))
    naive = jax.jit(lambda x, w, b, s, kn=(k, n), g=g: jnp.dot(x, w + s * unpack_signs(b, kn, g)))
    fns = {
      "base": base,
      "cpu_one": impl("cpu"),
      "cpu_bank": impl("cpu"),
      "cpu_mixed": impl("cpu"),
      "xla": impl("xla"),
      "naive": naive,
    }
    for m in batches:
      x = jnp.asarray(rng.standard_normal((m, k), np.float32))
      same = jnp.ones((m,), jnp.int32)
      mixed = jnp.asarray(1 + np.arange(m) % min(m, n_slots - 1), jnp.int32)
      args = {
        "base": (x, w),
        "cpu_one": (x, w, bits, scale),
        "cpu_bank": (x, w, bank, bank_scale, same),
        "cpu_mixed": (x, w, bank, bank_scale, mixed),
        "xla": (x, w, bits, scale),
        "naive": (x, w, bits, scale),
      }
      use = dict(fns)
      if m > 8:
        use.pop("naive")  # known ~2x+ and slow; keeps the run short
      t = _interleaved(use, args, rounds, budget_s)
      row = {"K": k, "N": n, "M": m, "ms": {a: 1e3 * v for a, v in t.items()}}
      row["ratio_to_base"] = {a: v / t["base"] for a, v in t.items() if a != "base"}
      rows.append(row)
      print(
        f"K=N={k} M={m}: "
        + ", ".join(f"{a} {1e3 * v:.2f}ms ({v / t['base']:.2f}x)" for a, v in t.items()),
        flush=True,
      )
  return rows


def _plot(rows, path, title, modes, key=lambda r: f"K{r['K']} M{r['M']}"):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [key(r) for r in rows]
  xs = np.arange(len(rows))
  fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
  width = 0.8 / len(modes)
  for i, mode in enumerate(modes):
    ax.bar(xs + i * width, [r["ratio_to_base"].get(mode, np.nan) for r in rows], width, label=mode)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(xs + 0.4 - width / 2, labels, rotation=30, ha="right")
  ax.set_ylabel("latency / base")
  ax.set_yscale("log")
  ax.set_title(title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_cpu(rows, machine, out: pathlib.Path):
  goals = {"M=1": 1.3, "M=8": 1.5}
  data = {"machine": machine, "dtype": "float32", "rows": rows, "goals_variant_over_base": goals}
  report.write_json(out / "kernel_cpu.json", data, indent=1)
  lines = [
    "# delta_matmul CPU benchmark (one linear layer, f32)",
    "",
    f"Machine: {machine.get('cpu')} ({machine.get('cores')} cores, "
    f"{', '.join(f for f in machine['cpu_flags'] if f.startswith('avx512'))}), "
    f"jax {machine.get('jax')}, load average at start {machine['loadavg_at_start']}.",
    "",
    "Median latency per call (ms), interleaved rounds; ratio = variant / base `jnp.dot(x, W)`. "
    "Goals: <= 1.3 at M=1, <= 1.5 at M=8.",
    "",
    "| K=N | M | base ms | cpu_one | cpu_bank | cpu_mixed | xla | naive |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    cell = lambda a, r=r: (
      f"{r['ms'][a]:.2f} ms ({r['ratio_to_base'][a]:.2f}x)" if a in r["ratio_to_base"] else "-"
    )
    lines.append(
      f"| {r['K']} | {r['M']} | {r['ms']['base']:.2f} | "
      + " | ".join(cell(a) for a in ("cpu_one", "cpu_bank", "cpu_mixed", "xla", "naive"))
      + " |"
    )
  (out / "kernel_cpu.md").write_text("\n".join(lines) + "\n")
  _plot(
    rows,
    out / "kernel_cpu.png",
    "delta_matmul on CPU: variant / base",
    ["cpu_one", "cpu_bank", "cpu_mixed", "xla", "naive"],
  )


# --- GPU -----------------------------------------------------------------------------------------


def _gpu_time(f, *args, iters: int = 50) -> float:
  """Seconds per call: `iters` chained calls in one jitted loop (no per-call dispatch)."""

  @jax.jit
  def loop(x, *rest):
    def body(_, x):
      y = f(x, *rest)
      return (y[:, : x.shape[1]] * 1e-3).astype(x.dtype)  # K == N: feed y back as x

    return jax.lax.fori_loop(0, iters, body, x)

  jax.block_until_ready(loop(*args))
  ts = []
  for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(loop(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts) / iters


def _binary_bmm_torch(m: int, k: int, n: int, iters: int = 50) -> dict:
  """BitDelta's binary_bmm, re-implemented from its description: signs packed 32 per int32
  along K, a Triton kernel unpacks them to ±1 and multiplies; α and the base GEMM are outside."""
  import torch
  import triton
  import triton.language as tl

  @triton.jit
  def binary_mm_kernel(
    x_ptr, p_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
  ):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
      xk = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
      words = tl.load(p_ptr + ((k0 + rk) // 32)[:, None] * N + rn[None, :])  # [BK, BN] int32
      bit = (words >> ((k0 + rk) % 32)[:, None]) & 1
      sgn = (bit * 2 - 1).to(tl.float16)
      acc += tl.dot(xk, sgn)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16), mask=rm[:, None] < M)

  dev = "cuda"
  x = torch.randn(m, k, device=dev, dtype=torch.float16)
  w = torch.randn(k, n, device=dev, dtype=torch.float16)
  packed = torch.randint(-(2**31), 2**31 - 1, (k // 32, n), device=dev, dtype=torch.int32)
  alpha = torch.rand(n, device=dev, dtype=torch.float16)
  y = torch.empty(m, n, device=dev, dtype=torch.float16)
  bm = 16 if m <= 16 else 64
  grid = (triton.cdiv(m, bm), triton.cdiv(n, 64))

  def variant():
    binary_mm_kernel[grid](x, packed, y, m, n, k, BM=bm, BN=64, BK=64)
    return x @ w + alpha * y  # α and the base product outside the kernel, as in BitDelta

  from triton.testing import do_bench

  return {
    "binary_bmm_plus_base_ms": do_bench(variant, rep=iters),
    "torch_base_ms": do_bench(lambda: x @ w, rep=iters),
  }


def bench_gpu(interpret: bool = False, quick: bool = False) -> dict:
  if not interpret and jax.default_backend() not in ("gpu", "cuda"):
    return {
      "available": False,
      "note": f"no GPU available (jax backend {jax.default_backend()!r}); "
      "the GPU part was not run. Re-run `python -m bench delta_matmul --gpu` on an H100/H200.",
    }
  sizes = (256,) if quick else (4096, 8192)
  batches = (1, 16) if quick else (1, 16, 64, 256, 4096)
  dt = jnp.float32 if interpret else jnp.bfloat16
  impl = dict(implementation="pallas_triton", interpret=interpret)
  rng = np.random.default_rng(0)
  rows = []
  big = jnp.zeros((256 if quick else 512) * 2**20 // 2, jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.ones((), a.dtype))  # read + write once
  jax.block_until_ready(copy(big))
  t0 = time.perf_counter()
  for _ in range(10):
    jax.block_until_ready(copy(big))
  copy_gbs = 2 * big.nbytes / ((time.perf_counter() - t0) / 10) / 1e9
  for k in sizes:
    n = k
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, dt)
    bits = jnp.asarray(rng.integers(0, 256, (k // 8, n), np.uint8))
    scale = jnp.full((n,), 1e-3, jnp.float32)
    bank = jnp.asarray(rng.integers(0, 256, (17, k // 8, n), np.uint8))
    bank_scale = jnp.full((17, n), 1e-3, jnp.float32)
    for m in batches:
      x = jnp.asarray(rng.standard_normal((m, k)), dt)
      row = {"K": k, "N": n, "M": m}
      t_base = _gpu_time(lambda x, w: jnp.dot(x, w), x, w)
      t_fused = _gpu_time(lambda x, w, b, s: delta_matmul(x, w, b, s, **impl), x, w, bits, scale)
      t_unfused = _gpu_time(
        lambda x, w, b, s, kn=(k, n): jnp.dot(
          x, (w + s * unpack_signs(b, kn, 128)).astype(x.dtype)
        ),
        x,
        w,
        bits,
        scale,
      )
      row["ms"] = {"base": 1e3 * t_base, "fused": 1e3 * t_fused, "unfused": 1e3 * t_unfused}
      row["ratio_to_base"] = {"fused": t_fused / t_base, "unfused": t_unfused / t_base}
      row["unfused_over_fused"] = t_unfused / t_fused
      nbytes = k * n * jnp.dtype(dt).itemsize + k * n // 8 + 2 * m * k * jnp.dtype(dt).itemsize
      row["fused_GBps"] = nbytes / t_fused / 1e9
      row["base_GBps"] = (nbytes - k * n // 8) / t_base / 1e9
      if m == 16:
        slots = jnp.arange(1, 17, dtype=jnp.int32)
        t_mixed = _gpu_time(
          lambda x, w, b, s, sl: delta_matmul(x, w, b, s, sl, **impl), x, w, bank, bank_scale, slots
        )
        row["ms"]["mixed16"] = 1e3 * t_mixed
        row["ratio_to_base"]["mixed16"] = t_mixed / t_base
      if not interpret:
        try:
          row["bitdelta_binary_bmm"] = _binary_bmm_torch(m, k, n)
        except Exception as e:  # noqa: BLE001 - torch/triton may be missing; record why
          row["bitdelta_binary_bmm"] = {"error": f"{type(e).__name__}: {e}"[:300]}
      rows.append(row)
      print(json.dumps(row), flush=True)
  return {
    "available": True,
    "interpret": interpret,
    "dtype": jnp.dtype(dt).name,
    "copy_GBps": copy_gbs,
    "rows": rows,
  }


def write_gpu(res: dict, machine: dict, out: pathlib.Path):
  data = {"machine": machine, **res}
  report.write_json(out / "kernel_gpu.json", data, indent=1)
  lines = ["# delta_matmul GPU benchmark", ""]
  if not res["available"]:
    lines.append(res["note"])
  else:
    lines += [
      f"Device: {machine.get('devices')}, dtype {res['dtype']}, interpret={res['interpret']}, "
      f"device-to-device copy {res['copy_GBps']:.0f} GB/s.",
      "",
      "Goals: fused/base <= 1.10 for M <= 16 (bound 1.0625); unfused/fused >= 2; "
      "16 variants in batch 16 / base <= 2.2 (bound 2.0).",
      "",
      "| K=N | M | base ms | fused/base | unfused/fused | mixed16/base | fused GB/s | "
      "BitDelta binary_bmm+base / fused |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
      bb = r.get("bitdelta_binary_bmm", {})
      bbr = (
        f"{bb['binary_bmm_plus_base_ms'] / r['ms']['fused']:.2f}"
        if "binary_bmm_plus_base_ms" in bb
        else bb.get("error", "-")[:40]
      )
      mixed = r["ratio_to_base"].get("mixed16")
      lines.append(
        f"| {r['K']} | {r['M']} | {r['ms']['base']:.3f} | {r['ratio_to_base']['fused']:.2f} | "
        f"{r['unfused_over_fused']:.2f} | {'-' if mixed is None else f'{mixed:.2f}'} | "
        f"{r['fused_GBps']:.0f} | {bbr} |"
      )
    _plot(
      res["rows"],
      out / "kernel_gpu.png",
      "delta_matmul on GPU: latency / base",
      ["fused", "unfused", "mixed16"],
    )
  (out / "kernel_gpu.md").write_text("\n".join(lines) + "\n")


def bench_model_step(out: pathlib.Path) -> dict:
  """Hook: whole decode step, base vs variant, once the model exposes `bench_decode_step`."""
  try:
    from bitdelta_jax.models import bench_decode_step  # type: ignore[attr-defined]
  except ImportError:
    res = {
      "available": False,
      "note": "bitdelta_jax.models.bench_decode_step is not provided yet; not measured",
    }
  else:
    res = {"available": True, **bench_decode_step()}
  report.write_json(out / "kernel_model_step.json", res, indent=1)
  return res


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gpu", action="store_true", help="run the GPU part (skips the CPU part)")
  ap.add_argument(
    "--gpu-dry-run",
    action="store_true",
    help="the GPU part's JAX code at tiny shapes in interpret mode (CPU check)",
  )
  ap.add_argument("--model-step", action="store_true", help="also time a whole decode step")
  ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--rounds", type=int, default=25)
  ap.add_argument("--budget-s", type=float, default=20.0, help="max timing seconds per shape")
  ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
  args = ap.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  machine = _machine()
  if args.gpu or args.gpu_dry_run:
    res = bench_gpu(interpret=args.gpu_dry_run, quick=args.gpu_dry_run)
    if args.gpu_dry_run:
      print(json.dumps(res, indent=1)[:2000])
    else:
      write_gpu(res, machine, args.out)
  else:
    write_cpu(bench_cpu(args.sizes, args.batches, args.rounds, args.budget_s), machine, args.out)
    if jax.default_backend() not in ("gpu", "cuda"):
      write_gpu(bench_gpu(), machine, args.out)  # records that no GPU was available
  if args.model_step:
    print(bench_model_step(args.out))


if __name__ == "__main__":
  main()
