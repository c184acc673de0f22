"""Compression of one tensor, of parameter trees, and materialisation (`apply_delta`).

A delta tree maps tensor names to entries:
  * `PackedDelta` for 2-D linear weights (always in Flax ``[in, out]`` layout);
  * with ``CompressPolicy.mode`` other than ``"bitdelta"`` (`bitdelta_jax.delta.residual`), a
    linear weight is a `ResidualEntry` (1-bit + low rank, ``dqrelo``) or a `LoraEntry` (low rank
    alone, ``svd`` / ``delta-come``), which the slot banks serve as they are;
  * `Dense` for everything kept exactly: ``same`` (identical to the base, costs nothing),
    ``value`` (the fine-tuned tensor) or ``delta`` (``ft − base`` in float32, plus
    ``extra_rows`` when a fine-tune grew the vocabulary).

Names and layouts: with ``hf_layout=True`` tensors are PyTorch/HF-layout (a Linear weight is
``[out, in]``) and packing transposes them; with ``hf_layout=False`` they are Flax kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from bitdelta_jax.delta.entries import DeltaMismatchError, Dense, Entry  # noqa: F401
from bitdelta_jax.delta.format import DEFAULT_GROUP_K, GRANULARITIES, PackedDelta, dense_delta, pack
from bitdelta_jax.delta.report import Report, TensorReport


@dataclasses.dataclass(frozen=True)
class CompressPolicy:
  """What becomes a 1-bit delta and how the rest is kept.

  Attributes:
    granularity: ``"matrix"`` (one α per matrix, the paper's default) or ``"column"``.
    group_k: rows per bit-plane group (see `format`); a multiple of 8.
    dense: how kept tensors that changed are stored: ``"delta"`` (ft − base, f32) or
      ``"value"`` (the fine-tuned tensor in its own dtype).
    exact_patterns: regexes (searched in the tensor name) of 2-D tensors kept exactly:
      embeddings and LM head by default.
    mode: how linear weights are compressed: ``"bitdelta"`` (α ⊙ sign Δ), ``"dqrelo"`` (1-bit +
      compensated low-rank residual), ``"svd"`` (truncated SVD), ``"delta-come"`` (singular
      vectors at mixed precision); see `bitdelta_jax.delta.residual`.
    rank: rank of the low-rank part (ignored when ``budget`` is set).
    budget: bytes per linear weight as a fraction of its bf16 bytes (e.g. 1/15).
    factor_width: 16 (float factors), 8/4/2 (uniform codes) or 0 (mixed, from the budget).
    factor_dtype: ``"bfloat16"`` or ``"float16"`` for 16-bit factors.
    iters: D-QRELO alternations between the low-rank part and the signs/α.
  """

  granularity: str = "matrix"
  group_k: int = DEFAULT_GROUP_K
  dense: str = "value"
  exact_patterns: tuple[str, ...] = (r"embed", r"lm_head", r"\bwte\b", r"\bwpe\b", r"norm")
  mode: str = "bitdelta"
  rank: int = 0
  budget: float | None = None
  factor_width: int = 16
  factor_dtype: str = "bfloat16"
  iters: int = 2

  def __post_init__(self):
    if self.mode == "bitdelta" and (self.budget is not None or self.rank):
      raise ValueError("rank and budget are for the other modes (dqrelo, svd, delta-come); "
                       "a bitdelta delta's size is fixed by its granularity")
    if self.mode != "bitdelta":
      self.mode_spec()  # validates
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
    if self.dense not in ("delta", "value"):
      raise ValueError(f"dense must be 'delta' or 'value', got {self.dense!r}")
    if self.group_k <= 0 or self.group_k % 8:
      raise ValueError(f"group_k must be a positive multiple of 8, got {self.group_k}")

  def mode_spec(self):
    """The `residual.ModeSpec` of this policy's linear weights."""
    from bitdelta_jax.delta.residual import ModeSpec

    return ModeSpec(mode=self.mode, rank=self.rank, budget=self.budget, width=self.factor_width,
                    float_dtype=self.factor_dtype, iters=self.iters,
                    granularity=self.granularity, group_k=self.group_k)

  def is_linear(self, name: str, ndim: int) -> bool:
    return ndim == 2 and not any(re.search(p, name) for p in self.exact_patterns)

  def is_vocab(self, name: str) -> bool:
    return bool(re.search(r"embed|lm_head|\bwte\b", name))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)




