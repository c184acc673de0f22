"""Where the paged engine's arrays live: one device, or a ``(data, model)`` device mesh.

    layout = MeshLayout.of(model, mesh)     # mesh None: one device, plain jit
    run, copy = layout.jit_step(run_impl, copy_pages_impl)

On a mesh (`bitdelta_jax.sharding.make_mesh`):

* **parameters** (base weights, 1-bit bits and scales, LoRA factors, embedding banks) as
  `bitdelta_jax.sharding.shard_model` places them (tensor parallel over ``model``; the delta
  matmuls run per shard, `bitdelta_jax.sharding.ShardedDeltaMatmul`). A model restored straight
  into its shardings (`bitdelta_jax.sharding.restore_base`) is used as it is.
* **KV pages** ``[L, pages, page_size, kv_heads, head_dim]``: kv heads over ``model`` when they
  divide, else replicated. The page table is host data shared by all devices: every device
  holds the same pages, each only its own heads, so a step's writes and gathers stay local.
  Each layer's new K/V are constrained to the pools' head layout before they are written: a
  k/v projection split by columns that do not fall on head boundaries (4 kv heads over 8
  devices) otherwise led XLA to gather whole pools onto every device to write them.
* **step inputs and outputs** (`bitdelta_jax.engine.batch.PagedBatch`, `StepOutput`):
  replicated; every device sees the whole (small) batch and the sampled tokens.

The pages are donated to every step, so the cache is never copied.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """Shardings of the paged engine's state on ``mesh`` (all None on one device)."""

  mesh: Any = None  # jax.sharding.Mesh | None
  params: Any = None  # a NamedSharding per leaf of the model state
  kv: Any = None  # NamedSharding of each KV page pool
  replicated: Any = None

  @classmethod
  def of(cls, model, mesh=None, rules=None) -> MeshLayout:
    """The layout of ``model`` on ``mesh``; shards the model in place unless it already lives
    there."""
    if mesh is None:
      return cls()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from bitdelta_jax.sharding.mesh import MODEL
    from bitdelta_jax.sharding.rules import (
      PartitionRules,
      kv_heads_axis,
      on_mesh,
      shard_model,
      shardings_of,
    )

    if not on_mesh(model, mesh):
      shard_model(model, mesh, rules or PartitionRules())
    sizes = dict(mesh.shape)
    heads = kv_heads_axis(model.config, sizes) if sizes.get(MODEL, 1) > 1 else None
    return cls(mesh, shardings_of(nnx.state(model)),
               NamedSharding(mesh, P(None, None, None, heads, None)), NamedSharding(mesh, P()))

  def zeros(self, shape, dtype, sharding) -> jax.Array:
    """Zeros born in ``sharding`` (never whole on one device first)."""
    if self.mesh is None:
      return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

  def place_state(self, state):
    """The model state with every leaf in its sharding (a no-op for leaves already there)."""
    if self.mesh is None:
      return state
    from bitdelta_jax.sharding.rules import place

    return jax.tree.map(place, state, self.params)

  def replicate(self, tree):
    """Host arrays as device arrays every device of the mesh holds whole."""
    if self.mesh is None:
      return jax.device_put(tree)
    from bitdelta_jax.sharding.rules import place

    return jax.tree.map(lambda a: place(a, self.replicated), tree)

  def jit_step(self, run, copy, layer_shardings=None):
    """``run(params, layers, k_pool, v_pool, batch, base_only)`` (``params`` the model state's
    leaves, ``layers`` the stacked layer states' leaves or None, both tuples; ``base_only``
    static, passed by position: jit takes no keyword arguments with shardings) and
    ``copy(k_pool, v_pool, src, dst)``, jitted with the pools donated (and, on a mesh, with
    these shardings: ``layer_shardings`` a tree like the stacked layer states)."""
    if self.mesh is None:
      return (jax.jit(run, static_argnums=(5,), donate_argnums=(2, 3)),
              jax.jit(copy, donate_argnums=(0, 1)))
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    kv, rep = self.kv, self.replicated
    heads = self.kv.spec[3]  # the new K/V [N, kv, hd] as the pools hold them
    run = functools.partial(run, kv_sharding=NamedSharding(self.mesh, P(None, heads, None)))
    params = tuple(jax.tree.leaves(self.params))  # in the state's leaf order, as `run` gets them
    layers = None if layer_shardings is None else tuple(jax.tree.leaves(layer_shardings))
    return (
      jax.jit(run, static_argnums=(5,), donate_argnums=(2, 3),
              in_shardings=(params, layers, kv, kv, rep),
              out_shardings=(kv, kv, rep)),
      jax.jit(copy, donate_argnums=(0, 1), in_shardings=(kv, kv, rep, rep),
              out_shardings=(kv, kv)),
    )


def data_groups(model, mesh, rules=None) -> list[tuple[Any, Any]]:
  """``model`` on ``mesh`` as one ``(model, sub-mesh)`` per index of the ``data`` axis: each
  sub-mesh is that row of devices (``data=1, model=M``), each model the same parameters viewed
  on it (its devices' shards of each array: no copy). A mesh without ``data > 1`` is one group.

  A mesh spanning several processes stays one group (its data rows repeat each step): a group
  on one process's devices would need its results sent back to process 0, which the plan
  channel does not do (yet)."""
  import logging

  from bitdelta_jax.sharding.mesh import DATA
  from bitdelta_jax.sharding.rules import PartitionRules, on_mesh, shard_model

  d = dict(mesh.shape).get(DATA, 1)
  if d == 1:
    return [(model, mesh)]
  if jax.process_count() > 1:
    logging.getLogger("bitdelta_jax.engine").warning(
      "data=%d over %d processes: each step runs on every data row (data groups split the "
      "work on one process only)", d, jax.process_count())
    return [(model, mesh)]
  if not on_mesh(model, mesh):
    shard_model(model, mesh, rules or PartitionRules())
  from jax.sharding import Mesh, NamedSharding

  axis = mesh.axis_names.index(DATA)
  graphdef, state = nnx.split(model)
  out = []
  for i in range(d):
    sub = Mesh(np.take(mesh.devices, [i], axis=axis), mesh.axis_names)
    mine = set(sub.devices.flat)

    def view(a, sub=sub, mine=mine):
      sharding = NamedSharding(sub, a.sharding.spec)
      shards = [s.data for s in a.addressable_shards if s.device in mine]
      return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)

    m = nnx.merge(graphdef, jax.tree.map(view, state))
    for _, node in nnx.iter_graph(m):  # per-layer ops that hold the mesh (sharded matmuls)
      if isinstance(node, nnx.Module):
        for name, value in list(vars(node).items()):
          if dataclasses.is_dataclass(value) and getattr(value, "mesh", None) is mesh:
            setattr(node, name, dataclasses.replace(value, mesh=sub))
    out.append((m, sub))
  return out
