"""Shared test settings.

The suite is hermetic: no persistent XLA compilation cache (the engine turns one on under
``~/.cache/bitdelta_jax/xla`` by default; set before any test builds an engine, so servers and
the subprocesses they start compile for themselves and never write into the user's cache).

Each module's compiled programs are dropped when the module ends. XLA's CPU backend maps every
compiled program's code into its own memory mappings, and one pytest process that keeps all of
the suite's programs alive passes Linux's limit on mappings per process (``vm.max_map_count``,
65530 by default) at about 87% of the suite; the next compile then fails to map its code and
the process dies with a segmentation fault inside XLA (what CI saw). ``BITDELTA_TEST_MAPS=path``
appends each module's mapping count before and after the cleanup to ``path``.

``slow`` marks what a developer can leave out for a quick run (``pytest -m "not slow"``): a
module that starts servers, subprocesses or the real model says so with ``pytestmark``, a test
that took 4 s or more in a full run (``--durations``) with ``@pytest.mark.slow``. CI runs
everything.
"""

import gc
import os

import pytest
from model_fixtures import hf_models  # noqa: F401  (tiny HF models, session-wide)

os.environ.setdefault("BITDELTA_COMPILE_CACHE", "0")

def _mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return -1


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs(request):
  yield
  import sys

  if "jax" not in sys.modules:
    return
  import jax

  before = _mappings()
  gc.collect()
  jax.clear_caches()
  gc.collect()
  log = os.environ.get("BITDELTA_TEST_MAPS")
  if log:
    with open(log, "a") as f:
      f.write(f"{request.module.__name__} {before} {_mappings()}\n")

# servers that warmed up refuse to compile afterwards: a step shape the warm-up missed fails the
# test instead of compiling silently (ServerConfig.forbid_compile_after_warmup's default)
os.environ.setdefault("BITDELTA_FORBID_COMPILE_AFTER_WARMUP", "1")
