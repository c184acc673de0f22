"""A GGUF file checked before anything is allocated from it (issue 50 item 1).

`check_file(path)` walks the header itself, with every count, string length, array length and
dimension bounded by the bytes left in the file, before `gguf.GGUFReader` (which trusts the
header: a tensor count of 2^62 or a key length of 2^40 fails deep inside it, or allocates) is
ever built; then every tensor's ggml type must be one the `gguf` package knows, its byte range
(offset, and the size its type and shape imply) inside the file, and no two ranges overlap (a
header that calls a Q4_1 tensor Q6_K claims more bytes than it has: it runs into the next).
`check_values(name, fmt, raw)` checks what a tensor's bytes hold as they are read: block scales
(and minimums) finite for Q8_0 / Q4_0 / Q4_1, every value finite for F32 / F16 / BF16 (one
+inf scale made a served model answer empty texts). Both raise `GGUFImportError` naming the
file, the tensor and the problem.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from bitdelta_jax.hf.gguf_names import GGUFImportError

_MAGIC = b"GGUF"
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type → bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class _Cursor:
  def __init__(self, f, size: int, path: Path):
    self.f, self.size, self.path, self.pos = f, size, path, 0

  def take(self, n: int, what: str) -> bytes:
    if n < 0 or self.pos + n > self.size:
      raise GGUFImportError(f"{self.path}: malformed GGUF header: {what} needs {n} bytes at "
                            f"offset {self.pos}, past the end of the {self.size}-byte file")
    self.f.seek(self.pos)
    b = self.f.read(n)
    self.pos += n
    return b

  def u32(self, what: str) -> int:
    return struct.unpack("<I", self.take(4, what))[0]

  def u64(self, what: str) -> int:
    return struct.unpack("<Q", self.take(8, what))[0]

  def string(self, what: str) -> bytes:
    n = self.u64(f"the length of {what}")
    if n > self.size - self.pos:
      raise GGUFImportError(f"{self.path}: malformed GGUF header: {what} claims {n} bytes, the "
                            f"file has {self.size - self.pos} left")
    return self.take(n, what)


def _value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> object:
  if vtype in _SCALAR:
    raw = c.take(_SCALAR[vtype], f"the value of {key!r}")
    return raw
  if vtype == _STRING:
    return c.string(f"the string value of {key!r}")
  if vtype == _ARRAY and depth == 0:
    etype = c.u32(f"the element type of {key!r}")
    n = c.u64(f"the length of array {key!r}")
    if etype in _SCALAR:
      c.take(n * _SCALAR[etype], f"the {n} elements of {key!r}")
      return None
    if etype == _STRING:
      if n > (c.size - c.pos) // 8:  # each string has at least its 8-byte length
        raise GGUFImportError(f"{c.path}: malformed GGUF header: array {key!r} claims {n} "
                              f"strings, the file has {c.size - c.pos} bytes left")
      for i in range(n):
        c.string(f"element {i} of {key!r}")
      return None
    raise GGUFImportError(f"{c.path}: malformed GGUF header: array {key!r} has element type "
                          f"{etype}")
  raise GGUFImportError(f"{c.path}: malformed GGUF header: key {key!r} has value type {vtype}")


def check_file(path: str | os.PathLike) -> None:
  """Raises `GGUFImportError` naming ``path`` unless it is a GGUF file whose header is sound and
  whose tensors' types and byte ranges fit the file (module docstring)."""
  import gguf

  path = Path(path)
  if path.is_dir():
    raise GGUFImportError(f"{path}: is a directory, not a GGUF file")
  if not path.exists():
    raise GGUFImportError(f"{path}: no such GGUF file")
  size = path.stat().st_size
  if size == 0:
    raise GGUFImportError(f"{path}: the file is empty, not a GGUF file")
  with open(path, "rb") as f:
    c = _Cursor(f, size, path)
    if c.take(4, "the magic") != _MAGIC:
      raise GGUFImportError(f"{path}: not a GGUF file (no GGUF magic at its start)")
    version = c.u32("the version")
    if version not in (2, 3):
      raise GGUFImportError(f"{path}: GGUF version {version}: only versions 2 and 3 are read")
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the key count")
    # each key-value pair takes >= 12 bytes (length + type), each tensor entry >= 24
    if n_kv > size // 12 or n_tensors > size // 24:
      raise GGUFImportError(f"{path}: malformed GGUF header: {n_tensors} tensors and {n_kv} "
                            f"keys cannot fit in {size} bytes")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
      key = c.string("a key").decode("utf-8", "replace")
      vtype = c.u32(f"the type of {key!r}")
      v = _value(c, vtype, key)
      if key == "general.alignment" and vtype == _UINT32:
        alignment = struct.unpack("<I", v)[0]
        if alignment == 0 or alignment & (alignment - 1):
          raise GGUFImportError(f"{path}: general.alignment {alignment} is not a power of two")
    tensors = []
    for i in range(n_tensors):
      name = c.string(f"the name of tensor {i}").decode("utf-8", "replace")
      n_dims = c.u32(f"the rank of {name!r}")
      if not 1 <= n_dims <= _MAX_DIMS:
        raise GGUFImportError(f"{path}: tensor {name!r} has {n_dims} dimensions (1-{_MAX_DIMS})")
      dims = [c.u64(f"dimension {j} of {name!r}") for j in range(n_dims)]
      ttype = c.u32(f"the type of {name!r}")
      offset = c.u64(f"the offset of {name!r}")
      try:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
      except (ValueError, KeyError):
        raise GGUFImportError(f"{path}: tensor {name!r} has ggml type {ttype}, which is not a "
                              "known type") from None
      elements = 1
      for dim in dims:
        if dim == 0 or dim > size * 8:  # no tensor of this file can have more elements
          raise GGUFImportError(f"{path}: tensor {name!r} has dimensions {dims}, impossible for "
                                f"a {size}-byte file")
        elements *= dim
      if dims[0] % block:
        raise GGUFImportError(f"{path}: tensor {name!r} ({qtype.name}) has rows of {dims[0]} "
                              f"values, not a multiple of its {block}-value blocks")
      nbytes = elements // block * type_size
      tensors.append((offset, nbytes, name, qtype.name))
    data_start = -(-c.pos // alignment) * alignment
    end_prev, prev = 0, None
    for offset, nbytes, name, tname in sorted(tensors):
      start = data_start + offset
      if start + nbytes > size:
        raise GGUFImportError(
          f"{path}: tensor {name!r} ({tname}, {nbytes} bytes at offset {start}) runs past the end "
          f"of the {size}-byte file (truncated, or its header names the wrong type or shape)")
      if start < end_prev:
        raise GGUFImportError(
          f"{path}: tensors {prev!r} and {name!r} overlap in the file (a header that names the "
          f"wrong type or shape for {prev!r})")
      end_prev, prev = start + nbytes, name


def check_values(path, name: str, fmt: str, raw: np.ndarray) -> None:
  """Raises `GGUFImportError` if tensor ``name``'s stored bytes ``raw`` (format ``fmt``) hold a
  non-finite block scale or minimum (Q8_0 / Q4_0 / Q4_1) or value (F32 / F16 / BF16)."""
  flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
  from pallas_kernels.quant_matmul.formats import FORMATS

  if fmt in FORMATS:
    size, has_m = FORMATS[fmt].block_bytes, FORMATS[fmt].has_min
    b = flat.reshape(-1, size)
    scales = [("scale", np.ascontiguousarray(b[:, 0:2]).view(np.float16))]
    if has_m:
      scales.append(("minimum", np.ascontiguousarray(b[:, 2:4]).view(np.float16)))
    for what, v in scales:
      bad = ~np.isfinite(v.reshape(-1))
      if bad.any():
        i = int(np.argmax(bad))
        raise GGUFImportError(f"{path}: tensor {name!r} ({fmt}): block {i} has a non-finite "
                              f"{what} ({v.reshape(-1)[i]}); {int(bad.sum())} such block(s)")
    return
  if fmt in ("f32", "f16", "bf16"):
    if fmt == "bf16":
      v = (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
      v = flat.view(np.float32 if fmt == "f32" else np.float16)
    bad = ~np.isfinite(v)
    if bad.any():
      i = int(np.argmax(bad))
      raise GGUFImportError(f"{path}: tensor {name!r} ({fmt}): value {i} is {v[i]}; "
                            f"{int(bad.sum())} non-finite value(s)")
