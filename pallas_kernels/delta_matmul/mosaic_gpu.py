"""Mosaic GPU (Hopper wgmma) kernels for the fused 1-bit delta GEMM.

Why: decode is memory bound, so each K step streams the base tile and the packed delta bits
into shared memory once (TMA) and expands the bits there; no dense ``W + α ⊙ S`` ever exists
in HBM. jax 0.11 deprecates the Pallas Triton lowering `pallas_gpu` uses; this is the same
computation on the Pallas GPU backend that replaces it (``plgpu.kernel``).

Numerics: per K step the CTA issues ``acc_b += x·W`` and ``acc_d += x·S`` into two f32 wgmma
accumulators, ``S ∈ {−1, +1}`` (exact in bf16/f16) expanded from the bits into an SMEM tile;
the epilogue forms ``acc_b + α ⊙ acc_d`` per row's slot in f32 and the wrapper casts to
``x.dtype`` once (after adding the ``split_k`` partial sums). Hopper has no f32 MMA (wgmma
would silently use TF32), so f32 inputs are split into bf16 pieces ``v = hi + mid + lo`` (to
2^-27 relative; x in the wrapper, each W tile in SMEM inside the kernel): ``x·W`` takes the six
piece products above 2^-24, ``x·S`` the three exact ones: f32-dot accuracy for 9 bf16 wgmmas
per step instead of 2.

Backend: Pallas Mosaic GPU (Lane semantics, one warpgroup per CTA, sm_90a wgmma with both
operands in swizzled SMEM), written against jax 0.10.2 without deprecated API; it lowers for
CUDA from a CPU-only process (custom call `CUSTOM_CALL_TARGET`). ``interpret=True`` runs the
same bodies in the Mosaic GPU interpreter on CPU, minus the layout casts (they only pick
register layouts, and the interpreter has no rule for them). Design:

* Bits: packed row ``p`` of a group holds planes ``j = 0..7`` (K rows ``j*P + p``). Each step
  TMA-copies every ``[P, block_n]`` block of packed rows to the 8 row blocks of its planes in an
  SMEM byte tile (8 copies from L2, one read from HBM), so the tile is in natural K order; the
  CTA turns it into ±1 in 64-row wgmma-layout passes (plane of a row: ``(row mod G) / P``) and
  stores it as the wgmma B operand. Hence ``group_k % 64 == 0`` (8-row SMEM tiling, 64-row
  passes); the smallest is 64 (SmolLM2's K=576 packs with it).
* `delta_matmul_bank` sorts rows by slot (segments, as in ``ragged_dot``). Each M tile runs the
  base K loop once, then one delta K loop per slot that has rows in the tile, reading that
  slot's bits once per M tile (slot 0 and out-of-range ids never), and adds ``α[s] ⊙ acc`` to
  the rows of its segment.
* Shapes that are not tile multiples are zero padded by the wrapper (as `pallas_gpu` does; the
  interpreter rejects the out-of-bounds TMA boxes the hardware would zero fill, and TMA needs
  16-byte row strides); aligned shapes (the real model's, with ``block_n`` dividing N) pass
  through untouched.
* ``plgpu.kernel`` takes no cost estimate (the Mosaic GPU lowering drops it in 0.10.2); the
  kernels are named ``bitdelta_delta_matmul`` / ``bitdelta_bank_matmul``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.bits import round_up

from .config import MosaicConfig

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - jax without the Mosaic GPU backend
  plgpu = None

try:  # not exported publicly in jax 0.10.2
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
  InterpretGPUParams = None

#: The StableHLO custom-call target a Mosaic GPU kernel lowers to (jax 0.10).
CUSTOM_CALL_TARGET = "mosaic_gpu_v2"
_PASS_ROWS = 64  # rows of a register pass: one wgmma-layout tile
_COMPUTE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def unavailable_reason(*, interpret: bool = False) -> str | None:
  """None if this jax can build (lower, or with ``interpret`` run) the kernels, else why."""
  if plgpu is None:
    return "this jax has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)"
  if interpret and InterpretGPUParams is None:
    return "this jax has no Mosaic GPU interpreter (InterpretGPUParams)"
  return None


def shapes_supported(x_shape, w_shape, bits_shape, group_k: int, dtype=None) -> str | None:
  """None if the Mosaic GPU kernels take these shapes (and x dtype), else a readable reason."""
  k, n = w_shape
  if len(x_shape) != 2 or x_shape[1] != k:
    return f"x must be [M, {k}], got {tuple(x_shape)}"
  if group_k % _PASS_ROWS:
    return (
      f"group_k={group_k}: the Mosaic GPU kernel needs a multiple of 64 (each group's "
      f"{group_k // 8} packed rows are copied to 8-row-tiled SMEM plane blocks and expanded in "
      "64-row wgmma-layout passes), e.g. group_k in {64, 128, 256}"
    )
  if bits_shape[-2] * 8 != round_up(k, group_k) or bits_shape[-1] != n:
    return f"bits {tuple(bits_shape)} do not match w_base {tuple(w_shape)} with group_k={group_k}"
  if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(d) for d in _COMPUTE_DTYPES]:
    return f"x dtype {jnp.dtype(dtype)} is not one of bfloat16, float16, float32"
  return None


def _swizzled(minor: int, itemsize: int):
  """Tiling + swizzle transforms of an SMEM tile whose minor dim has ``minor`` elements."""
  swizzle = min(128, minor * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _pad_to(a, shape):
  pads = [(0, t - s) for s, t in zip(a.shape, shape, strict=True)]
  return a if all(p == (0, 0) for p in pads) else jnp.pad(a, pads)


def _split3(x32):
  """f32 → three bf16 pieces with ``hi + mid + lo == x`` to 2^-27 relative: ``[3, ...]``."""
  hi = x32.astype(jnp.bfloat16)
  r = x32 - hi.astype(jnp.float32)
  mid = r.astype(jnp.bfloat16)
  lo = (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  return jnp.stack([hi, mid, lo])


@dataclasses.dataclass(frozen=True)
class TileContext:
  """What a `BaseOperand` sees of the CTA it runs in (see `fused_call`)."""

  cfg: MosaicConfig
  kt: int  # K rows per step
  bm: int
  bn: int
  stages: int
  cdt: object  # the wgmma operand dtype
  interpret: bool
  cols: object  # pl.ds of this CTA's output columns
  k_step: Callable  # local step t -> the global K step index
  cast: Callable  # (value, layout) -> value (a no-op in the interpreter)
  column_vector: Callable  # ref [BN] -> value in the accumulator's column layout


class BaseOperand(Protocol):
  """A base product other than a dense W (e.g. `pallas_kernels.quant_matmul.mosaic_gpu`): its
  GMEM operands, their TMA copies per K step and the wgmmas that add ``x·W`` to an f32 acc."""

  shape: tuple[int, int]  # (K, N)
  num_refs: int

  def operands(self, k_pad: int, n_pad: int) -> tuple: ...
  def copies(self, ctx: TileContext) -> int: ...
  def smem(self, ctx: TileContext) -> dict: ...
  def fetch(self, ctx: TileContext, refs, bufs: dict, t, slot, barrier) -> None: ...
  def mma(self, ctx: TileContext, acc, x_tile, bufs: dict, slot) -> None: ...


def _kernel_body(
  *refs,
  cfg: MosaicConfig,
  group_k: int,
  steps: int,
  banked: bool,
  pieces: bool,
  cdt,
  interpret: bool,
  delta_only: bool = False,
  base: BaseOperand | None = None,
  with_delta: bool = True,
):
  """One CTA: rows ``mi*BM``, columns ``ni*BN``, K steps ``[si*steps, (si+1)*steps)``.
  ``delta_only`` (banked): no base operand, the tile starts from zero (`delta_bank_products`).
  ``base``: the base product's operand in place of a dense W; ``with_delta`` False: the base
  product alone (no bits)."""
  refs = list(refs)
  x_g = refs.pop(0)
  base_g = [refs.pop(0) for _ in range(0 if delta_only else 1 if base is None else base.num_refs)]
  w_g = base_g[0] if base is None and base_g else None
  bits_g = scale_g = None
  if with_delta:
    bits_g, scale_g = refs.pop(0), refs.pop(0)
  if banked:
    tile_lo, tile_hi, seg_lo, seg_hi = refs[:4]
    refs = refs[4:]
  (out_g,) = refs
  single = with_delta and not banked
  bm, bn, stages = cfg.block_m, cfg.block_n, min(cfg.num_stages, steps)
  g, kt = group_k, cfg.k_step(group_k)
  p = g // 8
  ni, mi, si = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("k")
  rows, cols = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)
  wgmma_layout = plgpu.Layout.WGMMA

  def cast(v, layout):
    return v if interpret else plgpu.layout_cast(v, layout)

  def column_vector(ref):  # [BN] in the column layout of the accumulator
    if interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=wgmma_layout.reduce(0), optimized=False)

  def load_alpha(slot):  # [BN] f32
    return column_vector(scale_g.at[slot, cols])

  def kslice(t):
    return pl.ds((si * steps + t) * kt, kt)

  ctx = TileContext(cfg, kt, bm, bn, stages, cdt, interpret, cols, lambda t: si * steps + t,
                    cast, column_vector)

  # --- SMEM buffers -----------------------------------------------------------------------
  x_shape = (stages, 3, bm, kt) if pieces else (stages, bm, kt)
  x_buf = plgpu.SMEM(x_shape, cdt, transforms=_swizzled(min(kt, bn), 2))
  if w_g is not None:
    w_buf = plgpu.SMEM((stages, kt, bn), w_g.dtype, transforms=_swizzled(bn, w_g.dtype.itemsize))
  b_buf = plgpu.SMEM((stages, kt, bn), jnp.uint8, transforms=_swizzled(bn, 1))
  s_buf = plgpu.SMEM((kt, bn), cdt, transforms=_swizzled(bn, 2))
  wp_buf = plgpu.SMEM((3, kt, bn), cdt, transforms=_swizzled(bn, 2))
  out_buf = plgpu.SMEM((bm, bn), jnp.float32, transforms=_swizzled(bn, 4))

  def fetch_x(x_s, t, slot, bar):
    src = x_g.at[:, rows, kslice(t)] if pieces else x_g.at[rows, kslice(t)]
    plgpu.copy_gmem_to_smem(src, x_s.at[slot], bar.at[slot])

  def fetch_bits(b_s, bank_slot, t, slot, bar):
    base_row = (si * steps + t) * (kt // 8)

    def copy(i, carry):  # packed block q of the step to the row block of its plane j
      q, j = lax.div(i, 8), lax.rem(i, 8)
      src = bits_g.at[bank_slot, pl.ds(base_row + q * p, p), cols]
      dst = pl.ds(pl.multiple_of(q * g + j * p, 8), p)
      plgpu.copy_gmem_to_smem(src, b_s.at[slot, dst], bar.at[slot])
      return carry

    lax.fori_loop(0, 8 * cfg.groups_per_step, copy, None)

  def k_loop(fetch, compute, bar):
    def prologue(t, carry):
      fetch(t, t)
      return carry

    lax.fori_loop(0, stages, prologue, None)

    def step(t, carry):
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(bar.at[slot])
      compute(slot)

      @pl.when(t + stages < steps)
      def _():
        fetch(t + stages, slot)

      return carry

    lax.fori_loop(0, steps, step, None)

  def expand_signs(b_tile, s_s):
    """±1 in ``cdt`` from the plane-replicated byte tile, 64 rows per register pass."""
    for c in range(kt // _PASS_ROWS):
      r = pl.ds(c * _PASS_ROWS, _PASS_ROWS)
      b = b_tile[r, :].astype(jnp.int32)
      off = (c * _PASS_ROWS) % g
      if p >= _PASS_ROWS:  # one plane per pass
        plane = jnp.int32(off // p)
      else:
        row = cast(lax.broadcasted_iota(jnp.int32, (_PASS_ROWS, bn), 0), wgmma_layout)
        plane = lax.div(row + off, jnp.int32(p))
      bit = lax.shift_right_logical(b, plane) & 1
      s_s[r, :] = (bit * 2 - 1).astype(cdt)

  def split_w(w_tile, wp_s):
    """The f32 W tile as three bf16 pieces (same split as `_split3`)."""
    for c in range(kt // _PASS_ROWS):
      r = pl.ds(c * _PASS_ROWS, _PASS_ROWS)
      w = w_tile[r, :]
      hi = w.astype(cdt)
      rem = w - hi.astype(jnp.float32)
      mid = rem.astype(cdt)
      wp_s[0, r, :] = hi
      wp_s[1, r, :] = mid
      wp_s[2, r, :] = (rem - mid.astype(jnp.float32)).astype(cdt)

  def base_mma(acc, x_tile, w_tile, wp_s):
    if not pieces:
      plgpu.wgmma(acc, x_tile, w_tile)
      return
    split_w(w_tile, wp_s)
    plgpu.commit_smem()
    for i, j in ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0)):  # terms above 2^-24
      plgpu.wgmma(acc, x_tile.at[i], wp_s.at[j])

  def delta_mma(acc, x_tile, b_tile, s_s):
    expand_signs(b_tile, s_s)
    plgpu.commit_smem()  # make the generic-proxy stores visible to wgmma
    for i in range(3 if pieces else 1):
      plgpu.wgmma(acc, x_tile.at[i] if pieces else x_tile, s_s)

  def row_mask(lo, hi):
    row = cast(lax.broadcasted_iota(jnp.int32, (bm, bn), 0), wgmma_layout)
    return (row >= lo) & (row < hi)

  def alpha_times(acc_value, slot):
    alpha = lax.broadcast_in_dim(load_alpha(slot), (bm, bn), (1,))
    return acc_value * alpha

  def with_out(out_s):
    # Phase 1: x·W (and, for one variant, x·S in the same K loop).
    def base_scope(x_s, bar, w_s=None, b_s=None, s_s=None, wp_s=None, **base_s):
      def fetch(t, slot):
        fetch_x(x_s, t, slot, bar)
        if base is None:
          plgpu.copy_gmem_to_smem(w_g.at[kslice(t), cols], w_s.at[slot], bar.at[slot])
        else:
          base.fetch(ctx, base_g, base_s, t, slot, bar.at[slot])
        if single:
          fetch_bits(b_s, 0, t, slot, bar)

      def acc_scope(acc_b, acc_d=None):
        def compute(slot):
          if base is None:
            base_mma(acc_b, x_s.at[slot], w_s.at[slot], wp_s)
          else:
            base.mma(ctx, acc_b, x_s.at[slot], base_s, slot)
          if single:
            delta_mma(acc_d, x_s.at[slot], b_s.at[slot], s_s)
          plgpu.wgmma_wait(0)  # the slot and the SMEM scratch are reused next

        k_loop(fetch, compute, bar)
        if single:
          out_s[...] = acc_b[...] + alpha_times(acc_d[...], 0)
        else:
          out_s[...] = acc_b[...]

      accs = [plgpu.ACC((bm, bn))] * (2 if single else 1)
      pl.run_scoped(acc_scope, *accs)

    scratch = dict(b_s=b_buf, s_s=s_buf) if single else {}
    if base is not None:
      scratch.update(base.smem(ctx))
      copies = base.copies(ctx)
    else:
      copies = 1
      if not delta_only:
        scratch["w_s"] = w_buf
      if pieces:
        scratch["wp_s"] = wp_buf
    arrivals = 1 + copies + (8 * cfg.groups_per_step if single else 0)
    if delta_only:  # no base product: the slots' terms add to zero
      out_s[...] = cast(jnp.zeros((bm, bn), jnp.float32), wgmma_layout)
    else:
      pl.run_scoped(
        base_scope,
        x_buf,
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
        **scratch,
      )

    # Phase 2 (bank): one delta K loop per slot with rows in this tile.
    if banked:

      def delta_scope(x_s, b_s, s_s, bar):
        def slot_body(s, carry):
          r0 = seg_lo[s] - mi * bm
          r1 = seg_hi[s] - mi * bm

          @pl.when(r1 > r0)
          def _():
            def fetch(t, slot):
              fetch_x(x_s, t, slot, bar)
              fetch_bits(b_s, s, t, slot, bar)

            def acc_scope(acc_d):
              def compute(slot):
                delta_mma(acc_d, x_s.at[slot], b_s.at[slot], s_s)
                plgpu.wgmma_wait(0)

              k_loop(fetch, compute, bar)
              d = alpha_times(acc_d[...], s)
              out_s[...] = out_s[...] + jnp.where(row_mask(r0, r1), d, 0.0)

            pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

          return carry

        lax.fori_loop(tile_lo[mi], tile_hi[mi], slot_body, None)

      pl.run_scoped(
        delta_scope,
        x_buf,
        b_buf,
        s_buf,
        plgpu.Barrier(num_arrivals=1 + 8 * cfg.groups_per_step, num_barriers=stages),
      )

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_g.at[si, rows, cols])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(with_out, out_buf)


def fused_call(x, w_base, bits, scale, meta, *, group_k, banked, config, interpret,
               kernel_name=None, base: BaseOperand | None = None):
  """Pads, calls the kernel, adds the split-K partial sums; returns f32 ``[M_pad, N_pad]``.
  ``w_base`` None (a bank): the slots' delta terms alone, or with ``base`` (a `BaseOperand`)
  that base product; ``bits`` None: the base product alone (K padded to ``group_k``)."""
  m, k = x.shape
  if base is not None:
    n = base.shape[1]
  else:
    n = bits.shape[-1] if w_base is None else w_base.shape[1]
  delta_only = w_base is None and base is None
  with_delta = bits is not None
  pieces = jnp.dtype(x.dtype) == jnp.float32
  cfg = config or MosaicConfig.heuristic(m, k, n, group_k, x.dtype.itemsize)
  bm, bn = cfg.block_m, cfg.block_n
  k_pad = bits.shape[-2] * 8 if with_delta else round_up(k, group_k)
  n_groups = k_pad // group_k
  if n_groups % cfg.groups_per_step:
    raise NotImplementedError(
      f"groups_per_step={cfg.groups_per_step} does not divide the {n_groups} groups of K={k}"
    )
  n_steps = n_groups // cfg.groups_per_step
  if n_steps % cfg.split_k:
    raise NotImplementedError(f"split_k={cfg.split_k} does not divide the {n_steps} K steps")
  steps = n_steps // cfg.split_k
  m_pad, n_pad = round_up(m, bm), round_up(n, bn)
  cdt = jnp.bfloat16 if pieces else x.dtype
  # Aligned shapes pass through untouched; others are zero padded (padded K rows of the bits
  # are 0 by the format and meet x = 0; padded rows and columns are sliced off).
  x_p = _pad_to(x, (m_pad, k_pad))
  x_p = _split3(x_p) if pieces else x_p
  if base is not None:
    w_p = tuple(base.operands(k_pad, n_pad))
  else:
    w_p = () if delta_only else (_pad_to(w_base.astype(x.dtype), (k_pad, n_pad)),)
  delta_p = ()
  if with_delta:
    delta_p = (
      _pad_to(bits, (*bits.shape[:-1], n_pad)),
      _pad_to(jnp.broadcast_to(scale.astype(jnp.float32), (scale.shape[0], n)),
              (scale.shape[0], n_pad)),
    )
  body = functools.partial(
    _kernel_body,
    cfg=cfg,
    group_k=group_k,
    steps=steps,
    banked=banked,
    pieces=pieces,
    cdt=cdt,
    interpret=bool(interpret),
    delta_only=delta_only,
    base=base,
    with_delta=with_delta,
  )
  interp = None
  if interpret:
    interp = interpret if isinstance(interpret, InterpretGPUParams) else InterpretGPUParams()
  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((cfg.split_k, m_pad, n_pad), jnp.float32),
    grid=(n_pad // bn, m_pad // bm, cfg.split_k),
    grid_names=("n", "m", "k"),
    interpret=interp,
    kernel_name=kernel_name or ("bitdelta_bank_matmul" if banked else "bitdelta_delta_matmul"),
  )
  out = kernel(x_p, *w_p, *delta_p, *meta)
  return out[0] if cfg.split_k == 1 else out.sum(axis=0)


def _check(x, w_base, bits, group_k):
  reason = unavailable_reason() or shapes_supported(
    x.shape, w_base.shape, bits.shape, group_k, x.dtype
  )
  if reason:
    raise NotImplementedError(reason)


def delta_matmul_single(
  x,
  w_base,
  bits,
  scale,
  *,
  group_k: int,
  config: MosaicConfig | None = None,
  interpret=False,
):
  """y = x·W_base + α ⊙ (x·S) for one variant (bits ``[K_pad/8, N]``, scale ``[1|N]``).

  ``interpret``: True (or an ``InterpretGPUParams``) runs the Mosaic GPU interpreter."""
  _check(x, w_base, bits, group_k)
  m, n = x.shape[0], w_base.shape[1]
  y = fused_call(
    x,
    w_base,
    bits[None],
    scale[None],
    (),
    group_k=group_k,
    banked=False,
    config=config,
    interpret=interpret,
  )
  return y[:m, :n].astype(x.dtype)


def delta_matmul_bank(
  x,
  w_base,
  bits,
  scale,
  slot_ids,
  *,
  group_k: int,
  config: MosaicConfig | None = None,
  interpret=False,
):
  """Mixed variants: bits ``[S, K_pad/8, N]``, scale ``[S, 1|N]``, slot_ids ``[M]`` (0 = base;
  ids outside ``[0, S)`` are base only too)."""
  _check(x, w_base, bits, group_k)
  m, n = x.shape[0], w_base.shape[1]
  cfg = config or MosaicConfig.heuristic(m, x.shape[1], n, group_k, x.dtype.itemsize)
  return _by_slot(x, w_base, bits, scale, slot_ids, group_k=group_k, config=cfg,
                  interpret=interpret).astype(x.dtype)


def _by_slot(x, w_base, bits, scale, slot_ids, *, config, **kw):
  """The bank kernel over ``x``'s rows sorted by slot (`segments`), rows put back in order:
  f32 ``[M, N]``."""
  m, n = x.shape[0], bits.shape[-1]
  order, meta = segments(slot_ids, bits.shape[0], m, config.block_m)
  y_sorted = fused_call(x[order], w_base, bits, scale, meta, banked=True, config=config,
                        **kw)[:m, :n]
  return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def segments(slot_ids, n_slots: int, m: int, block_m: int):
  """Rows sorted by slot (ids outside ``[0, S)`` as 0) and the kernel's slot tables: each M
  tile's slot range ``[max(min, 1), max + 1)`` of its real rows and each slot's row segment."""
  slots = jnp.where((slot_ids < 0) | (slot_ids >= n_slots), 0, slot_ids).astype(jnp.int32)
  order = jnp.argsort(slots, stable=True)
  sorted_slots = slots[order]
  ids = jnp.arange(n_slots, dtype=jnp.int32)
  seg_lo = jnp.searchsorted(sorted_slots, ids, side="left").astype(jnp.int32)
  seg_hi = jnp.searchsorted(sorted_slots, ids, side="right").astype(jnp.int32)
  m_pad = round_up(m, block_m)
  tiles = m_pad // block_m
  lo_src = jnp.pad(sorted_slots, (0, m_pad - m), constant_values=n_slots)
  hi_src = jnp.pad(sorted_slots, (0, m_pad - m))
  tile_lo = jnp.maximum(lo_src.reshape(tiles, -1).min(axis=1), 1).astype(jnp.int32)
  tile_hi = (hi_src.reshape(tiles, -1).max(axis=1) + 1).astype(jnp.int32)
  return order, (tile_lo, tile_hi, seg_lo, seg_hi)


def bank_shapes_supported(x_shape, bits_shape, group_k: int, dtype=None) -> str | None:
  """`shapes_supported` for `delta_bank_products` (no base operand)."""
  if len(bits_shape) != 3:
    return f"bits must be a bank [S, K_pad/8, N], got {tuple(bits_shape)}"
  if len(x_shape) != 2:
    return f"x must be [M, K], got {tuple(x_shape)}"
  return shapes_supported(x_shape, (x_shape[1], bits_shape[-1]), bits_shape, group_k, dtype)


def delta_bank_products(
  x,
  bits,
  scale,
  slot_ids,
  *,
  group_k: int,
  config: MosaicConfig | None = None,
  interpret=False,
  kernel_name: str = "bitdelta_bank_delta",
):
  """f32 ``α[s] ⊙ (x·S[s])`` per row, ``s = slot_ids[m]``, without a base product: bits ``[S,
  K_pad/8, N]``, scale ``[S, 1|N]``; rows of slot 0 or of ids outside ``[0, S)`` get zeros.
  The bank kernel with its base phase left out (each tile starts from zero), e.g. a 1-bit
  LM-head bank added to logits computed elsewhere (`pallas_kernels.lm_head`)."""
  reason = unavailable_reason() or bank_shapes_supported(x.shape, bits.shape, group_k, x.dtype)
  if reason:
    raise NotImplementedError(reason)
  m, k = x.shape
  n = bits.shape[-1]
  cfg = config or MosaicConfig.heuristic(m, k, n, group_k, x.dtype.itemsize)
  return _by_slot(x, None, bits, scale, slot_ids, group_k=group_k, config=cfg,
                  interpret=interpret, kernel_name=kernel_name)
