"""Kernels lowered for CUDA inside ``shard_map`` over 8 devices: jobs for the session's mesh
worker (tests/mesh/worker.py), asserted on by tests/kernels/test_paged_attention_gpu.py and
tests/kernels/test_delta_matmul_mosaic_gpu.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _sds(mesh, shape, dtype, spec=P()):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def paged_attention() -> dict:
  """The ragged paged attention (decode + prefill) per KV head shard: the Mosaic GPU calls, and
  whether each reads one KV head's pool shard."""
  from pallas_kernels.paged_attention import (
    AttentionInputs,
    lowering_platform,
    ragged_paged_attention,
  )

  assert len(jax.devices()) == 8, jax.devices()
  mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
  heads, kv_heads = P(None, "model", None), P(None, None, None, "model", None)
  i32 = jnp.int32
  n, r, p, u, layers, num_pages, ps, kv, h, d = 64, 32, 128, 4096, 32, 2048, 16, 8, 32, 128
  pool = _sds(mesh, (layers, num_pages, ps, kv, d), jnp.bfloat16, kv_heads)
  ints = ([_sds(mesh, (r, p), i32), _sds(mesh, (r,), i32)] + [_sds(mesh, (u,), i32)] * 4
          + [_sds(mesh, (n,), i32)] * 2)
  args = [_sds(mesh, (n, h, d), jnp.bfloat16, heads), pool, pool, _sds(mesh, (), i32), *ints,
          _sds(mesh, (2,), i32)]
  names = ["lane_pages", "lane_len", "pages", "page_seq", "page_start", "page_fill",
           "token_seq", "positions", "blocks"]

  def attend(q, k, v, layer, *rest):
    inputs = AttentionInputs(**dict(zip(names, rest)), block_pages=8)
    return ragged_paged_attention(q, k, v, layer, inputs, window=None)

  f = jax.shard_map(attend, mesh=mesh, in_specs=(heads, kv_heads, kv_heads) + (P(),) * 10,
                    out_specs=heads, check_vma=False)
  with lowering_platform("cuda"):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
  calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line]
  return {"calls": text.count("custom_call @mosaic_gpu_v2"),
          # decode and prefill each read one KV head's pool shard per device
          "per_shard_pool": all("tensor<32x2048x16x1x128xbf16>" in c for c in calls),
          "shards": exported.nr_devices, "out_shape": list(exported.out_avals[0].shape)}


def delta_matmul() -> dict:
  """The 1-bit delta GEMM column-parallel (576 columns per device): its Mosaic GPU calls and
  the partitions of the lowered and exported program."""
  from pallas_kernels.delta_matmul import api, delta_matmul

  mesh = jax.make_mesh((8,), ("model",))
  m, k, n, s = 8, 1536, 4608, 4
  f = jax.shard_map(
    lambda x, w, b, a, sl: delta_matmul(x, w, b, a, sl, group_k=128), mesh=mesh,
    in_specs=(P(), P(None, "model"), P(None, None, "model"), P(None, "model"), P()),
    out_specs=P(None, "model"))
  args = (_sds(mesh, (m, k), jnp.bfloat16), _sds(mesh, (k, n), jnp.bfloat16, P(None, "model")),
          _sds(mesh, (s, k // 8, n), jnp.uint8, P(None, None, "model")),
          _sds(mesh, (s, n), jnp.float32, P(None, "model")), _sds(mesh, (m,), jnp.int32))
  with api.lowering_platform("cuda"):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    exp = jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
  return {"devices": jax.device_count(), "calls": text.count("@mosaic_gpu_v2("),
          "partitions": re.findall(r"mhlo.num_partitions = (\d+)", text),
          "export_devices": exp.nr_devices}
