"""CPU path over a ggml-quantized base: ``x · dequant(W_q)`` and every slot's 1-bit delta in one
call, the blocks dequantized in registers.

Why: a decode step reads every weight once for a handful of rows, so its time is the weight
bytes and the work of turning them into numbers; Q8_0 / Q4_0 / Q4_1 blocks are 1.06 / 0.56 /
0.63 bytes per weight against 4 for f32. ``cpu_rows_kernel.cc`` reads each block once per pass
of up to 16 rows, widens its values to f32 per 8 columns in registers (AVX2), sums up to 8 rows'
products over the block in registers and scales them by d at the block's end (+ m·Σx for
Q4_1); a slot present in the batch adds ``α ⊙ (x·S)`` in one pass over its bit plane (table
lookups of the x sums per packed byte). With int8 activations (the default) the f32 widening and
FMAs give way to integer products, int32 per block: on AVX-512 VNNI + VBMI CPUs vpdpbusd (4 K
rows of a column per lane: each quad of byte rows transposed by two byte permutes, 64
multiply-adds an instruction), elsewhere AVX2 vpmaddubsw / vpmaddwd on weights interleaved per
column over pairs of K rows; both give the same bits. Threads split the columns, then K. More than 16 rows
(prefill chunks, any number): passes of 16 rows over the blocks; measured on 2 busy cores
at 64 rows, K = N = 4096, the plain product runs as fast as the reference's dequantize + XLA
GEMM and a 4-slot bank ~5x faster (the reference computes every slot for every row), so the
kernel keeps prefill chunks too (an earlier run of bench/kernels/quant_kernel.py --bf16). At 544
and 2048 rows (K 4096, N 11008, f32 x, 2 quiet AVX-512 cores) it takes 0.97-1.01x the
reference's time at Q4_0 and 1.16-1.18x at Q8_0, without the reference's dequantized f32
matrix (180 MB for that shape; 500 MB for a 7B LM head): a step of more than 512 rows used to
take the reference, and its temporaries were the largest part of a 7B server's warm-up peak.

Numerics: two activation modes (`activations_for`; ``$BITDELTA_QUANT_ACTIVATIONS``). ``f32``:
x stays f32, f32 products and sums in another order than `reference.quant_matmul_reference`
(agrees to f32 rounding), on request. ``int8`` (the default, as llama.cpp's CPU path; ``auto``
takes it for q4_0 / q4_1 only, where it is faster): the
base product's x quantized per row and 32-block as ggml's Q8_0 with an f32 scale (d = max|x|/127,
round to nearest even), integer products summed exactly in int32 per block, then
(d_w·d_x)·Σ (+ m_w·d_x·Σq_x for Q4_1, ggml's Q8_1 sum) in f32: x's rounding costs ~0.5% of y's
L2 on Gaussian x (tests/kernels/test_quant_matmul_int8.py); on the real SmolLM2 Q4_1 model
max |Δlogit| 1.3 (logits up to ~40), next-token argmax equal at 64 of 66 positions, KL 4e-3
nats on average (bench/results/kernels/quant_kernel_logits.md). The delta term keeps f32 x. y f32.

Backend: host CPU, built on first use like `delta_matmul.cpu_rows` (``g++ -O3 -march=native``,
the shared pool, ``$BITDELTA_CPU_THREADS``); ``BITDELTA_QUANT_ROWS=0`` turns it off (read when
a program is traced).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import settings
from pallas_kernels.bits import group_k_for
from pallas_kernels.native import registry
from pallas_kernels.native.registry import NativeKernel

from .blocks import BLOCK, FORMATS, QuantizedKernel
from .formats import FORMATS as TABLE
from .reference import reference_grads, with_reference_vjp

ACTIVATIONS = ("f32", "int8")
# by format, from bench/results/kernels/quant_kernel.md (2 AVX2 cores shared with other work; rows 1
# and 8, four shapes): int8 x takes q4_0 to a median 0.61x (0.36-0.72) of the f32-activation
# time and q4_1 to 0.82x (0.55-0.85); q8_0's vpmaddwd + vpaddd do 16 multiply-adds in two
# instructions, as two FMAs: a median 0.83x but 0.60-1.35 (slower at 8 rows on the large
# shapes), so q8_0 keeps f32 x
# ``auto``: the faster mode per format on the measured machines (bench/results/kernels/quant_kernel.md).
# The default is int8, as llama.cpp's CPU path computes (its vec_dot_type for these formats is
# Q8_0/Q8_1): the request for the f32 path's exact tokens was withdrawn (issue 49); its cost is
# measured instead: on the real SmolLM2 Q4_1 model argmax equal at 64/66 positions, KL 4e-3
# (bench/results/kernels/quant_kernel_logits.md), and the real variants' task points served through
# this kernel with each mode in bench/results/fidelity/fidelity_quant.md. f32 on request
# (``BITDELTA_QUANT_ACTIVATIONS=f32``).
FASTEST_ACTIVATIONS = {f.name: f.fastest_activations for f in TABLE.values()}
DEFAULT_ACTIVATIONS = settings.SETTINGS["BITDELTA_QUANT_ACTIVATIONS"].default  # int8
_SOURCE = pathlib.Path(__file__).with_name("cpu_rows_kernel.cc")
_TARGET = "bitdelta_quant_rows"
_MANY_TARGET = "bitdelta_quant_rows_many"  # several products of one x in one call


KERNELS = (NativeKernel("quant_rows", _SOURCE, ((_TARGET, "BitdeltaQuantRows"),
                                                (_MANY_TARGET, "BitdeltaQuantRowsMany")),
                        "the quantized CPU rows kernel"),)


def _load() -> str | None:
  """Builds and registers the kernel once; None, or why it cannot run here."""
  return registry.load(KERNELS[0])[1]


def build_target(arch: tuple[str, ...], target: str) -> None:
  """Builds the kernel with target flags ``arch`` (``()``: portable vectors) and registers it
  as ``target`` (pass it to `rows_call`; its many-products entry as ``target + "_many"``, for
  `rows_call_many`): for tests of the paths this machine's build skips."""
  registry.build_variant(KERNELS[0], arch, target)


