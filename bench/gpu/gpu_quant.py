"""The GPU check's quantized-base stage: the Mosaic GPU kernels over ggml blocks
(`pallas_kernels.quant_matmul.mosaic_gpu`) on the GPU, numerics and speed.

Run by ``bench/gpu_check.sh`` after ``gpu_check.py`` (self-contained: its own budget, one JSON
entry ``"quant"`` in ``kernel_gpu.json``, one line appended to ``summary.txt``; the output
folder keeps to the 8 files the device tool brings back):

1. **lowering** (``--dry-run`` only): every kernel (Q8_0 / Q4_0 / Q4_1; plain, one variant, a
   bank) lowered for CUDA at the bench's shapes with the real Mosaic GPU lowering.
2. **numerics**: each format at K x N = 576 x 1536, 1536 x 576 and 4096 x 4096 (dry: 256 x 128),
   M = 8 over a bank of 3 slots (rows of slots 0..2; slot 0 holds bits that must not be read)
   and M = 1 with one variant, against float64 numpy of ``x · round_bf16(dequant(W)) + α ⊙
   (x · S)`` (the kernel's definition). Pass: max error ≤ 1e-5 · Σ_k |x|(|W| + |α|) (what an
   f32 sum allows; a wrong nibble, scale or slot is off by O(1)).
3. **bench**: 4096 x 4096 (dry: 256 x 128), M in 1 / 8 / 512 (decode rows and a prefill chunk;
   dry: 1 / 64, Q4_1 only): per format the kernel's plain product and a batch mixed over 3 variants,
   against XLA's bf16 GEMM on the dequantized weights already in HBM (``jnp.dot(x, W_bf16)``,
   f32 sums: what a bf16 checkpoint runs) and the reference path (the blocks dequantized by XLA
   every call, then that GEMM). Each timed call is a jitted ``fori_loop`` of chained calls,
   contenders interleaved per round, medians; GB/s = bytes read (blocks or bf16 W, + bits) /
   time.

``--dry-run``: CPU, the Mosaic GPU interpreter, tiny shapes, one round. Exit 0 only if every
part that ran passed (the bench fails only on errors).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import report

FORMATS = ("q8_0", "q4_0", "q4_1")
F32_REL = 1e-5


def log(msg: str) -> None:
  print(f"[gpu_quant {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _case(k, n, fmt, rng, slots=3):
  from bitdelta_jax.delta.format import pack
  from pallas_kernels.bits import group_k_for
  from pallas_kernels.quant_matmul import blocks

  w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
  qk = blocks.quantize(w, fmt)
  g = group_k_for(k, 128)
  packs = [pack((rng.standard_normal((k, n)) * 0.01).astype(np.float32), "column", g)
           for _ in range(slots)]
  bits = np.stack([p.bits for p in packs])
  scale = np.stack([np.broadcast_to(p.scale, (n,)) for p in packs]).astype(np.float32)
  scale[0] = 1e3  # slot 0: base only, never read
  return qk, g, bits, scale


def _exact(x, qk, g, bits, scale, slots):
  """float64 ``x · round_bf16(W) + α ⊙ (x·S)`` and the f32 error scale, per row's slot."""
  from bitdelta_jax.delta.format import unpack_signs
  from pallas_kernels.quant_matmul import blocks

  k, n = qk.shape
  w = np.asarray(jnp.asarray(blocks.dequantize(qk), jnp.bfloat16), np.float64)
  x64 = np.asarray(x, np.float64)
  y, mag = x64 @ w, np.abs(x64) @ np.abs(w)
  for i, s in enumerate(slots):
    if s > 0:
      a = scale[s].astype(np.float64)
      y[i] += a * (x64[i] @ unpack_signs(bits[s], (k, n), g, np.float64))
      mag[i] += np.abs(a) * np.abs(x64[i]).sum()
  return y, mag


def _fn(g, interpret):
  from pallas_kernels.quant_matmul import mosaic_gpu as qmg

  def f(x, qk, *rest):
    return qmg.quant_matmul_mosaic(x, qk, *rest, group_k=g, interpret=interpret)

  return f


