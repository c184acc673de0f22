"""Ragged prompt batches for the packed-prefill kernels' tests (the Mosaic GPU kernel in
interpret mode, the CPU kernel): pools with NaN in every unwritten row, the scheduler's page
list, and float64 attention to check against."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import AttentionInputs

PS, L = 16, 2


def _batch(rng, *, prefill, decode=(), n_tok, u, num_pages, kv, g, d, dtype, hostile=None,
           ps=PS):
  """Pools, queries and the scheduler's page list for ``prefill`` chunks ``(cached, new)``
  packed after ``decode`` lane tokens (lengths after this step's token). Unused page-list
  entries point at ``hostile``'s pages (or random ones); unfilled page rows hold NaN; pages of
  ``ps`` tokens.
  Returns (q, k_pool, v_pool, kw, owner, pages_of)."""
  free = list(rng.permutation(np.arange(1, num_pages)))
  lens = list(decode) + [c + m for c, m in prefill]
  pages_of = {i: [int(free.pop()) for _ in range(-(-n // ps))] for i, n in enumerate(lens)}
  k_pool = rng.standard_normal((L, num_pages, ps, kv, d)).astype(np.float32)
  v_pool = rng.standard_normal((L, num_pages, ps, kv, d)).astype(np.float32)
  written = np.zeros((num_pages, ps), bool)
  for i, n in enumerate(lens):
    for k, p in enumerate(pages_of[i]):
      written[p, : max(0, min(ps, n - k * ps))] = True
  k_pool[:, ~written] = np.nan  # a recycled page's stale rest
  v_pool[:, ~written] = np.nan
  spare = pages_of[hostile] if hostile is not None else list(range(num_pages))
  positions = np.zeros((n_tok,), np.int32)
  token_seq = np.full((n_tok,), -1, np.int32)
  owner = [None] * n_tok
  for i, n in enumerate(decode):
    positions[i] = n - 1
  pages = np.asarray(rng.choice(spare, u), np.int32)
  page_seq = np.full((u,), -2, np.int32)
  page_start = np.zeros((u,), np.int32)
  page_fill = np.zeros((u,), np.int32)
  place_prompt_chunks(prefill, len(decode), pages_of, ps, positions=positions,
                      token_seq=token_seq, owner=owner, pages=pages, page_seq=page_seq,
                      page_start=page_start, page_fill=page_fill)
  q = rng.standard_normal((n_tok, kv * g, d)).astype(np.float32)
  kw = dict(pages=pages, page_seq=page_seq, page_start=page_start, page_fill=page_fill,
            token_seq=token_seq, positions=positions)
  return (q.astype(dtype), k_pool.astype(dtype), v_pool.astype(dtype),
          {k: jnp.asarray(v) for k, v in kw.items()}, owner, pages_of)


def place_prompt_chunks(prefill, first, pages_of, ps, *, positions, token_seq, owner, pages,
                        page_seq, page_start, page_fill) -> int:
  """Writes the prompt chunks ``prefill`` (``(cached, new)``; sequence ``first + j`` of
  ``pages_of``) after the ``first`` decode tokens, as the scheduler packs them: each token's
  position, sequence and owner, and each chunk's pages in the page list (pages of ``ps``
  tokens). Returns the page-list entries used."""
  col, at = first, 0
  for j, (cached, m) in enumerate(prefill):
    i, pg = first + j, pages_of[first + j]
    positions[col : col + m] = np.arange(cached, cached + m)
    token_seq[col : col + m] = j
    owner[col : col + m] = [i] * m
    pages[at : at + len(pg)], page_seq[at : at + len(pg)] = pg, j
    page_start[at : at + len(pg)] = np.arange(len(pg)) * ps
    page_fill[at : at + len(pg)] = np.clip(cached + m - np.arange(len(pg)) * ps, 0, ps)
    col, at = col + m, at + len(pg)
  return at


def _prompt_inputs(kw, u, **lanes):
  """`AttentionInputs` of `_batch`'s prompt chunks: no decode lane unless ``lanes`` gives them,
  the page list walked in ``u`` blocks of one page (the reference's loop bound; the kernel
  bounds its own)."""
  lanes = lanes or dict(lane_pages=jnp.zeros((0, 1), jnp.int32),
                        lane_len=jnp.zeros((0,), jnp.int32),
                        blocks=jnp.asarray([0, u], jnp.int32), block_pages=1)
  return AttentionInputs(**kw, **lanes)


def _exact(q, k_pool, v_pool, layer, t, pages, pos, window, kv, g):
  """float64 attention of token ``t``'s query at ``pos`` over its sequence's keys 0..pos."""
  qf = np.asarray(q, np.float64)[t].reshape(kv, g, -1)
  k = np.asarray(k_pool, np.float64)[layer, pages].reshape(-1, kv, qf.shape[-1])[: pos + 1]
  v = np.asarray(v_pool, np.float64)[layer, pages].reshape(-1, kv, qf.shape[-1])[: pos + 1]
  keys = np.arange(pos + 1)
  ok = np.ones(pos + 1, bool) if window is None else keys > pos - window
  s = np.einsum("kgd,skd->kgs", qf, k) / np.sqrt(qf.shape[-1])
  s = np.where(ok[None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("kgs,skd->kgd", p, np.where(ok[:, None, None], v, 0.0)).reshape(kv * g, -1)


def _f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


CASES = {
  # (cached, new) chunks: a prefix-cache hit ending mid-page, a fresh prompt, a chunk starting on
  # a page boundary; G = 3 rows per token, so row blocks straddle tokens and sequences
  "packed": dict(prefill=[(37, 30), (0, 9), (32, 20)], decode=(5, 12), n_tok=96, u=24, kv=2, g=3,
                 d=64),
  "llama_heads": dict(prefill=[(5, 40), (0, 17)], decode=(), n_tok=64, u=12, kv=2, g=4, d=128),
}


def _api_case(rng, dtype):
  kv, g, d = 2, 3, 64
  decode = (5, 30)
  q, k_pool, v_pool, kw, owner, pages_of = _batch(
    rng, prefill=[(20, 13), (0, 6)], decode=decode, n_tok=64, u=16, num_pages=32, kv=kv, g=g,
    d=d, dtype=dtype)
  r, width = 4, 4
  lane_pages = np.zeros((r, width), np.int32)
  lane_len = np.zeros((r,), np.int32)
  for i, n in enumerate(decode):
    lane_pages[i, : len(pages_of[i])] = pages_of[i]
    lane_len[i] = n
  blocks = jnp.asarray([-(-max(decode) // (2 * PS)), -(-16 // 2)], jnp.int32)
  return q, k_pool, v_pool, _prompt_inputs(kw, 16, lane_pages=jnp.asarray(lane_pages),
                                            lane_len=jnp.asarray(lane_len), blocks=blocks,
                                            block_pages=2)




def hostile_batch():
  """Three bf16 prompt chunks (48 tokens, KV 2, G 3, head_dim 64) whose second sequence holds
  NaN and inf in its written K and V rows; the page list's unused entries point at its pages
  too. Returns (q, k_pool, v_pool, inputs, check): ``check(out)`` asserts that every other
  token's output is finite and its own attention, and padding zeros (layer 0)."""
  rng = np.random.default_rng(7)
  kv, g, d = 2, 3, 64
  q, k_pool, v_pool, kw, owner, pages_of = _batch(
    rng, prefill=[(3, 12), (0, 21), (9, 11)], n_tok=48, u=12, num_pages=32, kv=kv, g=g, d=d,
    dtype=jnp.bfloat16, hostile=1)
  k_pool, v_pool = np.asarray(k_pool, np.float32), np.asarray(v_pool, np.float32)
  for p in pages_of[1]:
    v_pool[:, p, ::3] = np.nan
    v_pool[:, p, 1::3] = np.inf
    k_pool[:, p, 2::5] = np.nan
  k_pool, v_pool = k_pool.astype(jnp.bfloat16), v_pool.astype(jnp.bfloat16)

  def check(out):
    ulp = float(jnp.finfo(jnp.bfloat16).eps)
    for t in range(48):
      i = owner[t]
      if i is None:
        np.testing.assert_array_equal(out[t], 0.0)
      elif i != 1:  # the tenants: finite, and their own attention
        want = _exact(q, k_pool, v_pool, 0, t, pages_of[i], int(kw["positions"][t]), None, kv, g)
        assert np.isfinite(out[t]).all(), t
        np.testing.assert_allclose(out[t], want, rtol=0, atol=ulp * np.abs(want).max() + ulp * 4)

  return jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), _prompt_inputs(kw, 12), check
