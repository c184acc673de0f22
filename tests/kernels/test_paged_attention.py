"""The ragged paged attention (`pallas_kernels.paged_attention`) against attention computed
sequence by sequence in numpy from the same pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from prefill_batches import place_prompt_chunks

from pallas_kernels.paged_attention import AttentionInputs, ragged_paged_attention

PS, KV, G, D, L = 4, 2, 3, 8, 2  # page size, kv heads, heads per kv head, head dim, layers


def _naive(q, k_seq, v_seq, pos, window):
  """One query ``[H, D]`` at position ``pos`` against keys ``[S, KV, D]`` at 0..S-1."""
  keys = np.arange(k_seq.shape[0])
  ok = keys <= pos
  if window is not None:
    ok &= keys > pos - window
  qh = q.reshape(KV, G, D)
  s = np.einsum("kgd,skd->kgs", qh, k_seq) / np.sqrt(D)
  s = np.where(ok[None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("kgs,skd->kgd", p, v_seq).reshape(KV * G, D)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_pages", [1, 3])
def test_decode_lanes_and_packed_prompts_match_per_sequence_attention(window, block_pages):
  rng = np.random.default_rng(0)
  num_pages = 40
  k_pool = rng.standard_normal((L, num_pages, PS, KV, D)).astype(np.float32)
  v_pool = rng.standard_normal((L, num_pages, PS, KV, D)).astype(np.float32)
  free = list(rng.permutation(np.arange(1, num_pages)))
  # two decode sequences (lengths 1 and 11 after this step's token), then two prompt chunks:
  # 5 new tokens after 6 cached ones, and a fresh 3-token prompt
  decode = [1, 11]
  prefill = [(6, 5), (0, 3)]
  pages_of = {}
  for i, n in enumerate(decode + [c + m for c, m in prefill]):
    pages_of[i] = [int(free.pop()) for _ in range(-(-n // PS))]
  n_tok, r = 16, 4  # a bucket of 16 tokens, 4 lanes (10 tokens used)
  lane_w = 6
  lane_w = -(-lane_w // block_pages) * block_pages
  lane_pages = np.zeros((r, lane_w), np.int32)
  lane_len = np.zeros((r,), np.int32)
  positions = np.zeros((n_tok,), np.int32)
  token_seq = np.full((n_tok,), -1, np.int32)
  for i, n in enumerate(decode):
    lane_pages[i, : len(pages_of[i])] = pages_of[i]
    lane_len[i] = n
    positions[i] = n - 1
  u = r * lane_w
  pages = np.zeros((u,), np.int32)
  page_seq = np.full((u,), -2, np.int32)
  page_start = np.zeros((u,), np.int32)
  page_fill = np.zeros((u,), np.int32)
  col, at = len(decode), 0
  owners = {}
  for j, (cached, m) in enumerate(prefill):
    pg = pages_of[len(decode) + j]
    positions[col : col + m] = np.arange(cached, cached + m)
    token_seq[col : col + m] = j
    for t in range(col, col + m):
      owners[t] = len(decode) + j
    pages[at : at + len(pg)], page_seq[at : at + len(pg)] = pg, j
    page_start[at : at + len(pg)] = np.arange(len(pg)) * PS
    page_fill[at : at + len(pg)] = np.clip(cached + m - np.arange(len(pg)) * PS, 0, PS)
    col, at = col + m, at + len(pg)
  bk = block_pages * PS
  blocks = np.asarray([-(-lane_len.max() // bk), -(-at // block_pages)], np.int32)
  q = rng.standard_normal((n_tok, KV * G, D)).astype(np.float32)
  for layer in range(L):
    out = np.asarray(ragged_paged_attention(
      jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), layer, AttentionInputs(
        lane_pages=jnp.asarray(lane_pages), lane_len=jnp.asarray(lane_len),
        pages=jnp.asarray(pages), page_seq=jnp.asarray(page_seq),
        page_start=jnp.asarray(page_start), page_fill=jnp.asarray(page_fill),
        token_seq=jnp.asarray(token_seq), positions=jnp.asarray(positions),
        blocks=jnp.asarray(blocks), block_pages=block_pages),
      window=window))
    for t in range(n_tok):
      i = t if t < len(decode) else owners.get(t)
      if i is None:  # padding: no keys, zeros
        np.testing.assert_array_equal(out[t], 0.0)
        continue
      pg = pages_of[i]
      k_seq = k_pool[layer, pg].reshape(-1, KV, D)
      v_seq = v_pool[layer, pg].reshape(-1, KV, D)
      want = _naive(q[t], k_seq, v_seq, int(positions[t]), window)
      np.testing.assert_allclose(out[t], want, rtol=2e-5, atol=2e-5)


def _isolation_case(rng, block_pages, num_pages=48):
  """Two decode lanes and two packed prompt chunks: even sequences are the tenant under test,
  odd ones hostile. Returns the call's arrays, each token's sequence (None: padding), the pages
  of each sequence, and the set of (page, row) pairs no sequence has written (stale)."""
  free = list(rng.permutation(np.arange(1, num_pages)))
  decode = [6, 9]  # lengths after this step's token
  prefill = [(5, 6), (2, 7)]  # (cached, new) tokens
  lens = decode + [c + m for c, m in prefill]
  pages_of = {i: [int(free.pop()) for _ in range(-(-n // PS))] for i, n in enumerate(lens)}
  hostile_pages = pages_of[1] + pages_of[3]
  n_tok, r = 16, 4
  lane_w = -(-4 // block_pages) * block_pages
  # unused page-table entries and prefill slots point at hostile pages: read, never counted
  lane_pages = np.asarray(rng.choice(hostile_pages, (r, lane_w)), np.int32)
  lane_len = np.zeros((r,), np.int32)
  positions = np.zeros((n_tok,), np.int32)
  token_seq = np.full((n_tok,), -1, np.int32)
  owner = [None] * n_tok
  for i, n in enumerate(decode):
    lane_pages[i, : len(pages_of[i])] = pages_of[i]
    lane_len[i], positions[i], owner[i] = n, n - 1, i
  u = r * lane_w
  pages = np.asarray(rng.choice(hostile_pages, u), np.int32)
  page_seq = np.full((u,), -2, np.int32)
  page_start = np.zeros((u,), np.int32)
  page_fill = np.zeros((u,), np.int32)
  at = place_prompt_chunks(prefill, len(decode), pages_of, PS, positions=positions,
                           token_seq=token_seq, owner=owner, pages=pages, page_seq=page_seq,
                           page_start=page_start, page_fill=page_fill)
  written = {(p, t) for i, n in enumerate(lens) for k, p in enumerate(pages_of[i])
             for t in range(PS) if k * PS + t < n}
  stale = {(p, t) for p in range(num_pages) for t in range(PS)} - written
  bk = block_pages * PS
  blocks = np.asarray([-(-lane_len.max() // bk), -(-at // block_pages)], np.int32)
  kw = dict(lane_pages=lane_pages, lane_len=lane_len, pages=pages, page_seq=page_seq,
            page_start=page_start, page_fill=page_fill, token_seq=token_seq,
            positions=positions, blocks=blocks, block_pages=block_pages)
  return kw, owner, pages_of, stale


@pytest.mark.parametrize("implementation", ["reference", None])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_pages", [1, 3])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_stale_rows_and_other_sequences_values_never_reach_a_query(implementation, window,
                                                                   block_pages, poison):
  """Masks are selections: NaN / inf in the stale rest of pages (a recycled page), in page-table
  entries past a lane's pages, and in a hostile sequence's own K/V give a tenant's tokens exactly
  what zeros there give, which is attention over its own keys (numpy)."""
  rng = np.random.default_rng(1)
  num_pages = 48
  kw, owner, pages_of, stale = _isolation_case(rng, block_pages, num_pages)
  k_pool = rng.standard_normal((L, num_pages, PS, KV, D)).astype(np.float32)
  v_pool = rng.standard_normal((L, num_pages, PS, KV, D)).astype(np.float32)
  q = rng.standard_normal((16, KV * G, D)).astype(np.float32)
  stale_idx = tuple(np.asarray(sorted(stale)).T)
  hostile = pages_of[1] + pages_of[3]

  def run(fill):
    k, v = k_pool.copy(), v_pool.copy()
    for pool in (k, v):
      pool[:, stale_idx[0], stale_idx[1]] = fill
      pool[:, hostile] = fill
    args = {name: jnp.asarray(a) for name, a in kw.items() if name != "block_pages"}
    inputs = AttentionInputs(**args, block_pages=kw["block_pages"])
    return np.asarray(ragged_paged_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 1, inputs, window=window,
      implementation=implementation)), k, v

  clean, k_clean, v_clean = run(0.0)
  poisoned, _, _ = run(poison)
  tenant = [t for t, i in enumerate(owner) if i in (0, 2)]
  assert tenant
  np.testing.assert_array_equal(poisoned[tenant], clean[tenant])
  assert np.isfinite(poisoned[tenant]).all()
  for t in tenant:
    pg = pages_of[owner[t]]
    want = _naive(q[t], k_clean[1, pg].reshape(-1, KV, D), v_clean[1, pg].reshape(-1, KV, D),
                  int(kw["positions"][t]), window)
    np.testing.assert_allclose(poisoned[t], want, rtol=2e-5, atol=2e-5)
  padding = [t for t, i in enumerate(owner) if i is None]
  np.testing.assert_array_equal(poisoned[padding], 0.0)
