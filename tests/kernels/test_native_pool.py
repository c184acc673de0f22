"""The CPU kernels' thread pool (`pallas_kernels/native/pool.h`): one per process, shared by
every kernel library `pallas_kernels.native.registry` declares, and builds keyed on the shared
header."""

from __future__ import annotations

import ctypes

import pytest

from pallas_kernels.native import build as native


def _libs():
  from pallas_kernels.native import registry

  out = {}
  for k in registry.kernels():  # every library the registry builds
    lib, reason = registry.load(k)
    if lib is None:
      pytest.skip(f"{k.name}: {reason}")
    out[k.name] = lib
  return out


def test_every_kernel_library_runs_on_one_pool():
  libs = _libs()
  pools = set()
  for lib in libs.values():
    share = lib.BitdeltaPoolShare
    share.restype, share.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    pools.add(share(None))  # None: adopt nothing, report this library's pool
  assert len(pools) == 1 and native._pool in pools, (pools, native._pool)


def test_builds_are_keyed_on_the_shared_headers(monkeypatch, tmp_path):
  """Changing pool.h rebuilds every kernel (a stale library would disagree on its layout)."""
  src = tmp_path / "k.cc"
  src.write_text('#include "pool.h"\nextern "C" int Two() { return 2; }\n')
  monkeypatch.setenv("BITDELTA_CACHE", str(tmp_path / "cache"))
  lib, reason = native.build(src, "pool_key_test")
  assert lib is not None, reason
  assert lib.Two() == 2
  before = set((tmp_path / "cache").iterdir())
  monkeypatch.setattr(native, "_shared_headers", lambda: b"another pool.h")
  lib, reason = native.build(src, "pool_key_test")
  assert lib is not None, reason
  assert len(set((tmp_path / "cache").iterdir()) - before) == 1