def numerics(shapes, dry, rng) -> tuple[bool, list]:
  rows, ok = [], True
  for fmt in FORMATS:
    for k, n in shapes:
      qk, g, bits, scale = _case(k, n, fmt, rng)
      qj = jax.tree.map(jnp.asarray, qk)
      for m, mode in ((8, "bank"), (1, "single")):
        x = np.asarray(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), np.float32)
        slots = np.arange(m) % 3 if mode == "bank" else np.ones(m, int)
        args = [jnp.asarray(x, jnp.bfloat16), qj]
        if mode == "bank":
          args += [jnp.asarray(bits), jnp.asarray(scale), jnp.asarray(slots, jnp.int32)]
        else:
          args += [jnp.asarray(bits[1]), jnp.asarray(scale[1])]
        row = {"format": fmt, "k": k, "n": n, "m": m, "mode": mode}
        try:
          got = np.asarray(jax.jit(_fn(g, dry))(*args), np.float64)
          want, mag = _exact(x, qk, g, bits, scale, slots)
          err = np.abs(got - want)
          row.update(max_err=float(err.max()), max_rel=float((err / mag).max()),
                     ok=bool(np.all(err <= F32_REL * mag)))
        except Exception as e:  # noqa: BLE001
          row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        ok &= row["ok"]
        log(f"numerics {row}")
        rows.append(row)
  return ok, rows


def _loop(f, k, n, iters):
  from bench.gpu.gpu_check import (
    _chain_loop,  # bench/: the chained-call loop of the delta kernel bench
  )

  return jax.jit(_chain_loop(f, k, n, iters))


def _dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _dequantized_dot(x, qk):
  from pallas_kernels.quant_matmul import dequantize_jnp

  return _dot(x, dequantize_jnp(qk).astype(jnp.bfloat16))


def bench(k, n, ms, rounds, iters, dry, rng) -> list:
  from pallas_kernels.quant_matmul import dequantize_jnp

  out = []
  for fmt in FORMATS[2:] if dry else FORMATS:  # dry: the code path once (Q4_1: every field)
    qk, g, bits, scale = _case(k, n, fmt, rng)
    qj = jax.tree.map(jnp.asarray, qk)
    w_bf16 = dequantize_jnp(qj).astype(jnp.bfloat16)
    bits_j, scale_j = jnp.asarray(bits), jnp.asarray(scale)
    for m in ms:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      slots = jnp.asarray(np.arange(m) % 3, jnp.int32)
      calls = {
        "bf16_gemm": (_loop(_dot, k, n, iters), (x, w_bf16), k * n * 2),
        "reference": (_loop(_dequantized_dot, k, n, iters), (x, qj), qk.nbytes),
        "kernel": (_loop(_fn(g, dry), k, n, iters), (x, qj), qk.nbytes),
        "kernel_3_variants": (_loop(_fn(g, dry), k, n, iters),
                              (x, qj, bits_j, scale_j, slots), qk.nbytes + 2 * bits[0].nbytes),
      }
      times = {name: [] for name in calls}
      row = {"format": fmt, "k": k, "n": n, "m": m}
      try:
        for f, args, _ in calls.values():
          jax.block_until_ready(f(*args))  # compile + warm
        for _ in range(rounds):
          for name, (f, args, _) in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append((time.perf_counter() - t) / iters)
        med = {name: statistics.median(v) for name, v in times.items()}
        row.update(us={k_: round(v * 1e6, 2) for k_, v in med.items()},
                   gbps={name: round(calls[name][2] / med[name] / 1e9, 1) for name in calls},
                   vs_bf16={name: round(med[name] / med["bf16_gemm"], 3) for name in calls})
      except Exception as e:  # noqa: BLE001
        row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
      log(f"bench {row}")
      out.append(row)
  return out


