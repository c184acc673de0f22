"""The one table of block formats (pallas_kernels/quant_matmul/formats.py) agrees with the
gguf package (ggml's own sizes and type ids), with the C++ kernel's format enum, and with
ggml's dequantization of real blocks."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from pallas_kernels.quant_matmul import blocks
from pallas_kernels.quant_matmul.formats import BLOCK, FORMATS, block_format

KERNEL = Path(blocks.__file__).with_name("cpu_rows_kernel.cc")


@pytest.mark.parametrize("name", list(FORMATS))
def test_sizes_and_type_ids_are_ggml_s(name):
  f = FORMATS[name]
  t = gguf.GGMLQuantizationType(f.ggml_type)
  assert t.name.lower() == name
  assert gguf.GGML_QUANT_SIZES[t] == (BLOCK, f.block_bytes)
  assert f.bytes_per_weight == f.block_bytes / BLOCK
  assert blocks.block_bytes(name) == f.block_bytes


def test_the_cpu_kernels_format_ids_are_the_tables():
  enum = re.search(r"enum Format : int64_t \{([^}]*)\}", KERNEL.read_text()).group(1)
  ids = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"k(Q\d_\d) = (\d+)", enum)}
  assert ids == {n: f.kernel_id for n, f in FORMATS.items()}


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_tables_decoding_is_ggml_s(name):
  """Blocks made by the gguf package, dequantized by it and through the table's facts."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((8, 4 * BLOCK)).astype(np.float32)
  t = gguf.GGMLQuantizationType(FORMATS[name].ggml_type)
  raw = gguf.quants.quantize(w, t)
  want = gguf.quants.dequantize(raw, t).reshape(8, -1)
  got = blocks.dequantize(blocks.from_ggml_rows(raw, name, (4 * BLOCK, 8))).T
  np.testing.assert_array_equal(got, want)


def test_an_unknown_format_names_the_choices():
  with pytest.raises(ValueError, match="unknown block format 'q5_0'; choose from q8_0, q4_0, "
                                       "q4_1"):
    block_format("q5_0")
