"""The step's new K/V rows written into a paged pool in place, as a Mosaic GPU kernel.

Why: each layer of a step stores its new tokens' ``[KV, hd]`` rows at ``pool[layer, page,
offset]``. As a jnp scatter this depends on XLA keeping the pool's buffer (a loop carry of the
layer scan) in place; the kernel takes the pool as a mutable ``Ref``, so the custom call aliases
it to its result (``output_operand_aliases``) and writes only the rows, whatever XLA decides
about the scatter.

Numerics: a copy (the rows are converted to the pool's dtype by the wrapper). A row with an
index out of range (negative included) is dropped, as the reference's ``mode="drop"`` scatter
drops the ones past the end; rows that share a destination keep one of them (the reference
leaves that unspecified too).

Backend: Mosaic GPU through ``pl.kernel`` on a `plgpu.Mesh` (``plgpu.kernel`` wraps its body in
a ``custom_vmap`` that does not take ``Ref`` operands), grid ``(T,)``: one program per row, the
row TMA-copied into shared memory and from there to its ``(layer, page, offset)`` (a 2-D
``[KV, hd]`` box). ``interpret=True`` runs the same body in the Mosaic GPU interpreter. The
copies move whole warpgroup-sized chunks: ``KV * hd * itemsize`` must be a multiple of 128 bytes
(`shapes_supported`). Named ``KERNEL_NAME``; no cost estimate (the Mosaic GPU lowering drops it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

try:  # private in jax 0.10.2
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
  InterpretGPUParams = None

KERNEL_NAME = "bitdelta_kv_write"
_WARPGROUP_BYTES = 128  # a TMA copy of the lowering moves a multiple of the warpgroup's threads


def shapes_supported(pool_shape, dtype) -> str | None:
  """None if the kernel writes rows of a pool ``[L, NP, PS, KV, hd]`` of ``dtype``, else why."""
  if plgpu is None:
    return "this jax has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)"
  if len(pool_shape) != 5:
    return f"the pool must be [L, pages, page_size, KV, hd], got {tuple(pool_shape)}"
  kv, hd = pool_shape[3:]
  itemsize = jnp.dtype(dtype).itemsize
  if (kv * hd * itemsize) % _WARPGROUP_BYTES or (hd * itemsize) % 16:
    return (f"a [{kv}, {hd}] row of {jnp.dtype(dtype).name} is {kv * hd * itemsize} bytes: the "
            f"kernel copies multiples of {_WARPGROUP_BYTES} bytes with 16-byte TMA rows")
  return None


def _interpret_params(interpret):
  if interpret is True:
    if InterpretGPUParams is None:
      raise NotImplementedError("this jax has no Mosaic GPU interpret mode")
    return InterpretGPUParams()
  return interpret or False


def write(pool, layer, page, offset, new, *, interpret=False) -> jax.Array:
  """``pool.at[layer, page, offset].set(new)`` in place: ``pool [L, NP, PS, KV, hd]``, ``new
  [..., KV, hd]``, indices broadcast to ``new.shape[:-2]``; rows with an index out of range
  (negative included) are dropped. Returns the pool (the kernel's aliased result)."""
  if reason := shapes_supported(pool.shape, pool.dtype):
    raise NotImplementedError(f"Mosaic GPU KV write: {reason}")
  n_layers, n_pages, page_size, kv, hd = pool.shape
  lead = new.shape[:-2]
  if tuple(new.shape[-2:]) != (kv, hd):
    raise ValueError(f"new rows {new.shape} do not match the pool's [{kv}, {hd}]")
  rows = new.reshape(-1, kv, hd).astype(pool.dtype)
  t = rows.shape[0]
  if t == 0:
    return pool
  idx = [jnp.broadcast_to(jnp.asarray(i, jnp.int32), lead).reshape(t)
         for i in (layer, page, offset)]
  valid = jnp.ones((t,), jnp.bool_)
  for i, size in zip(idx, (n_layers, n_pages, page_size), strict=True):
    valid &= (i >= 0) & (i < size)
  # [T, 4]: layer, page, offset (0 where dropped, so no address is ever out of range), valid
  table = jnp.stack([jnp.where(valid, i, 0) for i in idx] + [valid.astype(jnp.int32)], axis=1)

  return bitdelta_kv_write(pool, table, rows, interpret=_interpret_params(interpret))


@functools.partial(jax.jit, static_argnames=("interpret",))
def bitdelta_kv_write(pool, table, rows, *, interpret):
  """The kernel: row ``r`` of ``rows [T, KV, hd]`` to ``pool[table[r, :3]]`` if ``table[r, 3]``.
  (Named as the kernel: with a ``Ref`` operand the Mosaic GPU module takes the name of the
  enclosing function, not ``pl.kernel``'s ``name``.)"""
  kv, hd = pool.shape[3:]

  def body(table_ref, rows_ref, pool_ref, buf, bar):
    r = lax.axis_index("t")

    @pl.when(table_ref[r, 3] > 0)
    def _():
      plgpu.copy_gmem_to_smem(rows_ref.at[r], buf, bar.at[0])
      plgpu.barrier_wait(bar.at[0])
      dst = pool_ref.at[table_ref[r, 0], table_ref[r, 1], table_ref[r, 2]]
      plgpu.copy_smem_to_gmem(buf, dst)
      plgpu.wait_smem_to_gmem(0)

  def scoped(*refs):
    pl.run_scoped(lambda *scratch: body(*refs, *scratch), plgpu.SMEM((kv, hd), pool.dtype),
                  plgpu.Barrier(num_arrivals=1, num_barriers=1))

  mesh = plgpu.Mesh(grid=(rows.shape[0],), grid_names=("t",), kernel_name=KERNEL_NAME)
  kernel = pl.kernel(scoped, out_type=(), mesh=mesh, interpret=interpret, name=KERNEL_NAME)
  ref = jax.new_ref(pool, memory_space=plgpu.GMEM)  # aliased in and out of the kernel
  kernel(table, rows, ref)
  return jax.freeze(ref)


__all__ = ["KERNEL_NAME", "shapes_supported", "write"]
