"""Output directories that never lose data: refuse what is not ours, write beside, swap in.

Every command that writes a directory (`compress`, `apply`, `merge`, `distill`, `zoo build`)
goes through `atomic_output_dir`:

* An existing target is replaced only if it is recognisably an output of the same kind, and
  only with ``overwrite``. A regular file, a symbolic link, a directory of another kind, or a
  non-empty directory of unrelated files is refused with `OutputError` and left untouched. An
  empty directory is filled without ``overwrite`` (there is nothing in it to lose).
* What counts as "ours": every output we write carries a marker file `MARKER`
  (``.bitdelta-output.json``, ``{"kind": ...}``). A delta store is also recognised by its
  ``manifest.json`` (stores written before the marker existed), and a model family by its
  ``family.json``. An HF checkpoint directory is recognised *only* by the marker: a
  ``config.json`` + ``*.safetensors`` directory may be the user's original fine-tune, and
  guessing wrong there is exactly the data loss this module prevents. A checkpoint written
  by an older version (no marker) must be removed by hand.
* The output is written into a hidden temporary directory beside the target,
  ``.bitdelta-tmp-<name>-<pid>@<host>-<hex>``, fsynced, then swapped in: the old target is
  renamed aside (``.bitdelta-old-<name>-<pid>@<host>-<hex>``), the new one renamed in, and the old one deleted
  only after that succeeded. On an error the temporary directory is removed.
* A process killed with ``kill -9`` leaves its temporary directory behind; the next run that
  writes beside the same target removes temporaries of dead processes of this host (and, if the
  kill hit between the two renames, puts the old target back). Temporaries of other hosts on a
  shared file system are left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

MARKER = ".bitdelta-output.json"
TMP_PREFIX = ".bitdelta-tmp-"
OLD_PREFIX = ".bitdelta-old-"
KINDS = ("delta", "checkpoint", "family", "adapter")
_KIND_WORDS = {"delta": "a bitdelta delta store", "adapter": "a PEFT adapter written by bitdelta",
               "checkpoint": "an HF checkpoint written by bitdelta",
               "family": "a bitdelta model family"}
_SIDE = re.compile(
  r"^\.bitdelta-(?P<what>tmp|old)-(?P<name>.+)-(?P<pid>\d+)@(?P<host>[A-Za-z0-9._\-]*)-[0-9a-f]{8}$")
# The host is part of a temporary's name: on a shared file system, a process id says nothing
# about another machine's processes, so only this host's temporaries are ever cleaned.
HOST = re.sub(r"[^A-Za-z0-9.\-]", "_", socket.gethostname())[:32]


class OutputError(ValueError):
  """An output path cannot be written without destroying something that is not ours."""


def _read_json(p: Path) -> dict | None:
  try:
    v = json.loads(p.read_text())
  except (OSError, ValueError):
    return None
  return v if isinstance(v, dict) else None


def output_kind(path: str | os.PathLike) -> str | None:
  """The kind of bitdelta output at ``path`` ("delta", "checkpoint", "family"), else None."""
  p = Path(path)
  if p.is_symlink() or not p.is_dir():
    return None
  marker = _read_json(p / MARKER)
  if marker is not None and marker.get("kind") in KINDS:
    return marker["kind"]
  manifest = _read_json(p / "manifest.json")
  if manifest is not None and manifest.get("format") == "bitdelta-jax-delta":
    return "delta"
  family = _read_json(p / "family.json")
  if family is not None and "variants" in family and "base" in family:
    return "family"
  return None


def describe(path: str | os.PathLike) -> str:
  """What is at ``path``, in words (for error messages)."""
  p = Path(path)
  if p.is_symlink():
    return "a symbolic link"
  if not p.exists():
    return "nothing"
  if not p.is_dir():
    return "a regular file" if p.is_file() else "not a directory"
  kind = output_kind(p)
  if kind is not None:
    return _KIND_WORDS[kind]
  if not any(p.iterdir()):
    return "an empty directory"
  return "a directory that is not a bitdelta output"


def check_output(path: str | os.PathLike, *, kind: str, overwrite: bool) -> None:
  """Raises `OutputError` unless ``path`` may be written as a ``kind`` output."""
  if kind not in KINDS:
    raise ValueError(f"unknown output kind {kind!r} (one of {KINDS})")
  p = Path(path)
  if not p.exists() and not p.is_symlink():
    return
  what = describe(p)
  if what == "an empty directory":
    return
  if output_kind(p) != kind:
    raise OutputError(f"{p}: refusing to replace {what} (expected {_KIND_WORDS[kind]} or a "
                      "path that does not exist); nothing was written")
  if not overwrite:
    raise OutputError(f"{p}: output already exists ({what}); use --overwrite to replace it")


def _pid_alive(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def clean_stale(path: str | os.PathLike) -> list[Path]:
  """Removes temporaries of dead processes beside ``path``; returns what it removed.

  If ``path`` is missing and an old copy set aside by a dead process exists, that copy is put
  back instead of removed (the process died between its two renames).
  """
  p = Path(path)
  parent = p.parent
  if not parent.is_dir():
    return []
  removed = []
  for side in sorted(parent.iterdir()):
    m = _SIDE.match(side.name)
    if not m or m["name"] != p.name or m["host"] != HOST or _pid_alive(int(m["pid"])):
      continue
    if m["what"] == "old" and not p.exists() and not p.is_symlink():
      os.rename(side, p)
      continue
    if side.is_dir() and not side.is_symlink():
      shutil.rmtree(side, ignore_errors=True)
    else:
      side.unlink(missing_ok=True)
    removed.append(side)
  return removed


def _fsync(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(root: Path) -> None:
  for dirpath, _, files in os.walk(root):
    for f in files:
      _fsync(Path(dirpath) / f)
    _fsync(Path(dirpath))


def side_name(p: Path, what: str, pid: int | None = None) -> Path:
  """``.bitdelta-<what>-<name>-<pid>@<host>-<random>`` beside ``p`` (what: "tmp" or "old")."""
  pid = os.getpid() if pid is None else pid
  return p.parent / f".bitdelta-{what}-{p.name}-{pid}@{HOST}-{uuid.uuid4().hex[:8]}"


class OutputDir:
  """A directory written under a temporary name beside ``path`` and swapped in on `commit`.

  Use `atomic_output_dir` unless the commit must happen at a chosen point inside the block.
  """

  def __init__(self, path: str | os.PathLike, *, kind: str, overwrite: bool = False):
    self.out = Path(path)
    self.kind = kind
    clean_stale(self.out)
    check_output(self.out, kind=kind, overwrite=overwrite)
    self.out.parent.mkdir(parents=True, exist_ok=True)
    self.tmp = side_name(self.out, "tmp")
    self.tmp.mkdir()
    self.done = False

  def commit(self) -> Path:
    """Writes the marker, fsyncs, and swaps the new directory in place of the old."""
    from bitdelta_jax import __version__

    (self.tmp / MARKER).write_text(json.dumps({"kind": self.kind, "written_by":
                                               f"bitdelta-jax {__version__}"}) + "\n")
    fsync_tree(self.tmp)
    old = None
    if self.out.exists():
      old = side_name(self.out, "old")
      os.rename(self.out, old)
    try:
      os.rename(self.tmp, self.out)
    except OSError:
      if old is not None:
        os.rename(old, self.out)
      raise
    _fsync(self.out.parent)
    self.done = True
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    return self.out

  def abort(self) -> None:
    if not self.done:
      shutil.rmtree(self.tmp, ignore_errors=True)

  def __enter__(self) -> OutputDir:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self.abort()


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, kind: str,
                      overwrite: bool = False) -> Iterator[Path]:
  """Yields a temporary directory to fill; on a clean exit it replaces ``path`` atomically.

  Refuses (`OutputError`, before anything is written) when ``path`` holds anything but a
  ``kind`` output, or holds one and ``overwrite`` is false. On an exception nothing changes.
  """
  with OutputDir(path, kind=kind, overwrite=overwrite) as out:
    yield out.tmp
    out.commit()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
  """Writes one file by writing a temporary sibling and renaming it over ``path``.

  Refuses to replace a directory or a symbolic link.
  """
  p = Path(path)
  if p.is_symlink() or (p.exists() and not p.is_file()):
    raise OutputError(f"{p}: refusing to replace {describe(p)} with a file")
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = side_name(p, "tmp")
  try:
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, p)
  finally:
    tmp.unlink(missing_ok=True)
  return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
  return atomic_write_bytes(path, text.encode())
