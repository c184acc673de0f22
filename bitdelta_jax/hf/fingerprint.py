"""The fingerprint of a base checkpoint: what a delta records of the base it was made against.

    fp = fingerprint_checkpoint(base_dir)   # {"tensors": {name: {shape, dtype, crc32}}, "digest"}

Every tensor's shape, dtype and crc32 (read in row blocks of ≤ `CHUNK_BYTES`); ``digest``
hashes them all. A GGUF base's tensors are its dequantized values (`GGUFCheckpoint`), its file
and formats are recorded beside them (``quantization``), and the checkpoint it was quantized
from, if known (`bitdelta_jax.hf.lineage`), as ``source``. `bitdelta_jax.delta.store.check_base`
compares a delta's manifest against it.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from bitdelta_jax.hf.checkpoints import open_checkpoint
from bitdelta_jax.hf.gguf_checkpoint import is_gguf_dir, quantization, resolve_base
from bitdelta_jax.hf.lineage_record import source_of

CHUNK_BYTES = 32 << 20


class Crc:
  """A crc32 accumulated over arrays (their bytes, in order): a tensor read in row blocks."""

  def __init__(self):
    self.value = 0

  def update(self, a: np.ndarray):
    self.value = zlib.crc32(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)), self.value)


def fingerprint(tensors: Mapping[str, tuple[tuple[int, ...], str, int | None]], *,
                quantization: dict | None = None) -> dict:
  """A base fingerprint from ``{name: (shape, dtype, crc32)}``; ``digest`` hashes it all.

  ``quantization`` (a GGUF base: its file and formats, `gguf_checkpoint.quantization`) is
  recorded beside the tensors for the error messages; the tensors of such a base are its
  dequantized values, so it takes no part in the digest."""
  entries = {n: {"shape": list(s), "dtype": d, "crc32": c} for n, (s, d, c) in sorted(tensors.items())}
  digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()
  out = {"tensors": entries, "digest": digest}
  if quantization:
    out["quantization"] = quantization
  return out


def fingerprint_checkpoint(base_dir, *, content: bool = True) -> dict:
  """The fingerprint of an HF base directory (reads every tensor when ``content``).

  A GGUF base's content fingerprint (every tensor dequantized) is computed once per file and
  kept in its metadata directory (which is keyed by the file's path, size and mtime)."""
  base_dir = resolve_base(base_dir)
  cached = Path(base_dir) / "dequantized_fingerprint.json"
  if content and cached.is_file():
    fp = json.loads(cached.read_text())
  else:
    fp = _fingerprint_tensors(base_dir, content)
    if content and is_gguf_dir(base_dir):
      tmp = cached.with_suffix(".tmp")
      tmp.write_text(json.dumps(fp))
      tmp.replace(cached)
  return with_source(fp, base_dir)


def with_source(fp: dict, base_dir) -> dict:
  """``fp`` with the GGUF base's source (`bitdelta_jax.hf.lineage`), if one is known:
  ``"source": {"name", "digest", "how"}``, what lets a delta made against that source load."""
  src = source_of(base_dir) if is_gguf_dir(base_dir) else None
  if src:
    fp = {**fp, "source": {"name": src["name"], "digest": src["fingerprint"]["digest"],
                           "how": src["how"]}}
  return fp


def _fingerprint_tensors(base_dir: Path, content: bool) -> dict:
  with open_checkpoint(base_dir) as r:
    ent = {}
    for n in r.names():
      t = r.info(n)
      c = None
      if content:
        crc = Crc()
        shape = t.shape or (1,)
        row = max(1, int(np.prod(shape[1:])) * t.dtype.itemsize)
        step = max(1, min(shape[0], CHUNK_BYTES // row))
        for r0 in range(0, shape[0], step):
          crc.update(r.read_rows(n, r0, r0 + step))
        c = crc.value
      ent[n] = (t.shape, t.dtype.name, c)
  return fingerprint(ent, quantization=quantization(base_dir))
