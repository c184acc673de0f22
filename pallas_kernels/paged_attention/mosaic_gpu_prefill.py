"""The packed-prefill pass of the ragged paged attention as a Pallas Mosaic GPU kernel (Hopper).

What it computes is `reference.packed_prefill`: every token of the step's prompt chunks
against the step's prompt pages of its own sequence (``token_seq`` = ``page_seq``), causally
(key position <= the token's position) and within ``window``; zeros for a token with no key
(decode lanes and padding). Prompt chunks are where time to first token goes: the reference
gathers every chunk's pages into a dense copy and forms a chunk x pages score matrix per head.
Here the pages are read in place through the page list, and the products run on the tensor
cores.

Layout of the work: the queries of one KV head are rows ``token * G + g`` (its G query heads
together, so a K/V block read once serves all of them), cut into blocks of ``BLOCK_ROWS`` = 64
rows (one WGMMA tile). A program takes one row block of one KV head (grid ``(blocks, KV)``,
one warpgroup) and walks only the key blocks its rows can see: `key_block_ranges` (plain jnp,
before the kernel) finds, per row block, the first and last page any of its tokens reads (its
sequences' pages up to its last position; chunks that start mid-page, prefix-cache hits and
several packed sequences in one block included), in blocks of ``BLOCK_KEYS`` = 64 keys
(``64 / page_size`` pages, each copied by TMA from the pool into a double-buffered SMEM block).

Per key block: ``S = Q Kᵀ`` (WGMMA, f32 accumulator), the mask (same sequence, a filled row of
its page, causal, window) applied by selection (``-inf``), an online softmax in base 2, then
``O += P V`` (WGMMA; P rounded to the pool dtype as in any flash attention, and as the reference
rounds it to the value dtype). Value rows no query of the block may read (a page's unfilled
rest, which may hold a recycled page's stale NaN) and non-finite value rows are replaced by 0
before ``P V``, as in the reference: queries of different sequences share one product, and a
zero probability times NaN is still NaN.

Numerics: scores, softmax and the accumulator in f32; queries are converted to the pool dtype
(a WGMMA takes one operand dtype). bf16 and f16 pools (f32 pools would need tf32 WGMMA with
both operands K-major; they stay with the reference). ``interpret=True`` runs the same body in
the Mosaic GPU interpreter on CPU; there K is transposed into an SMEM scratch by a register
transpose (the interpreter has no transposed WGMMA operand), and layout casts are skipped (the
interpreter has no rule for them). Everything else is the code that is lowered for CUDA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..attention_inputs import AttentionInputs
from .mosaic_gpu import _interpret_params, _swizzle, plgpu

BLOCK_ROWS = 64  # query rows (token x query head of one KV head) per program: one WGMMA tile
BLOCK_KEYS = 64  # keys per step of a program's loop
KERNEL_NAME = "ragged_paged_prefill"
_NO_WINDOW = 1 << 30
_LOG2E = math.log2(math.e)
_SMEM_BYTES = 227 * 1024
_DTYPES = ("bfloat16", "float16")

__all__ = [
  "BLOCK_KEYS",
  "BLOCK_ROWS",
  "KERNEL_NAME",
  "key_block_ranges",
  "packed_prefill",
  "shapes_supported",
]


def _smem_bytes(head_dim: int, itemsize: int) -> int:
  q = BLOCK_ROWS * head_dim * itemsize
  kv = 2 * 2 * BLOCK_KEYS * head_dim * itemsize  # K and V, two slots each
  vs = BLOCK_KEYS * head_dim * itemsize  # the selected V block
  p = BLOCK_ROWS * BLOCK_KEYS * itemsize
  out = BLOCK_ROWS * head_dim * itemsize
  return q + kv + vs + p + out + 256  # + barriers


def shapes_supported(
  *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, q_dtype=None
) -> str | None:
  """None if the kernel takes these shapes, else a readable reason."""
  if plgpu is None:
    return "this jax has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)"
  dt = jnp.dtype(dtype)
  if dt.name not in _DTYPES:
    return (
      f"K/V pages of dtype {dt.name}: the prefill kernel takes {', '.join(_DTYPES)} (an f32 "
      "pool would need tf32 WGMMA with K-major operands)"
    )
  if q_dtype is not None and not jnp.issubdtype(jnp.dtype(q_dtype), jnp.floating):
    return f"queries of dtype {jnp.dtype(q_dtype).name}"
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
  if head_dim % 64 or head_dim > 128:
    return (
      f"head_dim {head_dim}: the prefill kernel takes 64 or 128 (a WGMMA K step of whole "
      "128-byte swizzled rows; larger heads would spill the f32 accumulator's registers)"
    )
  if page_size % 8 or BLOCK_KEYS % page_size:
    return (
      f"page_size {page_size}: the prefill kernel needs a multiple of 8 that divides "
      f"{BLOCK_KEYS} (pages are copied whole into {BLOCK_KEYS}-key blocks)"
    )
  if (page_size * head_dim * dt.itemsize) % 128:
    return f"a page ({page_size} x {head_dim} x {dt.itemsize} bytes) is not a multiple of 128 bytes"
  smem = _smem_bytes(head_dim, dt.itemsize)
  if smem > _SMEM_BYTES:
    return f"the kernel needs {smem} bytes of shared memory (> {_SMEM_BYTES})"
  return None


def _pages_up_to(page_start, lo, hi, pos):
  """Per token: the end of the range of its sequence's pages ``[lo, hi)`` whose first position
  is <= ``pos`` (pages of a sequence are listed in order of position), by a vectorised binary
  search over ``page_start``."""
  steps = max(1, int(page_start.shape[0]).bit_length())

  def step(_, carry):
    a, b = carry
    mid = (a + b) // 2
    go = (a < b) & (page_start[jnp.minimum(mid, page_start.shape[0] - 1)] <= pos)
    return jnp.where(go, mid + 1, a), jnp.where(go | (a >= b), b, mid)

  end, _ = lax.fori_loop(0, steps, step, (lo, hi))
  return end


def key_block_ranges(
  *, page_seq, page_start, page_fill, token_seq, positions, group: int, block_pages: int
):
  """``[blocks, 2]`` int32: per block of `BLOCK_ROWS` query rows (rows ``token * group + g``),
  the key blocks ``[first, end)`` (units of ``block_pages`` pages of the page list) that hold
  every page a token of the block may read: from the first page of its first sequence to the
  last page at or before its last position. Empty (``first == end``) for a block with no
  prompt token. Assumes the engine's page list: a sequence's pages contiguous and in position
  order, sequences in the order of their tokens (`engine.scheduler`); other pages in the range
  are read and masked, never missed."""
  n = token_seq.shape[0]
  u = page_seq.shape[0]
  big = jnp.int32(1 << 30)
  live_page = (page_seq >= 0) & (page_fill > 0)
  # pages sorted by sequence: dead pages (padding) sort last
  seq_key = jnp.where(page_seq >= 0, page_seq, big)
  tok_live = token_seq >= 0
  tseq = jnp.where(tok_live, token_seq, big - 1)
  lo = jnp.searchsorted(seq_key, tseq, side="left").astype(jnp.int32)
  hi = jnp.searchsorted(seq_key, tseq, side="right").astype(jnp.int32)
  end = _pages_up_to(page_start, lo, hi, positions.astype(jnp.int32))
  sees = tok_live & (end > lo) & jnp.any(live_page)
  first = jnp.where(sees, lo, big)
  last = jnp.where(sees, end, 0)
  rows = n * group
  nblk = -(-rows // BLOCK_ROWS)
  pad = nblk * BLOCK_ROWS - rows
  first_r = jnp.pad(jnp.repeat(first, group), (0, pad), constant_values=big)
  last_r = jnp.pad(jnp.repeat(last, group), (0, pad), constant_values=0)
  p_lo = jnp.min(first_r.reshape(nblk, BLOCK_ROWS), axis=1)
  p_hi = jnp.max(last_r.reshape(nblk, BLOCK_ROWS), axis=1)
  b_lo = jnp.minimum(p_lo, u) // block_pages
  b_hi = -(-p_hi // block_pages)
  b_hi = jnp.maximum(b_hi, b_lo)
  return jnp.stack([b_lo, b_hi], axis=1).astype(jnp.int32)


def packed_prefill(q_NxHxD, k_pool, v_pool, layer, inputs: AttentionInputs, *, window=None,
                   interpret=False):
  """`reference.packed_prefill` as a kernel: ``[N, H, hd]`` in q's dtype. ``k_pool, v_pool``
  ``[L, num_pages, page_size, KV, hd]`` (bf16 or f16); of ``inputs`` it reads the page list
  (``pages, page_seq, page_start, page_fill [U]``) and the tokens' ``token_seq, positions [N]``
  as the scheduler builds them (not ``blocks``: `key_block_ranges` bounds each row block). Raises NotImplementedError with `shapes_supported`'s reason for shapes the
  kernel does not take."""
  n, h, d = q_NxHxD.shape
  _, _, ps, kv, _ = k_pool.shape
  reason = shapes_supported(
    num_heads=h, num_kv_heads=kv, head_dim=d, page_size=ps, dtype=k_pool.dtype,
    q_dtype=q_NxHxD.dtype,
  )
  if reason:
    raise NotImplementedError(f"Mosaic GPU paged prefill: {reason}")
  if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
    raise ValueError(
      f"k_pool {k_pool.shape} {k_pool.dtype} and v_pool {v_pool.shape} {v_pool.dtype} differ"
    )
  if n == 0:
    return jnp.zeros(q_NxHxD.shape, q_NxHxD.dtype)
  window = jnp.int32(_NO_WINDOW) if window is None else jnp.asarray(window, jnp.int32)
  return _prefill_jit(
    q_NxHxD, k_pool, v_pool, jnp.asarray(layer, jnp.int32), inputs.pages, inputs.page_seq,
    inputs.page_start, inputs.page_fill, inputs.token_seq, inputs.positions, window,
    interpret=_interpret_params(interpret),
  )


@functools.partial(jax.jit, static_argnames=("interpret",))
def _prefill_jit(q, k_pool, v_pool, layer, pages, page_seq, page_start, page_fill, token_seq,
                 positions, window, *, interpret):
  n, h, d = q.shape
  _, _, ps, kv, _ = k_pool.shape
  g = h // kv
  bp = BLOCK_KEYS // ps
  dt = jnp.dtype(k_pool.dtype)
  i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
  pages, page_seq, page_start, page_fill = map(i32, (pages, page_seq, page_start, page_fill))
  token_seq, positions = i32(token_seq), i32(positions)
  u = pages.shape[0]
  upad = -(-u // bp) * bp - u  # whole key blocks; padding pages are dead (fill 0)
  if upad:
    pages = jnp.pad(pages, (0, upad))
    page_seq = jnp.pad(page_seq, (0, upad), constant_values=-2)
    page_start = jnp.pad(page_start, (0, upad))
    page_fill = jnp.pad(page_fill, (0, upad))
  ranges = key_block_ranges(
    page_seq=page_seq, page_start=page_start, page_fill=page_fill, token_seq=token_seq,
    positions=positions, group=g, block_pages=bp,
  )
  nblk = ranges.shape[0]
  rows = n * g
  rpad = nblk * BLOCK_ROWS - rows
  # rows of one KV head: token * G + g
  q_rows = q.astype(dt).reshape(n, kv, g, d).transpose(1, 0, 2, 3).reshape(kv, rows, d)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, rpad), (0, 0)))
  row_seq = jnp.pad(jnp.repeat(token_seq, g), (0, rpad), constant_values=-1)
  row_pos = jnp.pad(jnp.repeat(positions, g), (0, rpad))
  row_info = jnp.stack([row_seq.reshape(nblk, BLOCK_ROWS), row_pos.reshape(nblk, BLOCK_ROWS)], 1)
  scalars = jnp.stack([layer.reshape(()), window.reshape(())])
  out = _kernel(q_rows, k_pool, v_pool, scalars, ranges, pages, page_seq, page_start, page_fill,
                row_info, interpret=interpret)
  out = out[:, :rows].reshape(kv, n, g, d).transpose(1, 0, 2, 3).reshape(n, h, d)
  return out.astype(q.dtype)


def _kernel(q_rows, k_pool, v_pool, scalars, ranges, pages, page_seq, page_start, page_fill,
            row_info, *, interpret):
  kv, nr, d = q_rows.shape
  _, _, ps, _, _ = k_pool.shape
  nblk = ranges.shape[0]
  bp = BLOCK_KEYS // ps
  bq, bk = BLOCK_ROWS, BLOCK_KEYS
  dt = jnp.dtype(k_pool.dtype)
  tiles = lambda minor_bytes: (  # noqa: E731
    plgpu.TilingTransform((8, _swizzle(minor_bytes) // dt.itemsize)),
    plgpu.SwizzleTransform(_swizzle(minor_bytes)),
  )
  scale = float(d) ** -0.5 * _LOG2E
  wg = plgpu.Layout.WGMMA
  row_l, col_l = wg.reduce(1), wg.reduce(0)
  if interpret:  # the interpreter evaluates plain jnp: layout casts are only lowering hints
    cast = lambda x, _layout: x  # noqa: E731
    iota = lambda n, _layout: lax.iota(jnp.int32, n)  # noqa: E731
    load_vec = lambda ref, _layout: ref[...]  # noqa: E731
  else:
    cast = plgpu.layout_cast
    iota = lambda n, layout: plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)  # noqa: E731
    load_vec = lambda ref, layout: plgpu.load(ref, (), layout=layout, optimized=False)  # noqa: E731
  rows2 = lambda v, shape: lax.broadcast_in_dim(v, shape, (0,))  # noqa: E731
  cols2 = lambda v, shape: lax.broadcast_in_dim(v, shape, (1,))  # noqa: E731

  def body(q_ref, k_ref, v_ref, sc_ref, rng_ref, pg_ref, pseq_ref, pstart_ref, pfill_ref,
           info_ref, o_ref, q_buf, k_buf, v_buf, vs_buf, p_buf, o_buf, *rest):
    if interpret:
      kt_buf, bars, q_bar = rest
    else:
      bars, q_bar = rest
    blk, head = lax.axis_index("qblk"), lax.axis_index("kvh")
    rows = pl.ds(blk * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[head, rows], q_buf, q_bar.at[0])
    lyr, win = sc_ref[0], sc_ref[1]
    first, count = rng_ref[blk, 0], rng_ref[blk, 1] - rng_ref[blk, 0]

    def fetch(kb, slot):  # the pages of key block ``kb`` into ``slot``
      for i in range(bp):
        page = pg_ref[kb * bp + i]
        dst = pl.ds(i * ps, ps)
        plgpu.copy_gmem_to_smem(k_ref.at[lyr, page, :, head], k_buf.at[slot, dst], bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[lyr, page, :, head], v_buf.at[slot, dst], bars.at[slot])

    @pl.when(count > 0)
    def _():
      fetch(first, 0)

    rseq = load_vec(info_ref.at[blk, 0], row_l)
    rpos = load_vec(info_ref.at[blk, 1], row_l)

    def key_info(kb, layout):
      """Per key of block ``kb``: its sequence, position, and whether its page row is filled."""
      c = iota(bk, layout)
      within = lax.rem(c, jnp.int32(ps))
      which = lax.div(c, jnp.int32(ps))
      kseq = jnp.full((bk,), -3, jnp.int32)
      kstart = jnp.zeros((bk,), jnp.int32)
      kfill = jnp.zeros((bk,), jnp.int32)
      for i in range(bp):
        here = which == i
        kseq = jnp.where(here, pseq_ref[kb * bp + i], kseq)
        kstart = jnp.where(here, pstart_ref[kb * bp + i], kstart)
        kfill = jnp.where(here, pfill_ref[kb * bp + i], kfill)
      return kseq, kstart + within, within < kfill

    plgpu.barrier_wait(q_bar.at[0])

    def step(i, carry):
      m, total, acc = carry
      slot = lax.rem(i, 2)
      kb = first + i

      @pl.when(i + 1 < count)
      def _():
        fetch(kb + 1, 1 - slot)

      plgpu.barrier_wait(bars.at[slot])
      # V rows no query of the block may read become 0 (selection, never 0 * NaN)
      _, _, vfilled = key_info(kb, row_l)
      vb = cast(v_buf[slot], wg)
      keep = rows2(vfilled, (bk, d)) & (jnp.abs(vb.astype(jnp.float32)) < jnp.inf)  # finite
      vs_buf[...] = jnp.where(keep, vb, jnp.zeros((), vb.dtype))
      if interpret:
        kt_buf[...] = k_buf[slot].T
      plgpu.commit_smem()  # the generic-proxy stores, visible to the WGMMAs

      def scores(acc_ref):
        b = kt_buf if interpret else plgpu.transpose_ref(k_buf.at[slot], (1, 0))
        plgpu.wgmma(acc_ref, q_buf, b)
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
      kseq, kpos, kfilled = key_info(kb, col_l)
      shape = (bq, bk)
      rp = rows2(rpos, shape)
      kp = cols2(kpos, shape)
      valid = (rows2(rseq, shape) == cols2(kseq, shape)) & cols2(kfilled, shape)
      valid = valid & (kp <= rp) & (kp > rp - win)
      s = jnp.where(valid, s * scale, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      corr = jnp.exp2(m - safe)
      p = jnp.exp2(s - rows2(safe, shape))  # exp2(-inf) = 0 where masked
      p_buf[...] = p.astype(dt)
      plgpu.commit_smem()

      def weighted(acc_ref):
        plgpu.wgmma(acc_ref, p_buf, vs_buf)
        return acc_ref[...]

      pv = pl.run_scoped(weighted, plgpu.ACC((bq, d), jnp.float32))
      total = total * corr + jnp.sum(p, axis=1)
      acc = acc * rows2(corr, (bq, d)) + pv
      return m_new, total, acc

    init = (
      cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_l),
      cast(jnp.zeros((bq,), jnp.float32), row_l),
      cast(jnp.zeros((bq, d), jnp.float32), wg),
    )
    _, total, acc = lax.fori_loop(0, jnp.maximum(count, 0), step, init)
    out = acc / rows2(jnp.maximum(total, 1e-30), (bq, d))
    o_buf[...] = out.astype(dt)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_buf, o_ref.at[head, rows])
    plgpu.wait_smem_to_gmem(0)

  kv_smem = plgpu.SMEM((2, bk, d), dt, transforms=tiles(d * dt.itemsize))
  scratch = [
    plgpu.SMEM((bq, d), dt, transforms=tiles(d * dt.itemsize)),  # q
    kv_smem,  # k
    kv_smem,  # v
    plgpu.SMEM((bk, d), dt, transforms=tiles(d * dt.itemsize)),  # selected v
    plgpu.SMEM((bq, bk), dt, transforms=tiles(bk * dt.itemsize)),  # p
    plgpu.SMEM((bq, d), dt, transforms=tiles(d * dt.itemsize)),  # out
  ]
  if interpret:
    scratch.append(plgpu.SMEM((d, bk), dt, transforms=tiles(bk * dt.itemsize)))  # kᵀ
  scratch += [
    plgpu.Barrier(num_arrivals=2 * bp, num_barriers=2),
    plgpu.Barrier(num_arrivals=1, num_barriers=1),
  ]
  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((kv, nr, d), dt),
    scratch_types=scratch,
    grid=(nblk, kv),
    grid_names=("qblk", "kvh"),
    kernel_name=KERNEL_NAME,
    interpret=interpret,
  )
  return kernel(q_rows, k_pool, v_pool, scalars, ranges, pages, page_seq, page_start, page_fill,
                row_info)

