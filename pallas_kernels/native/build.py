"""C++ kernel libraries compiled on first use with the system compiler, cached under the one
cache root (`pallas_kernels.cache.cache_root`, ``$BITDELTA_CACHE``).

Used by every CPU kernel of `pallas_kernels` (delta_matmul, small_matmul, paged_attention) and
the compression packer (`bitdelta_jax/delta/pack_native.py`). A build is keyed by the source,
the compiler, the extra key (e.g. the jax version for FFI headers) and the shared headers;
``-march=native`` is tried first, then a portable build. Without a compiler, callers get the
reason and fall back to pure XLA/numpy.

Shared headers (this folder, on every build's include path): ``pool.h``, the kernels'
persistent thread pool; ``lut_delta.h``, the 1-bit delta term's table lookups (the delta and
quant CPU rows kernels). A library that includes ``pool.h`` exports ``BitdeltaPoolShare``;
`build` hands each such library the pool of the ones loaded before it, so a process has one
pool (one set of worker threads) whatever the number of kernel libraries.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

from pallas_kernels.cache import cache_root

SHARED_INCLUDE = pathlib.Path(__file__).resolve().parent
_pool: int | None = None  # the address of the process's thread pool (``BitdeltaPoolShare``)
_pool_lock = threading.Lock()


def _shared_headers() -> bytes:
  """The shared headers' names and bytes: part of every build's key."""
  if not SHARED_INCLUDE.is_dir():
    return b""
  return b"".join(p.name.encode() + p.read_bytes() for p in sorted(SHARED_INCLUDE.glob("*.h")))


def _share_pool(lib: ctypes.CDLL) -> None:
  """Makes ``lib`` use the process's pool (the first library's), if it has one."""
  global _pool
  try:
    share = lib.BitdeltaPoolShare
  except AttributeError:
    return  # no pool in this library
  share.restype, share.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
  with _pool_lock:
    ptr = share(_pool)
    if _pool is None:
      _pool = ptr


def cache_dir() -> pathlib.Path:
  """Where built kernel libraries go: the one cache root (`pallas_kernels.cache.cache_root`,
  ``$BITDELTA_CACHE``)."""
  return cache_root()


def _compile(cxx: str, src: pathlib.Path, out: pathlib.Path, arch: tuple[str, ...],
             include_dirs: tuple[str, ...]) -> None:
  cmd = [cxx, *arch, "-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w",
         *(f"-I{d}" for d in (*include_dirs, SHARED_INCLUDE)), str(src), "-o", str(out)]
  subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)


def build(source: pathlib.Path, name: str, *, include_dirs: tuple[str, ...] = (),
          key_extra: bytes = b"", arch: tuple[str, ...] | None = None
          ) -> tuple[ctypes.CDLL | None, str | None]:
  """(the loaded library, None), or (None, why it cannot be built here).

  ``arch``: the target flags, e.g. ``("-march=native", "-mno-avx512f")`` to build a kernel's
  AVX2 path on an AVX-512 machine (tests); None tries ``-march=native``, then none."""
  if platform.system() != "Linux":
    return None, f"native helpers are only built on Linux, not {platform.system()}"
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if cxx is None:
    return None, "no C++ compiler (g++/c++ or $CXX) found"
  archs = [("-march=native",), ()] if arch is None else [tuple(arch)]
  key = hashlib.sha256(source.read_bytes() + cxx.encode() + key_extra + _shared_headers()
                       + platform.machine().encode()
                       + (b"" if arch is None else b"arch:" + " ".join(arch).encode())).hexdigest()[:16]
  lib_path = cache_dir() / f"{name}_{key}.so"
  if not lib_path.exists():
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
      tmp_lib = pathlib.Path(tmp) / lib_path.name
      errors = []
      for flags in archs:
        try:
          _compile(cxx, source, tmp_lib, flags, include_dirs)
          break
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
          errors.append(getattr(e, "stderr", None) or str(e))
      else:
        return None, f"building {source.name} failed:\n" + "\n".join(errors)[-2000:]
      os.replace(tmp_lib, lib_path)  # atomic: concurrent builders agree on the result
  lib = ctypes.cdll.LoadLibrary(str(lib_path))
  _share_pool(lib)
  return lib, None
