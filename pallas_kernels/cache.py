"""The one directory bitdelta-jax keeps things in between runs (built native kernels, compiled
step programs, XLA's cache, the zoo's downloads), each in its own subdirectory."""

from __future__ import annotations

import os
from pathlib import Path

from pallas_kernels import settings


def cache_root() -> Path:
  """``$BITDELTA_CACHE``, else ``$XDG_CACHE_HOME/bitdelta_jax``, else ``~/.cache/bitdelta_jax``."""
  root = settings.get("BITDELTA_CACHE")
  if root:
    return Path(root)
  return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "bitdelta_jax"
