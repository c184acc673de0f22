"""The delta matmul inside a sharded computation: per-shard kernels under `jax.shard_map`.

Why: the CPU kernel is a C++ `jax.ffi` call and the GPU kernel a Pallas call; XLA's SPMD
partitioner cannot split either, so it all-gathers every operand (each device would read all
the delta bits) and replicates the result. Here each device runs the kernel on its own shards:

* column-parallel (q/k/v/gate/up): x rows over ``data``, full K; W, bits, α split over N
  → y ``[M/d, N/m]``, no communication.
* row-parallel (o/down): x split over K, W and bits split over K (whole bit-plane groups, so the
  local bits unpack on their own), α replicated → partial y, ``psum`` over ``model``.
  ``x·W + α⊙(x·S)`` is linear in x, so the sum of the shards' results is the full result.
* replicated: every device computes the whole layer for its rows.

Numerics: as the inner implementation; the row-parallel sum adds f32 partials (in x's dtype)
in a different order than one device would, so results agree to f32 rounding, not bitwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bitdelta_jax.delta.format import DEFAULT_GROUP_K
from bitdelta_jax.sharding.mesh import COLUMN, DATA, MODEL, REPLICATED, ROW


@dataclasses.dataclass(frozen=True)
class ShardedDeltaMatmul:
  """A drop-in for `pallas_kernels.delta_matmul.api.delta_matmul` over ``mesh``.

  ``mode`` is the layer's layout (column | row | replicated); ``inner`` the implementation
  name each device runs (None: best for the backend). Set as `DeltaDense.implementation` by
  `bitdelta_jax.sharding.shard_model`.
  """

  mesh: Mesh
  mode: str
  inner: str | None = None

  def __call__(self, x, w_base, bits, scale, slot_ids=None, *, group_k: int = DEFAULT_GROUP_K,
               **kwargs):
    from pallas_kernels.delta_matmul.api import delta_matmul

    fn = functools.partial(delta_matmul, group_k=group_k, implementation=self.inner, **kwargs)
    d_size = self.mesh.shape[DATA]
    d = DATA if d_size > 1 and x.shape[0] % d_size == 0 else None
    lead = (None,) * (bits.ndim - 2)
    per_col = scale.shape[-1] != 1
    if self.mode == COLUMN:
      specs = (P(d, None), P(None, MODEL), P(*lead, None, MODEL),
               P(*lead, MODEL if per_col else None))
      out, body = P(d, MODEL), fn
    elif self.mode == ROW:
      specs = (P(d, MODEL), P(MODEL, None), P(*lead, MODEL, None), P())
      out = P(d, None)

      def body(*a):
        return jax.lax.psum(fn(*a), MODEL)
    elif self.mode == REPLICATED:
      specs, out, body = (P(d, None), P(), P(), P()), P(d, None), fn
    else:
      raise ValueError(f"unknown mode {self.mode!r}")
    args = (x, w_base, bits, scale)
    if slot_ids is not None:
      specs, args = specs + (P(d),), args + (slot_ids,)
    return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out, check_vma=False)(
      *args
    )
