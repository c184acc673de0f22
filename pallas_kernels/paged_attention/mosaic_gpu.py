"""Decode lanes of the ragged paged attention as a Pallas Mosaic GPU kernel (NVIDIA Hopper).

Why: a decode token reads its whole sequence's K/V once per layer, so decode attention is bound
by memory traffic. The reference (`reference.py`) gathers all lanes' pages into a dense copy and
walks every lane as far as the longest one. Here a program reads only its own lane's pages,
straight from the pool by the lane's page table (one TMA copy per page, double-buffered), and
stops at that lane's own length; a lane's blocks of pages are split over ``num_splits`` programs
("flash decoding") so that a few long sequences still fill the GPU.

Numerics: scores, softmax and the weighted sum in f32 whatever the pool dtype (bf16, f16 or f32
pages are converted in registers); online softmax in base 2 against the running maximum. Each
program writes its partial (maximum, sum of exponentials, unnormalised output); `combine` (plain
jnp, after the kernel) rescales the splits to their common maximum and divides once. A lane with
``lane_len == 0``, or with no key in its window, gets zeros. Unlike the reference, the
probabilities are not rounded to the value dtype before the weighted sum. Keys outside a lane's
window and length are masked by selection (scores to ``-inf``, value rows to 0), never by a
zero probability alone: a recycled page's stale rest may hold NaN.

Backend: Mosaic GPU (``plgpu.kernel``), grid ``(num_splits, KV, R)``, one warpgroup (128
threads) per program. A KV head has few query heads (G = 3 for SmolLM2, 4 for Llama-8B) against
the 64 rows of a WGMMA tile, so the products run on the vector units, not the tensor cores: a
block of 64 keys ``[64, hd]`` sits in registers in the WGMMA register layout, a head's scores
are a row reduction, its weighted sum a column reduction across the four warps. WGMMA would
waste 95% of its rows on padding and needs K or V transposed in shared memory, which the Mosaic
GPU interpret mode (how this kernel is tested without a GPU) does not implement, nor f32's tf32
WGMMA for V in its pool layout; decode does a few flops per byte read, within the vector units'
rate. `shapes_supported` says which shapes the kernel takes. The kernel is named
(``KERNEL_NAME``, in the Mosaic GPU module); it carries no cost estimate, which the Mosaic GPU
lowering drops (``del cost_estimate``) in this jax.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # the Mosaic GPU Pallas backend (jax >= 0.5); None when this jax has none
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

try:  # Mosaic GPU interpret mode (runs the kernel on CPU; jax >= 0.9, private module)
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
  InterpretGPUParams = None

BLOCK_KEYS = 64  # keys per step of a program's loop: the row tile of the WGMMA register layout
KERNEL_NAME = "ragged_paged_decode"
_NO_WINDOW = 1 << 30
_LOG2E = math.log2(math.e)
_SM_COUNT = 132  # H100 SXM; only sizes the default number of splits
_SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block (opt-in maximum)
_DTYPES = ("bfloat16", "float16", "float32")


def _swizzle(minor_bytes: int) -> int:
  for s in (128, 64, 32):
    if minor_bytes % s == 0:
      return s
  return 0


def block_keys(page_size: int) -> int:
  """Keys per loop step: 64, or one page when pages are larger."""
  return max(BLOCK_KEYS, page_size)


def shapes_supported(
  *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, q_dtype=None
) -> str | None:
  """None if the kernel takes these shapes, else a readable reason."""
  if plgpu is None:
    return "this jax has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)"
  dt = jnp.dtype(dtype)
  if dt.name not in _DTYPES:
    return f"K/V pages of dtype {dt.name} (the kernel takes {', '.join(_DTYPES)})"
  if q_dtype is not None and jnp.dtype(q_dtype).name not in _DTYPES:
    return f"queries of dtype {jnp.dtype(q_dtype).name} (the kernel takes {', '.join(_DTYPES)})"
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
  if head_dim % 8:
    return f"head_dim {head_dim} is not a multiple of 8 (WGMMA register layout columns)"
  if not _swizzle(head_dim * dt.itemsize):
    return (
      f"a K/V row of head_dim {head_dim} x {dt.itemsize} bytes is not a multiple of 32 "
      "bytes (the shared-memory swizzle the register loads need)"
    )
  if page_size % 8 or (BLOCK_KEYS % page_size and page_size % BLOCK_KEYS):
    return (
      f"page_size {page_size}: needs a multiple of 8 that divides {BLOCK_KEYS} or is a "
      f"multiple of {BLOCK_KEYS} (pages are copied whole into {BLOCK_KEYS}-key blocks)"
    )
  if head_dim > 256 or page_size > 256:
    return f"head_dim {head_dim} or page_size {page_size} over 256 (one TMA box per page)"
  if (page_size * head_dim * dt.itemsize) % 128:
    return f"a page ({page_size} x {head_dim} x {dt.itemsize} bytes) is not a multiple of 128 bytes"
  smem = _smem_bytes(
    num_heads // num_kv_heads,
    head_dim,
    page_size,
    dt.itemsize,
    jnp.dtype(q_dtype or jnp.float32).itemsize,
  )
  if smem > _SMEM_BYTES:
    return f"the kernel needs {smem} bytes of shared memory (> {_SMEM_BYTES})"
  return None


def _query_rows(g: int, head_dim: int, itemsize: int) -> int:
  """The G query rows padded so that one TMA copy moves a multiple of 128 bytes."""
  gq = g
  while (gq * head_dim * itemsize) % 128:
    gq += 1
  return gq


def _smem_bytes(g, head_dim, page_size, itemsize, q_itemsize) -> int:
  kv = 2 * 2 * block_keys(page_size) * head_dim * itemsize  # K and V, two slots each
  q = _query_rows(g, head_dim, q_itemsize) * head_dim * q_itemsize
  out = g * head_dim * 4 + g * 16
  return kv + q + out + 128 * 4 * 4 + 64  # + Mosaic's cross-warp reduction scratch, barriers


def default_num_splits(lanes: int, kv_heads: int, pages_per_lane: int, page_size: int) -> int:
  """Splits per lane so that about two programs per SM run, never more than a lane's blocks."""
  max_blocks = max(1, -(-pages_per_lane * page_size // block_keys(page_size)))
  want = -(-2 * _SM_COUNT // max(1, lanes * kv_heads))
  return int(max(1, min(want, max_blocks, 16)))


def _interpret_params(interpret):
  if interpret is True:
    if InterpretGPUParams is None:
      raise NotImplementedError("this jax has no Mosaic GPU interpret mode")
    return InterpretGPUParams()
  return interpret or None


def decode_partials(
  q_RxHxD,
  k_pool,
  v_pool,
  layer,
  *,
  lane_pages,
  lane_len,
  window=None,
  num_splits: int = 1,
  interpret=False,
):
  """The kernel: per lane, KV head and split, the partial online-softmax state.

  Returns ``(acc [R, KV, S, G, hd], stats [R, KV, S, G, 4])`` in f32: ``acc`` the unnormalised
  weighted sum of the values, ``stats[..., 0]`` the maximum of the base-2 scaled scores (-inf
  where the split saw no key), ``stats[..., 1]`` the sum of ``2**(score - max)`` (the rest is
  padding: a TMA row is a multiple of 16 bytes); see `combine`."""
  r, h, d = q_RxHxD.shape
  _, _, ps, kv, _ = k_pool.shape
  reason = shapes_supported(
    num_heads=h,
    num_kv_heads=kv,
    head_dim=d,
    page_size=ps,
    dtype=k_pool.dtype,
    q_dtype=q_RxHxD.dtype,
  )
  if reason:
    raise NotImplementedError(f"Mosaic GPU paged decode: {reason}")
  if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
    raise ValueError(
      f"k_pool {k_pool.shape} {k_pool.dtype} and v_pool {v_pool.shape} {v_pool.dtype} differ"
    )
  g = h // kv
  p = lane_pages.shape[1]
  s_n = int(num_splits)
  if s_n < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  bk = block_keys(ps)
  bp = bk // ps  # pages per block
  interpret = _interpret_params(interpret)
  dt = jnp.dtype(k_pool.dtype)
  swz = _swizzle(d * dt.itemsize)
  kv_smem = plgpu.SMEM(
    (2, bk, d),
    dt,
    transforms=(plgpu.TilingTransform((8, swz // dt.itemsize)), plgpu.SwizzleTransform(swz)),
  )
  window = _NO_WINDOW if window is None else window
  scalars = jnp.stack(
    [jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(window, jnp.int32).reshape(())]
  )
  q4 = q_RxHxD.reshape(r, kv, g, d)
  gq = _query_rows(g, d, jnp.dtype(q4.dtype).itemsize)
  if gq > g:
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, gq - g), (0, 0)))
  lane_pages = lane_pages.astype(jnp.int32)
  lane_len = lane_len.astype(jnp.int32)
  scale = float(d) ** -0.5 * _LOG2E
  tiled = plgpu.Layout.WGMMA
  row, col = tiled.reduce(1), tiled.reduce(0)
  if interpret:  # the interpreter evaluates plain jnp: layout casts are only lowering hints
    cast = lambda x, _layout: x  # noqa: E731
    iota = lambda n, _layout: lax.iota(jnp.int32, n)  # noqa: E731
  else:
    cast = plgpu.layout_cast
    iota = lambda n, layout: plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)  # noqa: E731

  def body(
    sc_ref,
    len_ref,
    pages_ref,
    q_ref,
    k_ref,
    v_ref,
    acc_ref,
    stats_ref,
    k_buf,
    v_buf,
    q_buf,
    o_buf,
    st_buf,
    bars,
    q_bar,
  ):
    split, head, lane = lax.axis_index("split"), lax.axis_index("kvh"), lax.axis_index("lane")
    plgpu.copy_gmem_to_smem(q_ref.at[lane, head], q_buf, q_bar.at[0])
    lyr, win = sc_ref[0], sc_ref[1]
    n = len_ref[lane]
    lo = jnp.maximum(n - win, 0)  # the first key in the window (keys > position - window)
    first = lo // bk
    nblk = jnp.where(lo < n, (n + bk - 1) // bk - first, 0)  # this lane's blocks, its own length
    per = (nblk + s_n - 1) // s_n
    start = first + split * per
    count = jnp.clip(nblk - split * per, 0, per)

    def fetch(blk, slot):  # the pages of block ``blk`` of this lane into ``slot``
      for i in range(bp):
        page = pages_ref[lane, jnp.minimum(blk * bp + i, p - 1)]
        dst = pl.ds(i * ps, ps)
        plgpu.copy_gmem_to_smem(k_ref.at[lyr, page, :, head], k_buf.at[slot, dst], bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[lyr, page, :, head], v_buf.at[slot, dst], bars.at[slot])

    @pl.when(count > 0)
    def _():
      fetch(start, 0)

    plgpu.barrier_wait(q_bar.at[0])
    qs = [cast(q_buf[j], col).astype(jnp.float32) * scale for j in range(g)]

    def step(i, carry):
      slot = i % 2

      @pl.when(i + 1 < count)
      def _():
        fetch(start + i + 1, 1 - slot)

      plgpu.barrier_wait(bars.at[slot])
      kpos = (start + i) * bk + iota(bk, row)
      valid = (kpos < n) & (kpos >= lo)
      kb = cast(k_buf[slot], tiled).astype(jnp.float32)
      scores = [
        jnp.where(valid, jnp.sum(kb * lax.broadcast_in_dim(qj, (bk, d), (1,)), axis=1), -jnp.inf)
        for qj in qs
      ]
      vb = cast(v_buf[slot], tiled).astype(jnp.float32)
      # rows past the lane's length (a page's stale rest, a table's stale page) are selected
      # away: their probability 0 times a stale NaN would still be NaN
      vb = jnp.where(lax.broadcast_in_dim(valid, (bk, d), (0,)), vb, 0.0)
      out = []
      for j in range(g):
        m, total, acc = carry[j]
        m_new = jnp.maximum(m, jnp.max(scores[j]))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        corr = jnp.exp2(m - safe)
        pj = jnp.exp2(scores[j] - safe)
        pv = jnp.sum(lax.broadcast_in_dim(pj, (bk, d), (0,)) * vb, axis=0)
        out.append((m_new, total * corr + pj, acc * corr + pv))
      return tuple(out)

    init = tuple(
      (
        jnp.float32(-jnp.inf),
        cast(jnp.zeros((bk,), jnp.float32), row),
        cast(jnp.zeros((d,), jnp.float32), col),
      )
      for _ in range(g)
    )
    final = lax.fori_loop(0, count, step, init)
    for j, (m, total, acc) in enumerate(final):
      o_buf[j] = acc
      st_buf[j, 0] = m
      st_buf[j, 1] = jnp.sum(total)  # per-key sums, reduced once at the end
      st_buf[j, 2] = jnp.float32(0.0)
      st_buf[j, 3] = jnp.float32(0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_buf, acc_ref.at[lane, head, split])
    plgpu.copy_smem_to_gmem(st_buf, stats_ref.at[lane, head, split])
    plgpu.wait_smem_to_gmem(0)

  out_type = (
    jax.ShapeDtypeStruct((r, kv, s_n, g, d), jnp.float32),
    jax.ShapeDtypeStruct((r, kv, s_n, g, 4), jnp.float32),
  )
  scratch = [
    kv_smem,
    kv_smem,
    plgpu.SMEM((gq, d), q4.dtype),
    plgpu.SMEM((g, d), jnp.float32),
    plgpu.SMEM((g, 4), jnp.float32),
    plgpu.Barrier(num_arrivals=2 * bp, num_barriers=2),
    plgpu.Barrier(num_arrivals=1, num_barriers=1),
  ]
  kernel = plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch,
    grid=(s_n, kv, r),
    grid_names=("split", "kvh", "lane"),
    kernel_name=KERNEL_NAME,
    interpret=interpret,
  )
  return kernel(scalars, lane_len, lane_pages, q4, k_pool, v_pool)


def combine(acc, stats, dtype):
  """Merge the splits' partials (`decode_partials`) into ``[R, KV*G, hd]`` of ``dtype``."""
  m, total = stats[..., 0], stats[..., 1]  # [R, KV, S, G]
  top = jnp.max(m, axis=2, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.where(jnp.isfinite(m), jnp.exp2(m - top), 0.0)
  den = jnp.sum(w * total, axis=2)
  num = jnp.sum(w[..., None] * acc, axis=2)
  out = num / jnp.maximum(den, 1e-30)[..., None]
  r, kv, g, d = out.shape
  return out.reshape(r, kv * g, d).astype(dtype)


@functools.partial(jax.jit, static_argnames=("num_splits", "interpret"))
def _decode_jit(q, k_pool, v_pool, layer, lane_pages, lane_len, window, *, num_splits, interpret):
  acc, stats = decode_partials(
    q,
    k_pool,
    v_pool,
    layer,
    lane_pages=lane_pages,
    lane_len=lane_len,
    window=window,
    num_splits=num_splits,
    interpret=interpret,
  )
  return combine(acc, stats, q.dtype)


def ragged_paged_decode(
  q_RxHxD,
  k_pool,
  v_pool,
  layer,
  *,
  lane_pages,
  lane_len,
  window=None,
  num_splits: int | None = None,
  interpret=False,
):
  """Attention of ``R`` decode queries ``[R, H, hd]`` (lane ``r`` = its sequence's next token,
  at position ``lane_len[r] - 1``) over their pages ``lane_pages [R, P]`` of layer ``layer`` of
  ``k_pool, v_pool [L, num_pages, page_size, KV, hd]``; ``window`` (int, traced or None) keeps
  the keys ``> position - window``. Returns ``[R, H, hd]`` in q's dtype, zeros for a lane with
  ``lane_len == 0``. ``num_splits``: partitions of a lane's pages (None: `default_num_splits`).
  ``interpret``: True (or an ``InterpretGPUParams``) runs the kernel in Mosaic GPU interpret
  mode on any backend. Raises NotImplementedError (with `shapes_supported`'s reason) for shapes
  the kernel does not take."""
  r = q_RxHxD.shape[0]
  _, _, ps, kv, _ = k_pool.shape
  if r == 0:
    return jnp.zeros(q_RxHxD.shape, q_RxHxD.dtype)
  if num_splits is None:
    num_splits = default_num_splits(r, kv, lane_pages.shape[1], ps)
  window = jnp.int32(_NO_WINDOW) if window is None else jnp.asarray(window, jnp.int32)
  return _decode_jit(
    q_RxHxD,
    k_pool,
    v_pool,
    jnp.asarray(layer, jnp.int32),
    lane_pages,
    lane_len,
    window,
    num_splits=int(num_splits),
    interpret=_interpret_params(interpret),
  )


__all__ = [
  "BLOCK_KEYS",
  "KERNEL_NAME",
  "block_keys",
  "combine",
  "decode_partials",
  "default_num_splits",
  "ragged_paged_decode",
  "shapes_supported",
]
