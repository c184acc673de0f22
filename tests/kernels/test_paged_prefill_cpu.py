"""The CPU packed-prefill kernel (`pallas_kernels.paged_attention.cpu.packed_prefill`) against
float64 attention computed sequence by sequence and against the reference's `packed_prefill`:
prompt chunks packed several per step (a prefix-cache hit ending mid-page, a chunk starting on a
page boundary, sequences spanning several tiles of the kernel), decode tokens and padding, a
sliding window, f32 and bf16 pools and queries, head_dim 64/128/37, group sizes 1/3/4, pages of
8/16/40 tokens (partial 16-key chunks); NaN in unwritten rows and in another sequence's rows
never reaches a query; the portable (no AVX-512) build; the api's ``"cpu"`` implementation runs
prompt chunks through the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from prefill_batches import _api_case, _batch, _exact, _f32, _prompt_inputs, hostile_batch

from pallas_kernels.paged_attention import cpu, ragged_paged_attention, reference

pytestmark = pytest.mark.skipif(cpu.build_reason() is not None, reason=str(cpu.build_reason()))

CASES = {
  # (cached, new) chunks after decode lanes; G = 3: a tile is 21 tokens, the 45-token chunk three
  "packed": dict(prefill=[(37, 30), (0, 9), (32, 45)], decode=(5, 12), n_tok=96, u=24, kv=2,
                 g=3, d=64, ps=16),
  "llama_heads": dict(prefill=[(5, 40), (0, 17)], n_tok=64, u=12, kv=2, g=4, d=128, ps=16),
  "one_head_per_group": dict(prefill=[(70, 70), (0, 3)], n_tok=80, u=14, kv=3, g=1, d=64,
                             ps=16),
  # 40-token pages: three 16-key chunks, the last partial; head_dim 37 pads to 64 columns
  "odd": dict(prefill=[(23, 19), (0, 50)], decode=(7,), n_tok=72, u=6, kv=1, g=2, d=37, ps=40),
  "small_pages": dict(prefill=[(11, 26), (0, 5)], n_tok=40, u=12, kv=2, g=4, d=64, ps=8),
}


def _run(case, dtype, window, *, target=None, seed=0):
  c = dict(CASES[case])
  rng = np.random.default_rng(seed + len(case))
  q, k_pool, v_pool, kw, owner, pages_of = _batch(rng, num_pages=40, dtype=dtype, **c)
  inputs = _prompt_inputs(kw, c["u"])
  args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 1, inputs)
  out = _f32(cpu.packed_prefill(*args, window=window, **({"target": target} if target else {})))
  ref = _f32(reference.packed_prefill(*args, window=window))
  return out, ref, (q, k_pool, v_pool, kw, owner, pages_of, c)


def _check_exact(out, q, k_pool, v_pool, kw, owner, pages_of, c, window, dtype):
  """Each token against float64 attention over its own sequence; zeros for lanes and padding."""
  ulp = float(jnp.finfo(dtype).eps)
  for t in range(c["n_tok"]):
    i = owner[t]
    if i is None:
      np.testing.assert_array_equal(out[t], 0.0)
      continue
    want = _exact(q, k_pool, v_pool, 1, t, pages_of[i], int(kw["positions"][t]), window,
                  c["kv"], c["g"])
    # f32: sums in another order; bf16: P rounded to bf16 (ulp/2 each) and q's output rounding
    tol = 2e-5 if dtype == jnp.float32 else ulp * np.abs(want).max() + ulp * 4
    np.testing.assert_allclose(out[t], want, rtol=0, atol=tol, err_msg=f"token {t}")


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_attention_and_the_reference(case, dtype, window):
  out, ref, (q, k_pool, v_pool, kw, owner, pages_of, c) = _run(case, dtype, window)
  assert np.isfinite(out).all()
  ulp = float(jnp.finfo(dtype).eps)
  np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 if dtype == jnp.float32 else 4 * ulp)
  _check_exact(out, q, k_pool, v_pool, kw, owner, pages_of, c, window, dtype)
  assert np.abs(out).max() > 0.1  # prompt tokens took the pass


@pytest.mark.parametrize("case", ["packed", "small_pages"])
def test_bf16_pools_round_probabilities_as_the_reference(case):
  """f32 queries over bf16 pools: the output is f32, so P's rounding to bf16 before P·V (the
  reference's ``p.astype(v.dtype)``; its sum of exponentials unrounded) shows: the kernel
  agrees with the reference far closer than with the unrounded float64 attention. Pages of at
  most 16 tokens, walked one per block by the reference: its running maxima are the kernel's,
  so both round the same probabilities."""
  c = dict(CASES[case])
  q, k_pool, v_pool, kw, owner, pages_of = _batch(
    np.random.default_rng(11), num_pages=40, dtype=jnp.bfloat16, **c)
  args = (jnp.asarray(q, jnp.float32), jnp.asarray(k_pool), jnp.asarray(v_pool), 1,
          _prompt_inputs(kw, c["u"]))
  out = np.asarray(cpu.packed_prefill(*args))
  ref = np.asarray(reference.packed_prefill(*args))
  assert out.dtype == np.float32
  np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
  t = next(t for t in range(c["n_tok"]) if owner[t] is not None and kw["positions"][t] > 20)
  exact = _exact(np.asarray(q, np.float32), k_pool, v_pool, 1, t, pages_of[owner[t]],
                 int(kw["positions"][t]), None, c["kv"], c["g"])
  assert np.abs(out[t] - exact).max() > 1e-4  # the rounding is there, and the reference's


def test_nan_in_stale_rows_and_in_another_sequence_never_reaches_a_query():
  q, k_pool, v_pool, inputs, check = hostile_batch()
  check(_f32(cpu.packed_prefill(q, k_pool, v_pool, 0, inputs)))


def test_portable_build_matches_float64():
  cpu.build_target((), "bitdelta_paged_decode_portable_prefill_test")
  for case in ("packed", "odd"):
    out, ref, rest = _run(case, jnp.float32, 21,
                          target="bitdelta_paged_decode_portable_prefill_test_prefill")
    _check_exact(out, *rest, 21, jnp.float32)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


def test_traced_layer_and_window_under_jit():
  c = CASES["packed"]
  q, k_pool, v_pool, kw, owner, pages_of = _batch(
    np.random.default_rng(3), num_pages=40, dtype=jnp.float32, **c)
  inputs = _prompt_inputs(kw, c["u"])
  f = jax.jit(lambda q, k, v, i, w, t: cpu.packed_prefill(q, k, v, i, t, window=w))
  for layer, window in ((0, 9), (1, 1 << 30)):
    got = np.asarray(f(q, k_pool, v_pool, jnp.int32(layer), jnp.int32(window), inputs))
    want = reference.packed_prefill(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
                                    layer, inputs, window=window)
    np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=2e-6)


def test_api_cpu_runs_prompt_chunks_through_the_kernel():
  q, k_pool, v_pool, kw = _api_case(np.random.default_rng(3), jnp.bfloat16)
  args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 1)
  got = _f32(ragged_paged_attention(*args, kw, implementation="cpu"))
  ref = _f32(ragged_paged_attention(*args, kw, implementation="reference"))
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, rtol=0, atol=4 * float(jnp.finfo(jnp.bfloat16).eps))
  text = jax.jit(lambda q, k, v: ragged_paged_attention(q, k, v, 1, kw)).trace(
    *args[:3]).lower().as_text()
  assert "bitdelta_paged_prefill" in text and "bitdelta_paged_decode" in text
