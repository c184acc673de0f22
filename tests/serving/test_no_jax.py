"""`serving/` is the HTTP layer: its modules import without JAX (the engine, which owns JAX,
imports it on its device thread when it builds the model)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import serving

SCRIPT = """
import importlib, sys
for name in sys.argv[1:]:
  importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
print("loaded:", loaded[:5])
sys.exit(1 if loaded else 0)
"""


def test_serving_modules_import_without_jax():
  names = [f"serving.{m.name}" for m in pkgutil.iter_modules(serving.__path__)]
  assert {"serving.app", "serving.cli", "serving.registry", "serving.generation"} <= set(names)
  proc = subprocess.run([sys.executable, "-c", SCRIPT, *names], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
