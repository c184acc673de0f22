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
from prefill_batches import CASES, _api_case, _batch, _exact, _f32, _prompt_inputs, hostile_batch

from pallas_kernels.paged_attention import mosaic_gpu_prefill as mp
from pallas_kernels.paged_attention import ragged_paged_attention, reference
from pallas_kernels.paged_attention.api import prefill_unavailable_reason
from pallas_kernels.platform import lowering_platform


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
  q, k_pool, v_pool, inputs, check = hostile_batch()
  check(_f32(mp.packed_prefill(q, k_pool, v_pool, 0, inputs, interpret=True)))


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
