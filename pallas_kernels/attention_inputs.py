"""`AttentionInputs`: what paged attention reads about one ragged token batch, as one pytree.

The scheduler fills one per step (`bitdelta_jax.engine.batch.PagedBatch.attention`), the model
hands it through every layer, and `pallas_kernels.paged_attention` reads it (the reference, the
CPU and the Mosaic GPU paths alike). A batch is N tokens, decode tokens first (one per sequence,
each a *lane*), then prompt chunks; see `pallas_kernels.paged_attention.reference` for how the
two passes read the fields.

numpy only at module level: the scheduler builds these without JAX. `register_pytree` (called by
`pallas_kernels.paged_attention` on import and by the engine before it jits a step) makes the
class a pytree: the arrays are its leaves, ``block_pages`` is static.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
  """Page tables, lengths and positions of one ragged batch (int32 arrays, host or device)."""

  positions: np.ndarray  # [N] each token's position in its own sequence
  token_seq: np.ndarray  # [N] a prompt token's sequence: its index in the page list (-1: none)
  lane_pages: np.ndarray  # [R, P] page table of the decode token at position r
  lane_len: np.ndarray  # [R] its keys after this step's write (0: not a decode token)
  pages: np.ndarray  # [U] the pages the prompt chunks read
  page_seq: np.ndarray  # [U] the sequence each page belongs to (-2: padding)
  page_start: np.ndarray  # [U] position of the page's first token
  page_fill: np.ndarray  # [U] valid tokens in the page after this step's writes
  blocks: np.ndarray  # [2] page blocks the decode and the prompt pass walk (the host counts)
  block_pages: int  # pages per attention block (static)

  @classmethod
  def empty(cls, n: int, lanes: int, lane_width: int, block_pages: int) -> AttentionInputs:
    """N padding tokens: no lane, no prompt page (the template the scheduler fills in)."""
    u = lanes * lane_width
    i32 = lambda shape, v=0: np.full(shape, v, np.int32)  # noqa: E731
    return cls(positions=i32(n), token_seq=i32(n, -1), lane_pages=i32((lanes, lane_width)),
               lane_len=i32(lanes), pages=i32(u), page_seq=i32(u, -2), page_start=i32(u),
               page_fill=i32(u), blocks=i32(2), block_pages=int(block_pages))

  @property
  def num_lanes(self) -> int:
    return self.lane_pages.shape[0]


ARRAYS = tuple(f.name for f in dataclasses.fields(AttentionInputs) if f.name != "block_pages")


@functools.cache
def register_pytree() -> None:
  """Idempotent: the arrays are data, ``block_pages`` is static (part of the tree's shape)."""
  import jax

  jax.tree_util.register_dataclass(AttentionInputs, data_fields=list(ARRAYS),
                                   meta_fields=["block_pages"])
