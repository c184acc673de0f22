"""The Mosaic GPU prefill kernel (`pallas_kernels.paged_attention.mosaic_gpu_prefill`) without
a GPU:

(a) its numerics in Mosaic GPU interpret mode on CPU, against float64 numpy attention computed
    sequence by sequence, and against the reference's `packed_prefill` (prompt chunks packed
    several per row block, a chunk that starts mid-page after a prefix-cache hit, one that
    starts on a page boundary, decode tokens and padding, a sliding window, bf16 and f16
    pools, head_dim 64 and 128);
(b) isolation: NaN in the unfilled rest of a page and in another packed sequence's values never
    reaches a query;
(c) `key_block_ranges` covers every page a token may read (brute force over tokens and pages);
(d) the dispatching API: ``implementation="mosaic_gpu"`` takes the kernel for prompt chunks and
    the decode kernel for lanes; its CUDA lowering has both kernels, an f32 pool keeps the
    reference's prefill.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import AttentionInputs, ragged_paged_attention, reference
from pallas_kernels.paged_attention import mosaic_gpu_prefill as mp
from pallas_kernels.paged_attention.api import prefill_unavailable_reason
from pallas_kernels.platform import lowering_platform

PS, L = 16, 2


def _batch(rng, *, prefill, decode=(), n_tok, u, num_pages, kv, g, d, dtype, hostile=None):
  """Pools, queries and the scheduler's page list for ``prefill`` chunks ``(cached, new)``
  packed after ``decode`` lane tokens (lengths after this step's token). Unused page-list
  entries point at ``hostile``'s pages (or random ones); unfilled page rows hold NaN.
  Returns (q, k_pool, v_pool, kw, owner, pages_of)."""
  free = list(rng.permutation(np.arange(1, num_pages)))
  lens = list(decode) + [c + m for c, m in prefill]
  pages_of = {i: [int(free.pop()) for _ in range(-(-n // PS))] for i, n in enumerate(lens)}
  k_pool = rng.standard_normal((L, num_pages, PS, kv, d)).astype(np.float32)
  v_pool = rng.standard_normal((L, num_pages, PS, kv, d)).astype(np.float32)
  written = np.zeros((num_pages, PS), bool)
  for i, n in enumerate(lens):
    for k, p in enumerate(pages_of[i]):
      written[p, : max(0, min(PS, n - k * PS))] = True
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
  col, at = len(decode), 0
  for j, (cached, m) in enumerate(prefill):
    i, pg = len(decode) + j, pages_of[len(decode) + j]
    positions[col : col + m] = np.arange(cached, cached + m)
    token_seq[col : col + m] = j
    owner[col : col + m] = [i] * m
    pages[at : at + len(pg)], page_seq[at : at + len(pg)] = pg, j
    page_start[at : at + len(pg)] = np.arange(len(pg)) * PS
    page_fill[at : at + len(pg)] = np.clip(cached + m - np.arange(len(pg)) * PS, 0, PS)
    col, at = col + m, at + len(pg)
  q = rng.standard_normal((n_tok, kv * g, d)).astype(np.float32)
  kw = dict(pages=pages, page_seq=page_seq, page_start=page_start, page_fill=page_fill,
            token_seq=token_seq, positions=positions)
  return (q.astype(dtype), k_pool.astype(dtype), v_pool.astype(dtype),
          {k: jnp.asarray(v) for k, v in kw.items()}, owner, pages_of)


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


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_kernel_matches_float64_attention_and_the_reference(case, dtype, window):
  if case == "llama_heads" and (dtype != jnp.bfloat16 or window is not None):
    pytest.skip("one configuration of the wide heads is enough")
  c = CASES[case]
  rng = np.random.default_rng(len(case) + (window or 0))
  q, k_pool, v_pool, kw, owner, pages_of = _batch(
    rng, prefill=c["prefill"], decode=c["decode"], n_tok=c["n_tok"], u=c["u"], num_pages=40,
    kv=c["kv"], g=c["g"], d=c["d"], dtype=dtype)
  layer = 1
  inputs = _prompt_inputs(kw, c["u"])
  out = _f32(mp.packed_prefill(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), layer,
                               inputs, window=window, interpret=True))
  ref = _f32(reference.packed_prefill(
    jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), layer, inputs, window=window))
  assert np.isfinite(out).all()
  # both round P to the pool dtype and the result to q's: they differ by rounding alone
  ulp = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(out, ref, rtol=0, atol=4 * ulp)
  for t in range(c["n_tok"]):
    i = owner[t]
    if i is None:  # a decode lane or padding: no prompt key, zeros
      np.testing.assert_array_equal(out[t], 0.0)
      continue
    pos = int(kw["positions"][t])
    want = _exact(q, k_pool, v_pool, layer, t, pages_of[i], pos, window, c["kv"], c["g"])
    # P rounded to the pool dtype (relative ulp/2 each) and the output (ulp/2): |err| <= ulp·max|v|
    np.testing.assert_allclose(out[t], want, rtol=0, atol=ulp * np.abs(want).max() + ulp * 4)


def test_nan_in_stale_rows_and_in_another_sequence_never_reaches_a_query():
  rng = np.random.default_rng(7)
  kv, g, d = 2, 3, 64
  q, k_pool, v_pool, kw, owner, pages_of = _batch(
    rng, prefill=[(3, 12), (0, 21), (9, 11)], n_tok=48, u=12, num_pages=32, kv=kv, g=g, d=d,
    dtype=jnp.bfloat16, hostile=1)
  # sequence 1 is hostile: NaN and inf in its written K and V rows; the page list's unused
  # entries point at its pages too
  k_pool, v_pool = np.asarray(k_pool, np.float32), np.asarray(v_pool, np.float32)
  for p in pages_of[1]:
    v_pool[:, p, ::3] = np.nan
    v_pool[:, p, 1::3] = np.inf
    k_pool[:, p, 2::5] = np.nan
  k_pool, v_pool = k_pool.astype(jnp.bfloat16), v_pool.astype(jnp.bfloat16)
  out = _f32(mp.packed_prefill(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 0,
                               _prompt_inputs(kw, 12), interpret=True))
  ulp = float(jnp.finfo(jnp.bfloat16).eps)
  for t in range(48):
    i = owner[t]
    if i is None:
      np.testing.assert_array_equal(out[t], 0.0)
    elif i != 1:  # the tenants: finite, and their own attention
      want = _exact(q, k_pool, v_pool, 0, t, pages_of[i], int(kw["positions"][t]), None, kv, g)
      assert np.isfinite(out[t]).all(), t
      np.testing.assert_allclose(out[t], want, rtol=0, atol=ulp * np.abs(want).max() + ulp * 4)


@pytest.mark.parametrize("g,ps", [(3, 16), (4, 8), (1, 64)])
def test_key_block_ranges_cover_every_page_a_token_reads(g, ps):
  rng = np.random.default_rng(g)
  chunks = [(0, 1), (40, 7), (0, 70), (17, 3), (64, 64)]  # (cached, new)
  n_tok, u = 256, 64
  token_seq = np.full(n_tok, -1, np.int32)
  positions = np.zeros(n_tok, np.int32)
  page_seq = np.full(u, -2, np.int32)
  page_start = np.zeros(u, np.int32)
  page_fill = np.zeros(u, np.int32)
  col, at = 3, 0  # three decode tokens first
  for j, (cached, m) in enumerate(chunks):
    k = -(-(cached + m) // ps) + int(rng.integers(0, 2))  # sometimes a spare page past the fill
    token_seq[col : col + m], positions[col : col + m] = j, np.arange(cached, cached + m)
    page_seq[at : at + k], page_start[at : at + k] = j, np.arange(k) * ps
    page_fill[at : at + k] = np.clip(cached + m - np.arange(k) * ps, 0, ps)
    col, at = col + m, at + k
  bp = mp.BLOCK_KEYS // ps
  ranges = np.asarray(mp.key_block_ranges(
    page_seq=jnp.asarray(page_seq), page_start=jnp.asarray(page_start),
    page_fill=jnp.asarray(page_fill), token_seq=jnp.asarray(token_seq),
    positions=jnp.asarray(positions), group=g, block_pages=bp))
  assert ranges.shape == (-(-n_tok * g // mp.BLOCK_ROWS), 2)
  total = 0
  for b, (lo, hi) in enumerate(ranges):
    tokens = {r // g for r in range(b * mp.BLOCK_ROWS, (b + 1) * mp.BLOCK_ROWS) if r < n_tok * g}
    need = {p for t in tokens for p in range(u) if token_seq[t] >= 0
            and page_seq[p] == token_seq[t] and page_fill[p] > 0 and page_start[p] <= positions[t]}
    if not need:
      assert hi <= lo, (b, lo, hi)
      continue
    assert lo * bp <= min(need) and max(need) < hi * bp, (b, lo, hi, sorted(need))
    # tight: the range starts at the block of the first page read and ends at the last's
    assert lo == min(need) // bp and hi == max(need) // bp + 1, (b, lo, hi, sorted(need))
    total += hi - lo
  assert total > 0


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


@pytest.mark.slow
def test_api_runs_prompt_chunks_through_the_prefill_kernel_and_lanes_through_decode():
  q, k_pool, v_pool, kw = _api_case(np.random.default_rng(3), jnp.bfloat16)
  args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 1)
  got = _f32(ragged_paged_attention(*args, kw, implementation="mosaic_gpu", interpret=True))
  ref = _f32(ragged_paged_attention(*args, kw, implementation="reference"))
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, rtol=0, atol=4 * float(jnp.finfo(jnp.bfloat16).eps))
  assert prefill_unavailable_reason(q, k_pool) is None
  assert "float32" in prefill_unavailable_reason(q, k_pool.astype(np.float32))
  assert "head_dim 96" in mp.shapes_supported(num_heads=4, num_kv_heads=2, head_dim=96,
                                              page_size=16, dtype=jnp.bfloat16)


@pytest.mark.parametrize("pool_dtype,prefill_kernel", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_cuda_lowering_has_the_prefill_kernel_for_bf16_pools(pool_dtype, prefill_kernel):
  q, k_pool, v_pool, kw = _api_case(np.random.default_rng(4), pool_dtype)
  spec = lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype)  # noqa: E731

  def step(q, k_pool, v_pool, inputs):
    return ragged_paged_attention(q, k_pool, v_pool, 0, inputs)

  with lowering_platform("cuda"):
    text = jax.jit(step).trace(spec(q), spec(k_pool), spec(v_pool),
                               jax.tree.map(spec, kw)).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
  assert calls.count("mosaic_gpu_v2") == (2 if prefill_kernel else 1), calls
  assert (mp.KERNEL_NAME in text) == prefill_kernel
