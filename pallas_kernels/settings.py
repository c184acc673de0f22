"""Every ``BITDELTA_*`` environment variable, declared once: name, type, default, meaning.

    from pallas_kernels import settings
    settings.get("BITDELTA_QUANT_ACTIVATIONS")        # "int8" unless the environment says else
    settings.traced_values()                          # what a compiled step program depends on
    print(settings.table())                           # the README's list

Python reads them only through `get` (a value that does not parse is a `SettingError` naming
the variable and what it takes); the native thread pool (``native/pool.h``) reads its two
itself when it starts. ``traced`` settings are read while a step is traced (kernel choices),
so a program compiled under other values is another program: they are part of the step
cache's key (`bitdelta_jax.engine.step_cache.step_key`). This module lives in the kernels
package, the lowest layer, so the kernels, the library and the server all read from it.
(``BITDELTA_TEST_*`` belong to the test suite's harness, ``tests/conftest.py``.)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


class SettingError(ValueError):
  """An environment variable whose value does not parse."""


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str
  kind: str  # "bool" (0 or 1), "int", "float", "str", "path"
  default: Any
  doc: str
  choices: tuple[str, ...] = ()
  traced: bool = False  # read while a step is traced: part of a compiled program's identity
  secret: bool = False  # never printed or hashed

  def parse(self, raw: str) -> Any:
    if self.kind == "bool":
      if raw not in ("0", "1"):
        raise SettingError(f"{self.name}: expected 0 or 1, got {raw!r}")
      return raw == "1"
    if self.kind in ("int", "float"):
      try:
        v = int(raw) if self.kind == "int" else float(raw)
      except ValueError:
        raise SettingError(f"{self.name}: expected {'an integer' if self.kind == 'int' else 'a number'}"
                           f", got {raw!r}") from None
      if v < 0:
        raise SettingError(f"{self.name}: must be >= 0, got {raw!r}")
      return v
    if self.choices and raw not in self.choices:
      raise SettingError(f"{self.name}: expected one of {', '.join(self.choices)}, got {raw!r}")
    return raw


_ALL = (
  # -- where things are kept
  Setting("BITDELTA_CACHE", "path", None,
          "the cache root (built kernels, compiled steps, GGUF metadata, the zoo); default "
          "$XDG_CACHE_HOME/bitdelta_jax or ~/.cache/bitdelta_jax"),
  Setting("BITDELTA_COMPILE_CACHE", "str", "1",
          "compiled step programs and XLA's cache: 1 under the cache root, 0 nowhere (every "
          "start compiles), or a directory"),
  # -- the server
  Setting("BITDELTA_API_KEY", "str", None, "default of `serve --api-key`", secret=True),
  Setting("BITDELTA_ADMIN_KEY", "str", None, "default of `serve --admin-key`", secret=True),
  Setting("BITDELTA_FORBID_COMPILE_AFTER_WARMUP", "bool", False,
          "1: a step that needs a program the warm-up did not compile raises (a bug guard; "
          "`serve --forbid-compile-after-warmup`)"),
  # -- CPU threads (native code)
  Setting("BITDELTA_CPU_THREADS", "int", None,
          "threads of the native kernels' pool and the delta packer (default: every core); "
          "read by native/pool.h when the pool starts"),
  Setting("BITDELTA_CPU_SPIN_US", "int", None,
          "microseconds the pool's idle workers spin before sleeping (native/pool.h's default)"),
  Setting("BITDELTA_HUGE_PAGES", "bool", True,
          "0: leave the CPU runner's weights in 4 KiB pages (by default they are collapsed "
          "into 2 MiB transparent huge pages where Linux allows: decode streams them)"),
  Setting("BITDELTA_AMX", "bool", True,
          "0: the GGUF block kernel never uses AMX tiles (prefill chunks take the AVX-512 VNNI "
          "path: the same bits, slower); read by the kernel when it first runs"),
  # -- kernel choices (read while a step is traced)
  Setting("BITDELTA_QUANT_ACTIVATIONS", "str", "int8",
          "activations of the GGUF block kernel: int8 (per 32-block, as llama.cpp), f32 (the "
          "dequantized model's exact products), auto", choices=("int8", "f32", "auto"),
          traced=True),
  Setting("BITDELTA_QUANT_ROWS", "bool", True, "0: no native GGUF block kernel on CPU",
          traced=True),
  Setting("BITDELTA_QUANT_ROWS_MANY", "bool", True,
          "0: a layer's q/k/v and gate/up over GGUF blocks take one kernel call each, not one "
          "together (the same numbers)", traced=True),
  Setting("BITDELTA_CPU_ROWS", "bool", True, "0: no native 1-bit delta row kernel on CPU",
          traced=True),
  Setting("BITDELTA_CPU_MERGED", "bool", True,
          "0: no merged base + delta CPU kernel for many-row steps", traced=True),
  Setting("BITDELTA_CPU_EXPAND", "bool", True,
          "0: do not expand the 1-bit delta to a dense tile for large row counts", traced=True),
  Setting("BITDELTA_CPU_EXPAND_ROWS", "int", 0,
          "rows from which the CPU delta kernel expands the bits (0: its own threshold)",
          traced=True),
  Setting("BITDELTA_SMALL_MATMUL", "bool", True, "0: XLA's dot for few-row matmuls on CPU",
          traced=True),
  Setting("BITDELTA_CPU_HEAD", "bool", True, "0: XLA's dot for the LM head on CPU", traced=True),
  Setting("BITDELTA_PAGED_ATTENTION_CPU", "bool", True,
          "0: the jnp reference for paged attention on CPU", traced=True),
  Setting("BITDELTA_PAGED_PREFILL_GPU", "bool", True,
          "0: no Pallas paged prefill kernel on GPU", traced=True),
  # -- fault injection (tests)
  Setting("BITDELTA_FAULT_STAGE", "str", None,
          "a start-up stage (compile) at which this process sleeps BITDELTA_FAULT_START_DELAY_S: "
          "how the tests make one process of several a straggler", choices=("compile",)),
  Setting("BITDELTA_FAULT_START_DELAY_S", "float", 0.0, "see BITDELTA_FAULT_STAGE"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}


def get(name: str) -> Any:
  """The value of ``name`` in the environment (parsed), or its default."""
  s = SETTINGS[name]
  raw = os.environ.get(name)
  return s.default if raw is None or raw == "" else s.parse(raw)


def traced_values() -> tuple[tuple[str, Any], ...]:
  """The ``traced`` settings' values now: what a compiled step program depends on."""
  return tuple((s.name, get(s.name)) for s in _ALL if s.traced)


def check_all() -> None:
  """Parses every variable that is set (a bad value fails at start, naming it)."""
  for s in _ALL:
    get(s.name)


def table() -> str:
  """A markdown table of every setting (the README's)."""
  rows = ["| variable | default | meaning |", "|---|---|---|"]
  for s in _ALL:
    default = "" if s.default is None else str(int(s.default) if s.kind == "bool" else s.default)
    rows.append(f"| `{s.name}` | {default} | {s.doc} |")
  return "\n".join(rows)
