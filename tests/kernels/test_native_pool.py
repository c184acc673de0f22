"""The CPU kernels' thread pool (`pallas_kernels/native/pool.h`): one per process, shared by
every kernel library `pallas_kernels.native.build` builds (small_matmul f32 and bf16, the delta
kernel, paged attention), and builds keyed on the shared header."""

from __future__ import annotations

import ctypes

import pytest

from pallas_kernels.native import build as native


def _libs():
  from pallas_kernels.delta_matmul import cpu as delta_cpu
  from pallas_kernels.paged_attention import cpu as paged_cpu
  from pallas_kernels.small_matmul import cpu, cpu_bf16

  out = {}
  for name, build in (("small_matmul", cpu._build), ("small_matmul_bf16", cpu_bf16._build),
                      ("delta_matmul", delta_cpu._build), ("paged_attention", paged_cpu._build)):
    lib, reason = build()
    if lib is None:
      pytest.skip(f"{name}: {reason}")
    out[name] = lib
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
