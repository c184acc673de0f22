"""The Mosaic GPU decode kernel (`pallas_kernels.paged_attention.mosaic_gpu`) without a GPU:

(a) its numerics in Mosaic GPU interpret mode on CPU, against a float64 numpy computation lane by
    lane and against the reference;
(b) its CUDA lowering (the Mosaic GPU custom call in the lowered module, `jax.export`) at the real
    model's shapes, through the dispatching API under ``lowering_platform("cuda")``;
(c) the same inside `jax.shard_map` over 8 forced host devices, KV heads on a "model" axis (a
    the session's mesh worker: the device count is fixed when jax starts).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
  AttentionInputs,
  lowering_platform,
  mosaic_gpu,
  mosaic_gpu_prefill,
  ragged_paged_attention,
  reference,
)
from pallas_kernels.paged_attention.api import unavailable_reason
from pallas_kernels.platform import override, target_platform

CUSTOM_CALL = "mosaic_gpu_v2"  # the call target of a Mosaic GPU kernel in the lowered module


def _lanes(rng, lens, *, ps, num_pages, width):
  """A page table [R, width]: each lane its own pages, then stale page ids (the kernel reads
  a whole block's pages and must mask the keys past ``lane_len``)."""
  perm = list(rng.permutation(np.arange(num_pages)))
  table = rng.integers(0, num_pages, (len(lens), width)).astype(np.int32)
  for r, n in enumerate(lens):
    used = -(-n // ps)
    table[r, :used] = [perm.pop() for _ in range(used)]
  return table


def _exact(q, k_pool, v_pool, layer, table, lens, window):
  """float64 attention lane by lane: lane r's query at position lens[r]-1 over its keys."""
  q, k_pool, v_pool = (np.asarray(a, np.float64) for a in (q, k_pool, v_pool))
  r, h, d = q.shape
  _, _, ps, kv, _ = k_pool.shape
  out = np.zeros((r, h, d))
  for i, n in enumerate(lens):
    if n == 0:
      continue
    pages = table[i, : -(-n // ps)]
    k = k_pool[layer, pages].reshape(-1, kv, d)[:n]
    v = v_pool[layer, pages].reshape(-1, kv, d)[:n]
    keys = np.arange(n)
    ok = keys > (n - 1) - (window if window is not None else 1 << 30)
    if not ok.any():
      continue
    s = np.einsum("kgd,skd->kgs", q[i].reshape(kv, h // kv, d), k) / np.sqrt(d)
    s = np.where(ok[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[i] = np.einsum("kgs,skd->kgd", p, v).reshape(h, d)
  return out


def _case(seed, *, dtype, h, kv, d, ps, lens, width, num_pages=48, layers=2):
  rng = np.random.default_rng(seed)
  k_pool = rng.standard_normal((layers, num_pages, ps, kv, d)).astype(np.float32)
  v_pool = rng.standard_normal((layers, num_pages, ps, kv, d)).astype(np.float32)
  q = (2.0 * rng.standard_normal((len(lens), h, d))).astype(np.float32)  # peaked softmaxes
  table = _lanes(rng, lens, ps=ps, num_pages=num_pages, width=width)
  cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
  return cast(q), cast(k_pool), cast(v_pool), table, np.asarray(lens, np.int32)


def _kernel(q, k_pool, v_pool, layer, table, lens, window, splits, dtype):
  return np.asarray(
    mosaic_gpu.ragged_paged_decode(
      jnp.asarray(q, dtype),
      jnp.asarray(k_pool, dtype),
      jnp.asarray(v_pool, dtype),
      layer,
      lane_pages=jnp.asarray(table),
      lane_len=jnp.asarray(lens),
      window=window,
      num_splits=splits,
      interpret=True,
    ).astype(jnp.float32)
  )


@functools.partial(jax.jit, static_argnames=("block_pages",))
def _reference_jit(q, k_pool, v_pool, layer, table, lens, blocks, window, *, block_pages):
  return reference.decode_lanes(
    q,
    k_pool,
    v_pool,
    layer,
    lane_pages=table,
    lane_len=lens,
    blocks=blocks,
    block_pages=block_pages,
    window=window,
  )


def _reference(q, k_pool, v_pool, layer, table, lens, window, dtype, block_pages):
  bk = block_pages * k_pool.shape[2]
  blocks = jnp.asarray([-(-int(lens.max()) // bk), 0], jnp.int32)
  window = 1 << 30 if window is None else window
  args = [jnp.asarray(a, dtype) for a in (q, k_pool, v_pool)]
  out = _reference_jit(
    *args,
    jnp.int32(layer),
    jnp.asarray(table),
    jnp.asarray(lens),
    blocks,
    jnp.int32(window),
    block_pages=block_pages,
  )
  return np.asarray(out.astype(jnp.float32))


@pytest.mark.slow
def test_f32_lanes_windows_and_splits_match_numpy_and_the_reference():
  """Pages of 16 (the engine's), hd 64, 3 splits: lanes of one key, exactly one page, many pages
  with a partial last block, none, and one whose blocks do not divide among the splits."""
  lens = [1, 16, 150, 0, 97]
  q, k, v, table, lens = _case(0, dtype=jnp.float32, h=6, kv=2, d=64, ps=16, lens=lens, width=12)
  for layer, window in [(1, None), (0, 20)]:
    got = _kernel(q, k, v, layer, table, lens, window, 3, jnp.float32)
    want = _exact(q, k, v, layer, table, lens, window)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    ref = _reference(q, k, v, layer, table, lens, window, jnp.float32, block_pages=4)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[lens == 0], 0.0)


@pytest.mark.slow
def test_bf16_error_is_within_the_references_own():
  """bf16 pages and queries, pages of 32, 2 splits, a window of one key: the kernel's error
  against the exact result (of the same bf16-rounded inputs, in float64) is at most 1.5x the
  reference's own bf16 error (plus 1e-3)."""
  lens = [1, 32, 150, 0, 64]
  q, k, v, table, lens = _case(1, dtype=jnp.bfloat16, h=6, kv=2, d=64, ps=32, lens=lens, width=6)
  for layer, window in [(0, None), (1, 1)]:
    want = _exact(q, k, v, layer, table, lens, window)
    got = _kernel(q, k, v, layer, table, lens, window, 2, jnp.bfloat16)
    ref = _reference(q, k, v, layer, table, lens, window, jnp.bfloat16, block_pages=2)
    err, ref_err = np.abs(got - want).max(), np.abs(ref - want).max()
    assert err <= 1.5 * ref_err + 1e-3, (err, ref_err)
    np.testing.assert_array_equal(got[lens == 0], 0.0)


@pytest.mark.slow
def test_odd_shapes_small_pages_padded_heads_and_more_splits_than_blocks():
  """hd 48 (a 64-byte swizzle), 3 query heads per KV head, 3 KV heads (the [3, 48] f32 query
  rows are not a whole TMA transfer: padded), pages of 8 (8 pages per block), 4 splits of lanes
  of 1-3 blocks, a window."""
  lens = [5, 64, 130, 0]
  q, k, v, table, lens = _case(2, dtype=jnp.float32, h=9, kv=3, d=48, ps=8, lens=lens, width=17)
  got = _kernel(q, k, v, 1, table, lens, 50, 4, jnp.float32)
  np.testing.assert_allclose(got, _exact(q, k, v, 1, table, lens, 50), rtol=2e-5, atol=2e-5)


def test_shapes_supported_gives_reasons():
  ok = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=jnp.bfloat16)
  assert mosaic_gpu.shapes_supported(**ok) is None
  llama = {**ok, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
  assert mosaic_gpu.shapes_supported(**llama) is None
  assert mosaic_gpu.shapes_supported(**{**llama, "dtype": jnp.float32}) is None
  for bad, word in [
    ({"page_size": 4}, "page_size"),
    ({"head_dim": 40}, "32 bytes"),
    ({"num_heads": 8}, "multiple"),
    ({"dtype": jnp.int8}, "dtype"),
  ]:
    reason = mosaic_gpu.shapes_supported(**{**ok, **bad})
    assert isinstance(reason, str) and word in reason, (bad, reason)
  q = jnp.zeros((2, 4, 8), jnp.float32)
  pool = jnp.zeros((1, 4, 4, 2, 8), jnp.float32)
  with pytest.raises(NotImplementedError, match="page_size 4"):
    mosaic_gpu.ragged_paged_decode(
      q,
      pool,
      pool,
      0,
      lane_pages=jnp.zeros((2, 2), jnp.int32),
      lane_len=jnp.zeros((2,), jnp.int32),
      interpret=True,
    )


def _mixed_batch(seed, *, ps, dtype, kv=2, g=3, d=64, num_pages=40, layers=2):
  """Two decode lanes (lengths 1 and 40), then two prompt chunks (5 tokens after 30 cached, a
  fresh 3-token prompt) packed after them, in a bucket of 16 tokens with 4 lanes."""
  rng = np.random.default_rng(seed)
  k_pool = jnp.asarray(rng.standard_normal((layers, num_pages, ps, kv, d)), dtype)
  v_pool = jnp.asarray(rng.standard_normal((layers, num_pages, ps, kv, d)), dtype)
  free = list(rng.permutation(np.arange(1, num_pages)))
  decode, prefill = [1, 40], [(30, 5), (0, 3)]
  pages_of = {
    i: [int(free.pop()) for _ in range(-(-n // ps))]
    for i, n in enumerate(decode + [c + m for c, m in prefill])
  }
  n_tok, r, width = 16, 4, 4
  lane_pages = np.zeros((r, width), np.int32)
  lane_len = np.zeros((r,), np.int32)
  positions = np.zeros((n_tok,), np.int32)
  token_seq = np.full((n_tok,), -1, np.int32)
  for i, n in enumerate(decode):
    lane_pages[i, : len(pages_of[i])] = pages_of[i]
    lane_len[i], positions[i] = n, n - 1
  u = 8
  pages, page_seq = np.zeros((u,), np.int32), np.full((u,), -2, np.int32)
  page_start, page_fill = np.zeros((u,), np.int32), np.zeros((u,), np.int32)
  col, at = len(decode), 0
  for j, (cached, m) in enumerate(prefill):
    pg = pages_of[len(decode) + j]
    positions[col : col + m] = np.arange(cached, cached + m)
    token_seq[col : col + m] = j
    pages[at : at + len(pg)], page_seq[at : at + len(pg)] = pg, j
    page_start[at : at + len(pg)] = np.arange(len(pg)) * ps
    page_fill[at : at + len(pg)] = np.clip(cached + m - np.arange(len(pg)) * ps, 0, ps)
    col, at = col + m, at + len(pg)
  bp = 2
  blocks = np.asarray([-(-lane_len.max() // (bp * ps)), -(-at // bp)], np.int32)
  q = jnp.asarray(rng.standard_normal((n_tok, kv * g, d)), dtype)
  arrays = dict(
    lane_pages=lane_pages,
    lane_len=lane_len,
    pages=pages,
    page_seq=page_seq,
    page_start=page_start,
    page_fill=page_fill,
    token_seq=token_seq,
    positions=positions,
    blocks=blocks,
  )
  kw = {name: jnp.asarray(a) for name, a in arrays.items()}
  return q, k_pool, v_pool, AttentionInputs(**kw, block_pages=bp)


@pytest.mark.slow
def test_api_kernel_path_equals_the_reference_on_a_mixed_batch():
  q, k, v, kw = _mixed_batch(3, ps=16, dtype=jnp.float32)
  want = reference.ragged_paged_attention(q, k, v, 1, kw, window=6)
  got = ragged_paged_attention(
    q, k, v, 1, kw, window=6, implementation="mosaic_gpu", interpret=True
  )
  np.testing.assert_allclose(got[:2], want[:2], rtol=2e-5, atol=2e-5)  # the decode lanes
  np.testing.assert_array_equal(got[2:], want[2:])  # prompt tokens: the reference's own pass


def test_dispatch_by_platform():
  q, k, v, kw = _mixed_batch(4, ps=16, dtype=jnp.float32)
  assert jax.default_backend() == "cpu" and target_platform() == "cpu" and override() is None
  program = lambda fn: str(jax.make_jaxpr(lambda q, k, v: fn(q, k, v, 0, kw))(q, k, v))  # noqa: E731
  # on the CPU the default is the CPU kernel where it builds (test_paged_attention_cpu.py),
  # else the reference: never the Mosaic GPU path
  cpu_name = "cpu" if unavailable_reason(q, k, implementation="cpu") is None else "reference"
  on_cpu = functools.partial(ragged_paged_attention, implementation=cpu_name)
  assert program(ragged_paged_attention) == program(on_cpu)
  assert "mosaic" not in program(ragged_paged_attention)
  with pytest.raises(RuntimeError, match="needs CUDA"):
    ragged_paged_attention(q, k, v, 0, kw, implementation="mosaic_gpu")
  with pytest.raises(ValueError, match="unknown implementation"):
    ragged_paged_attention(q, k, v, 0, kw, implementation="triton")

  def lowered(q, k, **extra):
    f = lambda q, k: ragged_paged_attention(q, k, k, jnp.int32(0), kw, **extra)  # noqa: E731
    return jax.jit(f).trace(q, k).lower(lowering_platforms=("cuda",)).as_text()

  assert CUSTOM_CALL not in lowered(q, k)  # CPU process: the reference
  with lowering_platform("cuda"):
    assert target_platform() == "cuda"
    assert CUSTOM_CALL in lowered(q, k)
    small = jnp.zeros((1, 8, 4, 2, 64), jnp.float32)  # pages of 4: the kernel does not take them
    assert CUSTOM_CALL not in lowered(q, small)
    with pytest.raises(NotImplementedError, match="page_size 4"):
      lowered(q, small, implementation="mosaic_gpu")
    with lowering_platform("cpu"):
      assert CUSTOM_CALL not in lowered(q, k)
    seen = []  # process-wide: the engine traces its programs in worker threads
    worker = threading.Thread(target=lambda: seen.append(target_platform()))
    worker.start()
    worker.join()
    assert seen == ["cuda"]
  assert override() is None
  with pytest.raises(ValueError, match="unknown platform"):
    with lowering_platform("metal"):
      pass


def _abstract_call(*, n, r, p, num_pages, layers, kv, h, d, ps, dtype):
  sds = jax.ShapeDtypeStruct
  i32 = jnp.int32
  u = r * p
  pool = sds((layers, num_pages, ps, kv, d), dtype)
  arrays = dict(
    lane_pages=sds((r, p), i32),
    lane_len=sds((r,), i32),
    pages=sds((u,), i32),
    page_seq=sds((u,), i32),
    page_start=sds((u,), i32),
    page_fill=sds((u,), i32),
    token_seq=sds((n,), i32),
    positions=sds((n,), i32),
    blocks=sds((2,), i32),
  )
  args = (sds((n, h, d), dtype), pool, pool, sds((), i32), sds((), i32), arrays)

  def f(q, k_pool, v_pool, layer, window, arrays):
    return ragged_paged_attention(q, k_pool, v_pool, layer, AttentionInputs(**arrays, block_pages=8),
                                  window=window)

  return f, args


# the real model (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, hd 64) and a Llama-8B-like layer
REAL = dict(
  n=64, r=32, p=128, num_pages=2048, layers=30, kv=3, h=9, d=64, ps=16, dtype=jnp.bfloat16
)
LLAMA = dict(REAL, layers=32, kv=8, h=32, d=128)


@pytest.mark.parametrize("shapes", [REAL, LLAMA], ids=["smollm2", "llama8b"])
def test_cuda_lowering_and_export_at_model_shapes(shapes):
  f, args = _abstract_call(**shapes)
  with lowering_platform("cuda"):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
  # the decode lanes' kernel and the prompt chunks' (`mosaic_gpu_prefill`), nothing else
  assert text.count(f"custom_call @{CUSTOM_CALL}") == 2
  assert mosaic_gpu.KERNEL_NAME in text  # the kernel's name travels in the Mosaic GPU module
  assert mosaic_gpu_prefill.KERNEL_NAME in text
  assert exported.platforms == ("cuda",)
  assert CUSTOM_CALL in exported.mlir_module()
  assert exported.out_avals[0].shape == (shapes["n"], shapes["h"], shapes["d"])


@pytest.mark.mesh  # the session's 8-device worker (tests/mesh/kernel_lowering.py)
def test_cuda_lowering_inside_shard_map_over_8_devices(mesh_worker):
  res = mesh_worker.call("mesh/kernel_lowering.py:paged_attention")
  assert res["calls"] == 2, res  # decode + prefill
  assert res["per_shard_pool"] is True, res
  assert (res["shards"], res["out_shape"]) == (8, [64, 32, 128]), res