@functools.partial(jax.jit, static_argnames=("granularity", "group_k", "transpose"))
def _compress_linear(base, ft, *, granularity: str, group_k: int, transpose: bool):
  d = ft.astype(jnp.float32) - base.astype(jnp.float32)
  if transpose:
    d = d.T
  pd = pack(d, granularity, group_k)
  approx = jnp.where(d >= 0, 1.0, -1.0) * pd.scale[None, :]
  err2 = jnp.sum(jnp.square(d - approx))
  return pd, err2, jnp.sum(jnp.square(d))


def _identical(a: np.ndarray, b: np.ndarray) -> bool:
  """Bit-identical when the dtypes agree (fast, and exact: -0.0 ≠ +0.0), else equal values."""
  if a.dtype == b.dtype:
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                          np.ascontiguousarray(b).view(np.uint8))
  return bool(np.array_equal(a, b))


def compress_tensor(
  name: str, base: np.ndarray, ft: np.ndarray, policy: CompressPolicy, *, hf_layout: bool = True
) -> tuple[Entry, TensorReport]:
  """Compresses one tensor pair; returns its entry and its report line."""
  before = int(ft.nbytes)
  if base.shape != ft.shape:
    grown = (
      policy.is_vocab(name) and base.ndim == ft.ndim >= 1 and base.shape[1:] == ft.shape[1:]
      and ft.shape[0] > base.shape[0]
    )
    if not grown:
      raise DeltaMismatchError(
        f"tensor {name!r}: base shape {list(base.shape)} != fine-tuned shape {list(ft.shape)}"
      )
    v = base.shape[0]
    if policy.dense == "value":
      entry = Dense("value", np.asarray(ft))
    else:
      entry = Dense(
        "delta",
        ft[:v].astype(np.float32) - base.astype(np.float32),
        np.asarray(ft[v:]),
      )
    return entry, TensorReport(name, entry.kind, ft.shape, str(ft.dtype), before, entry.nbytes, 0.0,
                               note=f"vocabulary grew {v} -> {ft.shape[0]}")
  if _identical(base, ft):
    return Dense("same"), TensorReport(name, "same", ft.shape, str(ft.dtype), before, 0, 0.0)
  if policy.is_linear(name, ft.ndim) and policy.mode != "bitdelta":
    return _compress_linear_mode(name, base, ft, policy, hf_layout=hf_layout)
  if policy.is_linear(name, ft.ndim):
    pd, err2, d2 = _compress_linear(
      base, ft, granularity=policy.granularity, group_k=policy.group_k, transpose=hf_layout
    )
    pd = jax.tree.map(np.asarray, pd)
    rel = float(np.sqrt(err2 / d2)) if d2 > 0 else 0.0
    return pd, TensorReport(name, "packed", ft.shape, str(ft.dtype), before, pd.nbytes, rel)
  if policy.dense == "value":
    entry = Dense("value", np.asarray(ft))
  else:
    entry = Dense("delta", ft.astype(np.float32) - base.astype(np.float32))
  return entry, TensorReport(name, entry.kind, ft.shape, str(ft.dtype), before, entry.nbytes, 0.0)


def _compress_linear_mode(name, base, ft, policy, *, hf_layout: bool):
  from bitdelta_jax.delta import residual

  d = ft.astype(np.float32) - base.astype(np.float32)
  if hf_layout:
    d = d.T
  entry = residual.compress_linear(d, policy.mode_spec())
  d2 = float(np.sum(np.square(d, dtype=np.float64)))
  err2 = float(np.sum(np.square(d - residual.dense_of(entry), dtype=np.float64)))
  rel = float(np.sqrt(err2 / d2)) if d2 > 0 else 0.0
  rank = residual.lora_rank_of([entry])
  note = f"{policy.mode}: " + ("1-bit" if isinstance(entry, PackedDelta) else
                               f"{'1-bit + ' if hasattr(entry, 'packed') else ''}rank {rank}")
  # Report kind "packed" = a compressed linear weight (the report's totals count those).
  return entry, TensorReport(name, "packed", ft.shape, str(ft.dtype), int(ft.nbytes),
                             residual.stored_nbytes(entry), rel, note=note)


