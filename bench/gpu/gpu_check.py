"""One prepared GPU check of bitdelta-jax: kernels' numerics and speed, paged attention, serving.

Run on a machine with one NVIDIA GPU (written for an H200, jax with CUDA) through the wrapper,
which installs the wheels of the runtime deps the GPU image lacks and tees everything to a log:

    bash bench/gpu_wheels.sh                    # here, once: the wheels into .whl/ (~12 MiB)
    bash bench/gpu_check.sh --out $OUT          # there: < 8 minutes
    bash bench/gpu_check.sh --dry-run           # here, on CPU: the same code paths, a few minutes

.whl/ is git-ignored: a copy of the working tree to the GPU machine must carry it explicitly
(the device tool's ``carry: [".whl"]``); without it the wrapper uses what is installed.

``gpu_check.sh`` installs ``.whl/*.whl`` (when present and the Python is 3.12, the version they
are for) with ``pip install --no-index --no-deps --target /tmp/site`` and puts /tmp/site and the
repo root on PYTHONPATH (jax, flax, orbax, optax, tensorstore, torch come from the image; the
image's CUDA jax must be used). It runs this file under ``timeout`` and prints the summary.
``python -m bench gpu_check --help`` lists the knobs (``--only STAGE``, ``--deadline-s``, ...).

Stages (each records pass/fail and its error text; a failed stage does not stop the later ones,
except ``env``, which stops the run when the backend is not a GPU outside ``--dry-run``):

1. **env**: jax/jaxlib (and plugin) versions, backend, devices and compute capability,
   ``nvidia-smi``, Python, glibc, CPU, which kernel implementations report available.
2. **kernel_numerics**: `pallas_kernels.delta_matmul` ``delta_matmul(x, w, bits, scale,
   slot_ids, implementation=NAME)`` for the GPU implementations (``mosaic_gpu``, ``pallas_triton``)
   against the jnp reference and a float64 numpy result, at SmolLM2-135M's shapes (K x N = 576 x
   1536, 1536 x 576, 576 x 576, 576 x 192) and 4096 x 4096, bf16 and f32, M in 1/8/64, one
   variant and a bank of 3 slots with rows mixed over slots 0..2 (slot 0, base only, holds bits
   that must not be read). Pass: f32 max error <= 2^-19 x max_mn sum_k |x|(|W| + alpha) (catches
   a TF32 path); bf16 max error <= 1.5 x the reference's own bf16 error + 2^-12 x max|y|.
   ``NotImplementedError`` from ``pallas_triton`` (it takes no 64-row groups, i.e. K = 576) is
   recorded as "unsupported", any other error while it lowers as "no_lower" (the Triton
   lowering is deprecated in jax 0.11); from ``mosaic_gpu`` either fails the stage. Cases run
   in tiers so that a budget cut still leaves every shape with both dtypes, all M and both modes.
3. **kernel_bench**: base ``jnp.dot(x, W)`` vs fused one variant vs a batch mixed over 3
   variants, per implementation, bf16, M in 1/8/64, same shapes. Each timed call is one jitted
   ``fori_loop`` of 50 chained calls (y sliced/tiled back to x's shape), rounds interleaved (one
   call of every contender per round), medians; ratios to base, also net of the chain's own
   cost (the "floor" contender); GB/s = (weights + bits) / time; device-to-device copy GB/s.
4. **attention**: `pallas_kernels.paged_attention` ``ragged_paged_attention`` with
   ``implementation="mosaic_gpu"`` vs ``"reference"`` on decode-only batches (R lanes, no prompt
   pages), R = 8 and 32, lane lengths random up to 2048 (one idle lane) or one long lane and the
   rest short, SmolLM2 heads (H 9, KV 3, hd 64) and Llama-8B-like (H 32, KV 8, hd 128), pages of
   16, bf16 (and f32 once): errors against float64 numpy, time ratio kernel / reference.
5. **prefill**: prompt chunks, `bench/gpu/gpu_prefill.py` (its docstring): the Mosaic GPU prefill
   attention kernel vs the reference at 512-8192-token prompts (numerics vs float64 on sampled
   tokens, time), and time to first token through the engine, base vs variant, kernel vs
   reference path. Results in attention_gpu.json under "prefill".
6. **serve**: ``python -m bitdelta_jax.cli serve`` on a free loopback port (``--dtype bfloat16``;
   started right after ``env`` so that its warm-up compiles overlap stages 2-4),
   one stream, 8 concurrent on the base, 8 concurrent over 3 variants, 8 concurrent on the base
   again; tokens/s and TTFT p50 (`bench/common/load.py`). Base: the real
   SmolLM2-135M-Instruct with its shipped variants when it can be found without network
   (`bitdelta_jax.zoo.real_base`), else the built-in nano family; the summary says which.
   Each scenario runs once unmeasured first; a measured pass during which the server compiled
   (``/health`` ``compiles_after_warmup``) is measured once more. The server runs with
   ``--no-prefix-caching`` (the passes repeat their prompts; each must do its full prefill),
   ``--max-batch 8 --prefill-chunk 64 --max-seq-len 512`` (few step programs to warm up).
7. **summary**: one screen, also written to summary.txt (rewritten after every stage, so a run
   killed by the wrapper's timeout still leaves the stages that finished).

Output folder (8 files at most): env.json, kernel_gpu.json (numerics + bench), attention_gpu.json,
serve_gpu.json, report.md (the tables), server.log, summary.txt, and log.txt (written by the
wrapper). Exit status 0 only when every stage that ran passed.

``--dry-run`` (CPU): interpret mode for the Pallas kernels (``interpret=True``), tiny shapes
(delta 256 x 128 and 576 x 192, M 1 and 8; bench 256 x 128 and 128 x 256, 2 rounds of 2-call
loops; attention R 4 and 2 with short lanes), the nano family with few short requests and
``--no-warmup`` (the step programs compile during the unmeasured passes). Same code otherwise.
The dry run also lowers the kernels' calls with ``interpret=False`` for CUDA
(``lowering_platform("cuda")``, ``lower(lowering_platforms=("cuda",))``), which runs their real
lowering without a GPU: a Mosaic GPU lowering error shows here, before any GPU time is spent.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import math
import os
import pathlib
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

from bench.common import report
from bench.common.paths import ROOT

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the server shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu import gpu_prefill  # noqa: E402  (after the environment above)

STAGES = ("env", "kernel_numerics", "kernel_bench", "attention", "prefill", "serve")
GPU_DELTA_IMPLS = ("mosaic_gpu", "pallas_triton")
REQUIRED_DELTA_IMPL = "mosaic_gpu"  # the kernel that must be there and take every shape
# seconds per stage on the GPU (upper bounds: a stage stops starting new work past its budget)
BUDGETS = {"env": 40, "kernel_numerics": 70, "kernel_bench": 70, "attention": 40, "prefill": 70,
           "serve": 90}  # 380 s: with gpu_quant.py's 90 s the wrapper's stages fit ~500 s
DRY_BUDGETS = {"env": 60, "kernel_numerics": 300, "kernel_bench": 300, "attention": 300,
               "prefill": 300, "serve": 600}
RESERVE = {"kernel_numerics": 30, "kernel_bench": 30, "attention": 20, "prefill": 30, "serve": 60}
HI = jax.lax.Precision.HIGHEST


def log(msg: str = "") -> None:
  print(msg, flush=True)


@dataclasses.dataclass
class Ctx:
  out: pathlib.Path
  dry: bool
  interpret: bool
  deadline: float  # time.monotonic() by which everything must be done
  stage_end: float = 0.0
  results: dict = dataclasses.field(default_factory=dict)  # stage -> record
  data: dict = dataclasses.field(default_factory=dict)  # stage -> its results
  t_start: float = dataclasses.field(default_factory=time.monotonic)
  interrupted: bool = False

  def left(self) -> float:
    return self.stage_end - time.monotonic()

  def over(self, keep: float = 0.0) -> bool:
    return time.monotonic() + keep > self.stage_end


def _err(e: BaseException, limit: int = 600) -> str:
  return f"{type(e).__name__}: {e}"[:limit]


def _write_json(path: pathlib.Path, obj) -> None:
  report.write_json(path, obj, indent=1)


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _is_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def _compile_all(tasks: dict, threads: int) -> dict:
  """{key: (fn, args)} -> {key: compiled executable or the exception}; lowered and compiled
  in a thread pool (XLA and ptxas release the GIL)."""

  def one(item):
    key, (fn, args) = item
    try:
      return key, jax.jit(fn).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - recorded per contender
      return key, e

  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    return dict(pool.map(one, tasks.items()))


def _cuda_lowering(tasks: dict) -> dict:
  """Dry run only: {key: (fn, args)} -> {key: "ok" | error}, each call traced with the GPU kernels
  selected (`lowering_platform("cuda")`, ``interpret=False``) and lowered for CUDA without a GPU:
  the kernels' own lowering (Mosaic GPU MLIR, layouts) runs; ptxas and the numbers do not."""
  from pallas_kernels.platform import lowering_platform

  out = {}
  for key, (fn, args) in tasks.items():  # one at a time: the platform override is process-wide
    try:
      with lowering_platform("cuda"):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      targets = sorted(set(re.findall(r"custom_call @([\w.]+)", text)))
      out[key] = f"ok ({', '.join(targets) or 'no custom call'})"
    except Exception as e:  # noqa: BLE001 - recorded
      out[key] = _err(e, 400)
  return out


