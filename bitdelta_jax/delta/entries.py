"""What a delta holds per tensor: the entry types every compressor writes, the store reads and
the model's slots load. Host data only (numpy): no JAX here, so the store and the server's HTTP
layer import them without JAX. `bitdelta_jax.delta.format` (packing, unpacking) registers
`PackedDelta` as a pytree; so does importing this module after JAX.

* `PackedDelta`: a 1-bit delta ``α ⊙ sign(Δ)`` of one ``[K, N]`` kernel (bit layout in
  `pallas_kernels.bits` and docs/FORMAT.md).
* `Dense`: a tensor kept exactly (``same``, ``value`` or ``delta``).
* `LoraEntry`: low-rank factors ``a [in, r] · b [r, out]`` (a PEFT adapter, SVD modes).
* `ResidualEntry`: a 1-bit delta plus a low-rank correction of what it leaves out (D-QRELO).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Literal

import numpy as np

from pallas_kernels.bits import (  # noqa: F401  (the bit layout, shared with the kernels)
  DEFAULT_GROUP_K,
  LAYOUT,
  packed_rows,
  round_up,
)


class DeltaMismatchError(ValueError):
  """Base and fine-tune (or base and delta) do not correspond."""


Granularity = Literal["matrix", "column"]
GRANULARITIES: tuple[str, ...] = ("matrix", "column")


@dataclasses.dataclass(frozen=True)
class PackedDelta:
  """A 1-bit delta of one ``[K, N]`` kernel, or a bank of them (leading axes on the data).

  Attributes:
    bits: uint8 ``[..., round_up(K, group_k) // 8, N]``, layout described in the module doc.
    scale: float32 ``[..., 1]`` (per matrix) or ``[..., N]`` (per output column).
    shape: logical ``(K, N)`` of one matrix.
    group_k: rows per bit-plane group (a multiple of 8).
    granularity: ``"matrix"`` or ``"column"``.
  """

  bits: np.ndarray  # or a jax.Array
  scale: np.ndarray
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
  group_k: int = dataclasses.field(metadata=dict(static=True), default=DEFAULT_GROUP_K)
  granularity: str = dataclasses.field(metadata=dict(static=True), default="matrix")
  layout: str = dataclasses.field(metadata=dict(static=True), default=LAYOUT)

  def __post_init__(self):
    k, n = self.shape
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
    if self.layout != LAYOUT:
      raise ValueError(f"unknown bit layout {self.layout!r} (this version reads {LAYOUT!r})")
    # Shape checks only when the leaves are concrete arrays (not tracers / abstract leaves).
    bits_shape = getattr(self.bits, "shape", None)
    if bits_shape is not None and len(bits_shape) >= 2:
      want = (packed_rows(k, self.group_k), n)
      if tuple(bits_shape[-2:]) != want:
        raise ValueError(
          f"PackedDelta bits have trailing shape {tuple(bits_shape[-2:])}, expected {want} "
          f"for logical shape {self.shape} with group_k={self.group_k}"
        )

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.bits.shape)) + 4 * int(np.prod(self.scale.shape))


@dataclasses.dataclass(frozen=True)
class Dense:
  """A tensor kept exactly. ``value`` is None for ``same``; HF or Flax layout as given."""

  kind: str  # "same" | "value" | "delta"
  value: np.ndarray | None = None
  extra_rows: np.ndarray | None = None

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in (self.value, self.extra_rows) if a is not None)


@dataclasses.dataclass(frozen=True)
class LoraEntry:
  """A LoRA adapter's factors for one linear weight, Flax layout: ``a [in, r]``,
  ``b [r, out]`` with the adapter's scale folded into ``b``."""

  a: np.ndarray
  b: np.ndarray

  @property
  def nbytes(self) -> int:
    return int(self.a.nbytes + self.b.nbytes)


@dataclasses.dataclass(frozen=True)
class ResidualEntry:
  """A 1-bit delta plus a low-rank correction of what it leaves out, for one linear weight:
  ``ΔW ≈ α ⊙ S + a · b`` (e.g. D-QRELO). Served by the slot's 1-bit bank and its LoRA bank
  together, so such a variant runs in the same mixed batch as plain 1-bit and LoRA variants."""

  packed: PackedDelta
  lora: LoraEntry

  @property
  def nbytes(self) -> int:
    return int(self.packed.nbytes + self.lora.nbytes)


Entry = PackedDelta | Dense | LoraEntry | ResidualEntry

_registered = False


def register_pytrees() -> None:
  """Makes `PackedDelta` a JAX pytree (bits and scale its leaves); imports JAX."""
  global _registered
  if not _registered:
    import jax

    jax.tree_util.register_dataclass(PackedDelta)
    _registered = True


if "jax" in sys.modules:  # JAX is there already: the entries are pytrees at once
  register_pytrees()
