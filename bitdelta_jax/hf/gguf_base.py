"""A GGUF file read as a base model without dequantizing it.

`open_gguf_base` gives a `GGUFBase`: the HF config (`gguf_import.hf_config`), the HF tensor
names and shapes, and each tensor as the model holds it. Q8_0 / Q4_0 / Q4_1 tensors come out as
`pallas_kernels.quant_matmul.blocks.QuantizedKernel` (the file's bytes, regrouped as column
blocks of the Flax ``[K, N]`` kernel); F32 / F16 / BF16 tensors as f32 numpy in HF layout, as
`gguf_import` gives them. `GGUFBase.dequantized` is the f32 tensor `gguf_import` writes, for
what needs the values (deltas are taken against them).

The file's metadata is read through `gguf.GGUFReader`'s memory map; a tensor's bytes are read
with a positioned read into a fresh array, so no page of the file stays mapped and resident.

`write_metadata_dir` writes what stands for the file where a checkpoint directory is expected
(`bitdelta_jax.hf.gguf_checkpoint.resolve_base`): config.json, the tokenizer files,
generation_config.json and ``gguf_base.json`` pointing at the file, no weights.

    base = open_gguf_base("SmolLM2-135M-Instruct.Q4_1.gguf")
    qk = base.read("model.layers.0.self_attn.q_proj.weight")   # QuantizedKernel [K, N]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bitdelta_jax.hf import gguf_import, gguf_validate, lineage_record
from bitdelta_jax.hf.gguf_names import GGUFImportError, hf_tensor_name, permute_rows, unpermute_rows
from pallas_kernels.quant_matmul import blocks

GGUF_BASE_FILE = "gguf_base.json"  # = gguf_checkpoint.GGUF_BASE_FILE
_HASH_CHUNK = 1 << 24  # bytes hashed at once


def _format_names() -> dict[Any, str]:
  import gguf

  from pallas_kernels.quant_matmul.formats import FORMATS

  T = gguf.GGMLQuantizationType
  return {**{T(f.ggml_type): f.name for f in FORMATS.values()}, T.F32: "f32", T.F16: "f16",
          T.BF16: "bf16"}


class GGUFBase:
  """A llama GGUF's tensors under their HF names (see the module docstring).

  Attributes:
    path: the file.
    config: the HF ``config.json`` dict.
  """

  def __init__(self, path: str | os.PathLike):
    import gguf

    self.path = Path(path)
    gguf_validate.check_file(self.path)  # the header, types and byte ranges, before any allocation
    try:
      self._reader = gguf.GGUFReader(self.path, "r")
    except (ValueError, KeyError, OSError, struct.error) as e:  # what check_file cannot foresee
      raise GGUFImportError(f"{self.path}: unreadable GGUF ({e})") from None
    try:
      self.config = gguf_import.hf_config(self._reader)
    except GGUFImportError as e:
      raise GGUFImportError(f"{self.path}: {e}") from None
    self._tensors = {hf_tensor_name(t.name): t for t in self._reader.tensors}
    self._formats = _format_names()

  def names(self) -> list[str]:
    """HF tensor names in file order (no ``lm_head.weight`` when the head is tied)."""
    return list(self._tensors)

  def _tensor(self, name: str):
    try:
      return self._tensors[name]
    except KeyError:
      raise GGUFImportError(f"{self.path}: no tensor named {name!r}") from None

  def shape(self, name: str) -> tuple[int, ...]:
    """HF shape (ggml lists dims innermost first: reversed)."""
    return tuple(int(n) for n in reversed(self._tensor(name).shape))

  def format(self, name: str) -> str:
    """``q8_0`` | ``q4_0`` | ``q4_1`` | ``f32`` | ``f16`` | ``bf16``, or another ggml type's
    name in lower case (``q6_k``...: `dequantized` reads it, `read` refuses it)."""
    t = self._tensor(name)
    return self._formats.get(t.tensor_type, t.tensor_type.name.lower())

  def tensor_formats(self) -> dict[str, str]:
    """{HF name: `format`}."""
    return {name: self.format(name) for name in self._tensors}

  def _heads(self, name: str) -> int:
    """Heads whose rows llama.cpp permuted (q_proj, k_proj), else 0."""
    if name.endswith("q_proj.weight"):
      return int(self.config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
      return int(self.config["num_key_value_heads"])
    return 0

  def read(self, name: str):
    """The tensor as the model holds it.

    Q8_0 / Q4_0 / Q4_1: a `QuantizedKernel` in Flax kernel orientation ``[K, N]``, each ggml row
    one kernel column: a Linear weight ``[N, K]`` gives its kernel ``[K, N]``, and
    ``model.embed_tokens.weight`` ``[V, D]`` gives ``[D, V]`` (column v: token v's embedding).
    q_proj / k_proj columns are back in HF order (llama.cpp's RoPE row permutation undone, whole
    rows at a time, so the blocks are unchanged). F32 / F16 / BF16: f32 numpy in HF layout.

    Raises:
      GGUFImportError: another ggml type (K-quants, ...), or a quantized tensor that is not 2-D.
    """
    fmt = self.format(name)
    if fmt in ("f32", "f16", "bf16"):
      return self.dequantized(name)
    shape = self.shape(name)
    if fmt not in blocks.FORMATS:
      raise GGUFImportError(
        f"{self.path}: tensor {name!r} is ggml type {fmt.upper()}: only Q8_0, Q4_0, Q4_1, F32, "
        "F16 and BF16 are read without dequantizing")
    if len(shape) != 2:
      raise GGUFImportError(f"{self.path}: tensor {name!r} ({fmt}) is {len(shape)}-D, not 2-D")
    n, k = shape
    qk = blocks.from_ggml_rows(self._stored(name), fmt, (k, n))
    heads = self._heads(name)
    if heads:
      file_order = permute_rows(np.arange(n), heads)  # file row r holds HF row file_order[r]
      qk = blocks.permute_columns(qk, np.argsort(file_order))
    return qk

  def _stored(self, name: str) -> np.ndarray:
    """The tensor's stored bytes as a fresh array shaped like the reader's view of them, read
    with one positioned read: touching them through the file's memory map instead kept every
    page read resident (file-backed RSS) while the model loaded, the size of the whole file on
    top of the weights (`bench/results/engine/memory.md`)."""
    t = self._tensor(name)
    out = np.empty(t.data.shape, t.data.dtype)  # the view's shape only: no page is touched
    view = memoryview(out.reshape(-1).view(np.uint8))
    if len(view) != int(t.n_bytes):
      raise GGUFImportError(f"{self.path}: tensor {name!r} has {t.n_bytes} bytes, its shape "
                            f"implies {len(view)}")
    fd = os.open(self.path, os.O_RDONLY)
    try:
      done = 0
      while done < len(view):
        got = os.preadv(fd, [view[done:]], int(t.data_offset) + done)
        if got <= 0:
          raise GGUFImportError(f"{self.path}: unexpected end of file reading {name!r}")
        done += got
    finally:
      os.close(fd)
    gguf_validate.check_values(self.path, name, self.format(name), out)
    return out

  def dequantized(self, name: str) -> np.ndarray:
    """f32 numpy in HF layout: exactly what `gguf_import.write_hf_checkpoint` writes."""
    import gguf

    t = self._tensor(name)
    w = np.asarray(gguf.dequantize(self._stored(name), t.tensor_type), dtype=np.float32)
    w = w.reshape(self.shape(name))
    heads = self._heads(name)
    if heads:
      w = unpermute_rows(w, heads)
    return np.ascontiguousarray(w)

  def fingerprint(self) -> str:
    """sha256 over every tensor's GGUF name, ggml type, shape and stored bytes (streamed)."""
    h = hashlib.sha256()
    for t in self._reader.tensors:
      h.update(f"{t.name}|{t.tensor_type.name}|{[int(s) for s in t.shape]}|".encode())
      flat = t.data.reshape(-1).view(np.uint8)
      fmt = self._formats.get(t.tensor_type, t.tensor_type.name.lower())
      step = _HASH_CHUNK // 3060 * 3060  # whole blocks of every checked format (34, 18, 20 B)
      for i in range(0, flat.size, step):
        chunk = np.ascontiguousarray(flat[i:i + step])
        gguf_validate.check_values(self.path, hf_tensor_name(t.name), fmt, chunk)
        h.update(memoryview(chunk))
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
  """The sha256 of the whole file (read in blocks)."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_HASH_CHUNK):
      h.update(block)
  return h.hexdigest()


def open_gguf_base(path: str | os.PathLike) -> GGUFBase:
  """The GGUF file at ``path`` (llama architecture; `gguf_import.hf_config`'s checks)."""
  return GGUFBase(path)


def write_metadata_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
  """Writes ``out_dir``: config.json, generation_config.json, tokenizer.json,
  tokenizer_config.json (as `gguf_import.write_hf_checkpoint` writes them) and
  ``gguf_base.json`` = {"gguf": absolute path, "size": bytes, "sha256": the file's sha256,
  "fingerprint", "formats"}; no
  weights. Built in a temporary directory beside ``out_dir`` and renamed into place; an existing
  metadata directory there is replaced, anything else refused (`FileExistsError`)."""
  base = open_gguf_base(gguf_path)
  out = Path(out_dir)
  made_parent = not out.parent.exists()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
  try:
    gguf_import.write_config_files(base._reader, tmp)
    lineage_record.record_from_file(base._reader, tmp, base.path.name)  # quantize's source
    gguf_import.dump_json(tmp / GGUF_BASE_FILE, {
      "gguf": str(base.path.resolve()),
      "size": base.path.stat().st_size,
      "sha256": file_sha256(base.path),
      "fingerprint": base.fingerprint(),
      "formats": base.tensor_formats(),
    })
    _swap_in(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if made_parent:  # a refused file leaves nothing in the cache
      try:
        out.parent.rmdir()
      except OSError:
        pass
    raise
  return out


def _swap_in(tmp: Path, out: Path) -> None:
  old = None
  if out.exists():
    if not (out / GGUF_BASE_FILE).is_file() and any(out.iterdir()):
      raise FileExistsError(f"{out}: exists and is not a GGUF metadata directory (not replaced)")
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    try:
      os.rename(out, old)
    except FileNotFoundError:  # another process moved it meanwhile
      old = None
  try:
    os.rename(tmp, out)
  except OSError:
    if not (out / GGUF_BASE_FILE).is_file():  # not a concurrent writer's complete copy
      raise
    shutil.rmtree(tmp, ignore_errors=True)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
