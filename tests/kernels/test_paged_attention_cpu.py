"""The CPU decode-lane kernel (`pallas_kernels.paged_attention.cpu`) against attention computed
in numpy float64 from the same pools and page tables, and against `reference.decode_lanes`; the
api's dispatch to it on CPU, and away from it when lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import AttentionInputs, api, cpu, lowering_platform, reference

pytestmark = pytest.mark.skipif(cpu.build_reason() is not None, reason=str(cpu.build_reason()))

PS, L, NUM_PAGES = 16, 2, 48
# lane lengths: empty, 1, page_size - 1, page_size, page_size + 1, long
LENS = [0, 1, PS - 1, PS, PS + 1, 7 * PS + 5]
P = 8  # page-table width


def _setup(g, d, kv=3, dtype=jnp.float32, seed=0, shared=True):
  """Pools, scrambled page tables (lanes 4 and 5 share their first page, a cached prefix) and
  queries; the pools already rounded to ``dtype``."""
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.standard_normal((L, NUM_PAGES, PS, kv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((L, NUM_PAGES, PS, kv, d)), dtype)
  pages = rng.permutation(NUM_PAGES)[: len(LENS) * P].reshape(len(LENS), P).astype(np.int32)
  if shared:
    pages[5, 0] = pages[4, 0]
    pages[3, 0] = pages[4, 0]
  q = jnp.asarray(rng.standard_normal((len(LENS) + 3, kv * g, d)), jnp.float32)
  return q, k, v, jnp.asarray(pages), jnp.asarray(LENS, jnp.int32)


def _naive64(q, k_pool, v_pool, layer, pages, lens, window):
  """Float64 attention, lane by lane, from the pools through the page tables."""
  q = np.asarray(q, np.float64)
  k_pool = np.asarray(jnp.asarray(k_pool, jnp.float32), np.float64)
  v_pool = np.asarray(jnp.asarray(v_pool, jnp.float32), np.float64)
  _, _, ps, kv, d = k_pool.shape
  r = len(lens)
  g = q.shape[1] // kv
  out = np.zeros((r, kv * g, d))
  for i, n in enumerate(np.asarray(lens)):
    if n == 0:
      continue
    pg = np.asarray(pages)[i, : -(-n // ps)]
    ks = k_pool[layer, pg].reshape(-1, kv, d)[:n]
    vs = v_pool[layer, pg].reshape(-1, kv, d)[:n]
    keep = np.arange(n) > (n - 1) - (window if window is not None else 1 << 30)
    s = np.einsum("kgd,skd->kgs", q[i].reshape(kv, g, d), ks) / np.sqrt(d)
    s = np.where(keep[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[i] = np.einsum("kgs,skd->kgd", p, vs).reshape(kv * g, d)
  return out


def _reference(q, k, v, layer, pages, lens, window, block_pages=2):
  blocks = (-(-int(max(LENS)) // (block_pages * PS)), 0)
  return reference.decode_lanes(
    q,
    k,
    v,
    layer,
    lane_pages=pages,
    lane_len=lens,
    blocks=blocks,
    block_pages=block_pages,
    window=window,
  )


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("d", [64, 37])
@pytest.mark.parametrize("g", [1, 3, 4])
def test_f32_matches_float64_and_reference(g, d, window):
  q, k, v, pages, lens = _setup(g, d)
  for layer in range(L):
    got = np.asarray(
      cpu.decode_lanes(q[: len(LENS)], k, v, layer, lane_pages=pages, lane_len=lens, window=window)
    )
    want = _naive64(q[: len(LENS)], k, v, layer, pages, lens, window)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[0], 0.0)  # the empty lane
    ref = np.asarray(_reference(q, k, v, layer, pages, lens, window))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("g", [1, 3])
def test_bf16_pools_error_within_the_references_own(g, q_dtype):
  q, k, v, pages, lens = _setup(g, 64, dtype=jnp.bfloat16, seed=1)
  q = q.astype(q_dtype)
  got = cpu.decode_lanes(q[: len(LENS)], k, v, 1, lane_pages=pages, lane_len=lens)
  ref = _reference(q, k, v, 1, pages, lens, None)
  assert got.dtype == ref.dtype == q_dtype
  exact = _naive64(q[: len(LENS)].astype(jnp.float32), k, v, 1, pages, lens, None)
  err = np.abs(np.asarray(got, np.float64) - exact).max()
  ref_err = np.abs(np.asarray(ref, np.float64) - exact).max()
  assert err <= 1.5 * ref_err, (err, ref_err)
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2
  )


def test_traced_layer_and_window_under_jit():
  q, k, v, pages, lens = _setup(3, 64)
  f = jax.jit(
    lambda q, k, v, i, w: cpu.decode_lanes(q, k, v, i, lane_pages=pages, lane_len=lens, window=w)
  )
  for layer, window in ((0, 7), (1, 1 << 30)):
    got = np.asarray(f(q[: len(LENS)], k, v, jnp.int32(layer), jnp.int32(window)))
    want = _naive64(q[: len(LENS)], k, v, layer, pages, lens, window)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_portable_build_matches_float64():
  cpu.build_target((), "bitdelta_paged_decode_portable_test")
  q, k, v, pages, lens = _setup(3, 37)
  got = np.asarray(
    cpu.decode_lanes(
      q[: len(LENS)],
      k,
      v,
      1,
      lane_pages=pages,
      lane_len=lens,
      target="bitdelta_paged_decode_portable_test",
    )
  )
  np.testing.assert_allclose(
    got, _naive64(q[: len(LENS)], k, v, 1, pages, lens, None), rtol=2e-5, atol=2e-5
  )


def test_uneven_heads_raise_not_implemented():
  q, k, v, pages, lens = _setup(3, 64)
  with pytest.raises(NotImplementedError):
    cpu.decode_lanes(q[:, :8], k, v, 0, lane_pages=pages, lane_len=lens)


def _api_args(with_prompt=True):
  """A ragged batch: the decode lanes of `_setup`, then a 5-token prompt chunk on two pages."""
  q, k, v, pages, lens = _setup(3, 64, shared=False)
  r, n = len(LENS), q.shape[0]  # 3 prompt tokens after the lanes
  prompt_pages = jnp.asarray([int(pages[0, 0]), int(pages[0, 1])], jnp.int32)  # lane 0 is empty
  tables = AttentionInputs(
    lane_pages=pages,
    lane_len=lens,
    pages=prompt_pages,
    page_seq=jnp.asarray([0, 0], jnp.int32),
    page_start=jnp.asarray([0, PS], jnp.int32),
    page_fill=jnp.asarray([PS, 2], jnp.int32),
    token_seq=jnp.asarray([-1] * r + [0] * (n - r), jnp.int32),
    positions=jnp.asarray([0] * r + list(range(PS - 1, PS + 2)), jnp.int32),
    blocks=jnp.asarray([-(-int(max(LENS)) // (2 * PS)), 1], jnp.int32),
    block_pages=2,
  )
  return (q, k, v, 1), tables


def test_api_cpu_equals_reference_with_prompt_tokens_merged():
  args, tables = _api_args()
  got = np.asarray(api.ragged_paged_attention(*args, tables, implementation="cpu"))
  want = np.asarray(api.ragged_paged_attention(*args, tables, implementation="reference"))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert np.abs(got[len(LENS) :]).max() > 0  # the prompt tokens took the packed-prefill pass


def _hlo(platform=None):
  args, tables = _api_args()
  f = jax.jit(lambda q, k, v: api.ragged_paged_attention(q, k, v, 1, tables))
  if platform is None:
    return f.trace(*args[:3]).lower().as_text()
  with lowering_platform(platform):
    return f.trace(*args[:3]).lower(lowering_platforms=(platform,)).as_text()


def test_default_dispatch_on_cpu_takes_the_kernel():
  assert (
    api.unavailable_reason(
      jnp.zeros((1, 9, 64)), jnp.zeros((1, 1, PS, 3, 64)), implementation="cpu"
    )
    is None
  )
  assert "bitdelta_paged_decode" in _hlo()


def test_lowering_for_cuda_has_no_cpu_custom_call():
  assert "bitdelta_paged_decode" not in _hlo("cuda")
  with lowering_platform("cuda"):
    reason = api.unavailable_reason(
      jnp.zeros((1, 9, 64)), jnp.zeros((1, 1, PS, 3, 64)), implementation="cpu"
    )
  assert reason and "CPU platform" in reason


def test_switch_off_falls_back_to_the_reference(monkeypatch):
  monkeypatch.setenv("BITDELTA_PAGED_ATTENTION_CPU", "0")
  assert "bitdelta_paged_decode" not in _hlo()
