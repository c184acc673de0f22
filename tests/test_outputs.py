"""`bitdelta_jax.outputs`: refuse what is not ours, swap atomically, clean up after kill -9."""

import json
import os
import subprocess
import sys

import pytest

from bitdelta_jax.outputs import (
  HOST,
  MARKER,
  OutputError,
  atomic_output_dir,
  atomic_write_text,
  clean_stale,
  output_kind,
)


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_new_output_is_written_with_marker(tmp_path):
  out = tmp_path / "d"
  with atomic_output_dir(out, kind="checkpoint") as tmp:
    assert tmp.parent == tmp_path and tmp.name.startswith(".bitdelta-tmp-d-")
    (tmp / "a.txt").write_text("x")
  assert (out / "a.txt").read_text() == "x"
  assert json.loads((out / MARKER).read_text())["kind"] == "checkpoint"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_regular_file_is_refused_even_with_overwrite(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  with pytest.raises(OutputError, match="regular file"):
    with atomic_output_dir(victim, kind="delta", overwrite=True):
      raise AssertionError("not reached")
  assert victim.read_text() == "precious"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_unrelated_directory_is_refused(tmp_path):
  d = tmp_path / "mine"
  d.mkdir()
  (d / "thesis.tex").write_text("precious")
  for kind in ("delta", "checkpoint", "family"):
    with pytest.raises(OutputError, match="not a bitdelta output"):
      with atomic_output_dir(d, kind=kind, overwrite=True):
        pass
  assert (d / "thesis.tex").read_text() == "precious"


def test_other_kind_is_refused(tmp_path):
  d = tmp_path / "ckpt"
  with atomic_output_dir(d, kind="checkpoint"):
    pass
  with pytest.raises(OutputError, match="HF checkpoint written by bitdelta"):
    with atomic_output_dir(d, kind="delta", overwrite=True):
      pass
  assert output_kind(d) == "checkpoint"


def test_same_kind_needs_overwrite_and_then_replaces(tmp_path):
  d = tmp_path / "ckpt"
  with atomic_output_dir(d, kind="checkpoint") as tmp:
    (tmp / "old.txt").write_text("1")
  with pytest.raises(OutputError, match="--overwrite"):
    with atomic_output_dir(d, kind="checkpoint"):
      pass
  with atomic_output_dir(d, kind="checkpoint", overwrite=True) as tmp:
    (tmp / "new.txt").write_text("2")
  assert sorted(p.name for p in d.iterdir()) == [MARKER, "new.txt"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_legacy_delta_store_without_marker_is_recognised(tmp_path):
  d = tmp_path / "delta"
  d.mkdir()
  (d / "manifest.json").write_text(json.dumps({"format": "bitdelta-jax-delta"}))
  assert output_kind(d) == "delta"
  with atomic_output_dir(d, kind="delta", overwrite=True) as tmp:
    (tmp / "manifest.json").write_text("{}")
  assert (d / "manifest.json").read_text() == "{}"


def test_error_inside_leaves_old_output_and_no_temporaries(tmp_path):
  d = tmp_path / "ckpt"
  with atomic_output_dir(d, kind="checkpoint") as tmp:
    (tmp / "old.txt").write_text("1")
  with pytest.raises(RuntimeError):
    with atomic_output_dir(d, kind="checkpoint", overwrite=True) as tmp:
      (tmp / "half.txt").write_text("2")
      raise RuntimeError("boom")
  assert (d / "old.txt").read_text() == "1" and not (d / "half.txt").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_empty_directory_is_filled_without_overwrite(tmp_path):
  d = tmp_path / "empty"
  d.mkdir()
  with atomic_output_dir(d, kind="delta") as tmp:
    (tmp / "x").write_text("1")
  assert (d / "x").exists()


def test_orphan_of_dead_pid_is_removed_live_one_kept(tmp_path):
  dead = _dead_pid()
  orphan = tmp_path / f".bitdelta-tmp-out-{dead}@{HOST}-0123abcd"
  orphan.mkdir()
  (orphan / "big").write_text("x" * 100)
  live = tmp_path / f".bitdelta-tmp-out-{os.getppid()}@{HOST}-0123abcd"  # a running process
  live.mkdir()
  other = tmp_path / f".bitdelta-tmp-elsewhere-{dead}@{HOST}-0123abcd"  # beside another target
  other.mkdir()
  remote = tmp_path / f".bitdelta-tmp-out-{dead}@another-host-0123abcd"  # shared file system
  remote.mkdir()
  with atomic_output_dir(tmp_path / "out", kind="delta"):
    pass
  assert not orphan.exists() and live.exists() and other.exists() and remote.exists()


def test_old_copy_of_dead_pid_is_restored_when_target_missing(tmp_path):
  dead = _dead_pid()
  old = tmp_path / f".bitdelta-old-out-{dead}@{HOST}-0123abcd"
  old.mkdir()
  (old / "manifest.json").write_text(json.dumps({"format": "bitdelta-jax-delta"}))
  clean_stale(tmp_path / "out")
  assert (tmp_path / "out" / "manifest.json").exists() and not old.exists()


def test_atomic_write_text(tmp_path):
  f = tmp_path / "r" / "x.json"
  atomic_write_text(f, "1")
  atomic_write_text(f, "2")
  assert f.read_text() == "2" and sorted(p.name for p in f.parent.iterdir()) == ["x.json"]
  with pytest.raises(OutputError, match="directory"):
    atomic_write_text(tmp_path / "r", "3")
