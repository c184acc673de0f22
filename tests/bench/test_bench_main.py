"""`python -m bench list` names every bench with a description, and each one imports (one
subprocess for all of them: imports only, nothing compiled or run)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, **kw)


def test_list_names_every_bench_and_each_imports_with_a_main():
  from bench.__main__ import benches

  listed = _run("-m", "bench", "list")
  assert listed.returncode == 0, listed.stderr
  found = benches()
  names = [b.name for b in found]
  assert len(names) == len(set(names)) >= 30  # `python -m bench NAME` needs unique names
  for b in found:
    assert b.description, f"{b.module} has no docstring"
    assert f"  {b.name} " in listed.stdout and b.description in listed.stdout
  # every module of every area folder (helpers too) is listed or is a helper without main
  on_disk = {p.stem for p in (ROOT / "bench").glob("*/*.py") if p.parent.name != "common"}
  assert set(names) <= on_disk and {"gpu_prefill"} >= on_disk - set(names) - {"__init__"}
  code = ("import importlib\n"
          f"for m in {[b.module for b in found]!r}:\n"
          "  assert callable(importlib.import_module(m).main), m\n"
          "print('ok')")
  imported = _run("-c", code, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert imported.returncode == 0 and imported.stdout.strip() == "ok", imported.stderr[-3000:]


def test_an_unknown_name_says_how_to_list():
  r = _run("-m", "bench", "no_such_bench")
  assert r.returncode != 0 and "python -m bench list" in r.stderr
