"""Loading variant deltas into the slot banks of a model (no recompilation).

    load_variant(model, slot, delta)   # delta: {HF tensor name: PackedDelta | Dense}
    clear_slot(model, slot)            # slot back to the base
    slot_bank_bytes(model) -> int      # device bytes of all banks

``delta`` is what `bitdelta_jax.delta.compress.compress(..., hf_layout=True)` or
`bitdelta_jax.delta.store.load_delta` return. Entries:

* `PackedDelta` of a linear weight (Flax ``[in, out]``) → the layer's 1-bit bank; a bank
  built with another ``group_k`` is re-packed on the host; a per-matrix α is broadcast.
* ``Dense`` kind ``same`` → the slot row is zeroed (the base); kind ``value`` (HF layout) or
  ``delta`` (``ft − base``, f32) of a norm weight or bias → the layer's f32 delta row.
* embeddings / LM head that differ need ``ModelConfig.dense_embedding_slots``; otherwise a
  `ValueError` names the tensor. Rows of tokens a variant added (a grown vocabulary:
  ``extra_rows``, or a ``value`` longer than the base) go into the ``extra_vocab`` rows of the
  slot, which must have room for them.
* `LoraEntry` (``a [in, r]``, ``b [r, out]``) → the layer's LoRA bank (its 1-bit row stays zero);
  `ResidualEntry` (a `PackedDelta` plus a `LoraEntry`) → both banks of the layer.
* A tensor the delta omits is the base; a name the model lacks is an error.

A slot's bank rows are written by jitted, buffer-donating updates, one per bank, whose slot
index is traced (`prepare_variant` on the host, then `write_variant`): one compile per bank
shape, none per slot, and the model's own jitted functions see arrays of unchanged shape and
dtype, so they never retrace. Because the old bank
buffers are donated, re-read ``nnx.state(model)`` after loading (`Generator` does this).
Mutation is in place on the NNX module (the NNX idiom); ``nnx.state(model, SlotBank)`` gives
the functional view.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.delta.entries import LoraEntry, ResidualEntry
from bitdelta_jax.delta.format import PackedDelta, _pack_bits, unpack_signs
from bitdelta_jax.models.layers import DeltaDense, Embed, LMHead, RMSNorm, hf_array


def _targets(model) -> dict[str, tuple[Any, str]]:
  """HF name → (module, role) for every tensor a slot can hold."""
  out = {}
  for path, node in nnx.iter_graph(model):
    prefix = ".".join(str(p) for p in path)
    if isinstance(node, DeltaDense):
      out[f"{prefix}.weight"] = (node, "linear")
      if node.bias is not None:
        out[f"{prefix}.bias"] = (node, "bias")
    elif isinstance(node, RMSNorm):
      out[f"{prefix}.weight"] = (node, "norm")
    elif isinstance(node, Embed):
      out[f"{prefix}.weight"] = (node, "embed")
    elif isinstance(node, LMHead):
      out[f"{prefix}.weight"] = (node, "head")
  return out


def lora_entries(adapter) -> dict[str, LoraEntry]:
  """A PEFT adapter (`bitdelta_jax.merge.lora.LoraAdapter`) as slot entries keyed by HF weight
  name; `load_variant` accepts them like 1-bit deltas."""
  out = {}
  for module_name, m in adapter.modules.items():
    if m.fan_in_fan_out:
      raise ValueError(f"module {module_name!r}: fan_in_fan_out adapters are not for Llama layers")
    out[f"{module_name}.weight"] = LoraEntry(
      a=np.asarray(m.A, np.float32).T, b=(m.scale * np.asarray(m.B, np.float32)).T)
  return out


def _bank(module, role: str) -> list[nnx.Variable | None]:
  if role == "linear":
    lora = [module.lora_a, module.lora_b] if getattr(module, "lora_a", None) is not None else []
    return [module.delta_bits, module.delta_scale, *lora]
  if role == "bias":
    return [module.bias_delta]
  if role == "head":
    return [module.kernel_delta, module.kernel_delta_used, module.extra_kernel, module.extra_count,
            module.kernel_bits, module.kernel_scale]
  if role == "embed":
    return [module.weight_delta, module.weight_delta_used, module.extra_weight, module.extra_count,
            module.weight_bits, module.weight_scale]
  return [module.weight_delta]  # norm


def _base(module, role: str) -> np.ndarray:
  """The base tensor in HF layout."""
  if role == "linear" or role == "head":
    return hf_array(module.kernel.get_value(), True)
  if role == "bias":
    return np.asarray(module.bias[...])
  return hf_array(module.weight.get_value(), False)


def _check_slot(model, slot: int) -> None:
  s = model.config.num_slots
  if not 1 <= int(slot) < s:
    raise ValueError(f"slot must be in [1, {s}) (slot 0 is the base; num_slots={s}), got {slot}")


def _packed_rows(name: str, module, pd: PackedDelta,
                 shape: tuple[int, int] | None = None) -> list[np.ndarray]:
  k, n = shape or (module.in_features, module.out_features)
  if tuple(pd.shape) != (k, n):
    raise ValueError(f"tensor {name!r}: packed delta has shape {pd.shape}, the layer is {(k, n)}")
  bits = np.asarray(pd.bits)
  if pd.group_k != module.group_k:  # re-pack into the bank's group layout
    signs = unpack_signs(bits, (k, n), pd.group_k, dtype=np.float32)
    bits = _pack_bits(signs > 0, k, module.group_k, np)
  scale = np.broadcast_to(np.asarray(pd.scale, np.float32).reshape(-1), (n,))
  return [bits, scale]


def _dense_row(name: str, entry: Any, base_hf: np.ndarray, role: str) -> np.ndarray:
  """f32 ``ft − base`` in the bank's layout (HF layout transposed for the LM head)."""
  value = np.asarray(entry.value)
  if value.shape != base_hf.shape:
    raise ValueError(f"tensor {name!r}: variant has shape {list(value.shape)}, "
                     f"base {list(base_hf.shape)}")
  if entry.kind == "value":
    d = value.astype(np.float32) - base_hf.astype(np.float32)
  elif entry.kind == "delta":
    d = value.astype(np.float32)
  else:
    raise ValueError(f"tensor {name!r}: unknown entry kind {entry.kind!r}")
  return d.T if role == "head" else d