def _threads(ctx: Ctx) -> int:
  return 2 if ctx.dry else min(8, os.cpu_count() or 2)


# ---------------------------------------------------------------------------------------------
# 1. env
# ---------------------------------------------------------------------------------------------
def _delta_impls_status(interpret: bool) -> dict:
  """name -> None (available) or the reason, for every implementation in the api and the GPU
  ones; notes how mosaic_gpu is reached when the api does not list it yet."""
  from pallas_kernels.delta_matmul import api

  out = {}
  for name in dict.fromkeys((*api.IMPLEMENTATIONS, *GPU_DELTA_IMPLS)):
    out[name] = _delta_unavailable(name, interpret)
  return out


def _delta_unavailable(name: str, interpret: bool) -> str | None:
  from pallas_kernels.delta_matmul import api

  try:
    if name in api.IMPLEMENTATIONS:
      try:
        return api.unavailable_reason(name, interpret=interpret)
      except TypeError:  # an api without the interpret keyword
        return api.unavailable_reason(name)
    if name == "mosaic_gpu":  # written, not registered in the api yet: the module directly
      from pallas_kernels.delta_matmul import mosaic_gpu

      reason = mosaic_gpu.unavailable_reason(interpret=interpret)
      if reason is None and not interpret and not _is_gpu():
        reason = f"needs a GPU backend, the default backend is {jax.default_backend()!r}"
      return reason
    return f"{name!r} is not in pallas_kernels.delta_matmul.api.IMPLEMENTATIONS"
  except Exception as e:  # noqa: BLE001 - an import error is the reason
    return _err(e)


def _attention_status(interpret: bool) -> dict:
  out = {}
  try:
    from pallas_kernels.paged_attention import api as pa
  except Exception as e:  # noqa: BLE001
    return {"import": _err(e)}
  for label, (h, kv, d) in {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}.items():
    q = jax.ShapeDtypeStruct((8, h, d), jnp.bfloat16)
    kp = jax.ShapeDtypeStruct((2, 64, 16, kv, d), jnp.bfloat16)
    try:
      out[label] = pa.unavailable_reason(q, kp, implementation="mosaic_gpu", interpret=interpret)
    except Exception as e:  # noqa: BLE001
      out[label] = _err(e)
  return out


def stage_env(ctx: Ctx) -> tuple[bool, str]:
  env: dict = {"python": platform.python_version(), "executable": sys.executable,
               "platform": platform.platform(), "dry_run": ctx.dry, "interpret": ctx.interpret}
  env["versions"] = {d: _version(d) for d in (
    "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
    "jax-cuda13-pjrt", "flax", "orbax-checkpoint", "optax", "tensorstore", "numpy", "ml_dtypes",
    "torch", "triton", "safetensors", "tokenizers", "gguf", "jinja2", "aiohttp",
    "prometheus-client", "llguidance", "tqdm", "requests")}
  env["jax_version"] = jax.__version__
  env["backend"] = jax.default_backend()
  devs = []
  for d in jax.devices():
    devs.append({"str": str(d), "kind": getattr(d, "device_kind", None),
                 "platform": d.platform,
                 "compute_capability": getattr(d, "compute_capability", None)})
  env["devices"] = devs
  try:
    from pallas_kernels import platform as kplatform

    env["target_platform"] = kplatform.target_platform()
    env["cuda_compute_capability"] = kplatform.cuda_compute_capability()
  except Exception as e:  # noqa: BLE001
    env["target_platform"] = _err(e)
  try:
    env["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                       timeout=30).stdout[-6000:]
  except (OSError, subprocess.SubprocessError) as e:
    env["nvidia_smi"] = f"not available ({_err(e, 200)})"
  try:
    env["glibc"] = subprocess.run(["ldd", "--version"], capture_output=True, text=True,
                                  timeout=10).stdout.splitlines()[0]
  except (OSError, subprocess.SubprocessError, IndexError):
    env["glibc"] = platform.libc_ver()
  try:
    from bench.common.machine import describe

    env["machine"] = describe()
  except Exception as e:  # noqa: BLE001
    env["machine"] = _err(e)
  env["xla_env"] = {k: v for k, v in os.environ.items() if k.startswith(("XLA", "JAX", "CUDA"))}
  env["delta_matmul"] = _delta_impls_status(ctx.interpret)
  env["paged_attention_mosaic_gpu"] = _attention_status(ctx.interpret)
  ctx.data["env"] = env
  _write_json(ctx.out / "env.json", env)
  dev = devs[0]["kind"] if devs else "?"
  cc = devs[0]["compute_capability"] if devs else None
  avail = ", ".join(f"{n} {'ok' if r is None else 'NO'}" for n, r in env["delta_matmul"].items()
                    if n in GPU_DELTA_IMPLS)
  log(f"jax {jax.__version__} backend {env['backend']}, {len(devs)} device(s): {dev} cc {cc}")
  for n, r in env["delta_matmul"].items():
    log(f"  delta_matmul {n}: {'available' if r is None else r}")
  for n, r in env["paged_attention_mosaic_gpu"].items():
    log(f"  paged_attention mosaic_gpu ({n}): {'available' if r is None else r}")
  line = f"{env['backend']}, {dev}" + (f" sm_{str(cc).replace('.', '')}" if cc else "") + \
    f"; jax {jax.__version__}; {avail}"
  if not ctx.dry and not _is_gpu():
    return False, f"jax's backend is {jax.default_backend()!r}, not a GPU ({line})"
  return True, line


# ---------------------------------------------------------------------------------------------
# 2. + 3. delta kernel: numerics and bench
# ---------------------------------------------------------------------------------------------
REAL_SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192), (4096, 4096))
# (dtype, M, mode) tiers: the first tier alone covers both dtypes, all M and both modes per shape
TIERS = (
  (("bfloat16", 8, "bank"), ("bfloat16", 1, "single"), ("float32", 64, "single"),
   ("float32", 1, "bank")),
  (("bfloat16", 64, "bank"), ("float32", 8, "single"), ("bfloat16", 8, "single"),
   ("float32", 8, "bank")),
  (("bfloat16", 64, "single"), ("bfloat16", 1, "bank"), ("float32", 64, "bank"),
   ("float32", 1, "single")),
)


def _delta_fn(name: str, mode: str, group_k: int, interpret: bool):
  """The call under test: the api for registered names, the module for mosaic_gpu when the api
  does not list it yet."""
  from pallas_kernels.delta_matmul import api

  if name in api.IMPLEMENTATIONS or name == "reference":
    if mode == "single":
      return lambda x, w, b, s: api.delta_matmul(x, w, b, s, group_k=group_k,
                                                 implementation=name, interpret=interpret)
    return lambda x, w, b, s, sl: api.delta_matmul(x, w, b, s, sl, group_k=group_k,
                                                   implementation=name, interpret=interpret)
  if name == "mosaic_gpu":
    from pallas_kernels.delta_matmul import mosaic_gpu

    if mode == "single":
      return lambda x, w, b, s: mosaic_gpu.delta_matmul_single(x, w, b, s, group_k=group_k,
                                                               interpret=interpret)
    return lambda x, w, b, s, sl: mosaic_gpu.delta_matmul_bank(x, w, b, s, sl, group_k=group_k,
                                                               interpret=interpret)
  raise ValueError(f"unknown implementation {name!r}")


def _reference_fn(mode: str, group_k: int):
  from pallas_kernels.delta_matmul.reference import delta_matmul_reference

  if mode == "single":
    return lambda x, w, b, s: delta_matmul_reference(x, w, b, s, group_k=group_k)
  return lambda x, w, b, s, sl: delta_matmul_reference(x, w, b, s, sl, group_k=group_k)


