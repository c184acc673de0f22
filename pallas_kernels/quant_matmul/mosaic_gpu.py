"""Mosaic GPU (Hopper wgmma) kernels: ``x · dequant(W_q)`` over ggml Q8_0 / Q4_0 / Q4_1 blocks,
plus the 1-bit delta term of each row's variant slot.

Why: a GGUF base is served as stored, so HBM holds and streams the blocks (1.06 / 0.56 / 0.63
bytes per weight against 2 for bf16) and a dense dequantized ``[K, N]`` never exists there (the
reference dequantizes the whole matrix every step). Each K step TMA-copies the step's blocks
(values, d, m) into shared memory; the CTA dequantizes them in registers, 64 rows per
wgmma-layout pass, into an SMEM tile in x's dtype: the wgmma B operand of ``x·W``. Everything
else (the TMA pipeline of the K loop, the bits expanded to ±1, the slot segments of a bank, the
epilogue, split K) is the delta GEMM's kernel (`pallas_kernels.delta_matmul.mosaic_gpu`): this
module supplies its base operand (`_Blocks`, a ``BaseOperand``) and the wrappers.

Numerics: x is bf16 or f16 (the wgmma operands are 16-bit and of one type). Each weight is
ggml's ``d·q`` / ``d·(q − 8)`` / ``d·q + m`` in f32, rounded once to x's dtype, so the product is
``x · round(dequant(W))`` with f32 sums: what a bf16 (f16) checkpoint of the dequantized weights
computes, not the f32 reference's ``x · dequant(W)`` (the rounding moves each weight by at most
2^-9 of itself in bf16, 2^-12 in f16). The delta term and the epilogue are the delta kernel's
(±1 exact; ``acc + α ⊙ acc_d`` in f32). The result is f32 (the api casts).

Backend: Pallas Mosaic GPU as the delta kernel (Lane semantics, one warpgroup, sm_90a), lowered
for CUDA from a CPU process; ``interpret=True`` runs the bodies in the Mosaic GPU interpreter.
Layout in SMEM: Q8_0's ``qs [K/32, 32, N]`` is the int8 ``[K, N]`` matrix (a reshape, one TMA
copy per step). In Q4_0 / Q4_1 byte j of a block holds weights j (low nibble) and j + 16: each
block's 16 byte rows are copied twice (from L2), to its rows 0..15 and 16..31 of a byte tile in
natural K order, and a row keeps its low or high nibble (bit 4 of the row index). ``d`` (and
``m``) ``[K/32, N]`` are one TMA copy of ``K_step/32`` rows; a 64-row pass spans two blocks and
takes each row's scale by a select. Shapes that are not tile multiples are zero padded by the
wrapper (zero blocks dequantize to 0), aligned ones pass untouched. The kernels are named
``bitdelta_quant_matmul`` (plain), ``bitdelta_quant_delta_matmul`` (one variant) and
``bitdelta_quant_bank_matmul`` (a bank).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_matmul import mosaic_gpu as dmg
from pallas_kernels.delta_matmul.config import _MOSAIC_SMEM_BUDGET, MosaicConfig

from .blocks import BLOCK, FORMATS, QuantizedKernel
from .formats import block_format

plgpu = dmg.plgpu
CUSTOM_CALL_TARGET = dmg.CUSTOM_CALL_TARGET
KERNEL_NAMES = ("bitdelta_quant_matmul", "bitdelta_quant_delta_matmul",
                "bitdelta_quant_bank_matmul")
_PASS = 64  # rows of a register pass (one wgmma-layout tile): two blocks
_X_DTYPES = (jnp.bfloat16, jnp.float16)


def unavailable_reason(*, interpret: bool = False) -> str | None:
  """None if this jax can build (or with ``interpret`` run) the kernels, else why."""
  return dmg.unavailable_reason(interpret=interpret)


def shapes_supported(x_shape, x_dtype, qk: QuantizedKernel, bits_shape=None,
                     group_k: int | None = None) -> str | None:
  """None if the kernels take ``x [M, K]`` (dtype), the blocks and the bits (packed with
  ``group_k``, the group actually used), else a readable reason."""
  if qk.format not in FORMATS:
    return f"format {qk.format!r}: the Mosaic GPU quantized kernel takes {', '.join(FORMATS)}"
  k, n = qk.shape
  if len(x_shape) != 2 or x_shape[1] != k:
    return f"x must be [M, {k}], got {tuple(x_shape)}"
  if jnp.dtype(x_dtype) not in [jnp.dtype(d) for d in _X_DTYPES]:
    return (f"x is {jnp.dtype(x_dtype)}: the Mosaic GPU quantized kernel takes bfloat16 or "
            "float16 activations (its wgmma operands are 16-bit; f32 x runs the reference)")
  f = block_format(qk.format)
  want = jnp.uint8 if f.nibbles else jnp.int8
  if k % BLOCK or qk.qs.dtype != want or tuple(qk.qs.shape) != (k // BLOCK, f.qs_rows, n):
    return f"qs {qk.qs.dtype}{tuple(qk.qs.shape)} is not {qk.format}'s column-block layout"
  if bits_shape is not None:
    return dmg.shapes_supported(x_shape, (k, n), bits_shape, group_k, x_dtype)
  return None


@dataclasses.dataclass(frozen=True)
class _Blocks:
  """The base operand of ggml blocks for `dmg.fused_call` (its ``BaseOperand`` protocol)."""

  qk: QuantizedKernel = dataclasses.field(compare=False)
  format: str
  shape: tuple[int, int]

  @property
  def fmt(self):
    return block_format(self.format)

  @property
  def nibbles(self) -> bool:
    return self.fmt.nibbles

  @property
  def num_refs(self) -> int:
    return 1 + self.fmt.fields  # qs, d (and m)

  def operands(self, k_pad: int, n_pad: int) -> tuple:
    """qs as ``[K, N]`` int8 (Q8_0) or ``[K/2, N]`` bytes (Q4), d (m) ``[K/32, N]`` f16; zero
    blocks pad K to the kernel's steps and N to its column tiles."""
    k, n = self.shape
    rows = self.fmt.qs_rows
    qs = self.qk.qs.reshape(k // BLOCK * rows, n)
    out = [dmg._pad_to(qs, (k_pad // BLOCK * rows, n_pad))]
    for f in (self.qk.d, self.qk.m)[: self.num_refs - 1]:
      out.append(dmg._pad_to(f.astype(jnp.float16), (k_pad // BLOCK, n_pad)))
    return tuple(out)

  def copies(self, ctx) -> int:
    return (ctx.kt // 16 if self.nibbles else 1) + self.num_refs - 1

  def smem(self, ctx) -> dict:
    kt, bn, st = ctx.kt, ctx.bn, ctx.stages
    qdt = jnp.uint8 if self.nibbles else jnp.int8
    bufs = dict(
      q_s=plgpu.SMEM((st, kt, bn), qdt, transforms=dmg._swizzled(bn, 1)),
      d_s=plgpu.SMEM((st, kt // BLOCK, bn), jnp.float16),
      wq_s=plgpu.SMEM((kt, bn), ctx.cdt, transforms=dmg._swizzled(bn, 2)),
    )
    if self.fmt.has_min:
      bufs["m_s"] = plgpu.SMEM((st, kt // BLOCK, bn), jnp.float16)
    return bufs

  def fetch(self, ctx, refs, bufs, t, slot, barrier) -> None:
    qs_g, d_g, *m_g = refs
    kt, step = ctx.kt, ctx.k_step(t)
    q_s = bufs["q_s"].at[slot]
    if not self.nibbles:
      plgpu.copy_gmem_to_smem(qs_g.at[pl.ds(step * kt, kt), ctx.cols], q_s, barrier)
    else:
      row0 = step * (kt // 2)

      def copy(i, carry):  # block b's 16 byte rows to its weight rows 0..15 (h=0), 16..31 (h=1)
        b, h = lax.div(i, 2), lax.rem(i, 2)
        src = qs_g.at[pl.ds(row0 + b * 16, 16), ctx.cols]
        dst = pl.ds(pl.multiple_of(b * BLOCK + h * 16, 16), 16)
        plgpu.copy_gmem_to_smem(src, q_s.at[dst], barrier)
        return carry

      lax.fori_loop(0, kt // 16, copy, None)
    blocks = pl.ds(step * (kt // BLOCK), kt // BLOCK)
    plgpu.copy_gmem_to_smem(d_g.at[blocks, ctx.cols], bufs["d_s"].at[slot], barrier)
    if m_g:
      plgpu.copy_gmem_to_smem(m_g[0].at[blocks, ctx.cols], bufs["m_s"].at[slot], barrier)

  def mma(self, ctx, acc, x_tile, bufs, slot) -> None:
    """Dequantizes the step's blocks into ``wq_s`` (64-row passes), then ``acc += x·W``."""
    bn, wgmma = ctx.bn, plgpu.Layout.WGMMA
    q_tile, w_s = bufs["q_s"].at[slot], bufs["wq_s"]
    row = ctx.cast(lax.broadcasted_iota(jnp.int32, (_PASS, bn), 0), wgmma)

    def per_row(name, c):  # the f16 field of blocks 2c (rows 0..31) and 2c+1 (rows 32..63)
      ref = bufs[name].at[slot]
      lo, hi = (lax.broadcast_in_dim(ctx.column_vector(ref.at[2 * c + i]).astype(jnp.float32),
                                     (_PASS, bn), (1,)) for i in (0, 1))
      return jnp.where(row >= BLOCK, hi, lo)

    for c in range(ctx.kt // _PASS):
      r = pl.ds(c * _PASS, _PASS)
      q = q_tile[r, :].astype(jnp.int32)
      if self.nibbles:  # rows 16..31 of a block: the high nibble
        q = lax.shift_right_logical(q, (row & 16) >> 2) & 15
      v = q.astype(jnp.float32)
      if self.fmt.offset:  # q4_0's signed nibbles
        v = v - float(self.fmt.offset)
      w = v * per_row("d_s", c)
      if self.fmt.has_min:
        w = w + per_row("m_s", c)
      w_s[r, :] = w.astype(ctx.cdt)
    plgpu.commit_smem()  # the generic-proxy stores, visible to wgmma
    plgpu.wgmma(acc, x_tile, w_s)


def smem_bytes(cfg: MosaicConfig, group_k: int, fmt: str, mode: str) -> int:
  """Shared memory of the kernel's largest phase (mode "plain", "single" or "bank")."""
  kt, bm, bn, st = cfg.k_step(group_k), cfg.block_m, cfg.block_n, cfg.num_stages
  x_tile, byte_tile, signs = bm * kt * 2, kt * bn, kt * bn * 2
  fields = (kt // BLOCK) * bn * 2 * block_format(fmt).fields
  base = st * (x_tile + byte_tile + fields) + kt * bn * 2
  if mode == "single":
    base += st * byte_tile + signs
  delta = st * (x_tile + byte_tile) + signs if mode == "bank" else 0
  return bm * bn * 4 + max(base, delta)


def config_for(m: int, qk: QuantizedKernel, group_k: int, mode: str) -> MosaicConfig:
  """The delta kernel's heuristic (bf16 tiles), with fewer stages where the block tiles and
  the dequantized tile would not fit in shared memory."""
  k, n = qk.shape
  cfg = MosaicConfig.heuristic(m, k, n, group_k, 2)
  while cfg.num_stages > 1 and smem_bytes(cfg, group_k, qk.format, mode) > _MOSAIC_SMEM_BUDGET:
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
  return cfg


def quant_matmul_mosaic(x: jax.Array, qk: QuantizedKernel, bits: jax.Array | None = None,
                        scale: jax.Array | None = None, slot_ids: jax.Array | None = None, *,
                        group_k: int, config: MosaicConfig | None = None,
                        interpret=False) -> jax.Array:
  """f32 ``[M, N]``: ``x · round(dequant(qk))`` plus ``α_s ⊙ (x·S_s)`` per row's slot.

  bits / scale / slot_ids as `quant_matmul`: None (plain), one variant (``[KP, N]``, ``[1|N]``,
  None) or a bank (``[S, KP, N]``, ``[S, 1|N]``, ``[M]``; slot 0 and ids outside ``[0, S)`` are
  base only). ``group_k``: the group the bits were packed with (a multiple of 64). Raises
  `NotImplementedError` (with `shapes_supported`'s reason) for what it does not take."""
  reason = unavailable_reason(interpret=bool(interpret)) or shapes_supported(
    x.shape, x.dtype, qk, None if bits is None else bits.shape, group_k)
  if reason:
    raise NotImplementedError(reason)
  m, n = x.shape[0], qk.shape[1]
  base = _Blocks(qk, qk.format, tuple(qk.shape))
  call = dict(interpret=interpret, base=base)
  if bits is None:  # K steps of 64 or 128 rows, no bits
    g = group_k if group_k % _PASS == 0 else _PASS
    cfg = config or config_for(m, qk, g, "plain")
    y = dmg.fused_call(x, None, None, None, (), group_k=g, banked=False, config=cfg,
                       kernel_name=KERNEL_NAMES[0], **call)
    return y[:m, :n]
  if slot_ids is None:
    cfg = config or config_for(m, qk, group_k, "single")
    y = dmg.fused_call(x, None, bits[None], scale[None], (), group_k=group_k, banked=False,
                       config=cfg, kernel_name=KERNEL_NAMES[1], **call)
    return y[:m, :n]
  cfg = config or config_for(m, qk, group_k, "bank")
  order, meta = dmg.segments(slot_ids, bits.shape[0], m, cfg.block_m)
  y = dmg.fused_call(x[order], None, bits, scale, meta, group_k=group_k, banked=True,
                     config=cfg, kernel_name=KERNEL_NAMES[2], **call)[:m, :n]
  return jnp.zeros_like(y).at[order].set(y)
