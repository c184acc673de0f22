"""The C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing). No JAX:
the server's delta cache calls it too (`serving.cache`).

Large host buffers freed by a thread (an XLA compile's working memory, a delta read from disk
into numpy arrays of a few MB each) stay in that thread's malloc arena, resident, until trimmed.
"""

from __future__ import annotations

_trim = None


def trim() -> None:
  global _trim
  if _trim is None:
    try:
      import ctypes

      _trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
      _trim = False
  if _trim:
    _trim(0)
