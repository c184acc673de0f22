"""Compiled step programs kept on disk, so that a restarted server neither traces nor lowers.

JAX's persistent compilation cache (which the server turns on) skips XLA's compile, but every
program must still be traced and lowered before the cache is consulted: for SmolLM2's 30
unrolled layers that is ~1.1 s of Python a program (GIL-bound, so threads do not help) and
~0.75 s to load it, for the 14-22 step programs of a server. This cache stores each compiled
step whole (`jax.experimental.serialize_executable`) under a key of everything the program
depends on, and loads it without tracing:

    key = step_key(parts)            # a hash of the code, the versions, the machine, the shapes
    compiled = load(root, key)       # None when absent or unreadable (then compile and `save`)

The key covers the source of `bitdelta_jax` and `pallas_kernels` (every .py, .cc, .h file), the
jax and jaxlib versions, the backend and its devices, the CPU model and flags, ``XLA_FLAGS``,
and the caller's parts (model config, dtypes, every input's shape, dtype and sharding, static
arguments). A stale or foreign entry therefore never matches; an entry that fails to load is
ignored (and overwritten by the next save). Single-process only: the engine does not use it
across processes, where each process's executable is one part of a distributed program.

Only programs compiled in this process are saved (`fresh_compile`). A program that JAX's own
persistent cache returned was deserialized, and XLA's CPU client does not keep the object code
of a deserialized executable: serialized again it holds the symbol names without their code
(10.3 KB instead of 18.3 KB for a small test program), loads in another process and then fails
its first run ("Function compare_convert_fusion not found"). Within the process that loaded it
the symbols are still resident, which is why a test that saves and loads in one process cannot
see it (tests/engine/test_step_cache_restarts.py runs each start in its own process). The engine also runs
each program once on a padding batch before serving (`PagedRunner.compile_all`), so a bad
entry that still gets through is recompiled at start, never met by a request.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import platform
import threading

from pallas_kernels import settings

log = logging.getLogger("bitdelta_jax.step_cache")

_ROOTS = ("bitdelta_jax", "pallas_kernels")


@functools.cache
def code_fingerprint() -> str:
  """A hash of every .py, .cc and .h file (the native kernels' shared headers too) of the
  packages that build the step."""
  top = pathlib.Path(__file__).resolve().parents[2]
  h = hashlib.sha256()
  for root in _ROOTS:
    for p in sorted((top / root).rglob("*")):
      if p.suffix in (".py", ".cc", ".h") and p.is_file():
        h.update(str(p.relative_to(top)).encode())
        h.update(p.read_bytes())
  return h.hexdigest()


@functools.cache
def _machine() -> str:
  cpu = ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("model name", "flags")):
          cpu += line
          if line.startswith("flags"):
            break
  except OSError:
    cpu = platform.processor()
  return cpu


def step_key(parts) -> str:
  """The cache key of a program built from ``parts`` (any repr-able values) on this machine."""
  import jax
  import jaxlib

  devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
  # settings read when a step is traced (kernel choices, the quantized kernel's activation
  # mode): a program traced under other values is another program
  switches = settings.traced_values()
  full = (code_fingerprint(), jax.__version__, jaxlib.__version__, jax.default_backend(),
          devices, os.environ.get("XLA_FLAGS", ""), switches, _machine(), parts)
  return hashlib.sha256(repr(full).encode()).hexdigest()


_fresh_lock = threading.Lock()
_fresh_users = 0  # threads inside `fresh_compile`
_cache_was_on = True


@contextlib.contextmanager
def fresh_compile():
  """Within it, compiles bypass JAX's persistent compilation cache: the program is really
  compiled here, so `save` stores its object code (see the module docstring).

  JAX decides once per process, at its first compile, whether its persistent cache is used
  (`jax._src.compilation_cache.is_cache_used`), so a thread-local ``enable_compilation_cache``
  context is ignored once anything has compiled: the switch is process-wide here, turned off
  by the first thread to enter and back on by the last to leave (`reset_cache` makes JAX decide
  again each time). Compiles of other threads meanwhile miss the cache too (the engine's
  warm-up is the only compiler then)."""
  global _fresh_users, _cache_was_on
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  with _fresh_lock:
    if _fresh_users == 0:
      _cache_was_on = bool(jax.config.jax_enable_compilation_cache)
      jax.config.update("jax_enable_compilation_cache", False)
      compilation_cache.reset_cache()
    _fresh_users += 1
  try:
    yield
  finally:
    with _fresh_lock:
      _fresh_users -= 1
      if _fresh_users == 0:
        jax.config.update("jax_enable_compilation_cache", _cache_was_on)
        compilation_cache.reset_cache()


def _path(root, key: str) -> pathlib.Path:
  return pathlib.Path(root) / f"step-{key[:40]}.bin"


def load(root, key: str):
  """The compiled program stored under ``key``, or None."""
  path = _path(root, key)
  if not path.exists():
    return None
  try:
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = pickle.loads(path.read_bytes())
    return deserialize_and_load(payload, in_tree, out_tree)
  except Exception as e:  # noqa: BLE001  a bad entry is a cache miss, never an error
    log.warning("step cache: ignoring %s (%s: %s)", path.name, type(e).__name__, e)
    return None


def save(root, key: str, compiled) -> None:
  """Stores ``compiled`` under ``key`` (atomically; failures only log). ``compiled`` must come
  from a compile under `fresh_compile`, not from JAX's persistent cache."""
  try:
    from jax.experimental.serialize_executable import serialize

    data = pickle.dumps(serialize(compiled))
    path = _path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
  except Exception as e:  # noqa: BLE001
    log.warning("step cache: not saved (%s: %s)", type(e).__name__, e)
