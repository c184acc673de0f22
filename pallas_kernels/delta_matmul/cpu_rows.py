"""CPU path for a few rows (decode steps): the base product and every slot's delta in one pass.

Why: a decode step multiplies a handful of rows by every weight matrix, so its time is the time
to read the weights. ``cpu_rows_kernel.cc`` streams W once per call with all cores (each thread
one contiguous block of K rows) and, for each slot present in the batch, turns the W tile into
``W + α ⊙ S`` in registers from the slot's bit plane: a variant costs its bits (1/32 of f32 W),
not a second kernel, and a batch of base rows needs no ``lax.cond`` around it. f32 or bf16 W
(bf16 widened exactly); x and y f32. `api.delta_matmul` takes it first for up to `MAX_ROWS`
rows on one CPU device, with or without deltas (bench/results/serving/cpu_decode.md); prefill chunks
keep XLA's GEMM + `cpu.fused_call` or `cpu.merged_call`.

Numerics: ``W + α⊙S`` rounded once to f32 per element, f32 products and sums in another order
than `reference.delta_matmul_reference` (agrees to rounding). Backend: host CPU; built on first
use like `cpu.py` (``g++ -O3 -march=native``, the shared pool, ``$BITDELTA_CPU_THREADS``);
``BITDELTA_CPU_ROWS=0`` turns it off (read when a program is traced).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import settings
from pallas_kernels.delta_matmul.reference import with_reference_vjp
from pallas_kernels.native import registry
from pallas_kernels.native.registry import NativeKernel

MAX_ROWS = 16
_SOURCE = pathlib.Path(__file__).with_name("cpu_rows_kernel.cc")
_TARGET = "bitdelta_delta_rows"


KERNELS = (NativeKernel("delta_rows", _SOURCE, ((_TARGET, "BitdeltaDeltaRows"),),
                        "the CPU rows kernel"),)


def _load() -> str | None:
  """Builds and registers the kernel once; None, or why it cannot run here."""
  return registry.load(KERNELS[0])[1]


def build_target(arch: tuple[str, ...], target: str) -> None:
  """Builds the kernel with target flags ``arch`` (``()``: portable vectors, no AVX-512) and
  registers it as ``target`` (pass it to `rows_call`): for tests of the paths this machine's
  native build does not take."""
  registry.build_variant(KERNELS[0], arch, target)


def unavailable_reason() -> str | None:
  """None if the kernel can run in this process (one CPU device, built), else why not.

  One device: the FFI call does not partition, so under a multi-device program XLA would gather
  every operand (`bitdelta_jax.sharding.ShardedDeltaMatmul` runs per-shard kernels instead)."""
  from pallas_kernels.platform import target_platform

  if not settings.get("BITDELTA_CPU_ROWS"):
    return "turned off by BITDELTA_CPU_ROWS=0"
  if target_platform() != "cpu":
    return f"the few-rows kernel runs on the host CPU; the target platform is {target_platform()!r}"
  if jax.device_count() != 1:
    return (f"the few-rows kernel runs on one device; this process has {jax.device_count()} "
            "(its FFI call does not partition)")
  return _load()


def shapes_supported(rows: int, x_dtype, w_dtype) -> str | None:
  """None if the kernel takes ``rows`` rows of these dtypes, else why not."""
  if not 1 <= rows <= MAX_ROWS:
    return f"{rows} rows: the few-rows kernel takes 1 to {MAX_ROWS}"
  for what, dtype in (("x", x_dtype), ("W", w_dtype)):
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
      return f"{what} is {jnp.dtype(dtype)}: the few-rows kernel takes f32 or bf16"
  return None


def usable(rows: int, x_dtype, w_dtype) -> bool:
  """Whether `api.delta_matmul` takes this kernel for ``rows`` rows of x·W (traced shapes)."""
  return unavailable_reason() is None and shapes_supported(rows, x_dtype, w_dtype) is None


def rows_call(x, w, bits=None, scale=None, slots=None, *, group_k: int = 8,
              target: str = _TARGET) -> jax.Array:
  """f32 ``[M, N]``: ``x·W`` plus, for each row m with ``slots[m] > 0``, ``α_s ⊙ (x[m]·S_s)``
  (s = slots[m]; 0 = base only). x ``[M, K]``; W ``[K, N]`` f32 or bf16; bits ``[S, KP, N]``
  uint8 in the group-local layout with ``group_k``; scale ``[S, N]`` (or ``[S, 1]``). One
  variant for every row: bits ``[KP, N]``, scale ``[1|N]``, slots None (read in place, no bank
  built around it). Without bits it is the plain product. Differentiable in x, W and α: the
  backward pass is the reference formula's (`reference.delta_matmul_reference`), as for the
  other kernels."""
  m, k = x.shape
  n = w.shape[1]
  if bits is None:
    bits = jnp.zeros((1, -(-k // 8), n), jnp.uint8)
    scale = jnp.zeros((1, n), jnp.float32)
    slots = jnp.zeros((m,), jnp.int32)
    group_k = -(-k // 8) * 8
  if w.dtype not in (jnp.float32, jnp.bfloat16):
    w = w.astype(jnp.float32)
  if target == _TARGET:
    reason = _load()
    if reason:
      raise NotImplementedError(reason)
  one = bits.ndim == 2  # one variant: bank row 0 is slot 1, every row's slot
  kernel = functools.partial(_kernel, group_k=group_k, target=target, one=one)
  scale = scale.astype(jnp.float32)
  if not one:
    scale = jnp.broadcast_to(scale, (bits.shape[0], n))
    slots = slots.astype(jnp.int32)
  return with_reference_vjp(kernel, group_k, f32=True)(x, w, scale, bits.astype(jnp.uint8), slots)


def _kernel(x, w, scale, bits, slots, *, group_k, target, one):
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                          vmap_method="sequential")
  if one:
    bits = bits.reshape(1, *bits.shape)  # a view: no copy of the bits
    scale = jnp.broadcast_to(scale, (w.shape[1],)).reshape(1, w.shape[1])
    slots = jnp.ones((x.shape[0],), jnp.int32)
  return call(x.astype(jnp.float32), w, bits, scale, slots, group_k=np.int64(group_k),
              first_slot=np.int64(1 if one else 0))