class DeltaData:
  """Weights and packed deltas of one K x N shape (numpy, f32), plus their float64 signs."""

  def __init__(self, k: int, n: int, rng, slots: int = 3):
    from bitdelta_jax.delta.format import pack, unpack_signs

    self.k, self.n = k, n
    self.w = (rng.standard_normal((k, n), np.float32) * (0.5 / math.sqrt(k))).astype(np.float32)
    deltas = [rng.standard_normal((k, n), np.float32) * (0.1 / math.sqrt(k)) for _ in range(slots)]
    col = pack(deltas[1], "column")  # one variant: one scale per output column
    self.group_k = col.group_k
    self.bits1, self.scale1 = np.asarray(col.bits), np.asarray(col.scale)  # [K/8, N], [N]
    mats = [pack(d, "matrix") for d in deltas]  # the bank: one scale per matrix
    self.bank = np.stack([np.asarray(p.bits) for p in mats])  # [S, K/8, N]
    self.bank_scale = np.stack([np.asarray(p.scale) for p in mats])  # [S, 1]
    self._signs = {}
    self._unpack = lambda b: unpack_signs(b, (k, n), self.group_k, dtype=np.float64)

  def signs(self, key):
    if key not in self._signs:
      self._signs[key] = self._unpack(self.bits1 if key == "single" else self.bank[key])
    return self._signs[key]


def _slot_ids(m: int, rng, slots: int = 3) -> np.ndarray:
  ids = (np.arange(m) + 1) % slots  # M = 1: slot 1; otherwise every slot 0..2 present
  return rng.permutation(ids).astype(np.int32)


def _exact(dd: DeltaData, x64, w64, mode: str, slot_ids=None) -> np.ndarray:
  y = x64 @ w64
  if mode == "single":
    return y + (x64 @ dd.signs("single")) * dd.scale1.astype(np.float64)
  for s in range(1, dd.bank.shape[0]):
    rows = slot_ids == s
    if rows.any():
      y[rows] += (x64[rows] @ dd.signs(s)) * float(dd.bank_scale[s, 0])
  return y


def _mag(dd: DeltaData, x64, w64, mode: str) -> float:
  """max over outputs of sum_k |x| (|W| + alpha): the scale of a dot's rounding error."""
  a = float(np.max(dd.scale1)) if mode == "single" else float(np.max(dd.bank_scale))
  return float(np.max(np.abs(x64) @ (np.abs(w64) + a)))


def stage_kernel_numerics(ctx: Ctx) -> tuple[bool, str]:
  shapes = ((256, 128), (576, 192)) if ctx.dry else REAL_SHAPES
  tiers = TIERS
  if ctx.dry:  # M in {1, 8}: the tier cases with M = 64 run at M = 8 (once)
    seen: set = set()
    tiers = []
    for t in TIERS:
      t = [c for c in dict.fromkeys((dt, min(m, 8), mode) for dt, m, mode in t) if c not in seen]
      seen.update(t)
      tiers.append(tuple(t))
    tiers = tuple(t for t in tiers if t)
  status = {n: _delta_unavailable(n, ctx.interpret) for n in GPU_DELTA_IMPLS}
  impls = [n for n, r in status.items() if r is None]
  res = {"implementations": status, "criteria": {
    "float32": "max|y - exact| <= 2^-19 * max_mn sum_k |x_mk| (|W_kn| + alpha)",
    "bfloat16": "max|y - exact| <= 1.5 * max|reference - exact| + 2^-12 * max|exact|"},
    "cases": []}
  ctx.data["kernel_numerics"] = res
  failures = []
  if status[REQUIRED_DELTA_IMPL] is not None:
    failures.append(f"{REQUIRED_DELTA_IMPL} unavailable: {status[REQUIRED_DELTA_IMPL]}")
  rng = np.random.default_rng(0)
  data = {}
  cut = False
  for ti, tier in enumerate(tiers):
    if ctx.over(keep=5):
      cut = True
      log(f"  budget: tier {ti + 1}/{len(tiers)} and later not run")
      break
    cases, tasks = [], {}
    for k, n in shapes:
      dd = data.get((k, n)) or data.setdefault((k, n), DeltaData(k, n, rng))
      for dt_name, m, mode in tier:
        dt = jnp.dtype(dt_name)
        x = rng.standard_normal((m, k), np.float32)
        args = [jnp.asarray(x, dt), jnp.asarray(dd.w, dt)]
        sl = None
        if mode == "single":
          args += [jnp.asarray(dd.bits1), jnp.asarray(dd.scale1)]
        else:
          sl = _slot_ids(m, rng)
          args += [jnp.asarray(dd.bank), jnp.asarray(dd.bank_scale), jnp.asarray(sl)]
        case = {"K": k, "N": n, "M": m, "dtype": dt_name, "mode": mode, "group_k": dd.group_k}
        cases.append((case, dd, args, sl))
        ci = len(cases) - 1
        tasks[(ci, "reference")] = (_reference_fn(mode, dd.group_k), args)
        for name in impls:
          tasks[(ci, name)] = (_delta_fn(name, mode, dd.group_k, ctx.interpret), args)
    t0 = time.monotonic()
    compiled = _compile_all(tasks, _threads(ctx))
    log(f"  tier {ti + 1}: compiled {len(tasks)} programs in {time.monotonic() - t0:.1f}s")
    for ci, (case, dd, args, sl) in enumerate(cases):
      try:
        _numerics_case(ci, case, dd, args, sl, compiled, impls, failures)
      except Exception as e:  # noqa: BLE001 - e.g. the reference failing at run time
        case["error"] = _err(e)
        failures.append(f"{_case_label(case)}: {_err(e, 150)}")
      res["cases"].append(case)
    del compiled
  if ctx.dry:  # the same calls with interpret=False, lowered for CUDA (no GPU needed)
    tasks = {}
    for k, n in shapes:
      dd = data.get((k, n))
      if dd is None:
        continue
      for dt_name, m, mode in tiers[0]:
        dt = jnp.dtype(dt_name)
        args = [jnp.zeros((m, k), dt), jnp.asarray(dd.w, dt)]
        if mode == "single":
          args += [jnp.asarray(dd.bits1), jnp.asarray(dd.scale1)]
        else:
          args += [jnp.asarray(dd.bank), jnp.asarray(dd.bank_scale),
                   jnp.asarray(_slot_ids(m, rng))]
        for name in GPU_DELTA_IMPLS:
          tasks[f"{name} {k}x{n} M={m} {dt_name} {mode}"] = (
            _delta_fn(name, mode, dd.group_k, False), args)
    t0 = time.monotonic()
    low = res["cuda_lowering"] = _cuda_lowering(tasks)
    bad = {key: v for key, v in low.items() if not v.startswith("ok")
           and key.startswith(REQUIRED_DELTA_IMPL)}
    log(f"  lowered {len(low)} calls for CUDA (interpret=False) in {time.monotonic() - t0:.1f}s: "
        f"{sum(v.startswith('ok') for v in low.values())} ok"
        + "".join(f"\n    {key}: {v[:150]}" for key, v in low.items() if not v.startswith("ok")))
    failures += [f"CUDA lowering {key}: {v[:150]}" for key, v in bad.items()]
  res["budget_cut"] = cut
  res["failures"] = failures
  counts = {}
  for name in impls:
    st = [c["impl"][name]["status"] for c in res["cases"] if name in c.get("impl", {})]
    counts[name] = {s: st.count(s) for s in dict.fromkeys(st)}
    worst = [c["impl"][name].get("err_over_bound", 0) for c in res["cases"]
             if c.get("impl", {}).get(name, {}).get("status") in ("pass", "FAIL")]
    counts[name]["worst_err_over_bound"] = max(worst) if worst else None
  res["counts"] = counts
  _write_kernel_json(ctx)
  line = "; ".join(
    f"{n}: {c.get('pass', 0)}/{sum(v for k, v in c.items() if isinstance(v, int))} pass"
    + "".join(f", {v} {k}" for k, v in c.items() if isinstance(v, int) and k != "pass")
    + (f", worst err/bound {c['worst_err_over_bound']:.2f}" if c["worst_err_over_bound"] else "")
    for n, c in counts.items()) or "no GPU implementation available"
  line += f"; {len(res['cases'])} cases" + (" (budget cut)" if cut else "")
  if "cuda_lowering" in res:
    low = res["cuda_lowering"]
    line += "; CUDA lowering (interpret=False) " + ", ".join(
      f"{n} {sum(v.startswith('ok') for k, v in low.items() if k.startswith(n))}/"
      f"{sum(k.startswith(n) for k in low)} ok" for n in GPU_DELTA_IMPLS)
  if failures:
    return False, f"{len(failures)} failure(s), first: {failures[0]} | {line}"
  return True, line


