"""`ragged_paged_attention`: one entry point, dispatch by platform.

Implementations (``implementation=``):

* ``"reference"``: `reference.ragged_paged_attention`, plain jnp, any backend.
* ``"cpu"``: the decode lanes and the packed-prefill pass through the C++ kernels (`cpu.py`,
  host CPU, read in place from the pools), put together by the reference's `merge`.
* ``"mosaic_gpu"``: the decode lanes through the Pallas Mosaic GPU decode kernel
  (`mosaic_gpu.py`, NVIDIA Hopper or newer), the packed-prefill pass through the Mosaic GPU
  prefill kernel (`mosaic_gpu_prefill.py`: bf16/f16 pools, head_dim 64 or 128, pages dividing
  64 keys; the reference's `packed_prefill` for other shapes, `prefill_unavailable_reason`),
  put together by the reference's `merge`. ``interpret=True`` runs the kernels in Mosaic GPU
  interpret mode on any backend (tests).

``implementation=None`` picks ``"mosaic_gpu"`` when the target platform
(`pallas_kernels.platform.target_platform`: the default backend, or the platform set by
`lowering_platform`) is CUDA, the device (if there is one) is sm_90 or newer and the kernel takes
the shapes (`mosaic_gpu.shapes_supported`); ``"cpu"`` when the target platform is the CPU, the
kernel builds and takes the shapes (`cpu.shapes_supported`) and ``BITDELTA_PAGED_ATTENTION_CPU``
is not ``0``; the reference otherwise.

`write_kv` stores the step's new K/V into a pool: a jnp scatter, or on the CPU for pools other
than f32 the in-place C++ write (`cpu.write`), since XLA's CPU backend computes a bf16 scatter in
f32 over the whole pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import settings

from ..attention_inputs import AttentionInputs
from ..platform import hopper_reason, lowering_platform, target_platform
from . import cpu, mosaic_gpu, mosaic_gpu_prefill, reference
from .mosaic_gpu_write import shapes_supported as _write_shapes_supported
from .mosaic_gpu_write import write as _write_gpu

IMPLEMENTATIONS = ("reference", "cpu", "mosaic_gpu")
WRITE_IMPLEMENTATIONS = ("reference", "cpu", "mosaic_gpu")


def _shape_reason(q, k_pool) -> str | None:
  _, h, d = q.shape
  _, _, ps, kv, _ = k_pool.shape
  return mosaic_gpu.shapes_supported(
    num_heads=h, num_kv_heads=kv, head_dim=d, page_size=ps, dtype=k_pool.dtype, q_dtype=q.dtype
  )


def prefill_unavailable_reason(q, k_pool) -> str | None:
  """None if the Mosaic GPU prefill kernel takes these shapes, else why not (the prompt chunks
  then take the reference's `packed_prefill`). ``BITDELTA_PAGED_PREFILL_GPU=0`` turns the
  kernel off (read when a step is traced: the GPU check times the reference path with it)."""
  if not settings.get("BITDELTA_PAGED_PREFILL_GPU"):
    return "BITDELTA_PAGED_PREFILL_GPU=0"
  _, h, d = q.shape
  _, _, ps, kv, _ = k_pool.shape
  return mosaic_gpu_prefill.shapes_supported(
    num_heads=h, num_kv_heads=kv, head_dim=d, page_size=ps, dtype=k_pool.dtype, q_dtype=q.dtype
  )


def _platform_reason() -> str | None:
  platform = target_platform()
  if platform != "cuda":
    return (
      f"the Mosaic GPU kernel needs CUDA, the target platform is {platform!r} (use "
      "lowering_platform('cuda') to lower for CUDA elsewhere, or interpret=True)"
    )
  return hopper_reason()


def _kernel_reason(q, k_pool, *, interpret) -> str | None:
  """None if the Mosaic GPU path can run this call, else why not."""
  return _shape_reason(q, k_pool) or (None if interpret else _platform_reason())


def _cpu_reason(q, k_pool) -> str | None:
  """None if the CPU kernel can run this call on the target platform, else why not."""
  _, h, _ = q.shape
  reason = cpu.shapes_supported(
    num_heads=h, num_kv_heads=k_pool.shape[3], dtype=k_pool.dtype, q_dtype=q.dtype
  )
  if reason is None and (platform := target_platform()) != "cpu":
    reason = f"the CPU kernel needs the CPU platform, the target platform is {platform!r}"
  return reason or cpu.build_reason()


def _default(q, k_pool) -> str:
  if _kernel_reason(q, k_pool, interpret=False) is None:
    return "mosaic_gpu"
  if cpu.enabled() and _cpu_reason(q, k_pool) is None:
    return "cpu"
  return "reference"


def unavailable_reason(
  q, k_pool, *, implementation: str = "mosaic_gpu", interpret: bool = False
) -> str | None:
  """None if ``implementation`` can take a call with these ``q`` and ``k_pool`` (arrays or
  ``jax.ShapeDtypeStruct``) on the target platform, else a readable reason."""
  if implementation == "reference":
    return None
  if implementation == "cpu":
    return _cpu_reason(q, k_pool)
  if implementation == "mosaic_gpu":
    return _kernel_reason(q, k_pool, interpret=interpret)
  raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")


def ragged_paged_attention(
  q_NxHxD: jax.Array,
  k_pool: jax.Array,
  v_pool: jax.Array,
  layer,
  inputs: AttentionInputs,
  *,
  window=None,
  implementation: str | None = None,
  interpret=False,
) -> jax.Array:
  """Attention of one ragged token batch over a paged KV cache: the reference's signature and
  results (`reference.ragged_paged_attention`), plus

  Args:
    implementation: ``"reference"``, ``"cpu"``, ``"mosaic_gpu"``, or None for the best on the target
      platform (see the module docstring). Naming ``"mosaic_gpu"`` for shapes the kernel does
      not take raises NotImplementedError, for a platform it cannot run on RuntimeError.
    interpret: run the Mosaic GPU kernel in interpret mode (True or an ``InterpretGPUParams``).

  The kernels bound each lane by its own ``lane_len`` and do not read ``inputs.blocks[0]``
  (they cover every key below ``lane_len``, as the reference does when the host sizes
  ``blocks[0]`` from the longest lane).
  """
  if implementation is None:
    name = _default(q_NxHxD, k_pool)
  elif implementation in IMPLEMENTATIONS:
    name = implementation
  else:
    raise ValueError(
      f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS} or None"
    )
  if name == "reference":
    return reference.ragged_paged_attention(q_NxHxD, k_pool, v_pool, layer, inputs, window=window)
  lane_pages, lane_len = inputs.lane_pages, inputs.lane_len
  r = lane_pages.shape[0]
  if name == "cpu":
    if (platform := target_platform()) != "cpu":
      raise RuntimeError(f"ragged_paged_attention 'cpu' cannot run on platform {platform!r}")
    # decode_lanes raises NotImplementedError for shapes it does not take or an unbuildable kernel
    dec = cpu.decode_lanes(
      q_NxHxD[:r], k_pool, v_pool, layer, lane_pages=lane_pages, lane_len=lane_len, window=window
    )
  else:
    if reason := _shape_reason(q_NxHxD, k_pool):
      raise NotImplementedError(f"ragged_paged_attention 'mosaic_gpu': {reason}")
    if not interpret and (reason := _platform_reason()):
      raise RuntimeError(f"ragged_paged_attention 'mosaic_gpu' cannot run: {reason}")
    dec = mosaic_gpu.ragged_paged_decode(
      q_NxHxD[:r],
      k_pool,
      v_pool,
      layer,
      lane_pages=lane_pages,
      lane_len=lane_len,
      window=window,
      interpret=interpret,
    )
  if name == "mosaic_gpu" and prefill_unavailable_reason(q_NxHxD, k_pool) is None:
    pre = mosaic_gpu_prefill.packed_prefill(
      q_NxHxD, k_pool, v_pool, layer, inputs, window=window, interpret=interpret)
  elif name == "cpu":
    pre = cpu.packed_prefill(q_NxHxD, k_pool, v_pool, layer, inputs, window=window)
  else:
    pre = reference.packed_prefill(q_NxHxD, k_pool, v_pool, layer, inputs, window=window)
  return reference.merge(dec, pre, lane_len)


def write_unavailable_reason(pool, *, implementation: str = "mosaic_gpu",
                             interpret: bool = False) -> str | None:
  """None if write implementation ``implementation`` can write into ``pool`` (an array or
  ``jax.ShapeDtypeStruct``) on the target platform, else a readable reason."""
  if implementation == "reference":
    return None
  if implementation == "cpu":
    if (platform := target_platform()) != "cpu":
      return f"the CPU write needs the CPU platform, the target platform is {platform!r}"
    return cpu.build_reason()
  if implementation == "mosaic_gpu":
    reason = _write_shapes_supported(pool.shape, pool.dtype)
    return reason or (None if interpret else _platform_reason())
  raise ValueError(
    f"unknown implementation {implementation!r}; choose from {WRITE_IMPLEMENTATIONS} or None"
  )


def write_kv(pool, layer, page, offset, new, *, implementation: str | None = None,
             interpret=False) -> jax.Array:
  """``pool.at[layer, page, offset].set(new.astype(pool.dtype))``: ``pool`` ``[L, NP, PS, KV,
  hd]``, ``new`` ``[..., KV, hd]``, indices broadcast to ``new.shape[:-2]``; entries with an
  index out of range are dropped (``"cpu"`` and ``"mosaic_gpu"`` drop negative indices too).

  ``implementation``: ``"reference"`` (the jnp scatter), ``"cpu"`` (`cpu.write`, in place),
  ``"mosaic_gpu"`` (`mosaic_gpu_write.write`: the pool aliased to the kernel's result, rows
  copied by TMA; ``interpret=True`` runs it in the Mosaic GPU interpreter), or None:
  ``"mosaic_gpu"`` when the target platform is CUDA (sm_90 or newer if there is a device) and
  the kernel takes the pool's row (`write_unavailable_reason`); ``"cpu"`` when the target
  platform is the CPU, the pool is not f32 (XLA's CPU backend converts a bf16 pool to f32 and
  back around a scatter, a pass over the whole pool per call; an f32 scatter is already in
  place), the kernel builds and ``BITDELTA_PAGED_ATTENTION_CPU`` is not ``0``; the reference
  otherwise. A pool sharded over a mesh takes the kernels only inside ``shard_map`` (each
  device writes its own heads: `bitdelta_jax.models.llama`); outside it pass ``"reference"``
  (a custom call cannot be partitioned)."""
  if implementation is None:
    if write_unavailable_reason(pool, implementation="mosaic_gpu") is None:
      implementation = "mosaic_gpu"
    elif (pool.dtype != jnp.float32 and cpu.enabled()
          and write_unavailable_reason(pool, implementation="cpu") is None):
      implementation = "cpu"
    else:
      implementation = "reference"
  if implementation == "cpu":
    return cpu.write(pool, layer, page, offset, new)
  if implementation == "mosaic_gpu":
    reason = write_unavailable_reason(pool, implementation="mosaic_gpu", interpret=interpret)
    if reason:
      raise NotImplementedError(f"write_kv 'mosaic_gpu' cannot run: {reason}")
    return _write_gpu(pool, layer, page, offset, new, interpret=interpret)
  if implementation != "reference":
    raise ValueError(
      f"unknown implementation {implementation!r}; choose from {WRITE_IMPLEMENTATIONS} or None"
    )
  return pool.at[layer, page, offset].set(new.astype(pool.dtype))


__all__ = [
  "AttentionInputs",
  "IMPLEMENTATIONS",
  "WRITE_IMPLEMENTATIONS",
  "lowering_platform",
  "ragged_paged_attention",
  "prefill_unavailable_reason",
  "unavailable_reason",
  "write_kv",
  "write_unavailable_reason",
]
