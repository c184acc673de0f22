"""Tensor-parallel and data-parallel sharding of the base model and its variant slot banks.

    from bitdelta_jax import sharding
    mesh = sharding.make_mesh("data=2,model=4")
    sharding.shard_model(model, mesh)                 # params + banks → NamedSharding, in place
    gen = Generator(model, mesh=mesh, max_rows=8)  # the one engine, on the mesh
    model = sharding.restore_base(hf_dir, mesh, num_slots=9)   # born sharded, no host copy
    sharding.load_variant_sharded(model, 1, delta_dir)         # per-device slices of the bits

Modules: `mesh` (spec strings), `rules` (partition rules, `shard_model`), `ops` (the delta
matmul under `shard_map`), `restore` (restore into shardings: safetensors, delta dirs, Orbax).
The engine places its KV pages and step inputs itself (`bitdelta_jax.engine.mesh_layout`).
See docs/SCALING.md.
"""

from bitdelta_jax.sharding.mesh import (
  AXES,
  COLUMN,
  DATA,
  MODEL,
  REPLICATED,
  ROW,
  make_mesh,
  mesh_spec,
  parse_mesh_spec,
)
from bitdelta_jax.sharding.ops import ShardedDeltaMatmul
from bitdelta_jax.sharding.restore import (
  load_variant_sharded,
  restore_base,
  restore_state,
  save_state,
)
from bitdelta_jax.sharding.rules import (
  PartitionRules,
  Plan,
  ShardingError,
  kv_heads_axis,
  per_device_bytes,
  place,
  plan_model,
  shard_model,
)

__all__ = [
  "AXES", "DATA", "MODEL", "COLUMN", "ROW", "REPLICATED",
  "make_mesh", "mesh_spec", "parse_mesh_spec",
  "PartitionRules", "Plan", "ShardingError", "plan_model", "shard_model", "kv_heads_axis",
  "per_device_bytes", "place",
  "ShardedDeltaMatmul",
  "restore_base", "load_variant_sharded", "save_state", "restore_state",
]
