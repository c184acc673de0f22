"""Where a GGUF base's source (the checkpoint it was quantized from) is recorded, and read.

``bitdelta quantize`` writes the source's content fingerprint into the file's metadata
(`SOURCE_KEY`: the JSON of `bitdelta_jax.hf.fingerprint.fingerprint`, `SOURCE_NAME_KEY`: the
source's directory name); `record_from_file` copies it into the file's metadata directory when
that is first made. `bitdelta_jax.hf.lineage.establish` records one it has checked there too
(`write_source`). Either way `source_of` reads it back (`SOURCE_FILE`). What a source is for:
`bitdelta_jax.hf.lineage`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SOURCE_KEY = "bitdelta.source.fingerprint"
SOURCE_NAME_KEY = "bitdelta.source.name"
SOURCE_FILE = "source.json"


def source_of(base_dir: str | os.PathLike) -> dict | None:
  """A GGUF base directory's source: ``{"name", "fingerprint", "how"}``, else None (an HF
  base, or a GGUF whose source is unknown)."""
  p = Path(base_dir) / SOURCE_FILE
  if not p.is_file():
    return None
  return json.loads(p.read_text())


def write_source(base_dir: Path, record: dict) -> None:
  """Records ``record`` as ``base_dir``'s source (atomically: a reader sees it whole or not)."""
  tmp = base_dir / f".{SOURCE_FILE}.{os.getpid()}.tmp"
  tmp.write_text(json.dumps(record))
  tmp.replace(base_dir / SOURCE_FILE)


def record_from_file(reader, out_dir: Path, file_name: str) -> None:
  """Copies the source fingerprint ``bitdelta quantize`` wrote into a GGUF (``reader``: its
  `gguf.GGUFReader`) into the metadata directory being built at ``out_dir``."""
  field = reader.fields.get(SOURCE_KEY)
  if field is None:
    return
  fp = json.loads(bytes(field.parts[field.data[0]]).decode())
  name_field = reader.fields.get(SOURCE_NAME_KEY)
  name = bytes(name_field.parts[name_field.data[0]]).decode() if name_field else "?"
  write_source(Path(out_dir), {"name": name, "fingerprint": fp,
                               "how": f"recorded in {file_name} by bitdelta quantize"})


def forget(base_dir: str | os.PathLike) -> None:
  """Removes a recorded source (tests, and a user who re-quantized in place)."""
  p = Path(base_dir) / SOURCE_FILE
  if p.is_file():
    p.unlink()