def _numerics_case(ci, case, dd, args, sl, compiled, impls, failures) -> None:
  x64 = np.asarray(args[0].astype(jnp.float32), np.float64)
  w64 = np.asarray(args[1].astype(jnp.float32), np.float64)
  exact = _exact(dd, x64, w64, case["mode"], sl)
  mag = _mag(dd, x64, w64, case["mode"])
  ymax = float(np.max(np.abs(exact)))
  ref = compiled[(ci, "reference")]
  if isinstance(ref, Exception):
    case["error"] = f"reference: {_err(ref)}"
    failures.append(f"{_case_label(case)} reference: {_err(ref, 120)}")
    return
  y_ref = np.asarray(ref(*args).astype(jnp.float32), np.float64)
  err_ref = float(np.max(np.abs(y_ref - exact)))
  if case["dtype"] == "float32":
    bound = 2.0**-19 * mag
  else:
    bound = 1.5 * err_ref + 2.0**-12 * ymax
  case.update(max_abs_exact=ymax, mag=mag, ref_err=err_ref, bound=bound, impl={})
  for name in impls:
    r = {}
    c = compiled[(ci, name)]
    if isinstance(c, NotImplementedError) and name != REQUIRED_DELTA_IMPL:
      r = {"status": "unsupported", "reason": _err(c, 300)}
    elif isinstance(c, Exception) and name != REQUIRED_DELTA_IMPL:
      r = {"status": "no_lower", "reason": _err(c, 600)}  # e.g. Triton on a newer jax
    elif isinstance(c, Exception):
      r = {"status": "error", "error": _err(c)}
    else:
      try:
        y = np.asarray(c(*args).astype(jnp.float32), np.float64)
        err = float(np.max(np.abs(y - exact)))
        finite = bool(np.all(np.isfinite(y)))
        ok = finite and err <= bound
        r = {"status": "pass" if ok else "FAIL", "err": err, "err_over_bound": err / bound,
             "err_over_ref": err / err_ref if err_ref > 0 else None,
             "max_abs_vs_reference": float(np.max(np.abs(y - y_ref))), "finite": finite}
      except Exception as e:  # noqa: BLE001
        r = {"status": "error", "error": _err(e)}
    case["impl"][name] = r
    if r["status"] in ("FAIL", "error"):
      failures.append(f"{_case_label(case)} {name}: {r.get('error') or _fmt_err(r)}")
  log(f"  {_case_label(case)} ref_err {err_ref:.2e} bound {bound:.2e} " + " ".join(
    f"{n}={_short(case['impl'][n])}" for n in impls))


def _case_label(c: dict) -> str:
  return f"{c['K']}x{c['N']} M={c['M']} {c['dtype']} {c['mode']}"


def _fmt_err(r: dict) -> str:
  nan = float("nan")
  return f"err {r.get('err', nan):.3g} = {r.get('err_over_bound', nan):.2f} x bound"


def _short(r: dict) -> str:
  if r["status"] in ("pass", "FAIL"):
    return f"{r['status']}({r['err_over_bound']:.2f})"
  return r["status"]


def _write_kernel_json(ctx: Ctx) -> None:
  _write_json(ctx.out / "kernel_gpu.json", {
    "numerics": ctx.data.get("kernel_numerics"), "bench": ctx.data.get("kernel_bench")})


