"""Host weights into transparent huge pages (`engine.heap.huge_pages`; the CPU runner collapses
its weights on a thread of its own, ``BITDELTA_HUGE_PAGES``): the bytes stay as they were, the
range is backed by 2 MiB pages where Linux allows it, and nothing breaks where it does not."""

from __future__ import annotations

import mmap
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.engine import heap
from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.models import from_pretrained

HUGE = 2 << 20


def _anon_huge_kb(address: int) -> int:
  """AnonHugePages (kB) of the mapping of /proc/self/smaps that holds ``address``."""
  inside = False
  for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0]
    if "-" in head and ":" not in head:
      lo, hi = (int(v, 16) for v in head.split("-"))
      inside = lo <= address < hi
    elif inside and line.startswith("AnonHugePages:"):
      return int(line.split()[1])
  return 0


def test_huge_pages_keeps_the_bytes_and_backs_the_range():
  # private anonymous memory (what malloc hands out), page-aligned, not 2 MiB aligned inside
  buf = mmap.mmap(-1, 4 * HUGE + 12345, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  view = np.frombuffer(buf, np.uint8)
  view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8) ^ 0x5A
  want = view.copy()
  address = view.ctypes.data
  done = heap.huge_pages(address + 4096, view.size - 4096)
  np.testing.assert_array_equal(view, want)
  if done == 0:
    pytest.skip("this kernel or its THP setting refuses MADV_COLLAPSE (the runner then keeps "
                "4 KiB pages)")
  start = -(-(address + 4096) // HUGE) * HUGE
  assert done % HUGE == 0 and start + done <= address + view.size
  assert _anon_huge_kb(start) * 1024 >= done
  assert heap.huge_pages(address, 100) == 0  # no whole 2 MiB page inside: nothing asked
  del view
  buf.close()


def test_runner_collapse_leaves_tokens_alone(hf_models, monkeypatch):
  """The runner's thread finishes (its event is set) with the setting on or off; a tiny model's
  arrays (< 4 MiB) are left alone, and the greedy tokens are the same either way."""
  _, path = hf_models("llama")
  tokens = {}
  for on in ("1", "0"):
    monkeypatch.setenv("BITDELTA_HUGE_PAGES", on)
    gen = Generator(from_pretrained(path, jnp.float32), max_rows=2, max_seq_len=32,
                    page_size=4, prefill_chunk=8)
    assert gen.runner.huge_pages_done.wait(30)
    assert gen.runner.huge_page_bytes == 0
    tokens[on] = gen.generate([[5, 9, 14, 3]], params=SamplingParams(max_new_tokens=4))[0].tokens
  assert tokens["1"] == tokens["0"] and len(tokens["1"]) == 4
