"""Partition rules for the base parameters and the variant slot banks; `shard_model`.

Tensor parallelism over the mesh axis ``model`` (Megatron layout, Flax kernels are ``[in, out]``):

| module | base | slot banks |
|---|---|---|
| q/k/v/gate/up (column) | kernel ``[K, N/m]``, bias ``[N/m]`` | bits ``[S, Kp/8, N/m]``, α ``[S, N/m]``, Δbias ``[S, N/m]``, LoRA B ``[S, r, N/m]`` |
| o/down (row) | kernel ``[K/m, N]``, bias replicated | bits ``[S, Kp/8/m, N]``, α replicated, LoRA A ``[S, K/m, r]`` |
| embeddings | ``[V/m, D]`` | ``[S, V/m, D]`` |
| LM head | ``[D, V/m]`` | ``[S, D, V/m]`` |
| norms | replicated | replicated |

Everything is replicated over ``data``. A column shard of the packed bits is a plain column
slice. A row shard is locally unpackable only when it holds whole bit-plane groups
(docs/FORMAT.md): the input dimension must be a multiple of ``model × group_k``. When a tensor
cannot be split (that, or a dimension not divisible by ``model``), `PartitionRules.on_indivisible`
decides: ``"error"`` raises `ShardingError` naming the tensor and the fix; ``"fallback"``
(default) logs a warning and uses the next legal layout (row → column → replicated).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bitdelta_jax.models.layers import DeltaDense, Embed, LMHead, RMSNorm
from bitdelta_jax.sharding.mesh import COLUMN, MODEL, REPLICATED, ROW

log = logging.getLogger(__name__)


class ShardingError(ValueError):
  """A tensor cannot be split the way the rules ask."""


@dataclasses.dataclass(frozen=True)
class PartitionRules:
  """Which linear layers are column- and row-parallel (by module name), and what to do with a
  tensor that cannot be split: ``"fallback"`` (log, next legal layout) or ``"error"``."""

  column: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
  row: tuple[str, ...] = ("o_proj", "down_proj")
  on_indivisible: str = "fallback"

  def __post_init__(self):
    if self.on_indivisible not in ("fallback", "error"):
      raise ValueError(f"on_indivisible must be 'fallback' or 'error', got {self.on_indivisible!r}")


@dataclasses.dataclass
class Plan:
  """The outcome of the rules for one model on one mesh shape.

  ``specs``: state path → PartitionSpec for every variable; ``modes``: DeltaDense module path
  → column | row | replicated; ``notes``: the fallbacks taken (also logged).
  """

  specs: dict[tuple, P]
  modes: dict[tuple, str]
  notes: list[str]

  def shardings(self, mesh: Mesh, state: nnx.State):
    """A pytree like ``state`` with a NamedSharding per leaf."""
    return _map_state(state, lambda path, _: NamedSharding(mesh, self.specs.get(path, P())))


def _map_state(state: nnx.State, fn):
  flat = [(path, var) for path, var in nnx.to_flat_state(state)]
  leaves = {path: fn(path, var) for path, var in flat}
  return jax.tree_util.tree_map_with_path(lambda kp, _: leaves[_state_path(kp)], state)


def _state_path(kp) -> tuple:
  """A pytree key path into an `nnx.State` → the variable's state path (drops ``.value``)."""
  out = []
  for k in kp:
    if isinstance(k, jax.tree_util.GetAttrKey):
      continue
    out.append(k.key if isinstance(k, jax.tree_util.DictKey) else getattr(k, "idx", k))
  return tuple(out)


def _shape(var) -> tuple[int, ...]:
  return tuple(np.shape(var.get_value()))


def _fail(rules: PartitionRules, notes: list[str], msg: str, fallback: str) -> None:
  if rules.on_indivisible == "error":
    raise ShardingError(msg)
  note = f"{msg}; falling back to {fallback}"
  log.warning("sharding: %s", note)
  notes.append(note)


