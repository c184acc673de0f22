"""Restore straight into the target shardings: each device reads only its own slice.

* `restore_base(hf_dir, mesh)`: the base model from HF safetensors. Every parameter is a
  `jax.make_array_from_callback` whose callback reads the device's slice (whole output rows of
  an HF ``[out, in]`` weight with one positioned read; column slices through a read-only mmap
  view, copying only the slice). Slot banks are created as sharded zeros. No tensor is ever
  whole in host memory, and a process reads only what its own devices hold.
* `load_variant_sharded(model, slot, delta)`: a variant into a slot of a sharded model, from a
  delta directory (tensorstore zarr: each device's slice of the packed bits is one ranged read)
  or from an in-memory delta dict; rows are written into the banks by a donated, sharded
  update (no recompilation, same as `bitdelta_jax.models.slots.load_variant`).
* `save_state` / `restore_state`: the whole model state (base + banks) as an Orbax checkpoint,
  restored by Orbax into abstract arrays that carry the target sharding.

Checksums: a slice read cannot check the per-array crc32 of the manifest (it covers the whole
array); `load_variant_sharded(..., verify=True)` reads each array once more, whole and
unsharded, to check it. Off by default for the sharded path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bitdelta_jax.delta.store import _array_dir, read_array, read_manifest
from bitdelta_jax.hf.checkpoints import open_checkpoint
from bitdelta_jax.hf.safetensors_io import CheckpointError, CheckpointReader
from bitdelta_jax.models import slots as slots_lib
from bitdelta_jax.models.layers import SlotBank
from bitdelta_jax.models.llama import LlamaForCausalLM
from bitdelta_jax.models.loading import _config_dtype, hf_name, load_config
from bitdelta_jax.sharding.rules import (
  PartitionRules,
  _map_state,
  place,
  plan_model,
  set_delta_modes,
)

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# -- base weights from safetensors ------------------------------------------------------------
def _read_slice(reader: CheckpointReader, name: str, idx: tuple, transpose: bool) -> np.ndarray:
  info = reader.info(name)
  hf_idx = tuple(idx)[::-1] if transpose else tuple(idx)
  hf_idx = hf_idx + (slice(None),) * (len(info.shape) - len(hf_idx))
  full_rest = all(
    s.indices(n) == (0, n, 1) for s, n in zip(hf_idx[1:], info.shape[1:], strict=True)
  )
  if info.shape and full_rest and hf_idx[0].indices(info.shape[0])[2] == 1:
    start, stop, _ = hf_idx[0].indices(info.shape[0])
    a = reader.read_rows(name, start, stop).reshape((stop - start, *info.shape[1:]))
  else:  # a column slice: copy it out of a read-only memory map
    a = np.array(reader.read(name, copy=False)[hf_idx])
  return a.T if transpose else a


def _sharded_zeros(shape, dtype, sharding) -> jax.Array:
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def restore_base(
  path: str | os.PathLike,
  mesh: Mesh,
  dtype=None,
  *,
  num_slots: int = 1,
  dense_embedding_slots: bool = False,
  lora_rank: int = 0,
  extra_vocab: int = 0,
  packed_embedding_slots: bool = False,
  delta_implementation: str | None = None,
  rules: PartitionRules = PartitionRules(),
) -> LlamaForCausalLM:
  """`bitdelta_jax.models.from_pretrained`, but every array is born sharded on ``mesh``.

  Returns the model with its delta matmuls routed through per-shard kernels (as after
  `shard_model`). Banks without a partition rule (packed 1-bit embedding banks, 1/32 of the
  dense ones; added-token rows) are replicated.
  """
  path = Path(path)
  cfg = load_config(path, num_slots=num_slots, dense_embedding_slots=dense_embedding_slots,
                    lora_rank=lora_rank, extra_vocab=extra_vocab,
                    packed_embedding_slots=packed_embedding_slots)
  cfg = dataclasses.replace(cfg, delta_implementation=delta_implementation)
  dtype = jnp.dtype(_config_dtype(path) if dtype is None else dtype)
  abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  plan = plan_model(abstract, dict(mesh.shape), rules)
  graphdef, state = nnx.split(abstract)
  reader = open_checkpoint(path)
  kinds = {p: v for p, v in nnx.to_flat_state(state)}
  wanted = {hf_name(p)[0] for p, v in kinds.items() if not isinstance(v, SlotBank)}
  missing = sorted(wanted - set(reader.names()))
  if missing:
    raise CheckpointError(f"{path}: missing tensors {missing[:8]}")
  extra = sorted(n for n in set(reader.names()) - wanted if not n.endswith(_IGNORED_SUFFIXES)
                 and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
  if extra:
    raise CheckpointError(f"{path}: tensors this {cfg.model_type} decoder does not use: {extra[:8]}")

  def make(spath, leaf):
    sharding = NamedSharding(mesh, plan.specs.get(spath, P()))
    shape, dt = tuple(leaf.shape), leaf.dtype
    if isinstance(kinds[spath], SlotBank):
      return _sharded_zeros(shape, dt, sharding)
    name, transpose = hf_name(spath)
    hf_shape = reader.info(name).shape
    if tuple(hf_shape[::-1] if transpose else hf_shape) != shape:
      raise CheckpointError(
        f"{path}: tensor {name!r} has shape {list(hf_shape)}, the config implies "
        f"{list(shape[::-1] if transpose else shape)}"
      )
    return jax.make_array_from_callback(
      shape, sharding, lambda idx: _read_slice(reader, name, idx, transpose).astype(dt)
    )

  state = _map_state(state, lambda spath, var: make(spath, var.get_value()))
  model = nnx.merge(graphdef, state)
  set_delta_modes(model, mesh, plan)
  return model


# -- variants into slots -----------------------------------------------------------------------
@dataclasses.dataclass
class _Row:
  """How to produce one bank row: ``get(index)`` reads a slice in the bank's layout; with
  ``minus`` the base tensor (same layout) is subtracted on device."""

  get: Callable[[tuple], np.ndarray] | None  # None: zeros
  minus: jax.Array | None = None


def _host_rows(rows: list | None, n_banks: int) -> list[_Row]:
  rows = rows or []
  out = []
  for i in range(n_banks):
    r = rows[i] if i < len(rows) else None
    out.append(_Row(None if r is None else (lambda idx, r=np.asarray(r): r[idx])))
  return out


def _stored_rows(root: Path, name: str, meta: Mapping, module, role: str,
                 n_banks: int) -> list[_Row] | None:
  """Slice readers for a stored entry; None when it must be converted on the host first."""
  d = _array_dir(root, name)
  arrays = meta["arrays"]
  kind = meta["kind"]
  if kind == "same":
    return _host_rows(None, n_banks)
  if kind == "packed" and role == "linear":
    if meta["group_k"] != module.group_k or tuple(meta["shape"]) != (
        module.in_features, module.out_features):
      return None  # re-pack (or a shape error) on the host, as load_variant does
    n = module.out_features
    scale = np.broadcast_to(read_array(d / "scale", arrays["scale"]).reshape(-1), (n,))
    return [_Row(lambda idx: read_array(d / "bits", arrays["bits"], index=tuple(idx))),
            _Row(lambda idx: scale[idx])] + _host_rows(None, n_banks - 2)
  if kind in ("value", "delta") and role in ("bias", "norm", "embed", "head"):
    if "extra_rows" in arrays and int(np.prod(arrays["extra_rows"]["shape"])):
      return None  # load_variant's error message
    if any(b is None for b in slots_lib._bank(module, role)):
      return None
    base = module.kernel if role == "head" else module.bias if role == "bias" else module.weight
    base = base.get_value()
    vshape = tuple(arrays["value"]["shape"])
    if (vshape[::-1] if role == "head" else vshape) != tuple(base.shape):
      return None
    if role == "head":  # bank row [D, V], stored HF [V, D]
      get = lambda idx: read_array(d / "value", arrays["value"], index=tuple(idx)[::-1]).T
    else:
      get = lambda idx: read_array(d / "value", arrays["value"], index=tuple(idx))
    return [_Row(get, base if kind == "value" else None)]
  return None


@functools.cache
def _set_row_fn(sharding: NamedSharding):
  def f(bank, slot, row):
    return jax.lax.dynamic_update_index_in_dim(bank, row.astype(bank.dtype), slot, 0)

  return jax.jit(f, donate_argnums=0, out_shardings=sharding)


@functools.cache
def _minus_fn(sharding: NamedSharding):
  return jax.jit(lambda v, b: v.astype(jnp.float32) - b.astype(jnp.float32),
                 out_shardings=sharding)


def _row_sharding(bank: jax.Array) -> NamedSharding:
  spec = tuple(bank.sharding.spec)[1:]
  return NamedSharding(bank.sharding.mesh, P(*spec))


def _write(var: nnx.Variable, slot: int, row: _Row) -> None:
  bank = var.get_value()
  rsh = _row_sharding(bank)
  shape = tuple(bank.shape[1:])
  if row.get is None:
    new = _sharded_zeros(shape, bank.dtype, rsh)
  else:
    dt = np.float32 if row.minus is not None else bank.dtype
    new = jax.make_array_from_callback(shape, rsh, lambda idx: np.asarray(row.get(idx), dt))
    if row.minus is not None:
      new = _minus_fn(rsh)(new, row.minus)
  s = place(np.int32(slot), NamedSharding(rsh.mesh, P()))
  var.set_value(_set_row_fn(bank.sharding)(bank, s, new))


def load_variant_sharded(model, slot: int, delta, *, verify: bool = False) -> None:
  """Writes a variant into ``slot`` of a sharded model, each device reading its own slices.

  ``delta``: a delta directory (path) or an in-memory ``{name: entry}`` dict (what
  `load_variant` takes). Entries that need host-side conversion (bits packed with another
  ``group_k``, LoRA factors) are converted whole on the host, then placed shard by shard.
  """
  slots_lib._check_slot(model, slot)
  targets = slots_lib._targets(model)
  stored = isinstance(delta, (str, os.PathLike))
  if stored:
    root = Path(delta)
    manifest = read_manifest(root)
    metas = manifest["tensors"]
    if verify:
      from bitdelta_jax.delta.store import load_delta

      load_delta(root, verify=True)  # whole-array crc32 check, unsharded
  else:
    metas = dict(delta)
  unknown = sorted(set(metas) - set(targets))
  if unknown:
    raise ValueError(f"delta has tensors this model lacks: {unknown[:8]}")
  plan: list[tuple[nnx.Variable, _Row]] = []
  for name, (module, role) in targets.items():
    banks = slots_lib._bank(module, role)
    rows = None
    if name in metas and stored:
      rows = _stored_rows(root, name, metas[name], module, role, len(banks))
      if rows is None:  # host-side conversion (or load_variant's own error)
        from bitdelta_jax.delta.store import load_entry

        entry = load_entry(root, name, metas[name], verify=True)
        rows = _host_rows(slots_lib._rows_for(name, module, role, entry), len(banks))
    elif name in metas:
      rows = _host_rows(slots_lib._rows_for(name, module, role, metas[name]), len(banks))
    else:
      rows = _host_rows(None, len(banks))
    plan += [(v, r) for v, r in zip(banks, rows) if v is not None]
  for var, row in plan:
    _write(var, slot, row)


# -- whole state through Orbax ---------------------------------------------------------------
def save_state(path: str | os.PathLike, model) -> None:
  """Writes the model's whole state (base + banks) as an Orbax checkpoint at ``path``."""
  import orbax.checkpoint as ocp

  ckptr = ocp.StandardCheckpointer()
  ckptr.save(Path(path).absolute(), nnx.to_pure_dict(nnx.state(model)))
  ckptr.wait_until_finished()


def restore_state(
  path: str | os.PathLike, cfg, mesh: Mesh, dtype=jnp.float32,
  rules: PartitionRules = PartitionRules(),
) -> LlamaForCausalLM:
  """Restores `save_state`'s checkpoint: Orbax reads each array into an abstract target that
  carries its NamedSharding, so every device receives only its shard."""
  import orbax.checkpoint as ocp

  abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  plan = plan_model(abstract, dict(mesh.shape), rules)
  graphdef, state = nnx.split(abstract)

  def target(spath, var):
    v = var.get_value()
    return jax.ShapeDtypeStruct(v.shape, v.dtype,
                                sharding=NamedSharding(mesh, plan.specs.get(spath, P())))

  abstract_state = _map_state(state, target)
  restored = ocp.StandardCheckpointer().restore(
    Path(path).absolute(), nnx.to_pure_dict(abstract_state)
  )
  nnx.replace_by_pure_dict(state, restored)
  model = nnx.merge(graphdef, state)
  set_delta_modes(model, mesh, plan)
  return model


__all__ = ["restore_base", "load_variant_sharded", "save_state", "restore_state"]
