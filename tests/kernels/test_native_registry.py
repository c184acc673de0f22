"""The one registry of native kernels: every FFI handler a C++ source defines is declared (so
`register_all`, what a warm start from the step cache calls, registers it), registration
happens only there, and a fresh process that loads programs without tracing them finds every
target."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels.native import registry

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="native kernels build on Linux")


def test_every_handler_a_source_defines_is_declared_once():
  defined = {}
  for cc in (ROOT / "pallas_kernels").rglob("*.cc"):
    for sym in re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+),", cc.read_text()):
      defined[sym] = cc.resolve()
  declared = {}
  for k in registry.kernels():
    for _target, sym in k.handlers:
      assert sym not in declared, f"{sym} declared twice"
      declared[sym] = k.source.resolve()
  assert declared == defined
  targets = [t for k in registry.kernels() for t, _ in k.handlers]
  assert len(targets) == len(set(targets)) == 13


def test_only_the_registry_registers_ffi_targets():
  users = [str(p.relative_to(ROOT)) for top in ("pallas_kernels", "bitdelta_jax")
           for p in (ROOT / top).rglob("*.py") if "register_ffi_target" in p.read_text()]
  assert users == ["pallas_kernels/native/registry.py"], users


def test_register_all_registers_every_target_in_a_fresh_process():
  # a process that has traced nothing (a warm start): every kernel builds and registers
  code = ("from pallas_kernels.native import registry; "
          "print(sorted(registry.register_all().items(), key=str))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  reasons = eval(out.stdout.splitlines()[0])  # noqa: S307  [(name, None | why)]
  assert [n for n, why in reasons if why is not None] == [], reasons
  assert {n for n, _ in reasons} == {k.name for k in registry.kernels()}


def test_a_variant_build_registers_its_entries_under_the_given_name():
  from pallas_kernels.small_matmul import cpu

  lib = registry.build_variant(cpu.KERNELS[0], (), "bitdelta_small_matmul_registry_test")
  assert lib is not None
  with pytest.raises(RuntimeError, match="the CPU small-matmul kernel cannot be built with"):
    registry.build_variant(cpu.KERNELS[0], ("-mno-such-flag-xyz",), "x")