_AMX_STATUS = {1: None, 0: "the native build has no AMX path (the CPU or the compiler lacks "
                "AMX-INT8)", -1: "turned off by BITDELTA_AMX=0",
               -2: "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"}


def amx_unavailable_reason() -> str | None:
  """None where int8 activations of 6 rows or more run on AMX tiles here, else why not."""
  lib, reason = registry.load(KERNELS[0])
  if reason is not None or lib is None:
    return reason or "the kernel is not built"
  return _AMX_STATUS[int(lib.BitdeltaQuantRowsAmx())]


def amx_in_use() -> bool:
  """Whether int8 activations of 6 rows or more run on AMX tiles here: the CPU has AMX-INT8,
  the native build has it and Linux granted the tile state."""
  return amx_unavailable_reason() is None


def unavailable_reason() -> str | None:
  """None if the kernel can run in this process (one CPU device, built), else why not."""
  from pallas_kernels.platform import target_platform

  if not settings.get("BITDELTA_QUANT_ROWS"):
    return "turned off by BITDELTA_QUANT_ROWS=0"
  if target_platform() != "cpu":
    return f"the quantized rows kernel runs on the host CPU; the target platform is {target_platform()!r}"
  if jax.device_count() != 1:
    return (f"the quantized rows kernel runs on one device; this process has "
            f"{jax.device_count()} (its FFI call does not partition)")
  return _load()