def _linear_delta(entry) -> np.ndarray | None:
  """The dense f32 ``[K, N]`` of a linear entry, or None if ``entry`` is not one."""
  if isinstance(entry, PackedDelta):
    return np.asarray(dense_delta(jax.tree.map(np.asarray, entry), np.float32))
  if isinstance(entry, Dense):
    return None
  from bitdelta_jax.delta import residual

  try:
    return residual.dense_of(entry)
  except TypeError:
    return None


def apply_tensor(name: str, base: np.ndarray, entry: Entry, *, hf_layout: bool = True) -> np.ndarray:
  """``W_eff`` for one tensor, in the base's dtype (or the fine-tune's, for ``value``)."""
  d = _linear_delta(entry)
  if d is not None:
    k, n = d.shape
    want = (n, k) if hf_layout else (k, n)
    if tuple(base.shape) != want:
      raise DeltaMismatchError(
        f"tensor {name!r}: delta is for shape {list(want)}, base has {list(base.shape)}"
      )
    if hf_layout:
      d = d.T
    return (base.astype(np.float32) + d).astype(base.dtype)
  if entry.kind == "same":
    return np.asarray(base)
  if entry.kind == "value":
    return np.asarray(entry.value)
  if entry.kind == "delta":
    if entry.value.shape != base.shape:
      raise DeltaMismatchError(
        f"tensor {name!r}: dense delta has shape {list(entry.value.shape)}, "
        f"base has {list(base.shape)}"
      )
    w = (base.astype(np.float32) + entry.value).astype(base.dtype)
    if entry.extra_rows is not None and entry.extra_rows.size:
      w = np.concatenate([w, entry.extra_rows.astype(base.dtype)], axis=0)
    return w
  raise ValueError(f"tensor {name!r}: unknown entry kind {entry.kind!r}")


def _flat(tree: Any) -> dict[str, Any]:
  if isinstance(tree, Mapping) and tree and all(not isinstance(v, Mapping) for v in tree.values()):
    return dict(tree)
  return {".".join(map(str, k)): v for k, v in traverse_util.flatten_dict(dict(tree)).items()}


def _unflat(flat: dict[str, Any], like: Any) -> Any:
  if isinstance(like, Mapping) and all(not isinstance(v, Mapping) for v in like.values()):
    return flat
  keys = {".".join(map(str, k)): k for k in traverse_util.flatten_dict(dict(like))}
  return traverse_util.unflatten_dict({keys[k]: v for k, v in flat.items()})


def compress(
  base: Any, finetuned: Any, policy: CompressPolicy = CompressPolicy(), *, hf_layout: bool = False
) -> tuple[Any, Report]:
  """Compresses a fine-tuned parameter tree against its base.

  Args:
    base, finetuned: flat ``{name: array}`` dicts or nested dicts with the same structure.
    policy: what to pack and how to keep the rest.
    hf_layout: tensors are HF/PyTorch layout (Linear weight ``[out, in]``); default Flax.

  Returns:
    (delta tree with the input's structure, `Report`).
  """
  fb, ff = _flat(base), _flat(finetuned)
  missing = sorted(set(fb) - set(ff))
  if missing:
    raise DeltaMismatchError(f"fine-tuned tree lacks base tensors: {missing[:5]}")
  out, lines = {}, []
  for name, ft in ff.items():
    ft = np.asarray(ft)
    if name not in fb:  # a tensor new in the fine-tune is kept as its value
      out[name] = Dense("value", ft)
      lines.append(TensorReport(name, "value", ft.shape, str(ft.dtype), ft.nbytes, ft.nbytes, 0.0,
                                note="not in base"))
      continue
    out[name], line = compress_tensor(name, np.asarray(fb[name]), ft, policy, hf_layout=hf_layout)
    lines.append(line)
  return _unflat(out, finetuned), Report(lines)


def apply_delta(base: Any, delta: Any, *, hf_layout: bool = False) -> Any:
  """Materialises ``W_eff`` for every tensor of ``delta`` (a tree from `compress`)."""
  fb, fd = _flat(base), _flat(delta)
  out = {}
  for name, entry in fd.items():
    if name not in fb:
      if isinstance(entry, Dense) and entry.kind == "value":
        out[name] = entry.value
        continue
      raise DeltaMismatchError(f"delta has tensor {name!r} that the base lacks")
    out[name] = apply_tensor(name, np.asarray(fb[name]), entry, hf_layout=hf_layout)
  for name in fb.keys() - fd.keys():
    out[name] = np.asarray(fb[name])
  return _unflat(out, base)