def _chain_loop(f, k: int, n: int, iters: int):
  """A jitted loop of ``iters`` chained calls ``y = f(x, ...)``, y brought back to x's shape
  (sliced when N >= K, tiled otherwise), so that no call can be skipped or overlapped."""

  def to_k(y):
    return y[:, :k] if n >= k else jnp.tile(y, (1, -(-k // n)))[:, :k]

  def loop(x, *rest):
    return jax.lax.fori_loop(0, iters, lambda _, x: to_k(f(x, *rest)).astype(x.dtype), x)

  return loop


def _interleaved(calls: dict, rounds: int, ctx: Ctx, min_rounds: int = 3) -> dict:
  """Seconds per call of each contender (one call of each per round), all rounds kept."""
  for c in calls.values():  # warm
    jax.block_until_ready(c())
  times = {n: [] for n in calls}
  for r in range(rounds):
    for n, c in calls.items():
      t = time.perf_counter()
      jax.block_until_ready(c())
      times[n].append(time.perf_counter() - t)
    if r + 1 >= min_rounds and ctx.over():
      break
  return times


def _copy_gbps(nbytes: int, reps: int) -> float:
  a = jnp.zeros((nbytes // 2,), jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.ones((), a.dtype))  # reads and writes once
  jax.block_until_ready(copy(a))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(copy(a))
    ts.append(time.perf_counter() - t)
  return 2 * a.nbytes / statistics.median(ts) / 1e9


def stage_kernel_bench(ctx: Ctx) -> tuple[bool, str]:
  if ctx.dry:
    shapes, batches, rounds, iters = ((256, 128), (128, 256)), (8,), 2, 2
  else:
    shapes, batches, rounds, iters = ((4096, 4096), *REAL_SHAPES[:4]), (1, 8, 64), 9, 50
  dt = jnp.bfloat16
  status = {n: _delta_unavailable(n, ctx.interpret) for n in GPU_DELTA_IMPLS}
  impls = [n for n, r in status.items() if r is None]
  res = {"implementations": status, "dtype": "bfloat16", "iters_per_call": iters,
         "rounds": rounds, "rows": []}
  ctx.data["kernel_bench"] = res
  failures = []
  res["copy_GBps"] = _copy_gbps((8 if ctx.dry else 1024) * 2**20, 3 if ctx.dry else 10)
  log(f"  device-to-device copy: {res['copy_GBps']:.0f} GB/s")
  rng = np.random.default_rng(1)
  # priority: M = 1 (decode) over every shape first, then 8, then 64
  configs = [(k, n, m) for m in batches for (k, n) in shapes]
  data = {}
  cut = False
  for k, n, m in configs:
    if ctx.over(keep=5):
      cut = True
      break
    dd = data.get((k, n)) or data.setdefault((k, n), DeltaData(k, n, rng, slots=4))
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), dt)
    w = jnp.asarray(dd.w, dt)
    bits, scale = jnp.asarray(dd.bits1), jnp.asarray(dd.scale1)
    bank = jnp.asarray(dd.bank)
    bank_scale = jnp.asarray(np.repeat(dd.bank_scale, n, axis=1))  # [4, N]
    n_var = min(m, 3)
    slots = jnp.asarray(1 + np.arange(m) % 3, jnp.int32)  # rows over slots 1..3 (3 variants)
    floor = lambda x, w, k=k, n=n: x[:, :n] if k >= n else jnp.tile(x, (1, -(-n // k)))[:, :n]
    tasks = {"floor": (_chain_loop(floor, k, n, iters), (x, w)),
             "base": (_chain_loop(lambda x, w: jnp.dot(x, w), k, n, iters), (x, w))}
    for name in impls:
      tasks[f"{name}_single"] = (_chain_loop(_delta_fn(name, "single", dd.group_k, ctx.interpret),
                                             k, n, iters), (x, w, bits, scale))
      tasks[f"{name}_mixed"] = (_chain_loop(_delta_fn(name, "bank", dd.group_k, ctx.interpret),
                                            k, n, iters), (x, w, bank, bank_scale, slots))
    compiled = _compile_all(tasks, _threads(ctx))
    row = {"K": k, "N": n, "M": m, "variants_in_mixed": n_var, "ms": {}, "errors": {}}
    calls = {}
    for name, c in compiled.items():
      if isinstance(c, NotImplementedError) and not name.startswith(REQUIRED_DELTA_IMPL):
        row["errors"][name] = "unsupported: " + _err(c, 200)
      elif isinstance(c, Exception) and name.startswith(tuple(
          n for n in GPU_DELTA_IMPLS if n != REQUIRED_DELTA_IMPL)):
        row["errors"][name] = "does not lower: " + _err(c, 400)
      elif isinstance(c, Exception):
        row["errors"][name] = _err(c)
        failures.append(f"K{k} N{n} M{m} {name}: {_err(c, 150)}")
      else:
        calls[name] = (lambda c=c, a=tasks[name][1]: c(*a))
    try:
      times = _interleaved(calls, rounds, ctx, min_rounds=min(3, rounds))
    except Exception as e:  # noqa: BLE001
      row["errors"]["timing"] = _err(e)
      failures.append(f"K{k} N{n} M{m} timing: {_err(e, 150)}")
      res["rows"].append(row)
      continue
    med = {name: statistics.median(ts) / iters for name, ts in times.items()}
    row["rounds_run"] = len(next(iter(times.values()))) if times else 0
    row["ms"] = {name: 1e3 * v for name, v in med.items()}
    wbytes = k * n * 2
    bbytes = dd.bits1.nbytes
    if "base" in med:
      tb, tf = med["base"], med.get("floor", 0.0)
      row["base_GBps"] = wbytes / tb / 1e9
      row["ratio_to_base"] = {nm: v / tb for nm, v in med.items() if nm not in ("base", "floor")}
      if tb > tf:
        row["net_ratio_to_base"] = {nm: max(v - tf, 0.0) / (tb - tf) for nm, v in med.items()
                                    if nm not in ("base", "floor")}
      row["GBps"] = {nm: (wbytes + bbytes * (n_var if nm.endswith("_mixed") else 1)) / v / 1e9
                     for nm, v in med.items() if nm not in ("base", "floor")}
    res["rows"].append(row)
    log(f"  K={k} N={n} M={m}: base {row['ms'].get('base', float('nan')) * 1e3:.1f}us, floor "
        f"{row['ms'].get('floor', float('nan')) * 1e3:.1f}us; " + ", ".join(
          f"{nm} {r:.2f}x" for nm, r in row.get("ratio_to_base", {}).items())
        + (f"; errors: {list(row['errors'])}" if row["errors"] else ""))
    del compiled, calls
  res["budget_cut"] = cut
  res["failures"] = failures
  _write_kernel_json(ctx)
  parts = [f"copy {res['copy_GBps']:.0f} GB/s"]
  for name in impls:
    for mode in ("single", "mixed"):
      rs = [r["ratio_to_base"][f"{name}_{mode}"] for r in res["rows"]
            if f"{name}_{mode}" in r.get("ratio_to_base", {})]
      if rs:
        parts.append(f"{name} {mode}/base geomean {math.exp(np.mean(np.log(rs))):.2f}")
  line = "; ".join(parts) + f"; {len(res['rows'])}/{len(configs)} configs" + (
    " (budget cut)" if cut else "")
  if REQUIRED_DELTA_IMPL not in impls:
    failures.insert(0, f"{REQUIRED_DELTA_IMPL} unavailable: {status[REQUIRED_DELTA_IMPL]}")
  if failures:
    return False, f"{len(failures)} failure(s), first: {failures[0]} | {line}"
  return True, line


# ---------------------------------------------------------------------------------------------
# 4. paged attention
# ---------------------------------------------------------------------------------------------
ATTN_MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # H, KV, hd


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _attn_case(model: str, r: int, pattern: str, dtype, maxlen: int, ps: int, rng, key):
  h, kv, d = ATTN_MODELS[model]
  bp = max(1, 128 // ps)  # the engine's default block_pages
  p = _cdiv(_cdiv(maxlen, ps), bp) * bp  # pages per lane, whole blocks
  if pattern == "random":
    lens = rng.integers(1, maxlen + 1, r)
    lens[-1] = 0  # an idle lane: zeros
  else:  # one long lane, the rest short
    lens = rng.integers(1, min(64, maxlen) + 1, r)
    lens[0] = maxlen
  lens = lens.astype(np.int32)
  num_pages = r * p + 1
  perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  lane_pages = np.zeros((r, p), np.int32)
  for i in range(r):
    used = -(-int(lens[i]) // ps)
    lane_pages[i, :used] = perm[i * p:i * p + used]
  n_layers, layer = 2, 1
  k1, k2, k3 = jax.random.split(key, 3)
  shape = (n_layers, num_pages, ps, kv, d)
  k_pool = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
  v_pool = jax.random.normal(k2, shape, jnp.float32).astype(dtype)
  q = jax.random.normal(k3, (r, h, d), jnp.float32).astype(dtype)
  u = r * p
  bk = bp * ps
  meta = dict(lane_pages=jnp.asarray(lane_pages), lane_len=jnp.asarray(lens),
              pages=jnp.zeros((u,), jnp.int32), page_seq=jnp.full((u,), -2, jnp.int32),
              page_start=jnp.zeros((u,), jnp.int32), page_fill=jnp.zeros((u,), jnp.int32),
              token_seq=jnp.full((r,), -1, jnp.int32),
              positions=jnp.asarray(np.maximum(lens - 1, 0)),
              blocks=jnp.asarray([-(-int(lens.max()) // bk), 0], jnp.int32))
  return dict(q=q, k_pool=k_pool, v_pool=v_pool, layer=layer, meta=meta, block_pages=bp,
              lens=lens, lane_pages=lane_pages, ps=ps)


def _attn_exact(c) -> np.ndarray:
  q = np.asarray(c["q"].astype(jnp.float32), np.float64)
  kp = np.asarray(c["k_pool"][c["layer"]].astype(jnp.float32))
  vp = np.asarray(c["v_pool"][c["layer"]].astype(jnp.float32))
  r, h, d = q.shape
  kv = kp.shape[2]
  g = h // kv
  out = np.zeros((r, h, d))
  for i in range(r):
    n = int(c["lens"][i])
    if n == 0:
      continue
    pg = c["lane_pages"][i, :-(-n // c["ps"])]
    k = kp[pg].reshape(-1, kv, d)[:n].astype(np.float64)
    v = vp[pg].reshape(-1, kv, d)[:n].astype(np.float64)
    s = np.einsum("kgd,skd->kgs", q[i].reshape(kv, g, d), k) / math.sqrt(d)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    out[i] = np.einsum("kgs,skd->kgd", pr, v).reshape(h, d)
  return out


def _attn_fn(impl: str, layer: int, bp: int, interpret: bool):
  from pallas_kernels.paged_attention import AttentionInputs, ragged_paged_attention

  def f(q, k_pool, v_pool, meta):
    return ragged_paged_attention(q, k_pool, v_pool, layer, AttentionInputs(**meta, block_pages=bp),
                                  implementation=impl, interpret=interpret)

  return f


def stage_attention(ctx: Ctx) -> tuple[bool, str]:
  from pallas_kernels.paged_attention import api as pa

  if ctx.dry:
    maxlen, iters, rounds = 160, 2, 2
    cases = [("smollm2", 4, "random", "bfloat16"), ("smollm2", 4, "one_long", "float32"),
             ("llama8b", 2, "random", "bfloat16")]
  else:
    maxlen, iters, rounds = 2048, 20, 7
    cases = [(m, r, pat, "bfloat16") for m in ("smollm2", "llama8b") for r in (8, 32)
             for pat in ("random", "one_long")]
    cases.insert(1, ("smollm2", 8, "random", "float32"))
  res = {"maxlen": maxlen, "page_size": 16, "iters_per_call": iters, "rounds": rounds,
         "criteria": {"bfloat16": "kernel err <= 1.5 x reference err + 2^-12 x max|exact|",
                      "float32": "kernel err <= 4 x reference err + 2^-16 x max|exact|"},
         "cases": []}
  ctx.data["attention"] = res
  failures = []
  rng = np.random.default_rng(2)
  key = jax.random.PRNGKey(2)
  cut = False
  for model, r, pattern, dt_name in cases:
    if ctx.over(keep=5):
      cut = True
      break
    key, sub = jax.random.split(key)
    c = _attn_case(model, r, pattern, jnp.dtype(dt_name), maxlen, 16, rng, sub)
    h, kv, d = ATTN_MODELS[model]
    row = {"model": model, "H": h, "KV": kv, "hd": d, "R": r, "pattern": pattern,
           "dtype": dt_name, "lane_len": [int(v) for v in c["lens"]]}
    label = f"{model} R={r} {pattern} {dt_name}"
    reason = pa.unavailable_reason(c["q"], c["k_pool"], implementation="mosaic_gpu",
                                   interpret=ctx.interpret)
    if reason:
      row["mosaic_gpu"] = f"unavailable: {reason}"
      failures.append(f"{label}: mosaic_gpu unavailable: {reason}")
      res["cases"].append(row)
      log(f"  {label}: mosaic_gpu unavailable: {reason}")
      continue
    args = (c["q"], c["k_pool"], c["v_pool"], c["meta"])
    fns = {impl: _attn_fn(impl, c["layer"], c["block_pages"], ctx.interpret)
           for impl in ("reference", "mosaic_gpu")}
    tasks = {impl: (f, args) for impl, f in fns.items()}
    tasks.update({f"{impl}_loop": (_attn_loop(f, iters), args) for impl, f in fns.items()})
    compiled = _compile_all(tasks, _threads(ctx))
    bad = {n: v for n, v in compiled.items() if isinstance(v, Exception)}
    if bad:
      row["errors"] = {n: _err(v) for n, v in bad.items()}
      failures.append(f"{label}: {next(iter(row['errors'].items()))}")
      res["cases"].append(row)
      log(f"  {label}: errors {row['errors']}")
      continue
    if ctx.dry:  # the kernel path with interpret=False, lowered for CUDA (no GPU needed)
      low = _cuda_lowering({"mosaic_gpu": (_attn_fn("mosaic_gpu", c["layer"], c["block_pages"],
                                                    False), args)})["mosaic_gpu"]
      row["cuda_lowering"] = low
      if not low.startswith("ok"):
        failures.append(f"{label}: CUDA lowering: {low[:150]}")
    exact = _attn_exact(c)
    ymax = float(np.max(np.abs(exact)))
    out = {impl: np.asarray(compiled[impl](*args).astype(jnp.float32), np.float64)
           for impl in fns}
    err = {impl: float(np.max(np.abs(o - exact))) for impl, o in out.items()}
    if dt_name == "float32":
      bound = 4 * err["reference"] + 2.0**-16 * ymax
    else:
      bound = 1.5 * err["reference"] + 2.0**-12 * ymax
    idle = [i for i, n in enumerate(c["lens"]) if n == 0]
    zeros_ok = all(np.all(out["mosaic_gpu"][i] == 0) for i in idle)
    ok = bool(np.all(np.isfinite(out["mosaic_gpu"]))) and err["mosaic_gpu"] <= bound and zeros_ok
    row.update(ref_err=err["reference"], kernel_err=err["mosaic_gpu"], bound=bound,
               max_abs_exact=ymax, idle_lanes_zero=zeros_ok,
               kernel_vs_reference=float(np.max(np.abs(out["mosaic_gpu"] - out["reference"]))),
               numerics="pass" if ok else "FAIL")
    if not ok:
      failures.append(f"{label}: kernel err {err['mosaic_gpu']:.3g} > bound {bound:.3g}"
                      + ("" if zeros_ok else " (idle lane not zero)"))
    try:
      calls = {impl: (lambda c_=compiled[f"{impl}_loop"], a=args: c_(*a)) for impl in fns}
      times = _interleaved(calls, rounds, ctx, min_rounds=min(3, rounds))
      med = {impl: statistics.median(ts) / iters for impl, ts in times.items()}
      row["ms"] = {impl: 1e3 * v for impl, v in med.items()}
      row["ratio_kernel_to_reference"] = med["mosaic_gpu"] / med["reference"]
      kv_bytes = 2 * int(c["lens"].sum()) * kv * d * jnp.dtype(dt_name).itemsize
      row["kernel_GBps"] = kv_bytes / med["mosaic_gpu"] / 1e9
    except Exception as e:  # noqa: BLE001
      row["timing_error"] = _err(e)
      failures.append(f"{label}: timing {_err(e, 150)}")
    res["cases"].append(row)
    log(f"  {label}: err kernel {err['mosaic_gpu']:.2e} ref {err['reference']:.2e} bound "
        f"{bound:.2e} -> {row['numerics']}; time kernel/ref "
        f"{row.get('ratio_kernel_to_reference', float('nan')):.2f} "
        f"({row.get('ms', {}).get('mosaic_gpu', float('nan')):.3f} ms vs "
        f"{row.get('ms', {}).get('reference', float('nan')):.3f} ms)")
    del compiled, c, args
  res["budget_cut"] = cut
  res["failures"] = failures
  _write_json(ctx.out / "attention_gpu.json", res)
  timed = [x for x in res["cases"] if "ratio_kernel_to_reference" in x]
  npass = sum(x.get("numerics") == "pass" for x in res["cases"])
  line = f"numerics {npass}/{len(res['cases'])} pass"
  if timed:
    line += "; kernel/reference time " + ", ".join(
      f"{x['model'][:5]} R{x['R']} {x['pattern'][:4]}{'' if x['dtype'] == 'bfloat16' else ' f32'} "
      f"{x['ratio_kernel_to_reference']:.2f}" for x in timed)
  line += f"; {len(res['cases'])}/{len(cases)} cases" + (" (budget cut)" if cut else "")
  lows = [x["cuda_lowering"] for x in res["cases"] if "cuda_lowering" in x]
  if lows:
    n_ok = sum(v.startswith("ok") for v in lows)
    line += f"; CUDA lowering (interpret=False) {n_ok}/{len(lows)} ok"
  if failures:
    return False, f"{len(failures)} failure(s), first: {failures[0]} | {line}"
  return True, line


def _attn_loop(f, iters: int):
  def loop(q, k_pool, v_pool, meta):  # the output [R, H, hd] is the next query
    return jax.lax.fori_loop(0, iters, lambda _, q: f(q, k_pool, v_pool, meta).astype(q.dtype), q)

  return loop


# ---------------------------------------------------------------------------------------------
# 5. serve through HTTP
# ---------------------------------------------------------------------------------------------
def _pick_base(choice: str) -> tuple[str, pathlib.Path, dict, str]:
  """(label, base dir, {variant: delta dir} (3), note): the real SmolLM2 when it can be had
  without network, else the built-in nano family."""
  note = ""
  if choice in ("auto", "real"):
    try:
      from bitdelta_jax.zoo import shipped_real_family
      from bitdelta_jax.zoo.real_base import default_dir, import_real_base, is_complete, locate_gguf

      if not is_complete(default_dir()):
        locate_gguf(download=False)  # raises RealBaseUnavailable: no local copy
      base = import_real_base(download=False)
      try:
        _, variants, _ = shipped_real_family(download=False)
        variants = {n: p for n, p in variants.items() if (p / "manifest.json").exists()}
      except Exception:  # noqa: BLE001 - fall back to synthetic variants
        variants = {}
      if len(variants) < 3:
        from bench.common.random_models import make_variants

        variants = make_variants(base, pathlib.Path("/tmp/bitdelta_gpu_check/variants"))
      return "real SmolLM2-135M-Instruct", base, dict(list(variants.items())[:3]), note
    except Exception as e:  # noqa: BLE001
      if choice == "real":
        raise
      note = f"real base not available without network ({_err(e, 200)})"
  from bitdelta_jax.zoo import shipped_family

  base, variants = shipped_family()
  return "built-in nano family (bitdelta_jax/zoo/shipped)", base, dict(
    list(variants.items())[:3]), note


def _health(url: str) -> dict | None:
  from bench.common.server import health

  return health(url, timeout_s=3)


def _serve_help_has(flag: str) -> bool:
  p = subprocess.run([sys.executable, "-m", "bitdelta_jax.cli", "serve", "--help"],
                     capture_output=True, text=True, timeout=120, cwd=ROOT)
  if p.returncode != 0:
    raise RuntimeError(f"`bitdelta serve --help` failed ({p.returncode}): {p.stderr[-500:]}")
  return flag in p.stdout


class Server:
  """`bitdelta serve` as a subprocess: started right after the env stage, so that its warm-up
  (compiling every step program) runs beside the kernel stages; `stage_serve` waits for it."""

  def __init__(self, ctx: Ctx, base_choice: str):
    from bench.common.server import free_port

    self.proc = None
    self.log_path = ctx.out / "server.log"
    label, base, variants, note = _pick_base("nano" if ctx.dry and base_choice == "auto"
                                             else base_choice)
    self.variants = variants
    self.res = {"base": label, "base_dir": str(base), "note": note,
                "variants": {n: str(p) for n, p in variants.items()}}
    log(f"  serve: base {label}" + (f" ({note})" if note else ""))
    dtype = "bfloat16"
    has_dtype = _serve_help_has("--dtype")
    self.url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "bitdelta_jax.cli", "serve", "--base", str(base), "--port",
           self.url.rsplit(":", 1)[1], "--max-batch", "8", "--max-seq-len", "512",
           "--prefill-chunk", "64", "--device-slots", "4", "--kv-cache-mb", "512",
           "--base-name", "base",
           "--no-prefix-caching"]  # a repeated prompt must cost what its first run cost
    if has_dtype:
      cmd += ["--dtype", dtype]
    if ctx.dry:
      cmd += ["--no-warmup"]  # CPU: compile only the programs the requests need
    for n, p in variants.items():
      cmd += ["--variant", f"{n}={p}"]
    self.res.update(cmd=" ".join(cmd),
                    dtype=dtype if has_dtype else "server default (no --dtype)")
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    self._log = open(self.log_path, "w")  # closed in stop()
    self.t0 = time.monotonic()
    self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env=env)
    log(f"  serve: server starting in the background on {self.url} (pid {self.proc.pid})")
    self.healthy_after = None  # seconds from start to the first 200 on /health
    threading.Thread(target=self._poll, daemon=True).start()

  def _poll(self) -> None:
    while self.proc.poll() is None and self.healthy_after is None:
      if _health(self.url) is not None:
        self.healthy_after = time.monotonic() - self.t0
        log(f"  (serve: server healthy {self.healthy_after:.0f}s after its start)")
        return
      time.sleep(2)

  def wait_healthy(self, timeout: float) -> dict:
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"server exited with {self.proc.returncode} before /health; see "
                           f"{self.log_path}: {_tail(self.log_path)}")
      h = _health(self.url)
      if h is not None:
        return h
      if time.monotonic() > timeout:
        raise TimeoutError(f"server not healthy {time.monotonic() - self.t0:.0f}s after its "
                           f"start; see {self.log_path}: {_tail(self.log_path)}")
      time.sleep(1)

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(10)
    if not self._log.closed:
      self._log.close()
      _trim(self.log_path, 4 << 20)


def stage_serve(ctx: Ctx, server: Server | None, error: str | None) -> tuple[bool, str]:
  from bench.common.load import QUESTIONS, pct, serve

  if server is None:
    raise RuntimeError(f"the server could not be started: {error}")
  res = dict(server.res)
  ctx.data["serve"] = res
  url = server.url
  max_tokens = 8 if ctx.dry else 64
  n_single = 2 if ctx.dry else 4
  conc = 4 if ctx.dry else 8
  n_conc = 4 if ctx.dry else 16
  prompts = QUESTIONS
  names = list(server.variants)
  try:
    t_wait = time.monotonic()
    h = server.wait_healthy(ctx.stage_end - 45)
    res["server_start_s"] = server.healthy_after or time.monotonic() - server.t0
    res["waited_in_stage_s"] = time.monotonic() - t_wait
    res["health_at_start"] = h
    log(f"  server healthy {res['server_start_s']:.0f}s after its start (waited "
        f"{res['waited_in_stage_s']:.0f}s in this stage) on {url}")

    def measure(name, jobs, concurrency):
      """Warm once, then measure; once more if the server compiled during the measurement."""
      if ctx.over():
        res[name] = {"skipped": "stage budget"}
        return None
      serve(url, jobs, concurrency, max_tokens, warm=False)  # unmeasured
      for attempt in range(2):
        before = (_health(url) or {}).get("compiles_after_warmup")
        recs, wall = serve(url, jobs, concurrency, max_tokens, warm=False)
        after = (_health(url) or {}).get("compiles_after_warmup")
        compiled = None if before is None or after is None else after - before
        if not compiled or attempt == 1 or ctx.over():
          break
      tokens = sum(r["tokens"] for r in recs)
      lat = sum(r["latency"] for r in recs)
      ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
      out = {"requests": len(recs), "concurrency": concurrency, "tokens": tokens,
             "wall_s": wall, "tok_s": tokens / (lat if concurrency == 1 else wall),
             "ttft_p50_ms": 1e3 * pct(ttft, 50) if ttft else None,
             "ttft_max_ms": 1e3 * max(ttft) if ttft else None,
             "compiles_during_measure": compiled, "attempts": attempt + 1}
      empty = [i for i, r in enumerate(recs) if r["tokens"] <= 0]
      if empty:
        out["empty_requests"] = empty
      res[name] = out
      log(f"  {name}: {out['tok_s']:.1f} tok/s, TTFT p50 {out['ttft_p50_ms'] or float('nan'):.0f}"
          f" ms ({len(recs)} requests x {max_tokens} tokens, concurrency {concurrency}"
          + (f", compiles during measure {compiled}" if compiled else "") + ")")
      return out

    measure("single_stream", [("base", p) for p in prompts[:n_single]], 1)
    base_jobs = [("base", p) for p in prompts[:n_conc]]
    mixed_jobs = [(names[i % len(names)], p) for i, p in enumerate(prompts[:n_conc])]
    measure("concurrent_base", base_jobs, conc)
    measure("concurrent_mixed3", mixed_jobs, conc)
    measure("concurrent_base_again", base_jobs, conc)
    res["health_at_end"] = _health(url)
  finally:
    server.stop()
  bases = [res[k]["tok_s"] for k in ("concurrent_base", "concurrent_base_again")
           if isinstance(res.get(k), dict) and "tok_s" in res[k]]
  if bases and isinstance(res.get("concurrent_mixed3"), dict) and "tok_s" in res[
      "concurrent_mixed3"]:
    res["mixed3_over_base"] = res["concurrent_mixed3"]["tok_s"] / statistics.mean(bases)
  _write_json(ctx.out / "serve_gpu.json", res)
  problems = [f"{k}: empty responses {v['empty_requests']}" for k, v in res.items()
              if isinstance(v, dict) and v.get("empty_requests")]
  problems += [f"{k}: skipped (budget)" for k, v in res.items()
               if isinstance(v, dict) and v.get("skipped")]
  s, c8, mx = (res.get(k) or {} for k in ("single_stream", "concurrent_base", "concurrent_mixed3"))
  line = (f"{res['base'].split(' (')[0]}, {res['dtype']}: single {s.get('tok_s', float('nan')):.1f}"
          f" tok/s (TTFT p50 {s.get('ttft_p50_ms') or float('nan'):.0f} ms), {conc} concurrent "
          f"{c8.get('tok_s', float('nan')):.1f} tok/s (TTFT p50 "
          f"{c8.get('ttft_p50_ms') or float('nan'):.0f} ms), mixed 3 variants "
          f"{mx.get('tok_s', float('nan')):.1f} tok/s = "
          f"{res.get('mixed3_over_base', float('nan')):.2f} x base")
  if problems:
    return False, "; ".join(problems) + " | " + line
  return True, line


def _tail(path: pathlib.Path, n: int = 800) -> str:
  try:
    return path.read_text(errors="replace")[-n:].replace("\n", " | ")
  except OSError:
    return ""


def _trim(path: pathlib.Path, limit: int) -> None:
  try:
    if path.stat().st_size > limit:
      data = path.read_bytes()
      path.write_bytes(b"[... trimmed ...]\n" + data[-limit:])
  except OSError:
    pass


# ---------------------------------------------------------------------------------------------
# report, summary, driver
# ---------------------------------------------------------------------------------------------
def write_report(ctx: Ctx) -> None:
  L = ["# bitdelta-jax GPU check", ""]
  env = ctx.data.get("env") or {}
  if env:
    devs = env.get("devices") or [{}]
    L += [f"jax {env.get('jax_version')} ({env.get('backend')}), {devs[0].get('kind')} "
          f"(cc {devs[0].get('compute_capability')}), Python {env.get('python')}, "
          f"dry run: {ctx.dry}.", ""]
  num = ctx.data.get("kernel_numerics")
  if num and num.get("cases"):
    impls = list(num.get("counts", {}))
    L += ["## delta_matmul numerics (max abs error vs float64; ratio = error / bound)", "",
          "| K x N | M | dtype | mode | ref err | bound | " + " | ".join(impls) + " |",
          "|---|---|---|---|---|---|" + "---|" * len(impls)]
    for c in num["cases"]:
      cells = [_short(c["impl"][n]) if n in c.get("impl", {}) else "-" for n in impls]
      L.append(f"| {c['K']}x{c['N']} | {c['M']} | {c['dtype']} | {c['mode']} | "
               f"{c.get('ref_err', float('nan')):.2e} | {c.get('bound', float('nan')):.2e} | "
               + " | ".join(cells) + " |")
    L.append("")
  bench = ctx.data.get("kernel_bench")
  if bench and bench.get("rows"):
    names = sorted({n for r in bench["rows"] for n in r.get("ratio_to_base", {})})
    L += [f"## delta_matmul speed, bf16 (copy {bench.get('copy_GBps', 0):.0f} GB/s); "
          "latency / base (net of the chain floor in brackets), GB/s", "",
          "| K x N | M | base us | floor us | base GB/s | " + " | ".join(names) + " |",
          "|---|---|---|---|---|" + "---|" * len(names)]
    for r in bench["rows"]:
      cells = []
      for n in names:
        if n in r.get("ratio_to_base", {}):
          net = r.get("net_ratio_to_base", {}).get(n)
          cells.append(f"{r['ratio_to_base'][n]:.2f} ({'-' if net is None else f'{net:.2f}'}), "
                       f"{r['GBps'][n]:.0f}")
        else:
          cells.append((r["errors"].get(n) or "-")[:30])
      L.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['ms'].get('base', float('nan')) * 1e3:.1f} "
               f"| {r['ms'].get('floor', float('nan')) * 1e3:.1f} | "
               f"{r.get('base_GBps', float('nan')):.0f} | " + " | ".join(cells) + " |")
    L.append("")
  att = ctx.data.get("attention")
  if att and att.get("cases"):
    L += ["## paged attention, decode-only: mosaic_gpu vs reference", "",
          "| model | R | lanes | dtype | kernel err | ref err | bound | numerics | kernel ms | "
          "ref ms | kernel/ref | kernel GB/s |", "|---" * 12 + "|"]
    for x in att["cases"]:
      ms = x.get("ms", {})
      L.append(f"| {x['model']} | {x['R']} | {x['pattern']} | {x['dtype']} | "
               f"{x.get('kernel_err', float('nan')):.2e} | {x.get('ref_err', float('nan')):.2e} | "
               f"{x.get('bound', float('nan')):.2e} | "
               f"{x.get('numerics') or x.get('mosaic_gpu') or x.get('errors')} | "
               f"{ms.get('mosaic_gpu', float('nan')):.3f} | {ms.get('reference', float('nan')):.3f}"
               f" | {x.get('ratio_kernel_to_reference', float('nan')):.2f} | "
               f"{x.get('kernel_GBps', float('nan')):.0f} |")
    L.append("")
  L += gpu_prefill.report_lines(ctx)
  srv = ctx.data.get("serve")
  if srv:
    L += [f"## serve over HTTP: {srv.get('base')}, dtype {srv.get('dtype')}", "",
          f"Server start {srv.get('server_start_s', float('nan')):.0f} s. `{srv.get('cmd')}`", "",
          "| scenario | requests | concurrency | tokens/s | TTFT p50 ms | compiles in measure |",
          "|---|---|---|---|---|---|"]
    for k in ("single_stream", "concurrent_base", "concurrent_mixed3", "concurrent_base_again"):
      v = srv.get(k)
      if isinstance(v, dict) and "tok_s" in v:
        L.append(f"| {k} | {v['requests']} | {v['concurrency']} | {v['tok_s']:.1f} | "
                 f"{v['ttft_p50_ms'] or float('nan'):.0f} | {v['compiles_during_measure']} |")
    if "mixed3_over_base" in srv:
      L += ["", f"Mixed over 3 variants / base: {srv['mixed3_over_base']:.2f}."]
    L.append("")
  (ctx.out / "report.md").write_text("\n".join(L) + "\n")


def summary_text(ctx: Ctx, running: str | None = None) -> str:
  env = ctx.data.get("env") or {}
  devs = env.get("devices") or [{}]
  head = (f"bitdelta-jax GPU check{' (DRY RUN, CPU interpret)' if ctx.dry else ''}: "
          f"{devs[0].get('kind') or '?'}, jax {jax.__version__} ({jax.default_backend()}), "
          f"{time.monotonic() - ctx.t_start:.0f} s so far")
  lines = [head, "-" * min(100, len(head))]
  for name in STAGES:
    r = ctx.results.get(name)
    if r is None:
      st = "RUNNING" if name == running else "pending"
      lines.append(f"{name:16s} {st}")
      continue
    detail = r.get("detail") or r.get("error") or ""
    lines.append(f"{name:16s} {r['status']:4s} {r['seconds']:5.0f}s  {detail}"[:400])
  srv = ctx.data.get("serve") or {}
  if srv.get("base"):
    lines.append(f"serve base model: {srv['base']}" + (f" ({srv['note']})" if srv.get('note')
                                                       else ""))
  bench = ctx.data.get("kernel_bench") or {}
  if bench.get("rows"):
    abbr = {"mosaic_gpu": "mosaic", "pallas_triton": "triton"}
    lines.append("delta_matmul latency / base jnp.dot, bf16, one variant / 3 variants mixed:")
    for k, n in dict.fromkeys((r["K"], r["N"]) for r in bench["rows"]):
      cells = []
      for r in bench["rows"]:
        if (r["K"], r["N"]) == (k, n):
          rs = r.get("ratio_to_base", {})
          cell = " ".join(
            f"{abbr[i]} {rs.get(f'{i}_single', float('nan')):.2f}/"
            f"{rs.get(f'{i}_mixed', float('nan')):.2f}" for i in GPU_DELTA_IMPLS
            if f"{i}_single" in rs or f"{i}_mixed" in rs)
          cells.append(f"M{r['M']}: {cell or '-'}")
      lines.append(f"  {k}x{n}: " + " | ".join(cells))
  failed = [n for n, r in ctx.results.items() if r["status"] == "FAIL"]
  lines.append(f"files: {ctx.out}/ (env.json kernel_gpu.json attention_gpu.json serve_gpu.json "
               "report.md server.log summary.txt log.txt)")
  if ctx.interrupted:
    lines.append("RESULT: INTERRUPTED (timeout?) - stages not run: " + ", ".join(
      n for n in STAGES if n not in ctx.results) + (
      "; FAILED stages: " + ", ".join(failed) if failed else ""))
  elif running is None:
    lines.append("RESULT: " + ("FAILED stages: " + ", ".join(failed) if failed else
                               "all stages that ran passed"))
  return "\n".join(lines) + "\n"


def run_stage(ctx: Ctx, name: str, fn, budget: float) -> dict:
  later = [s for s in STAGES[STAGES.index(name) + 1:]]
  reserve = sum(RESERVE.get(s, 0) for s in later)
  now = time.monotonic()
  ctx.stage_end = min(now + budget, ctx.deadline - reserve)
  ctx.stage_end = max(ctx.stage_end, now + 10)
  log(f"\n=== STAGE {name} (budget {ctx.stage_end - now:.0f}s) ===")
  (ctx.out / "summary.txt").write_text(summary_text(ctx, running=name))
  t0 = time.monotonic()
  try:
    ok, detail = fn(ctx)
    rec = {"status": "PASS" if ok else "FAIL", "detail": detail}
  except KeyboardInterrupt as e:  # the wrapper's timeout (SIGTERM) or Ctrl-C
    ctx.results[name] = {"status": "FAIL", "seconds": time.monotonic() - t0,
                         "error": f"interrupted ({e}) after {time.monotonic() - t0:.0f}s"}
    raise
  except Exception as e:  # noqa: BLE001 - a stage's crash is its failure; later stages run
    tb = traceback.format_exc()
    log(tb)
    rec = {"status": "FAIL", "error": _err(e, 1500), "traceback": tb[-4000:]}
  rec["seconds"] = time.monotonic() - t0
  ctx.results[name] = rec
  if rec["status"] == "FAIL":
    log(f"!!! STAGE {name} FAILED: {rec.get('detail') or rec.get('error')}")
  else:
    log(f"--- STAGE {name} passed in {rec['seconds']:.0f}s: {rec['detail']}")
  try:
    write_report(ctx)
  except Exception as e:  # noqa: BLE001 - the report must not fail a stage
    log(f"(report.md not written: {_err(e)})")
  (ctx.out / "summary.txt").write_text(summary_text(ctx))
  return rec


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=pathlib.Path, default=None,
                  help="output folder (default /tmp/gpu_check, or /tmp/gpu_dry with --dry-run)")
  ap.add_argument("--dry-run", action="store_true",
                  help="CPU: interpret mode, tiny shapes, nano model (checks this script)")
  ap.add_argument("--only", nargs="+", choices=STAGES, help="run only these stages (env always)")
  ap.add_argument("--deadline-s", type=float, default=None,
                  help="seconds for the whole run (default 380 on GPU, 1500 dry)")
  ap.add_argument("--base", choices=("auto", "real", "nano"), default="auto",
                  help="serve stage base model (auto: real SmolLM2 if found offline, else nano; "
                       "the dry run takes nano unless told otherwise)")
  args = ap.parse_args(argv)
  out = args.out or pathlib.Path("/tmp/gpu_dry" if args.dry_run else "/tmp/gpu_check")
  out.mkdir(parents=True, exist_ok=True)
  deadline_s = args.deadline_s or (1500 if args.dry_run else 380)
  ctx = Ctx(out=out, dry=args.dry_run, interpret=args.dry_run,
            deadline=time.monotonic() + deadline_s)

  def on_term(signum, _frame):  # the wrapper's timeout: unwind (stops the server), keep files
    raise KeyboardInterrupt(f"signal {signum}")

  signal.signal(signal.SIGTERM, on_term)
  budgets = DRY_BUDGETS if args.dry_run else BUDGETS
  server: list = [None, None]  # Server, or None and why not
  fns = {"env": stage_env, "kernel_numerics": stage_kernel_numerics,
         "kernel_bench": stage_kernel_bench, "attention": stage_attention,
         "prefill": lambda c: gpu_prefill.stage_prefill(c, sys.modules[__name__]),
         "serve": lambda c: stage_serve(c, *server)}
  log(f"gpu_check: out={out} dry_run={args.dry_run} deadline {deadline_s:.0f}s")
  try:
    for name in STAGES:
      if name != "env" and args.only and name not in args.only:
        ctx.results[name] = {"status": "SKIP", "detail": "not selected (--only)", "seconds": 0}
        continue
      rec = run_stage(ctx, name, fns[name], budgets[name])
      if name == "env" and rec["status"] == "FAIL":
        log("!!! env failed: not running the other stages (they would not test a GPU)")
        for s in STAGES[1:]:
          ctx.results[s] = {"status": "SKIP", "detail": "env failed", "seconds": 0}
        break
      if name == "env" and (not args.only or "serve" in args.only):
        try:  # its warm-up compiles while the kernel stages run
          server[0] = Server(ctx, args.base)
        except Exception as e:  # noqa: BLE001 - the serve stage reports it
          log(f"!!! could not start the server: {_err(e)}")
          server[1] = _err(e, 1500)
  except KeyboardInterrupt as e:
    log(f"!!! interrupted ({e}): writing what finished")
    ctx.interrupted = True
  finally:
    if server[0] is not None:
      server[0].stop()
    with contextlib.suppress(Exception):
      write_report(ctx)
    if ctx.data.get("env") is not None:  # the stage records travel in env.json (8 files at most)
      _write_json(out / "env.json", {**ctx.data["env"], "stages": ctx.results})
    text = summary_text(ctx)
    (out / "summary.txt").write_text(text)
    log("\n" + "=" * 100)
    log(text)
  failed = [n for n, r in ctx.results.items() if r["status"] == "FAIL"]
  if ctx.interrupted:  # compile threads may still run in XLA: skip the interpreter's teardown
    sys.stdout.flush()
    os._exit(1)
  return 1 if failed or len(ctx.results) < len(STAGES) else 0


if __name__ == "__main__":
  sys.exit(main())
