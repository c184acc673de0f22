"""A GGUF base where the rest of the system expects an HF checkpoint directory.

`resolve_base` turns ``FILE.gguf`` into a small directory under the cache root (config.json,
the tokenizer files and ``gguf_base.json`` pointing at the file: no weights, see
`bitdelta_jax.hf.gguf_base.write_metadata_dir`), so the server, the compressor and the loaders
take a GGUF base wherever they take a base directory. Two readers then see its weights:

* `bitdelta_jax.models.loading.from_pretrained` keeps Q8_0 / Q4_0 / Q4_1 tensors in their ggml
  blocks (`pallas_kernels.quant_matmul.QuantizedKernel`): a dequantized copy never exists.
* `GGUFCheckpoint` (what `open_checkpoint` returns for such a directory) reads each tensor
  dequantized to f32 in HF layout: what a fine-tune's delta is taken against (Δ = W_ft −
  dequant(W_q)) and what the base fingerprint is computed over. The fingerprint's per-tensor
  CRCs are therefore those of the f32 checkpoint `bitdelta zoo real-base` writes from the same
  file (its dequantized tensors): a delta made against either serves over the other, while a
  delta made against another quantization, or the unquantized base, is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from bitdelta_jax.hf.gguf_names import permute_rows
from bitdelta_jax.hf.safetensors_io import CheckpointError, CheckpointReader, TensorInfo

GGUF_BASE_FILE = "gguf_base.json"


def is_gguf_dir(path: str | os.PathLike) -> bool:
  return (Path(path) / GGUF_BASE_FILE).is_file()


def resolve_base(path: str | os.PathLike) -> Path:
  """``path`` itself for a base directory; for a ``.gguf`` file, its metadata directory under
  ``$BITDELTA_CACHE/gguf`` (written once per file: keyed by its path, size and mtime)."""
  path = Path(path)
  if path.suffix == ".gguf" and not path.is_file() and not (path / "config.json").is_file():
    what = "is a directory, not a GGUF file" if path.is_dir() else "no such GGUF file"
    raise CheckpointError(f"{path}: {what}")
  if not (path.is_file() and path.suffix == ".gguf"):
    return path
  from pallas_kernels.cache import cache_root

  st = path.resolve().stat()
  key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
  out = cache_root() / "gguf" / key[:16] / path.stem
  if is_gguf_dir(out):
    return out
  from bitdelta_jax.hf.gguf_base import write_metadata_dir

  write_metadata_dir(path, out)
  return out


def gguf_file(base_dir: str | os.PathLike) -> Path:
  """The GGUF file a metadata directory points at (refuses one that no longer exists)."""
  meta = json.loads((Path(base_dir) / GGUF_BASE_FILE).read_text())
  gguf = Path(meta["gguf"])
  if not gguf.is_file():
    raise CheckpointError(f"{base_dir}: its weights are in {gguf}, which does not exist any more")
  return gguf


def quantization(base_dir: str | os.PathLike) -> dict | None:
  """``{"file": name, "formats": {format: tensors}}`` of a GGUF base directory, else None."""
  if not is_gguf_dir(base_dir):
    return None
  meta = json.loads((Path(base_dir) / GGUF_BASE_FILE).read_text())
  counts: dict[str, int] = {}
  for fmt in meta.get("formats", {}).values():
    counts[fmt] = counts.get(fmt, 0) + 1
  return {"file": Path(meta["gguf"]).name, "formats": dict(sorted(counts.items()))}


class GGUFCheckpoint(CheckpointReader):
  """A GGUF base directory's tensors, dequantized to f32 in HF layout, with `CheckpointReader`'s
  interface (names, info, read, read_rows). The tensor last read stays dequantized, so reading
  one in row blocks dequantizes it once."""

  def __init__(self, path: str | os.PathLike):
    from bitdelta_jax.hf.gguf_base import open_gguf_base

    self.path = Path(path)
    self.gguf = gguf_file(self.path)
    self.base = open_gguf_base(self.gguf)
    self.formats = self.base.tensor_formats()
    self.tensors = {}
    for name in self.base.names():
      shape = tuple(int(s) for s in self.base.shape(name))
      nbytes = int(np.prod(shape)) * 4
      self.tensors[name] = TensorInfo(name, self.gguf, np.dtype(np.float32), shape, 0, nbytes)
    self._last: tuple[str, np.ndarray] | None = None

  def _dequantized(self, name: str) -> np.ndarray:
    self.info(name)  # a clear error for an unknown name
    if self._last is None or self._last[0] != name:
      self._last = None  # the previous one is freed before the next is made
      self._last = (name, np.ascontiguousarray(self.base.dequantized(name), np.float32))
    return self._last[1]

  def read(self, name: str, copy: bool = True) -> np.ndarray:
    arr = self._dequantized(name)
    return arr.copy() if copy else arr

  def read_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    arr = self._dequantized(name)
    if arr.ndim == 0:
      arr = arr.reshape(1)
    return arr[start:min(stop, arr.shape[0])].copy()

  def requantizes_same(self, name: str, ft: CheckpointReader) -> bool:
    """Whether the fine-tune's tensor ``name`` quantizes (llama.cpp's reference quantizer, this
    file's format) to exactly the blocks this file stores: then the file already holds it as
    well as its format can, and a delta keeps it as the base's ("same", no bytes). That is how
    a tensor the fine-tune left unchanged (an embedding, say) is told from the base's rounding
    without the source checkpoint. Compared a block of rows at a time; False at the first
    difference, for a non-block format, or for another shape."""
    from pallas_kernels.quant_matmul.blocks import FORMATS, quantize_rows

    fmt = self.formats.get(name)
    if fmt not in FORMATS or name not in ft or ft.info(name).shape != self.info(name).shape:
      return False
    n, k = self.info(name).shape
    stored = self.base._stored(name).reshape(n, -1)  # file order: q/k rows permuted
    heads = self.base._heads(name)
    step = n if heads else max(1, (1 << 20) // k)
    for r0 in range(0, n, step):
      w = np.asarray(ft.read_rows(name, r0, r0 + step), np.float32)
      if heads:
        w = permute_rows(w, heads)
      if not np.array_equal(quantize_rows(w, fmt), stored[r0:r0 + step]):
        return False
    return True

  def close(self) -> None:
    self._last = None
