"""Shared test settings.

One compile cache per run. The first pytest process of a run (the only one, or xdist's
controller) makes a fresh directory and points ``BITDELTA_COMPILE_CACHE`` at it; xdist's workers
and every subprocess the tests start inherit it, so a program compiled once in a run (a server's
step, a kernel, a mesh layout's programs) is loaded, not compiled, by every later module and
process: JAX's persistent cache (``<dir>/xla``, every program however fast it compiled) and the
engine's step cache (``<dir>/steps``). The directory is removed when the run ends; nothing is
read from or written to the user's cache (``~/.cache/bitdelta_jax``), except the built native
kernels, which keep the cache root and are built once per machine. ``BITDELTA_COMPILE_CACHE=0``
set by the caller runs everything cold. Tests whose subject is a cache (step-cache restarts,
demo restarts) give their processes their own ``BITDELTA_CACHE`` and ``BITDELTA_COMPILE_CACHE``.

Each module's compiled programs are dropped from memory when the module ends. XLA's CPU backend
maps every compiled program's code into its own memory mappings, and one pytest process that
keeps all of the suite's programs alive passes Linux's limit on mappings per process
(``vm.max_map_count``, 65530 by default) at about 87% of the suite; the next compile then fails
to map its code and the process dies with a segmentation fault inside XLA (what CI saw). The
on-disk cache keeps what was compiled. ``BITDELTA_TEST_MAPS=path`` appends each module's mapping
count before and after the cleanup to ``path``.

Tiers (markers, pyproject.toml): ``slow`` marks what a developer can leave out for a quick run
(``pytest -m "not slow"``): a module that starts servers, subprocesses or the real model says
so with ``pytestmark``, a test that took about 2 s or more in a quick run (``--durations``)
with ``@pytest.mark.slow``. ``server``, ``mesh`` and ``real_model`` say which (each implies
``slow``; tests using the ``serve`` or ``mesh_worker`` fixtures get theirs here). CI runs
everything.
"""

import gc
import os
import shutil
import tempfile

import pytest

_OWNER = "BITDELTA_TEST_COMPILE_CACHE_OWNER"  # the pid of the process that made the directory
if os.environ.get("BITDELTA_COMPILE_CACHE") != "0" and _OWNER not in os.environ:
  os.environ["BITDELTA_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="bitdelta-test-compile-")
  os.environ[_OWNER] = str(os.getpid())
# every program is worth keeping within a run (JAX's own knob; the engine's default is 1 s)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The suite's time is mostly XLA compiling thousands of small programs once each: LLVM's -O0
# compiles them ~25% faster (a server's start 26 -> 19 s) and changes no result the tests check
# (no fast-math either way). Inherited by xdist's workers and the mesh worker; subprocesses that
# set their own XLA_FLAGS (multihost, step-cache restarts, demo restarts) run XLA's defaults.
# A caller's XLA_FLAGS that name the level already are left alone.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

from bitdelta_jax.engine.build import enable_compile_cache  # noqa: E402

enable_compile_cache()  # this process's plain jitted functions share the run's cache too

from model_fixtures import hf_models  # noqa: E402, F401  (tiny HF models, session-wide)


@pytest.fixture(scope="session")
def mesh_worker(tmp_path_factory):
  """The session's one process with 8 CPU devices (tests/mesh/worker.py): ``mesh_worker.call(
  "path/under/tests.py:function", *args)`` runs a mesh check there and returns its JSON."""
  from mesh.client import MeshWorker

  worker = MeshWorker(tmp_path_factory.mktemp("mesh") / "worker.log")
  yield worker
  worker.close()


def pytest_unconfigure(config):
  if os.environ.get(_OWNER) == str(os.getpid()):
    shutil.rmtree(os.environ["BITDELTA_COMPILE_CACHE"], ignore_errors=True)


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


# The longest modules of a full run (junit times, 2 cores, 2026-12-04), run first: with xdist's
# ``--dist loadfile`` a module runs whole on one worker, and a long one left for the end would
# keep one worker busy after the other has finished.
_LONGEST_FIRST = (
  "engine/test_data_groups_and_mesh.py", "serving/test_multihost.py", "engine/test_generator.py",
  "serving/test_gguf_serving.py", "engine/test_step_cache_restarts.py",
  "kernels/test_cuda_lowering.py", "zoo/test_zoo.py", "zoo/test_demo_restarts.py",
  "serving/test_kmerge_serving.py", "serving/test_variant_vocab.py",
  "serving/test_lora_serving.py", "serving/test_openai_lm_eval.py",
)

# a test that uses one of these fixtures is in that tier; every tier is also `slow`
_TIER_OF_FIXTURE = {"serve": "server", "mesh_worker": "mesh"}
_TIERS = ("server", "mesh", "real_model")


def pytest_collection_modifyitems(config, items):
  for item in items:
    for fixture, tier in _TIER_OF_FIXTURE.items():
      if fixture in item.fixturenames:
        item.add_marker(tier)
    if any(item.get_closest_marker(t) for t in _TIERS):
      item.add_marker("slow")

  def rank(item):
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)

  items.sort(key=rank)  # stable: the rest keep their order
