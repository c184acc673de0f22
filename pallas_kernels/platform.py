"""The platform the kernels' ``implementation=None`` dispatch targets, shared by every kernel.

By default that is the process's default backend. `lowering_platform` overrides it, so that a
program can be traced and lowered for another platform than the one it runs on, e.g. the
engine's whole step lowered for CUDA on a CPU-only CI machine::

    with lowering_platform("cuda"):
      lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))

The override is process-wide (every thread sees it while the ``with`` block is open: the
engine traces its step programs in worker threads), and nests.
"""

from __future__ import annotations

import contextlib
import threading

import jax

_ALIASES = {"gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "cpu": "cpu", "tpu": "tpu"}
_lock = threading.Lock()
_stack: list[str] = []


def _normalize(platform: str) -> str:
  key = str(platform).lower()
  if key not in _ALIASES:
    raise ValueError(f"unknown platform {platform!r}; choose from {sorted(_ALIASES)}")
  return _ALIASES[key]


@contextlib.contextmanager
def lowering_platform(platform: str):
  """Within the block, `target_platform` (and so every kernel's ``implementation=None``) is
  ``platform`` ("cuda" or "gpu", "rocm", "cpu", "tpu") whatever the default backend."""
  value = _normalize(platform)
  with _lock:
    _stack.append(value)
  try:
    yield value
  finally:
    with _lock:
      _stack.pop()


def override() -> str | None:
  """The platform `lowering_platform` set, or None outside it."""
  with _lock:
    return _stack[-1] if _stack else None


def target_platform() -> str:
  """The target platform, "cuda", "rocm", "cpu" or "tpu": the `lowering_platform` override, else the
  default backend (a "gpu" backend is told apart by its platform version)."""
  forced = override()
  if forced is not None:
    return forced
  backend = jax.default_backend()
  if backend != "gpu":
    return _ALIASES.get(backend, backend)
  try:
    version = jax.devices()[0].client.platform_version.lower()
  except Exception:  # no device or no version: assume CUDA
    version = ""
  return "rocm" if "rocm" in version else "cuda"


def cuda_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the first CUDA device, or None without one (e.g. under
  `lowering_platform` on a CPU machine, where nothing can be checked)."""
  try:
    dev = jax.devices("gpu")[0]
  except Exception:  # no GPU backend
    return None
  cc = getattr(dev, "compute_capability", None)
  if not cc:
    return None
  major, _, minor = str(cc).partition(".")
  return int(major), int(minor or 0)


def hopper_reason() -> str | None:
  """Why this process's GPU cannot run sm_90 (Hopper) kernels such as wgmma and TMA; None when
  it can, or when there is no GPU to ask (lowering for CUDA from a CPU process)."""
  cc = cuda_compute_capability()
  if cc is not None and cc < (9, 0):
    return f"the Mosaic GPU kernels need sm_90 (Hopper) or newer, this GPU is sm_{cc[0]}{cc[1]}"
  return None


__all__ = ["cuda_compute_capability", "hopper_reason", "lowering_platform", "override",
           "target_platform"]
