"""The one table of ggml block formats the kernels read (ggml's ``type_traits``, for ours).

    fmt = block_format("q4_1")
    fmt.block_bytes, fmt.qs_rows, fmt.has_min, fmt.offset, fmt.vec_dot_type

Every per-format fact the Python paths need is a field here: the blocks' layout (`blocks`),
the CPU kernel's format id and its activation choice (`cpu_rows`), the GPU kernel's field
count and value decoding (`mosaic_gpu`), the GGUF type it is (`bitdelta_jax.hf.gguf_base`).
The C++ kernel (``cpu_rows_kernel.cc``) switches on `BlockFormat.kernel_id`; its constants
(block sizes, header bytes) are checked against this table by ``tests/kernels/``. The
quantizers themselves (how a block's scale is chosen) stay code in `blocks`: they are
algorithms, not facts.
"""

from __future__ import annotations

import dataclasses

BLOCK = 32  # weights per block along K, every format


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  name: str  # "q8_0", as the GGUF type's lower-case name
  ggml_type: int  # gguf.GGMLQuantizationType's value
  nibbles: bool  # two 4-bit values per byte (low nibble: weight j, high: j + 16)
  has_min: bool  # an f16 minimum m after the f16 scale d: w = d·q + m
  offset: int  # w = d·(q − offset) (+ m): 8 for q4_0's signed nibbles, else 0
  # the activation blocks ggml pairs these weights with (its ``vec_dot_type``): q8_0 is x
  # quantized per 32-block with one f16 scale, q8_1 adds the block's sum (for m's term)
  vec_dot_type: str
  kernel_id: int  # the format id cpu_rows_kernel.cc switches on
  # activations the CPU kernel is fastest with (bench/results/kernels/quant_kernel.md): int8 where the
  # nibbles' unpacking dominates, f32 for q8_0's bytes
  fastest_activations: str

  @property
  def qs_rows(self) -> int:
    """Bytes of quantized values per block (32 int8, or 16 bytes of nibble pairs)."""
    return BLOCK // 2 if self.nibbles else BLOCK

  @property
  def header_bytes(self) -> int:
    """The block's f16 scale d (and minimum m), before its values."""
    return 4 if self.has_min else 2

  @property
  def block_bytes(self) -> int:
    return self.header_bytes + self.qs_rows

  @property
  def bytes_per_weight(self) -> float:
    return self.block_bytes / BLOCK

  @property
  def fields(self) -> int:
    """Per-block f16 fields (d, and m)."""
    return 2 if self.has_min else 1


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
  BlockFormat("q8_0", ggml_type=8, nibbles=False, has_min=False, offset=0, vec_dot_type="q8_0",
              kernel_id=0, fastest_activations="f32"),
  BlockFormat("q4_0", ggml_type=2, nibbles=True, has_min=False, offset=8, vec_dot_type="q8_0",
              kernel_id=1, fastest_activations="int8"),
  BlockFormat("q4_1", ggml_type=3, nibbles=True, has_min=True, offset=0, vec_dot_type="q8_1",
              kernel_id=2, fastest_activations="int8"),
)}


def block_format(name: str) -> BlockFormat:
  """The format named ``name``; a ValueError naming the choices otherwise."""
  try:
    return FORMATS[name]
  except (KeyError, TypeError):
    raise ValueError(f"unknown block format {name!r}; choose from {', '.join(FORMATS)}") from None
