"""Ragged paged attention in plain jnp: the paged engine's attention, and the readable
reference for a GPU kernel.

One step's queries are a flat, ragged token batch ``q [N, H, hd]``: first the decode tokens
(one per sequence), then prompt chunks (several tokens per sequence, several sequences packed).
Where their keys are is one pytree, `pallas_kernels.attention_inputs.AttentionInputs` (its
fields named below). The two kinds are attended to in two length-bounded passes, and each token
takes the pass it belongs to:

* **decode lanes**: the first ``R`` tokens are lanes; lane ``r`` reads its own sequence's page
  table ``lane_pages [R, P]`` up to ``lane_len[r]`` keys (0: the token is not a decode token).
* **packed prefill**: every token may attend to the pages of ``pages [U]`` (the pages of the
  step's prompt chunks, each labelled with its sequence ``page_seq``, its first position
  ``page_start`` and its valid tokens ``page_fill``); a key counts for a query of the same
  sequence (``token_seq``) at an earlier or equal position.

Both passes walk their pages in blocks of ``block_pages`` with an online softmax, and the loop
runs for ``blocks[0]`` (decode) and ``blocks[1]`` (prefill) blocks, counts the host computes
from the actual lengths: the cost follows the longest live sequence, never the maximum length,
and the shapes depend only on ``N`` (the token bucket). ``window`` (an int, possibly traced, or
None) limits a query to the keys ``> position - window`` (sliding-window layers).

Isolation: masks are selections, never products with 0 (``0 · NaN = NaN``). A score outside a
query's keys is replaced by ``-inf`` and its probability by 0, and every value row ``P·V`` reads
is selected first: decode lanes keep the rows of their own keys (a page's rest past the lane's
length may hold a recycled page's stale values), packed prefill keeps the filled rows of its
pages whose values are finite. Packed sequences share one ``P·V`` product, so a non-finite
value of one sequence would reach every query through its zero probabilities; it counts as 0
instead (its own sequence is non-finite already: what made its values non-finite is in its
residual stream, or in weights registration refuses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..attention_inputs import AttentionInputs, register_pytree

register_pytree()

_BIG = 1 << 30  # "no window"


def _update(carry, s, valid, v, spec):
  """One online-softmax step: scores ``s`` (f32, masked by ``valid``) against values ``v``;
  ``carry`` = (running max, running sum of exponentials, running weighted values)."""
  mx, total, acc = carry
  mx_new = jnp.maximum(mx, jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1))
  safe = jnp.where(jnp.isfinite(mx_new), mx_new, 0.0)
  p = jnp.where(valid, jnp.exp(s - safe[..., None]), 0.0)
  corr = jnp.where(jnp.isfinite(mx), jnp.exp(mx - safe), 0.0)
  pv = jnp.einsum(spec, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return mx_new, total * corr + p.sum(-1), acc * corr[..., None] + pv


def _finish(carry, dtype):
  _, total, acc = carry
  return (acc / jnp.maximum(total, 1e-30)[..., None]).astype(dtype)


def _init(rows, kv, g, d):
  return (
    jnp.full((rows, kv, g), -jnp.inf, jnp.float32),
    jnp.zeros((rows, kv, g), jnp.float32),
    jnp.zeros((rows, kv, g, d), jnp.float32),
  )


def decode_lanes(
  q_NxHxD, k_pool, v_pool, layer, *, lane_pages, lane_len, blocks, block_pages: int, window=None
):
  """The decode pass alone: ``[R, H, hd]`` for the first ``R = lane_pages.shape[0]`` tokens of
  ``q`` (``[N, H, hd]``, N >= R), each against its lane's pages; zeros where ``lane_len`` is 0.
  Only ``blocks[0]`` is read."""
  n, h, d = q_NxHxD.shape
  _, _, ps, kv, _ = k_pool.shape
  g = h // kv
  r = lane_pages.shape[0]
  bp = int(block_pages)
  bk = bp * ps
  window = _BIG if window is None else window
  qd = q_NxHxD[:r].reshape(r, kv, g, d)
  scale = d**-0.5
  offs = jnp.arange(bk, dtype=jnp.int32)
  lane_q = lane_len - 1  # the lane's query position

  def lane_block(j, carry):
    pg = jax.lax.dynamic_slice_in_dim(lane_pages, j * bp, bp, axis=1)  # [R, bp]
    k = k_pool[layer, pg].reshape(r, bk, kv, d)
    v = v_pool[layer, pg].reshape(r, bk, kv, d)
    s = jnp.einsum("rkgd,rskd->rkgs", qd, k, preferred_element_type=jnp.float32) * scale
    kpos = j * bk + offs
    valid = (kpos[None] < lane_len[:, None]) & (kpos[None] > lane_q[:, None] - window)
    v = jnp.where(valid[:, :, None, None], v, jnp.zeros((), v.dtype))  # stale rows never enter
    return _update(carry, s, valid[:, None, None], v, "rkgs,rskd->rkgd")

  dec = _finish(jax.lax.fori_loop(0, blocks[0], lane_block, _init(r, kv, g, d)), q_NxHxD.dtype)
  return dec.reshape(r, h, d)


def packed_prefill(q_NxHxD, k_pool, v_pool, layer, inputs: AttentionInputs, *, window=None):
  """The packed-prefill pass alone: ``[N, H, hd]``, every token against the step's prompt pages
  of its own sequence (``inputs.token_seq``) up to its position; zeros for a token with no key.
  Only ``inputs.blocks[1]`` is read."""
  n, h, d = q_NxHxD.shape
  _, _, ps, kv, _ = k_pool.shape
  g = h // kv
  t = inputs
  bp = int(t.block_pages)
  bk = bp * ps
  window = _BIG if window is None else window
  q = q_NxHxD.reshape(n, kv, g, d)
  scale = d**-0.5

  def packed_block(j, carry):
    sl = lambda a: jax.lax.dynamic_slice_in_dim(a, j * bp, bp)  # noqa: E731
    pg, seq, start, fill = sl(t.pages), sl(t.page_seq), sl(t.page_start), sl(t.page_fill)
    k = k_pool[layer, pg].reshape(bk, kv, d)
    v = v_pool[layer, pg].reshape(bk, kv, d)
    s = jnp.einsum("nkgd,skd->nkgs", q, k, preferred_element_type=jnp.float32) * scale
    within = jnp.arange(ps, dtype=jnp.int32)
    kpos = (start[:, None] + within[None]).reshape(bk)
    kvalid = (within[None] < fill[:, None]).reshape(bk)
    kseq = jnp.repeat(seq, ps)
    valid = (
      (t.token_seq[:, None] == kseq[None])
      & kvalid[None]
      & (kpos[None] <= t.positions[:, None])
      & (kpos[None] > t.positions[:, None] - window)
    )
    # one P·V for every packed query: rows no query may read (stale, or non-finite) become 0
    v = jnp.where(kvalid[:, None, None] & jnp.isfinite(v), v, jnp.zeros((), v.dtype))
    return _update(carry, s, valid[:, None, None], v, "nkgs,skd->nkgd")

  pre = _finish(jax.lax.fori_loop(0, t.blocks[1], packed_block, _init(n, kv, g, d)), q_NxHxD.dtype)
  return pre.reshape(n, h, d)


def merge(decode_RxHxD, prefill_NxHxD, lane_len):
  """Each of the first ``R`` tokens takes the decode result if it is a lane (``lane_len > 0``),
  every other token the packed-prefill result."""
  r = decode_RxHxD.shape[0]
  is_lane = (lane_len > 0)[:, None, None]
  return prefill_NxHxD.at[:r].set(jnp.where(is_lane, decode_RxHxD, prefill_NxHxD[:r]))


def ragged_paged_attention(q_NxHxD, k_pool, v_pool, layer, inputs: AttentionInputs, *,
                           window=None):
  """Softmax attention of ``q`` (``[N, H, hd]``) over layer ``layer`` (an int, possibly traced)
  of ``k_pool, v_pool`` (``[L, num_pages, page_size, KV, hd]``; pages are gathered straight from
  the pool, never a layer's slice first), the batch described by ``inputs``; see the module
  docstring. Scores and softmax in f32. Returns ``[N, H, hd]`` in q's dtype; a token with no key
  (padding) gets zeros. The two passes are `decode_lanes` and `packed_prefill`, put together by
  `merge`."""
  t = inputs
  dec = decode_lanes(q_NxHxD, k_pool, v_pool, layer, lane_pages=t.lane_pages,
                     lane_len=t.lane_len, blocks=t.blocks, block_pages=t.block_pages,
                     window=window)
  pre = packed_prefill(q_NxHxD, k_pool, v_pool, layer, t, window=window)
  return merge(dec, pre, t.lane_len)
