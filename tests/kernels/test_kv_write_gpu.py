"""The in-place KV write kernel (`pallas_kernels.paged_attention.mosaic_gpu_write`) without a GPU:
its rows in the Mosaic GPU interpreter against numpy and the reference scatter (out-of-range
rows dropped, broadcast indices as `engine.runner.copy_pages_impl` passes them), and its CUDA
lowering: one Mosaic GPU custom call whose result aliases the pool, no scatter, picked by
``write_kv``'s default under ``lowering_platform("cuda")``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import api, mosaic_gpu_write
from pallas_kernels.platform import lowering_platform

CUSTOM_CALL = "mosaic_gpu_v2"


def _numpy_write(pool, layer, page, offset, new):
  """Row by row; rows with any index out of range (negative included) are skipped."""
  out = np.array(pool)
  new = np.asarray(new)
  lead = new.shape[:-2]
  idx = [np.broadcast_to(np.asarray(i), lead).reshape(-1) for i in (layer, page, offset)]
  rows = new.reshape(-1, *new.shape[-2:])
  for r in range(rows.shape[0]):
    at = tuple(int(i[r]) for i in idx)
    if all(0 <= a < s for a, s in zip(at, out.shape[:3], strict=True)):
      out[at] = rows[r].astype(out.dtype)
  return out


@pytest.mark.parametrize("dtype,kv,hd", [(jnp.float32, 1, 32), (jnp.bfloat16, 3, 64)])
def test_rows_land_at_their_page_and_offset_and_out_of_range_rows_are_dropped(dtype, kv, hd):
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.standard_normal((2, 5, 4, kv, hd)), dtype)
  new = jnp.asarray(rng.standard_normal((7, kv, hd)), jnp.float32)  # converted to the pool's
  page = np.array([3, 0, 4, 5, -1, 2, 1], np.int32)  # 5: past the end, -1: negative
  offset = np.array([1, 0, 3, 2, 0, 4, 2], np.int32)  # 4: past the page
  layer = 1
  got = api.write_kv(pool, layer, page, offset, new, implementation="mosaic_gpu", interpret=True)
  want = _numpy_write(pool, layer, page, offset, new)
  np.testing.assert_array_equal(np.asarray(got), want)
  # the reference drops the rows past the end too; the negative one it would wrap, so compare
  # it on the rows whose indices are all non-negative
  keep = page >= 0
  ref = api.write_kv(pool, layer, page[keep], offset[keep], new[keep], implementation="reference")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_broadcast_indices_copy_whole_pages_under_jit_with_a_traced_layer():
  """`copy_pages_impl`'s call: layers [L,1,1], pages [1,P,1], offsets [1,1,PS]."""
  rng = np.random.default_rng(1)
  pool = jnp.asarray(rng.standard_normal((2, 6, 4, 2, 16)), jnp.float32)
  src, dst = jnp.array([0, 3]), jnp.array([5, 1])
  layers = jnp.arange(2, dtype=jnp.int32)[:, None, None]
  offsets = jnp.arange(4, dtype=jnp.int32)[None, None, :]

  @jax.jit
  def copy(pool):
    return api.write_kv(pool, layers, dst[None, :, None], offsets, pool[:, src],
                        implementation="mosaic_gpu", interpret=True)

  want = np.array(pool)
  want[:, [5, 1]] = want[:, [0, 3]]
  np.testing.assert_array_equal(np.asarray(copy(pool)), want)


def test_shapes_supported_gives_reasons():
  assert mosaic_gpu_write.shapes_supported((2, 4, 16, 3, 64), jnp.bfloat16) is None
  assert "128 bytes" in mosaic_gpu_write.shapes_supported((2, 4, 16, 1, 8), jnp.bfloat16)
  assert "[L, pages" in mosaic_gpu_write.shapes_supported((4, 16, 3, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="128 bytes"):
    api.write_kv(jnp.zeros((1, 2, 2, 1, 8), jnp.bfloat16), 0, 0, 0, jnp.zeros((1, 8)),
                 implementation="mosaic_gpu", interpret=True)


def _lowered(fn, *args) -> str:
  with lowering_platform("cuda"):
    return jax.jit(fn, donate_argnums=0).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_default_under_cuda_is_the_kernel_aliasing_the_pool():
  pool = jax.ShapeDtypeStruct((30, 256, 16, 3, 64), jnp.bfloat16)  # SmolLM2's pools
  new = jax.ShapeDtypeStruct((32, 3, 64), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((32,), jnp.int32)
  layer = jax.ShapeDtypeStruct((), jnp.int32)
  text = _lowered(lambda p, i, pg, o, n: api.write_kv(p, i, pg, o, n), pool, layer, idx, idx, new)
  calls = re.findall(r"stablehlo\.custom_call @(\w+)\(.*", text)
  assert calls == [CUSTOM_CALL], calls
  (line,) = [ln for ln in text.splitlines() if "custom_call @" in ln]
  assert "output_operand_aliases" in line and "tensor<30x256x16x3x64xbf16>" in line.split("->")[-1]
  assert "stablehlo.scatter" not in text
  # the CPU default is unchanged: no Mosaic GPU call outside lowering_platform("cuda")
  plain = jax.jit(lambda p, pg, o, n: api.write_kv(p, 0, pg, o, n)).trace(
    jax.ShapeDtypeStruct((2, 4, 16, 1, 64), jnp.float32), idx, idx,
    jax.ShapeDtypeStruct((32, 1, 64), jnp.float32)).lower().as_text()
  assert CUSTOM_CALL not in plain


def test_rows_the_kernel_cannot_copy_fall_back_to_the_scatter_under_cuda():
  pool = jax.ShapeDtypeStruct((2, 8, 16, 1, 8), jnp.bfloat16)  # 16-byte rows
  new = jax.ShapeDtypeStruct((4, 1, 8), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((4,), jnp.int32)
  with lowering_platform("cuda"):
    assert "128 bytes" in api.write_unavailable_reason(pool)
  text = _lowered(lambda p, pg, o, n: api.write_kv(p, 0, pg, o, n), pool, idx, idx, new)
  assert CUSTOM_CALL not in text and "stablehlo.scatter" in text