def split_grown(entry: Any, vocab: int) -> tuple[Any, np.ndarray | None]:
  """A `Dense` embedding / LM-head entry as (the part over the base's ``vocab`` rows, the rows
  of tokens the variant added or None). A ``value`` entry of a grown vocabulary holds both."""
  extra = getattr(entry, "extra_rows", None)
  if getattr(entry, "kind", None) == "value" and entry.value is not None:
    value = np.asarray(entry.value)
    if value.ndim == 2 and value.shape[0] > vocab:
      return dataclasses.replace(entry, value=value[:vocab], extra_rows=None), value[vocab:]
  if extra is not None and np.size(extra):
    return dataclasses.replace(entry, extra_rows=None), np.asarray(extra)
  return entry, None


def _vocab_rows(name: str, module, role: str, entry: Any) -> list[np.ndarray | None]:
  """Rows for ``[delta, used, extra, extra_count, bits, scale]`` of an embedding / LM head (see
  `_bank`): a `PackedDelta` (1-bit, per-token α, in the LM head's ``[D, V]`` orientation) goes
  to the packed banks, or densified into the dense bank when the model has no packed one."""
  banks = _bank(module, role)
  base = _base(module, role)  # [V, D] (the head's kernel transposed back)
  rows: list[np.ndarray | None] = [None] * 6
  extra = None
  if isinstance(entry, PackedDelta):
    vocab, dim = base.shape
    if tuple(entry.shape) != (dim, vocab):
      raise ValueError(f"tensor {name!r}: packed delta has shape {list(entry.shape)}, expected "
                       f"[{dim}, {vocab}] (the [hidden, vocab] orientation)")
    if banks[4] is not None:
      rows[4:] = _packed_rows(name, module, entry, (dim, vocab))
      return rows
    delta = np.asarray(jax.device_get(_dense_of(entry))).T  # [V, D]
    delta = delta.T if role == "head" else delta
  else:
    part, extra = split_grown(entry, base.shape[0])
    delta = None if part.kind == "same" else _dense_row(name, part, base, role)
    if delta is not None and not np.any(delta):
      delta = None  # only the added rows differ: no dense bank needed
  if delta is not None:
    if banks[0] is None:
      raise ValueError(
        f"tensor {name!r} differs in this variant, but the model has no per-slot embedding "
        f"bank: build it with dense_embedding_slots=True (or packed_embedding_slots=True for a "
        f"1-bit embedding delta), or keep {name!r} equal to the base")
    rows[:2] = [delta, np.float32(1.0)]  # the flag: LM-head products are skipped without it
  if extra is not None:
    n = extra.shape[0]
    room = 0 if banks[2] is None else banks[2][...].shape[1 if role == "embed" else 2]
    if n > room:
      raise ValueError(
        f"tensor {name!r}: the variant grew the vocabulary by {n} tokens, but the model has "
        f"room for {room} added tokens per slot (build it with extra_vocab >= {n})")
    if extra.shape[1:] != base.shape[1:]:
      raise ValueError(f"tensor {name!r}: added rows have shape {list(extra.shape)}, the "
                       f"base's rows {list(base.shape[1:])}")
    padded = np.zeros((room, base.shape[1]), np.float32)
    padded[:n] = extra
    rows[2:] = [padded.T if role == "head" else padded, np.float32(n)]
  return rows


