"""Streaming safetensors reading and writing for Hugging Face checkpoint directories.

Reading memory-maps each file and hands out one tensor at a time, so a 70B checkpoint never
sits in memory whole. Writing streams tensors to disk in order (header first, sizes known up
front). bf16 is handled through `ml_dtypes`, which numpy lacks.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
  """A checkpoint directory or file is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class TensorInfo:
  name: str
  file: Path
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int  # absolute byte offset of the data in `file`
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def read_header(path: Path) -> tuple[dict, int]:
  """Returns the JSON header of a safetensors file and the offset where its data starts."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER or 8 + n > size:
      raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file is {size} bytes)")
    try:
      header = json.loads(f.read(n))
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
  return header, 8 + n


def _file_tensors(path: Path) -> list[TensorInfo]:
  header, data_start = read_header(path)
  size = path.stat().st_size
  out = []
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype = DTYPES[meta["dtype"]]
      shape = tuple(int(d) for d in meta["shape"])
      b, e = (int(o) for o in meta["data_offsets"])
    except (KeyError, TypeError, ValueError) as err:
      raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry: {err}") from None
    if e - b != int(np.prod(shape)) * dtype.itemsize or data_start + e > size:
      raise CheckpointError(
        f"{path}: tensor {name!r} ({meta['dtype']} {list(shape)}) has data offsets [{b}, {e}) "
        f"that do not fit the file ({size} bytes): the file is truncated or corrupt"
      )
    out.append(TensorInfo(name, path, dtype, shape, data_start + b, data_start + e))
  return out


class CheckpointReader:
  """Lazily reads tensors from an HF directory (single or sharded safetensors) or one file.

  `bitdelta_jax.hf.checkpoints.open_checkpoint` picks this or, for a GGUF base's directory, a
  `GGUFCheckpoint` (the same interface over its tensors dequantized to f32)."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    if not self.path.exists():
      raise CheckpointError(f"{self.path}: no such checkpoint directory or file")
    self.tensors: dict[str, TensorInfo] = {}
    for f in self._files():
      for t in _file_tensors(f):
        if t.name in self.tensors:
          raise CheckpointError(f"{f}: tensor {t.name!r} also appears in {self.tensors[t.name].file}")
        self.tensors[t.name] = t
    self._index_check()
    self._maps: dict[Path, mmap.mmap] = {}

  def _files(self) -> list[Path]:
    if self.path.is_file():
      return [self.path]
    index = self.path / INDEX_FILE
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: malformed index ({e})") from None
      files = sorted({self.path / f for f in weight_map.values()})
      missing = [str(f) for f in files if not f.exists()]
      if missing:
        raise CheckpointError(f"{index}: lists shard files that do not exist: {missing}")
      self._weight_map = weight_map
      return files
    files = sorted(self.path.glob("*.safetensors"))
    if not files:
      raise CheckpointError(f"{self.path}: no *.safetensors files (and no {INDEX_FILE})")
    return files

  def _index_check(self):
    wm = getattr(self, "_weight_map", None)
    if wm is None:
      return
    for name, fname in wm.items():
      t = self.tensors.get(name)
      if t is None or t.file.name != Path(fname).name:
        raise CheckpointError(
          f"{self.path / INDEX_FILE}: maps {name!r} to {fname}, but that file does not hold it"
        )

  def names(self) -> list[str]:
    return list(self.tensors)

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def info(self, name: str) -> TensorInfo:
    try:
      return self.tensors[name]
    except KeyError:
      raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

  def _map(self, file: Path) -> mmap.mmap:
    m = self._maps.get(file)
    if m is None:
      with open(file, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
      self._maps[file] = m
    return m

  def read(self, name: str, copy: bool = True) -> np.ndarray:
    """Reads one tensor into a fresh array (``copy=False``: a read-only memory-map view)."""
    t = self.info(name)
    if not copy:
      buf = self._map(t.file)
      arr = np.frombuffer(buf, dtype=t.dtype, count=t.nbytes // t.dtype.itemsize, offset=t.start)
      return arr.reshape(t.shape)
    return self.read_rows(name, 0, t.shape[0] if t.shape else 1).reshape(t.shape)

  def read_rows(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
    """Reads rows ``[start, stop)`` (axis 0) with one positioned read: no memory map, so the
    pages do not stay resident once the array is freed. ``out`` (a flat buffer of this dtype,
    reused across calls) avoids faulting in fresh pages for every block."""
    t = self.info(name)
    shape = t.shape if t.shape else (1,)
    row = int(np.prod(shape[1:])) * t.dtype.itemsize
    stop = min(stop, shape[0])
    rows = max(0, stop - start)
    count = rows * (row // t.dtype.itemsize if t.dtype.itemsize else 0)
    if out is not None and out.dtype == t.dtype and out.size >= count:
      arr = out.reshape(-1)[:count].reshape((rows, *shape[1:]))
    else:
      arr = np.empty((rows, *shape[1:]), t.dtype)
    view = memoryview(arr.reshape(-1).view(np.uint8))
    fd = self._fd(t.file)
    pos, done = t.start + start * row, 0
    while done < len(view):
      n = os.preadv(fd, [view[done:]], pos + done)
      if n <= 0:
        raise CheckpointError(f"{t.file}: unexpected end of file reading {name!r}")
      done += n
    return arr

  def _fd(self, file: Path) -> int:
    fds = self.__dict__.setdefault("_fds", {})
    if file not in fds:
      fds[file] = os.open(file, os.O_RDONLY)
    return fds[file]

  def items(self) -> Iterator[tuple[str, np.ndarray]]:
    for name in self.tensors:
      yield name, self.read(name)

  def close(self):
    for fd in self.__dict__.pop("_fds", {}).values():
      os.close(fd)
    for m in self._maps.values():
      try:
        m.close()
      except BufferError:  # a view is still alive; the OS frees the map with it
        pass
    self._maps.clear()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class SafetensorsWriter:
  """Writes one safetensors file tensor by tensor; the header is fixed from the specs first."""

  def __init__(self, path: str | os.PathLike, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]],
               metadata: Mapping[str, str] | None = None):
    self.path = Path(path)
    header: dict = {}
    if metadata:
      header["__metadata__"] = dict(metadata)
    offset = 0
    self._order = list(specs)
    self._specs = {}
    for name in self._order:
      shape, dtype = specs[name]
      dtype = np.dtype(dtype)
      nbytes = int(np.prod(shape)) * dtype.itemsize
      header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      self._specs[name] = (tuple(shape), dtype)
      offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    self._f = open(self.path, "wb")
    self._f.write(struct.pack("<Q", len(raw)) + raw)
    self._next = 0

  def write(self, name: str, array: np.ndarray):
    if self._next >= len(self._order) or self._order[self._next] != name:
      want = self._order[self._next] if self._next < len(self._order) else None
      raise ValueError(f"{self.path}: expected tensor {want!r} next, got {name!r}")
    shape, dtype = self._specs[name]
    array = np.ascontiguousarray(array, dtype=dtype)
    if array.shape != shape:
      raise ValueError(f"{self.path}: tensor {name!r} has shape {array.shape}, declared {shape}")
    self._f.write(memoryview(array.reshape(-1).view(np.uint8)))
    self._next += 1

  def close(self):
    if self._next != len(self._order):
      self._f.close()
      raise ValueError(f"{self.path}: closed after {self._next} of {len(self._order)} tensors")
    self._f.flush()
    os.fsync(self._f.fileno())
    self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is None:
      self.close()
    else:
      self._f.close()


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None):
  """Writes a dict of numpy arrays as one safetensors file."""
  specs = {k: (tuple(v.shape), np.asarray(v).dtype) for k, v in tensors.items()}
  with SafetensorsWriter(path, specs, metadata or {"format": "pt"}) as w:
    for k, v in tensors.items():
      w.write(k, np.asarray(v))


def save_sharded(tensors: Mapping[str, np.ndarray], directory: str | os.PathLike,
                 max_shard_bytes: int) -> list[Path]:
  """Writes ``model-0000i-of-0000n.safetensors`` shards and the index, as HF does."""
  directory = Path(directory)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for k, v in tensors.items():
    if shards[-1] and size + v.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][k] = v
    size += v.nbytes
  n = len(shards)
  weight_map, paths = {}, []
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    save_file(shard, directory / fname)
    paths.append(directory / fname)
    weight_map.update({k: fname for k in shard})
  total = sum(v.nbytes for v in tensors.values())
  (directory / INDEX_FILE).write_text(
    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
  )
  return paths
