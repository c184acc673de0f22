"""Pallas GPU (Triton lowering) kernels for the fused 1-bit delta GEMM.

Why: decode is memory bound. Reading the base tile and the packed delta bits in the same pass,
and expanding the bits in registers, keeps HBM traffic at the base weights plus 1/16 of them
(bf16), instead of materialising ``W_eff = W + α ⊙ S`` or reading the weights twice.

Numerics: per K step (one bit-plane group of G rows) the program adds ``x_g · W_g`` and, for
each bit plane j, ``x_{g,j} · B_j`` with ``B_j ∈ {0, 1}`` (exact in bf16) to f32 accumulators;
the epilogue forms ``y = acc + α ⊙ (2·accB − rowsum(x))`` (α applied once, per row's slot),
then casts to ``x.dtype``. f32 inputs use ``Precision.HIGHEST`` (no TF32).

Backend: `pl.pallas_call` with the Triton lowering (``jax.experimental.pallas.triton``),
written for Hopper (H100/H200) and jax 0.10-0.11; every kernel body also runs under
``interpret=True`` on CPU, which is how CI tests it. Two entry points:

* `delta_matmul_single`: one variant for all rows.
* `delta_matmul_bank`: mixed variants. Rows are sorted by slot (a segment layout as in SGMV /
  ``ragged_dot``); each M tile loops over the slots its rows hold (a contiguous range after
  sorting), reading each slot's packed bits once per tile, while the base product of the tile
  is computed once for all its rows. Slot 0 (base only) is never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.bits import round_up

from .config import Config

try:  # jax >= 0.6 spelling; the Triton lowering is deprecated but present in 0.11.
  from jax.experimental.pallas import triton as pltriton

  _TritonParams = pltriton.CompilerParams
  _dot = pltriton.dot
except (ImportError, AttributeError):  # pragma: no cover - very old / future jax
  pltriton = None
  _TritonParams = None
  _dot = pl.dot


def shapes_supported(x_shape, w_shape, bits_shape, group_k: int) -> str | None:
  """None if the Triton kernels take these shapes, else a readable reason."""
  k, n = w_shape
  if len(x_shape) != 2 or x_shape[1] != k:
    return f"x must be [M, {k}], got {tuple(x_shape)}"
  p = group_k // 8
  if p < 16 or p & (p - 1):
    return (
      f"group_k={group_k} gives {p} packed rows per group; the Triton kernel needs a power of "
      "two >= 16 (tl.dot tile and power-of-two block sizes), i.e. group_k in {128, 256, ...}"
    )
  if bits_shape[-2] * 8 != round_up(k, group_k) or bits_shape[-1] != n:
    return f"bits {tuple(bits_shape)} do not match w_base {tuple(w_shape)} with group_k={group_k}"
  return None


def _kernel(
  x_ref,
  w_ref,
  bits_ref,
  scale_ref,
  slot_ref,
  o_ref,
  *,
  n_groups: int,
  group_k: int,
  block_m: int,
  block_n: int,
  banked: bool,
  precision,
):
  p = group_k // 8
  rows = pl.ds(pl.program_id(1) * block_m, block_m)
  cols = pl.ds(pl.program_id(0) * block_n, block_n)
  slots = slot_ref[rows]  # [BM] int32; rows sorted by slot when banked
  if banked:
    lo = jnp.maximum(jnp.min(slots), 1)  # slot 0 = base only: never read its bank entry
    hi = jnp.max(slots) + 1
  cdt = x_ref.dtype

  def plane_dots(x_g, b, mask=None):
    """sum_j x_{g,j} · B_j for one group; b is the [P, BN] uint8 tile."""
    out = jnp.zeros((block_m, block_n), jnp.float32)
    for j in range(8):
      x_j = x_g(j)
      if mask is not None:
        x_j = jnp.where(mask, x_j, jnp.zeros_like(x_j))
      plane = ((b >> j) & 1).astype(cdt)
      out += _dot(x_j, plane, precision=precision)
    return out

  def k_step(g, carry):
    acc, acc_b, rowsum = carry
    x_full = x_ref[rows, pl.ds(g * group_k, group_k)]
    acc += _dot(x_full, w_ref[pl.ds(g * group_k, group_k), cols], precision=precision)
    rowsum += jnp.sum(x_full.astype(jnp.float32), axis=1)
    x_g = lambda j: x_ref[rows, pl.ds(g * group_k + j * p, p)]
    if not banked:
      acc_b += plane_dots(x_g, bits_ref[0, pl.ds(g * p, p), cols])
    else:

      def slot_step(s, acc_b):
        mask = (slots == s)[:, None]
        return acc_b + plane_dots(x_g, bits_ref[s, pl.ds(g * p, p), cols], mask)

      acc_b = jax.lax.fori_loop(lo, hi, slot_step, acc_b)
    return acc, acc_b, rowsum

  zeros = jnp.zeros((block_m, block_n), jnp.float32)
  acc, acc_b, rowsum = jax.lax.fori_loop(
    0, n_groups, k_step, (zeros, zeros, jnp.zeros((block_m,), jnp.float32))
  )
  if not banked:
    alpha = jnp.broadcast_to(scale_ref[0, cols][None, :], (block_m, block_n))
  else:

    def alpha_step(s, alpha):
      return jnp.where((slots == s)[:, None], scale_ref[s, cols][None, :], alpha)

    alpha = jax.lax.fori_loop(lo, hi, alpha_step, zeros)
  y = acc + alpha * (2.0 * acc_b - rowsum[:, None])
  o_ref[...] = y.astype(o_ref.dtype)


def _pad_to(a, shape):
  pads = [(0, t - s) for s, t in zip(a.shape, shape, strict=True)]
  return a if all(p == (0, 0) for p in pads) else jnp.pad(a, pads)


def _fused(x, w_base, bits, scale, slots, *, group_k, banked, config, interpret):
  m, k = x.shape
  n = w_base.shape[1]
  bm, bn = config.block_m, config.block_n
  m_pad, n_pad, k_pad = round_up(m, bm), round_up(n, bn), bits.shape[-2] * 8
  # Aligned (real-model) shapes pass through untouched; others are zero padded: padded rows
  # of K have bit 0 and x = 0, padded columns and rows are sliced off.
  x_p = _pad_to(x, (m_pad, k_pad))
  w_p = _pad_to(w_base.astype(x.dtype), (k_pad, n_pad))
  bits_p = _pad_to(bits, (*bits.shape[:-1], n_pad))
  scale_p = _pad_to(
    jnp.broadcast_to(scale.astype(jnp.float32), (scale.shape[0], n)), (scale.shape[0], n_pad)
  )
  slots_p = _pad_to(slots.astype(jnp.int32), (m_pad,))
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  grid = (n_pad // bn, m_pad // bm)
  n_groups = k_pad // group_k
  itemsize = x.dtype.itemsize
  n_slots_read = 1 if not banked else max(1, min(m, bits.shape[0]))
  cost = pl.CostEstimate(
    flops=int(2 * m * k_pad * n * (1 + n_slots_read if banked else 2)),
    transcendentals=0,
    bytes_accessed=int(
      k_pad * n * itemsize * grid[1]  # base weights, once per M tile
      + n_slots_read * k_pad * n // 8  # packed bits, once per slot per M tile
      + m_pad * k_pad * itemsize * grid[0]
      + m * n * itemsize
    ),
  )
  kernel = functools.partial(
    _kernel,
    n_groups=n_groups,
    group_k=group_k,
    block_m=bm,
    block_n=bn,
    banked=banked,
    precision=precision,
  )
  compiler_params = None
  if _TritonParams is not None and not interpret:
    compiler_params = _TritonParams(num_warps=config.num_warps, num_stages=config.num_stages)
  out = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), x.dtype),
    grid=grid,
    out_specs=pl.BlockSpec((bm, bn), lambda i, j: (j, i)),
    compiler_params=compiler_params,
    interpret=interpret,
    name="bitdelta_bank_matmul" if banked else "bitdelta_delta_matmul",
    cost_estimate=cost,
  )(x_p, w_p, bits_p, scale_p, slots_p)
  return out[:m, :n]


def delta_matmul_single(
  x, w_base, bits, scale, *, group_k: int, config: Config | None = None, interpret: bool = False
):
  """y = x·W_base + α ⊙ (x·S) for one variant (bits ``[K_pad/8, N]``, scale ``[1|N]``)."""
  reason = shapes_supported(x.shape, w_base.shape, bits.shape, group_k)
  if reason:
    raise NotImplementedError(reason)
  config = config or Config.heuristic(x.shape[0], x.shape[1], w_base.shape[1], x.dtype.itemsize)
  slots = jnp.zeros((x.shape[0],), jnp.int32)
  return _fused(
    x,
    w_base,
    bits[None],
    scale[None],
    slots,
    group_k=group_k,
    banked=False,
    config=config,
    interpret=interpret,
  )


def delta_matmul_bank(
  x,
  w_base,
  bits,
  scale,
  slot_ids,
  *,
  group_k: int,
  config: Config | None = None,
  interpret: bool = False,
):
  """Mixed variants: bits ``[S, K_pad/8, N]``, scale ``[S, 1|N]``, slot_ids ``[M]`` (0 = base)."""
  reason = shapes_supported(x.shape, w_base.shape, bits.shape, group_k)
  if reason:
    raise NotImplementedError(reason)
  config = config or Config.heuristic(x.shape[0], x.shape[1], w_base.shape[1], x.dtype.itemsize)
  n_slots = bits.shape[0]
  # Out-of-range slots are treated as base only (like slot 0) rather than read out of bounds.
  slots = jnp.where((slot_ids < 0) | (slot_ids >= n_slots), 0, slot_ids).astype(jnp.int32)
  order = jnp.argsort(slots, stable=True)
  y_sorted = _fused(
    x[order],
    w_base,
    bits,
    scale,
    slots[order],
    group_k=group_k,
    banked=True,
    config=config,
    interpret=interpret,
  )
  return jnp.zeros_like(y_sorted).at[order].set(y_sorted)