def _rows_for(name: str, module, role: str, entry: Any) -> list[np.ndarray] | None:
  """New bank rows for one entry, or None for "leave at zero"."""
  is_packed = isinstance(entry, PackedDelta)
  kind = None if is_packed else getattr(entry, "kind", None)
  if isinstance(entry, LoraEntry):
    kind = "lora"
  if isinstance(entry, ResidualEntry):
    kind = "residual"
  if not is_packed and kind is None:
    raise ValueError(f"tensor {name!r}: expected PackedDelta or Dense, got {type(entry).__name__}")
  if kind == "same":
    return None
  if role in ("embed", "head"):
    return _vocab_rows(name, module, role, entry)
  banks = _bank(module, role)
  if any(b is None for b in banks):
    raise ValueError(f"tensor {name!r}: the model was built with num_slots=1 (no variant bank)")
  if role == "linear" and isinstance(entry, LoraEntry):
    return _lora_rows(name, module, entry)
  if role == "linear" and isinstance(entry, ResidualEntry):
    return _packed_rows(name, module, entry.packed) + _lora_rows(name, module, entry.lora)[2:]
  if isinstance(entry, ResidualEntry):
    raise ValueError(f"tensor {name!r}: a 1-bit + low-rank entry is only valid for linear weights")
  if role == "linear":
    if not is_packed:
      raise ValueError(
        f"tensor {name!r}: a dense ({kind}) linear weight cannot go into a 1-bit slot; "
        f"compress it to a PackedDelta"
      )
    return _packed_rows(name, module, entry)
  if is_packed:
    raise ValueError(f"tensor {name!r}: a PackedDelta is only valid for linear weights")
  return [_dense_row(name, entry, _base(module, role), role)]


def _lora_rows(name: str, module: DeltaDense, e: LoraEntry) -> list[np.ndarray | None]:
  if module.lora_a is None:
    raise ValueError(
      f"tensor {name!r}: the model has no LoRA slots; build it with lora_rank >= the adapter's rank"
    )
  k, n = module.in_features, module.out_features
  rank = module.lora_a[...].shape[-1]
  r = e.a.shape[1]
  if e.a.shape[0] != k or e.b.shape != (r, n):
    raise ValueError(f"tensor {name!r}: LoRA factors {e.a.shape} / {e.b.shape} do not fit "
                     f"the layer [{k}, {n}]")
  if r > rank:
    raise ValueError(f"tensor {name!r}: LoRA rank {r} exceeds the model's lora_rank {rank}")
  a = np.zeros((k, rank), np.float32)
  b = np.zeros((rank, n), np.float32)
  a[:, :r], b[:r] = e.a, e.b
  return [None, None, a, b]  # 1-bit bank rows stay zero (α = 0)


