"""One process with 8 simulated CPU devices that answers the suite's mesh checks.

JAX fixes its device count when it starts, so the pytest process (one device) cannot build an
8-device mesh itself. Instead of a cold process per check, the session starts this worker once
(`tests/mesh/client.py`, the ``mesh_worker`` fixture) and sends it jobs, one JSON line each on
stdin::

    {"fn": "engine/paged_mesh_worker.py:run_report", "args": [], "kwargs": {}}

``fn`` is a file under ``tests/`` and a function in it; the worker imports each file once and
answers one JSON line on its original stdout: ``{"ok": <the function's return value>}`` or
``{"error": <traceback>}``. Anything a job prints goes to stderr (the client's log file). After
each job the compiled programs are dropped from memory (they stay in the run's on-disk compile
cache), as the pytest process does after each module.
"""

from __future__ import annotations

import os
import sys

# the run's flags (tests/conftest.py) plus 8 host devices
os.environ["XLA_FLAGS"] = " ".join(
  [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
  + ["--xla_force_host_platform_device_count=8"])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("BITDELTA_CPU_THREADS", "1")  # 8 devices share 2 cores

import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import traceback  # noqa: E402

TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS.parent), str(TESTS)]


def _function(spec: str, modules: dict):
  path, name = spec.split(":")
  if path not in modules:
    file = (TESTS / path).resolve()
    if TESTS not in file.parents or file.suffix != ".py":
      raise ValueError(f"not a file under tests/: {path}")
    if str(file.parent) not in sys.path:  # its sibling helpers import as pytest imports them
      sys.path.insert(0, str(file.parent))
    mod_spec = importlib.util.spec_from_file_location("mesh_job_" + file.stem, file)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    modules[path] = module
  return getattr(modules[path], name)


def main() -> None:
  answers = os.fdopen(os.dup(1), "w")  # the client reads this; prints go to stderr
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  import jax

  from bitdelta_jax.engine.build import enable_compile_cache

  enable_compile_cache()
  assert jax.device_count() == 8, jax.devices()
  modules: dict = {}
  answers.write(json.dumps({"ready": jax.device_count()}) + "\n")
  answers.flush()
  for line in sys.stdin:
    job = json.loads(line)
    try:
      result = {"ok": _function(job["fn"], modules)(*job.get("args", ()),
                                                   **job.get("kwargs", {}))}
    except Exception:  # noqa: BLE001  the client raises it in the test
      result = {"error": traceback.format_exc()}
    gc.collect()
    jax.clear_caches()
    answers.write(json.dumps(result) + "\n")
    answers.flush()


if __name__ == "__main__":
  main()