def shapes_supported(rows: int, qk: QuantizedKernel) -> str | None:
  """None if the kernel takes ``rows`` rows times ``qk``, else why not."""
  if qk.format not in FORMATS:
    return f"format {qk.format!r}: the quantized rows kernel takes {', '.join(FORMATS)}"
  k, n = qk.shape
  if k % BLOCK:
    return f"K={k} is not a multiple of the {BLOCK}-weight block"
  if rows < 1:
    return f"{rows} rows: the quantized rows kernel takes 1 or more"
  f = TABLE[qk.format]
  want = jnp.uint8 if f.nibbles else jnp.int8
  if qk.qs.dtype != want or qk.qs.shape != (k // BLOCK, f.qs_rows, n):
    return f"qs {qk.qs.dtype}{tuple(qk.qs.shape)} is not {qk.format}'s column-block layout"
  return None


def activations_for(fmt: str, activations: str | None = None) -> str:
  """The activations a product over ``fmt`` blocks runs with: ``activations`` if given, else
  ``$BITDELTA_QUANT_ACTIVATIONS`` (``f32`` | ``int8`` | ``auto``: `FASTEST_ACTIVATIONS` of the
  format; read when a program is traced), else `DEFAULT_ACTIVATIONS` (int8). Every row count of
  a call takes
  the same mode, so a token's numbers do not depend on whether it came in a prompt chunk or a
  decode step."""
  mode = activations or settings.get("BITDELTA_QUANT_ACTIVATIONS")
  if mode == "auto":
    mode = FASTEST_ACTIVATIONS[fmt]
  if mode not in ACTIVATIONS:
    raise ValueError(f"quantized activations {mode!r}: choose from {ACTIVATIONS} or 'auto'")
  return mode


def rows_call(x: jax.Array, qk: QuantizedKernel, bits: jax.Array | None = None,
              scale: jax.Array | None = None, slot_ids: jax.Array | None = None, *,
              group_k: int = 8, target: str = _TARGET,
              activations: str | None = None) -> jax.Array:
  """f32 ``[M, N]``: ``x · dequant(qk)`` plus, for each row m with ``slot_ids[m] > 0``,
  ``α_s ⊙ (x[m] · S_s)``. One variant for every row: bits ``[KP, N]``, scale ``[1|N]``,
  slot_ids None (read in place). A bank: bits ``[S, KP, N]``, scale ``[S, 1|N]``, slot_ids
  ``[M]`` (0: the base). bits None: the plain product (no zero bank is built). ``activations``
  (`activations_for`): ``"f32"`` keeps x; ``"int8"`` quantizes the base product's x per row
  and 32-block as ggml's Q8_0 (the delta term keeps f32 x). Differentiable in x and scale
  (the reference's backward pass, f32 x); the blocks are constants."""
  if target == _TARGET and (reason := _load()):
    raise NotImplementedError(reason)
  if reason := shapes_supported(x.shape[0], qk):
    raise NotImplementedError(reason)
  group_k = group_k_for(qk.shape[0], group_k)  # the group the bits were packed with
  act = activations_for(qk.format, activations)
  kernel = functools.partial(_kernel, group_k=group_k, target=target, act=act)
  return with_reference_vjp(kernel, group_k)(x, scale, qk, bits, slot_ids)


def _kernel(x, scale, qk, bits, slot_ids, *, group_k, target, act):
  m, n = x.shape[0], qk.shape[1]
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")
  d = qk.d.astype(jnp.float16)
  mins = d if qk.m is None else qk.m.astype(jnp.float16)  # q8_0 / q4_0: unread
  first = 0
  if bits is None:  # the plain product: one-element placeholders, no [S, KP, N] zeros
    bits = jnp.zeros((1, 1, 1), jnp.uint8)
    scale = jnp.zeros((1, 1), jnp.float32)
    slot_ids = jnp.zeros((1,), jnp.int32)
    delta = 0
  elif bits.ndim == 2:  # one variant: bank row 0 is slot 1, every row's slot
    bits = bits.reshape(1, *bits.shape)  # a view: no copy of the bits
    scale = jnp.broadcast_to(scale.astype(jnp.float32).reshape(-1), (n,)).reshape(1, n)
    slot_ids = jnp.ones((m,), jnp.int32)
    first, delta = 1, 1
  else:
    scale = jnp.broadcast_to(scale.astype(jnp.float32), (bits.shape[0], n))
    slot_ids = slot_ids.astype(jnp.int32)
    delta = 1
  return call(x.astype(jnp.float32), qk.qs, d, mins, bits.astype(jnp.uint8), scale, slot_ids,
              fmt=np.int64(TABLE[qk.format].kernel_id), group_k=np.int64(group_k),
              first_slot=np.int64(first), delta=np.int64(delta),
              act=np.int64(ACTIVATIONS.index(act)))


def many_unavailable_reason(x: jax.Array, qks, bits=None) -> str | None:
  """None if `rows_call_many` takes these products of ``x``, else why not."""
  if reason := unavailable_reason():
    return reason
  if not settings.get("BITDELTA_QUANT_ROWS_MANY"):
    return "turned off by BITDELTA_QUANT_ROWS_MANY=0"
  if len(qks) < 2:
    return "one product: the plain call"
  formats = {qk.format for qk in qks}
  if len(formats) > 1:
    return f"the products are in several formats ({sorted(formats)}): one call takes one"
  if len({qk.shape[0] for qk in qks}) > 1:
    return "the products have different K"
  if bits is not None and any(b is None or b.ndim != 3 for b in bits):
    return "a product without a slot bank beside ones with: separate calls"
  for qk in qks:
    if reason := shapes_supported(x.shape[0], qk):
      return reason
  return None


def rows_call_many(x: jax.Array, qks, bits=None, scales=None, slot_ids=None, *,
                   group_k: int = 8, target: str = _MANY_TARGET,
                   activations: str | None = None) -> list[jax.Array]:
  """`rows_call` of several weights of one ``x`` in one kernel call (a layer's q/k/v, its
  gate/up): x's int8 copy and block sums made once, one thread-pool run for every product's
  tasks; each result has exactly the bits of its own `rows_call` (every product splits its
  columns and K as its own call would). ``qks`` share K and the format; ``bits``/``scales``:
  None (plain products) or one bank per product (``[S, KP, N_i]``, ``[S, 1|N_i]``) with the
  shared ``slot_ids [M]``. Differentiable in x and the scales (the reference's backward
  pass)."""
  qks = tuple(qks)
  if target == _MANY_TARGET and (reason := many_unavailable_reason(x, qks, bits)):
    raise NotImplementedError(reason)
  group_k = group_k_for(qks[0].shape[0], group_k)
  act = activations_for(qks[0].format, activations)
  bits = None if bits is None else tuple(bits)
  scales = None if scales is None else tuple(scales)

  def kernel(x, scales, qks, bits, slot_ids):
    return _many_kernel(x, scales, qks, bits, slot_ids, group_k=group_k, target=target, act=act)

  @jax.custom_vjp
  def f(x, scales, qks, bits, slot_ids):
    return kernel(x, scales, qks, bits, slot_ids)

  def fwd(x, scales, qks, bits, slot_ids):
    return kernel(x, scales, qks, bits, slot_ids), (x, scales, qks, bits, slot_ids)

  def bwd(res, cts):
    x, scales, qks, bits, slot_ids = res
    grads = [reference_grads(ct, x, None if bits is None else scales[i], qk,
                             None if bits is None else bits[i], slot_ids, group_k)
             for i, (qk, ct) in enumerate(zip(qks, cts))]
    dx = sum((g[0] for g in grads[1:]), grads[0][0])
    ds = None if bits is None else tuple(g[1] for g in grads)
    return dx, ds, None, None, None

  f.defvjp(fwd, bwd)
  return list(f(x, scales, qks, bits, slot_ids))


def _many_kernel(x, scales, qks, bits, slot_ids, *, group_k, target, act):
  m = x.shape[0]
  call = jax.ffi.ffi_call(
    target, tuple(jax.ShapeDtypeStruct((m, qk.shape[1]), jnp.float32) for qk in qks),
    vmap_method="sequential")
  ops = []
  for i, qk in enumerate(qks):
    n = qk.shape[1]
    d = qk.d.astype(jnp.float16)
    ops += [qk.qs, d, d if qk.m is None else qk.m.astype(jnp.float16)]
    if bits is None:
      ops += [jnp.zeros((1, 1, 1), jnp.uint8), jnp.zeros((1, 1), jnp.float32)]
    else:
      ops += [bits[i].astype(jnp.uint8),
              jnp.broadcast_to(scales[i].astype(jnp.float32), (bits[i].shape[0], n))]
  slots = (jnp.zeros((1,), jnp.int32) if bits is None else slot_ids.astype(jnp.int32))
  return call(x.astype(jnp.float32), slots, *ops, fmt=np.int64(TABLE[qks[0].format].kernel_id),
              group_k=np.int64(group_k), first_slot=np.int64(0),
              delta=np.int64(0 if bits is None else 1), act=np.int64(ACTIVATIONS.index(act)))