def load_lora(model, slot: int, adapter) -> None:
  """Writes a PEFT LoRA adapter (`bitdelta_jax.merge.lora.LoraAdapter`) into ``slot``."""
  load_variant(model, slot, lora_entries(adapter))


def _dense_of(pd: PackedDelta) -> np.ndarray:
  from bitdelta_jax.delta.format import dense_delta

  return np.asarray(dense_delta(jax.tree.map(np.asarray, pd), np.float32))


@dataclasses.dataclass(frozen=True)
class PreparedVariant:
  """A variant converted on the host to one row per bank variable (order of `bank_vars`; None:
  the row is zero, written on the device without a host array).

  Building it is the slow, host-only part of a load (no device work): a server can run it on
  an IO thread and hand the result to the device thread, which `write_variant`s it.
  """

  rows: tuple[np.ndarray | None, ...]
  nbytes: int


def bank_vars(model) -> list[nnx.Variable]:
  """Every slot-bank variable of the model, in a fixed order."""
  out, seen = [], set()
  for _, (module, role) in _targets(model).items():
    for var in _bank(module, role):
      if var is not None and id(var) not in seen:
        seen.add(id(var))
        out.append(var)
  return out


def prepare_variant(model, delta: Mapping[str, Any]) -> PreparedVariant:
  """Validates and converts ``delta`` into bank rows; raises before touching the model."""
  targets = _targets(model)
  unknown = sorted(set(delta) - set(targets))
  if unknown:
    raise ValueError(f"delta has tensors this model lacks: {unknown[:8]}")
  by_var: dict[int, np.ndarray] = {}
  for name, (module, role) in targets.items():
    rows = _rows_for(name, module, role, delta[name]) if name in delta else None
    for i, var in enumerate(_bank(module, role)):
      if var is not None and rows is not None and i < len(rows) and rows[i] is not None:
        by_var[id(var)] = rows[i]
  out = []
  for var in bank_vars(model):
    row = by_var.get(id(var))
    out.append(None if row is None else np.asarray(row, var[...].dtype))
  return PreparedVariant(tuple(out), sum(r.nbytes for r in out if r is not None))


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(bank: jax.Array, slot: jax.Array, row: jax.Array | None) -> jax.Array:
  row = jnp.zeros(bank.shape[1:], bank.dtype) if row is None else row.astype(bank.dtype)
  return jax.lax.dynamic_update_index_in_dim(bank, row, slot, 0)


def write_variant(model, slot: int, prepared: PreparedVariant) -> None:
  """Writes prepared rows into ``slot`` of every bank, one jitted, donating update per bank.

  One bank at a time: the host-to-device copy of a row lives only for its own update (a whole
  slot copied at once was a transient of the slot's size: 772 MiB for a 7B-shaped variant)."""
  _check_slot(model, slot)
  variables = bank_vars(model)
  if len(variables) != len(prepared.rows):
    raise ValueError("prepared variant does not match this model's banks")
  for var, row in zip(variables, prepared.rows):
    if row is not None and row.shape != var[...].shape[1:]:
      raise ValueError(f"prepared row {row.shape} does not fit a bank of {var[...].shape}")
  s = jnp.int32(slot)
  for var, row in zip(variables, prepared.rows):
    var.set_value(_set_row(var[...], s, row))


def load_variant(model, slot: int, delta: Mapping[str, Any]) -> None:
  """Writes a variant into ``slot`` of every bank (in place, no recompilation)."""
  _check_slot(model, slot)
  write_variant(model, slot, prepare_variant(model, delta))


def clear_slot(model, slot: int) -> None:
  """Resets ``slot`` to the base (all its bank rows zero)."""
  load_variant(model, slot, {})


def slot_bank_bytes(model) -> int:
  from bitdelta_jax.models.layers import SlotBank

  return sum(int(v[...].nbytes) for _, v in nnx.to_flat_state(nnx.state(model, SlotBank)))