def lowering(shapes) -> tuple[bool, list]:
  """Every kernel lowered for CUDA with the real Mosaic GPU lowering (no GPU needed)."""
  from pallas_kernels.bits import group_k_for
  from pallas_kernels.quant_matmul import blocks
  from pallas_kernels.quant_matmul import mosaic_gpu as qmg

  sds, rows, ok = jax.ShapeDtypeStruct, [], True
  for fmt in FORMATS:
    for k, n in shapes:
      g = group_k_for(k, 128)
      qk = blocks.abstract(fmt, (k, n))
      for m, extra in ((1, ()), (8, (sds((3, k // 8, n), jnp.uint8), sds((3, n), jnp.float32),
                                      sds((8,), jnp.int32))), (512, ())):
        row = {"format": fmt, "k": k, "n": n, "m": m, "bank": bool(extra)}
        try:
          text = (jax.jit(_fn(g, False)).trace(sds((m, k), jnp.bfloat16), qk, *extra)
                  .lower(lowering_platforms=("cuda",)).as_text())
          row["ok"] = text.count(f"@{qmg.CUSTOM_CALL_TARGET}(") == 1
        except Exception as e:  # noqa: BLE001
          row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        ok &= row["ok"]
        rows.append(row)
  log(f"lowering: {sum(r['ok'] for r in rows)}/{len(rows)} kernels lower for CUDA")
  return ok, rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", type=pathlib.Path, required=True)
  ap.add_argument("--dry-run", action="store_true")
  args, _ = ap.parse_known_args(argv)  # gpu_check.sh passes its own arguments too
  dry = args.dry_run
  args.out.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  res, ok, t0 = {"dry_run": dry, "backend": jax.default_backend()}, True, time.time()
  if not dry and jax.default_backend() != "gpu":
    res["error"] = f"backend is {jax.default_backend()!r}, not a GPU"
    ok = False
  else:
    try:
      if dry:
        lower_ok, res["lowering"] = lowering([(576, 1536), (1536, 576), (4096, 4096)])
        ok &= lower_ok
      num_ok, res["numerics"] = numerics(
        [(256, 128)] if dry else [(576, 1536), (1536, 576), (4096, 4096)], dry, rng)
      ok &= num_ok
      k, n = (256, 128) if dry else (4096, 4096)
      res["bench"] = bench(k, n, (1, 64) if dry else (1, 8, 512), 1 if dry else 5,
                           1 if dry else 20, dry, rng)
      ok &= not any("error" in r for r in res["bench"])
    except Exception:  # noqa: BLE001
      res["error"] = traceback.format_exc()[-3000:]
      ok = False
  res.update(ok=ok, seconds=round(time.time() - t0, 1))
  # into kernel_gpu.json (key "quant"): the device tool brings back at most 8 files
  path = args.out / "kernel_gpu.json"
  try:
    kernel = json.loads(path.read_text()) if path.exists() else {}
  except ValueError:
    kernel = {"unreadable_before_quant": True}
  report.write_json(path, {**kernel, "quant": res}, indent=1)
  line = summary_line(res)
  log(line)
  with open(args.out / "summary.txt", "a") as f:
    f.write(line + "\n")
  return 0 if ok else 1


def summary_line(res) -> str:
  parts = [f"quant_gpu: {'PASS' if res['ok'] else 'FAIL'} ({res['seconds']}s)"]
  if num := res.get("numerics"):
    parts.append(f"numerics {sum(r['ok'] for r in num)}/{len(num)} "
                 f"(worst rel {max((r.get('max_rel', 0) for r in num), default=0):.1e})")
  for r in res.get("bench", []):
    if "vs_bf16" in r:
      v = r["vs_bf16"]
      parts.append(f"{r['format']} M={r['m']}: kernel {v['kernel']}x bf16 GEMM, 3 variants "
                   f"{v['kernel_3_variants']}x, reference {v['reference']}x")
  if err := res.get("error"):
    parts.append("error: " + err.strip().splitlines()[-1][:200])
  return " | ".join(parts)


if __name__ == "__main__":
  sys.exit(main())
