"""The C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing), and host
weights into huge pages (`huge_pages`). No JAX: the server's delta cache calls it too
(`serving.cache`).

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


_madvise = None
_HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux; MADV_COLLAPSE since 6.1


def huge_pages(address: int, nbytes: int) -> int:
  """Asks Linux to back the whole 2 MiB pages inside ``[address, address + nbytes)`` with
  transparent huge pages now (``MADV_HUGEPAGE``, then ``MADV_COLLAPSE``: synchronous, the
  bytes stay where they are); the bytes collapsed, 0 where that is refused or unsupported
  (another OS, an older kernel, THP off). A decode step streams every weight once: in 4 KiB
  pages each page costs a TLB walk (bench/results/kernels/quant_stream.md)."""
  global _madvise
  if _madvise is None:
    try:
      import ctypes
      import sys

      if not sys.platform.startswith("linux"):
        raise OSError("not Linux")
      fn = ctypes.CDLL("libc.so.6", use_errno=True).madvise
      fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
      _madvise = fn
    except (OSError, AttributeError):
      _madvise = False
  if not _madvise:
    return 0
  start = -(-address // _HUGE) * _HUGE
  end = (address + nbytes) // _HUGE * _HUGE
  if end <= start:
    return 0
  if _madvise(start, end - start, MADV_HUGEPAGE) != 0:
    return 0
  return end - start if _madvise(start, end - start, MADV_COLLAPSE) == 0 else 0
