"""The one registry of native CPU kernels: each kernel module declares its libraries as
`NativeKernel`s (the C++ source, the build name, the FFI handlers it exports); this module
builds and registers them.

    QUANT_ROWS = NativeKernel("quant_rows", SOURCE, (("bitdelta_quant_rows", "BitdeltaQuantRows"),),
                              "the quantized CPU rows kernel")
    lib, reason = registry.load(QUANT_ROWS)           # built once per machine, registered once
    registry.build_variant(QUANT_ROWS, ("-march=native", "-mno-avx512f"), "my_target")  # tests
    registry.register_all()                           # every kernel of `MODULES`

A program compiled in an earlier process (the step cache) calls FFI targets without having
been traced, and tracing is what registers them otherwise, so a process that loads programs
calls `register_all` first: adding a kernel is one `NativeKernel` in its module and its
module's name in `MODULES` (a name left out made every GGUF warm start recompile once).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import pathlib
import threading

# the modules that declare native kernels (each a ``KERNELS`` tuple of `NativeKernel`)
MODULES = (
  "pallas_kernels.delta_matmul.cpu",  # the delta term, the merged product, the expansion
  "pallas_kernels.delta_matmul.cpu_rows",  # the few-rows kernel (decode)
  "pallas_kernels.quant_matmul.cpu_rows",  # a GGUF base's products over its blocks
  "pallas_kernels.small_matmul.cpu",  # small-M products, the tied head's x·Eᵀ (f32, bf16)
  "pallas_kernels.paged_attention.cpu",  # decode attention, the in-place K/V write, the gather
)


@dataclasses.dataclass(frozen=True)
class NativeKernel:
  name: str  # the library's build name (its cache file)
  source: pathlib.Path  # the C++ file
  handlers: tuple[tuple[str, str], ...]  # (FFI target, the symbol the library exports)
  what: str  # in messages: "<what> cannot be built: <why>"

  @property
  def target(self) -> str:
    """The first handler's FFI target (the kernel's own)."""
    return self.handlers[0][0]


_loaded: dict[str, tuple[ctypes.CDLL | None, str | None]] = {}
_lock = threading.Lock()


def _build(k: NativeKernel, arch: tuple[str, ...] | None):
  import jax

  from pallas_kernels.native.build import build

  # jax's FFI headers are on the include path, its version part of the build's key
  return build(k.source, k.name, include_dirs=(jax.ffi.include_dir(),),
               key_extra=jax.__version__.encode(), arch=arch)


def _register(lib: ctypes.CDLL, handlers) -> None:
  import jax

  for target, symbol in handlers:
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def load(k: NativeKernel) -> tuple[ctypes.CDLL | None, str | None]:
  """(the library, None) with its handlers registered, or (None, why it cannot be built
  here); built and registered once per process."""
  with _lock:
    if k.name not in _loaded:
      lib, reason = _build(k, None)
      if lib is not None:
        _register(lib, k.handlers)
      _loaded[k.name] = (lib, None if lib is not None else f"{k.what} cannot be built: {reason}")
    return _loaded[k.name]


def build_variant(k: NativeKernel, arch: tuple[str, ...], target: str,
                  others: dict[str, str] | None = None) -> ctypes.CDLL:
  """Builds ``k`` with target flags ``arch`` (e.g. ``("-march=native", "-mno-avx512f")``,
  ``()`` for portable code) and registers its handlers under ``target`` in place of
  `NativeKernel.target` (``bitdelta_x_nt`` becomes ``target + "_nt"``; handlers not named after
  the first are left out unless ``others`` maps their FFI target to the variant's): for tests
  and benches of the paths this machine's build skips."""
  lib, reason = _build(k, arch)
  if lib is None:
    raise RuntimeError(f"{k.what} cannot be built with {arch}: {reason}")
  others = others or {}
  _register(lib, [(target + t[len(k.target):], s) for t, s in k.handlers
                  if t.startswith(k.target)] +
            [(others[t], s) for t, s in k.handlers if t in others])
  return lib


def kernels() -> list[NativeKernel]:
  """Every declared kernel (importing the modules of `MODULES`)."""
  return [k for m in MODULES for k in importlib.import_module(m).KERNELS]


def register_all() -> dict[str, str | None]:
  """Builds (once per machine) and registers every kernel; its name → None, or why it cannot
  be built here (those kernels' programs then fail to load and are compiled afresh)."""
  return {k.name: load(k)[1] for k in kernels()}