def _dense_mode(path: tuple, node: DeltaDense, m: int, rules: PartitionRules, notes) -> str:
  k, n = node.in_features, node.out_features
  short = str(path[-1]) if path else ""
  name = ".".join(str(p) for p in path)
  role = ROW if short in rules.row else COLUMN if short in rules.column else None
  if role is None:
    return REPLICATED
  if m == 1:
    return role
  if role == ROW:
    g = node.group_k if node.has_bank else 1
    if k % (m * g) == 0:
      return ROW
    why = (
      f"{name}: input dim {k} is not a multiple of model={m} x group_k={g}, so a row shard "
      f"would split a bit-plane group"
      if g > 1 and k % m == 0
      else f"{name}: input dim {k} is not divisible by model={m}"
    )
    if g > 1 and k % m == 0 and (k // m) % 8 == 0:
      why += " (re-pack the deltas with --group-k 8 to allow it)"
    if n % m == 0:
      _fail(rules, notes, why, "column-parallel")
      return COLUMN
    _fail(rules, notes, why + f" and output dim {n} is not divisible either", "replication")
    return REPLICATED
  if n % m == 0:
    return COLUMN
  _fail(rules, notes, f"{name}: output dim {n} is not divisible by model={m}", "replication")
  return REPLICATED


def _dense_specs(mode: str) -> dict[str, P]:
  if mode == COLUMN:
    return {"kernel": P(None, MODEL), "bias": P(MODEL), "delta_bits": P(None, None, MODEL),
            "delta_scale": P(None, MODEL), "bias_delta": P(None, MODEL),
            "lora_a": P(), "lora_b": P(None, None, MODEL)}
  if mode == ROW:
    return {"kernel": P(MODEL, None), "bias": P(), "delta_bits": P(None, MODEL, None),
            "delta_scale": P(), "bias_delta": P(), "lora_a": P(None, MODEL, None), "lora_b": P()}
  return {}


def plan_model(
  model, axis_sizes: Mapping[str, int], rules: PartitionRules = PartitionRules()
) -> Plan:
  """Applies the rules to ``model`` (concrete or `nnx.eval_shape`-abstract) for mesh sizes
  ``{"data": D, "model": M}``; needs no devices."""
  m = int(axis_sizes.get(MODEL, 1))
  specs: dict[tuple, P] = {}
  modes: dict[tuple, str] = {}
  notes: list[str] = []
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    path = tuple(path)
    name = ".".join(str(p) for p in path)
    if isinstance(node, DeltaDense):
      mode = _dense_mode(path, node, m, rules, notes)
      if mode != REPLICATED:
        for attr, spec in _dense_specs(mode).items():
          specs[path + (attr,)] = spec
      modes[path] = mode
    elif isinstance(node, Embed):
      v = _shape(node.weight)[0]
      if v % m == 0:
        specs[path + ("weight",)] = P(MODEL, None)
        specs[path + ("weight_delta",)] = P(None, MODEL, None)
      else:
        _fail(rules, notes, f"{name}: vocabulary {v} is not divisible by model={m}", "replication")
    elif isinstance(node, LMHead):
      v = _shape(node.kernel)[1]
      if v % m == 0:
        specs[path + ("kernel",)] = P(None, MODEL)
        specs[path + ("kernel_delta",)] = P(None, None, MODEL)
      else:
        _fail(rules, notes, f"{name}: vocabulary {v} is not divisible by model={m}", "replication")
    elif isinstance(node, RMSNorm):
      pass  # replicated: D floats per slot
  return Plan(specs, modes, notes)


def kv_heads_axis(cfg, axis_sizes: Mapping[str, int]) -> str | None:
  """The mesh axis a KV cache's kv-head dimension is split over: ``model`` when it divides the
  kv heads, else None (GQA with fewer kv heads than ``model`` replicates them)."""
  return MODEL if cfg.num_kv_heads % int(axis_sizes.get(MODEL, 1)) == 0 else None


def place(x: Any, sharding: NamedSharding) -> jax.Array:
  """``device_put`` that also works for a host-local value and a mesh spanning processes
  (every process must pass the same value; each keeps only its devices' slices)."""
  if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  # Not device_put: for a host value it checks equality across processes with a collective.
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def set_delta_modes(model, mesh: Mesh, plan: Plan) -> None:
  """Routes every banked DeltaDense's delta matmul through `ShardedDeltaMatmul`."""
  from bitdelta_jax.sharding.ops import ShardedDeltaMatmul

  for path, node in nnx.iter_graph(model):
    if isinstance(node, DeltaDense) and tuple(path) in plan.modes:
      inner = node.implementation
      if isinstance(inner, ShardedDeltaMatmul):
        inner = inner.inner
      node.implementation = ShardedDeltaMatmul(mesh, plan.modes[tuple(path)], inner)


def shard_model(model, mesh: Mesh, rules: PartitionRules = PartitionRules()) -> Plan:
  """Places ``model``'s state (base parameters and slot banks) on ``mesh`` per the rules, in
  place, and routes its delta matmuls through per-shard kernels. Returns the `Plan`."""
  plan = plan_model(model, dict(mesh.shape), rules)
  state = nnx.state(model)
  shardings = plan.shardings(mesh, state)
  nnx.update(model, jax.tree.map(place, state, shardings))
  set_delta_modes(model, mesh, plan)
  return plan


def on_mesh(model, mesh: Mesh) -> bool:
  """Every array of ``model``'s state already lives on ``mesh`` (e.g. `restore_base`'s)."""
  leaves = jax.tree.leaves(nnx.state(model))
  return bool(leaves) and all(
    isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
    for a in leaves
  )


def shardings_of(tree):
  """The sharding of every array leaf of ``tree`` (for jit ``in_shardings``)."""
  return jax.tree.map(lambda a: a.sharding, tree)


def per_device_bytes(tree) -> dict[str, int]:
  """Bytes held by each addressable device over all array leaves of ``tree``."""
  out: dict[str, int] = {}
  for leaf in jax.tree.leaves(tree):
    for sh in leaf.addressable_shards:
      out[str(sh.device)] = out.get(str(sh.device), 0) + int(sh.data.nbytes)
  return out
