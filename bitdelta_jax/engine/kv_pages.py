"""Host-side bookkeeping of a paged KV cache: free pages, reference counts, prefix reuse.

The device holds one pool per layer, ``[L, num_pages, page_size, kv_heads, head_dim]``; a
sequence owns a list of page ids (its page table) and its tokens' K/V live in those pages in
order. Memory therefore grows with the tokens held, not with rows × max_len. Page 0 is never
handed out: writes of padding tokens land there.

Prefix caching (vLLM's block hashing): a *full* page is named by a hash of (the hash of the page
before it, the variant key, its tokens). When a sequence's page fills up it is published under
that name; a new prompt whose leading pages hash the same reuses them (their reference count
goes up) and starts its prefill after them. A page nobody references any more stays cached
(least recently released first out) until a new page is needed. The variant key includes a
slot's load epoch, so reloading a slot never serves another variant's K/V.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class OutOfPages(RuntimeError):
  """No free or evictable page is left."""


def page_hashes(tokens: Sequence[int], page_size: int, variant_key: tuple, n_pages: int,
                start: bytes = b"") -> list[bytes]:
  """Chained hashes of the first ``n_pages`` full pages of ``tokens``."""
  out, h = [], start
  vk = repr(variant_key).encode()
  for i in range(n_pages):
    chunk = tokens[i * page_size : (i + 1) * page_size]
    m = hashlib.blake2b(h, digest_size=16)
    m.update(vk)
    m.update(b",".join(str(t).encode() for t in chunk))
    h = m.digest()
    out.append(h)
  return out


@dataclasses.dataclass
class PagePool:
  """Free list, reference counts and the prefix cache of ``num_pages`` pages (page 0 reserved)."""

  num_pages: int
  page_size: int
  prefix_caching: bool = True

  def __post_init__(self):
    if self.num_pages < 2:
      raise ValueError(f"a paged KV cache needs at least 2 pages, got {self.num_pages}")
    self.refs = [0] * self.num_pages
    self.free = list(range(self.num_pages - 1, 0, -1))
    self.hash_of: dict[int, bytes] = {}
    self.page_of: dict[bytes, int] = {}
    self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: evictable
    self.hits = 0  # pages reused from the prefix cache (counter)

  @property
  def available(self) -> int:
    return len(self.free) + len(self.idle)

  @property
  def used(self) -> int:
    return self.num_pages - 1 - self.available

  def allocate(self) -> int:
    if self.free:
      page = self.free.pop()
    elif self.idle:
      page, _ = self.idle.popitem(last=False)
      del self.page_of[self.hash_of.pop(page)]
    else:
      raise OutOfPages("the KV cache has no free page")
    self.refs[page] = 1
    return page

  def share(self, pages: Sequence[int]) -> None:
    """One more reference to each of ``pages`` (held pages, e.g. a prompt forked into n)."""
    for p in pages:
      if self.refs[p] <= 0:
        raise ValueError(f"page {p} is not held; only held pages can be shared")
      self.refs[p] += 1

  def release(self, pages: Sequence[int]) -> None:
    for p in pages:
      self.refs[p] -= 1
      if self.refs[p] == 0:
        if p in self.hash_of:
          self.idle[p] = None
        else:
          self.free.append(p)

  def lookup(self, hashes: Sequence[bytes]) -> list[int]:
    """Pages for the longest cached run of ``hashes`` from the start; each gains a reference."""
    if not self.prefix_caching:
      return []
    out = []
    for h in hashes:
      p = self.page_of.get(h)
      if p is None:
        break
      if self.refs[p] == 0:
        self.idle.pop(p, None)
      self.refs[p] += 1
      out.append(p)
    self.hits += len(out)
    return out

  def publish(self, page: int, h: bytes) -> None:
    """Names a full page by its hash (first page with a given hash wins)."""
    if self.prefix_caching and h not in self.page_of and page not in self.hash_of:
      self.page_of[h] = page
      self.hash_of[page] = h

  def clear_cache(self) -> None:
    """Forgets every cached prefix (referenced pages stay allocated)."""
    for p in list(self.idle):
      self.free.append(p)
    self.idle.clear()
    self.page_of.clear()
    self.hash_of.clear()
