"""Every BITDELTA_* variable is declared once (pallas_kernels/settings.py), read through it,
parsed with an error naming it, listed in the README, and only the traced ones key a compiled
step program."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pallas_kernels import settings

ROOT = Path(__file__).resolve().parents[1]
# not after "-D": a C++ macro defined on a compiler command line is not a variable
NAME = re.compile(r"(?<!-D)BITDELTA_[A-Z0-9_]*[A-Z0-9]")


def _sources(*suffixes):
  for top in ("bitdelta_jax", "serving", "pallas_kernels", "bench"):
    for p in (ROOT / top).rglob("*"):
      if p.suffix in suffixes and p.is_file():
        yield p


def test_every_variable_the_code_names_is_declared():
  named = {}
  native = re.compile(r"getenv\(\"(BITDELTA_[A-Z0-9_]+)\"\)")  # (C++ macros are not variables)
  for p in _sources(".py", ".sh", ".md", ".cc", ".h"):
    text = p.read_text(errors="replace")
    found = native.findall(text) if p.suffix in (".cc", ".h") else NAME.findall(text)
    for n in found:
      if n != "BITDELTA_TEST" and not n.startswith("BITDELTA_TEST_"):  # the suite's harness
        named.setdefault(n, p.relative_to(ROOT))
  assert "BITDELTA_CPU_SPIN_US" in named  # the native pool's, found
  undeclared = {n: str(p) for n, p in named.items() if n not in settings.SETTINGS}
  assert not undeclared, undeclared
  assert len(settings.SETTINGS) >= 19


def test_python_reads_them_only_through_settings():
  reads = re.compile(r"(environ\.get|getenv|environ\[)\(?\s*[\"']BITDELTA_")
  offenders = [str(p.relative_to(ROOT)) for p in _sources(".py")
               if p.name != "settings.py" and p.parts[-2:] != ("pallas_kernels", "settings.py")
               and reads.search(p.read_text()) and "bench" not in p.parts]
  assert not offenders, offenders


def test_the_readme_lists_every_setting():
  readme = (ROOT / "README.md").read_text()
  assert settings.table() in readme


@pytest.mark.parametrize("name,raw,msg", [
  ("BITDELTA_CPU_ROWS", "yes", "expected 0 or 1, got 'yes'"),
  ("BITDELTA_QUANT_ACTIVATIONS", "int4", "expected one of int8, f32, auto"),
  ("BITDELTA_CPU_THREADS", "many", "expected an integer"),
  ("BITDELTA_FAULT_START_DELAY_S", "-1", "must be >= 0"),
])
def test_a_bad_value_names_the_variable(monkeypatch, name, raw, msg):
  monkeypatch.setenv(name, raw)
  with pytest.raises(settings.SettingError, match=f"{name}: {re.escape(msg)}"):
    settings.get(name)
  with pytest.raises(settings.SettingError, match=name):
    settings.check_all()


def test_defaults_and_values(monkeypatch):
  for s in settings.SETTINGS.values():
    monkeypatch.delenv(s.name, raising=False)
  assert settings.get("BITDELTA_QUANT_ACTIVATIONS") == "int8"
  assert settings.get("BITDELTA_CPU_ROWS") is True and settings.get("BITDELTA_CPU_THREADS") is None
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")
  monkeypatch.setenv("BITDELTA_CPU_THREADS", "3")
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")
  assert settings.get("BITDELTA_CPU_ROWS") is False and settings.get("BITDELTA_CPU_THREADS") == 3
  monkeypatch.setenv("BITDELTA_CPU_THREADS", "")  # empty: the default
  assert settings.get("BITDELTA_CPU_THREADS") is None


def test_only_traced_settings_key_a_step_program(monkeypatch):
  from bitdelta_jax.engine.step_cache import step_key

  monkeypatch.delenv("BITDELTA_CPU_ROWS", raising=False)
  key = step_key(("p",))
  monkeypatch.setenv("BITDELTA_API_KEY", "secret")
  monkeypatch.setenv("BITDELTA_CPU_THREADS", "1")
  assert step_key(("p",)) == key  # read at run time, or not by the step at all
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")
  assert step_key(("p",)) != key  # a kernel choice made while tracing


def test_a_bad_value_is_exit_2_from_the_cli(monkeypatch, capsys):
  from bitdelta_jax.cli import main

  monkeypatch.setenv("BITDELTA_QUANT_ROWS", "off")
  assert main(["inspect", str(ROOT)]) == 2
  assert "error: BITDELTA_QUANT_ROWS: expected 0 or 1, got 'off'" in capsys.readouterr().err
