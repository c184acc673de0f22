"""The paged engine's device side: the KV page pools, the model state and the jitted step.

    runner = PagedRunner(model, num_pages=1025, page_size=16, mesh=mesh)
    out = runner.run(batch, base_only=False)     # a PagedBatch of host arrays -> StepOutput
    tokens = runner.fetch(out.tokens)             # host values (on any number of processes)
    runner.copy_pages(src, dst)                   # forked choices' partly filled last pages
    runner.load_variant(slot, delta); runner.clear_slot(slot)

The scheduler (`bitdelta_jax.models.paged.PagedGenerator`) decides everything on the host and
hands the runner one `PagedBatch` per call; the runner holds no scheduling state, so every
process of a multi-process server can replay process 0's calls on its own runner and dispatch
the same computations in the same order (`serving.multihost`). A batch whose ``controls`` is
None uses cached neutral control arrays (no mask, bias or penalty): plain batches then send and
transfer nothing for them.

On a mesh spanning several processes, host inputs become global arrays with
`jax.make_array_from_callback` (every process passes the same values), and `fetch` reads a
replicated output from this process's first shard.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from bitdelta_jax.models import slots as slots_lib
from bitdelta_jax.models.controls import LogitControls
from bitdelta_jax.models.mesh_layout import MeshLayout
from bitdelta_jax.models.paged_batch import PagedBatch, StepOutput, copy_pages_impl, run_impl


class PagedRunner:
  """Device state of the paged engine and the calls that change it; see the module docstring."""

  def __init__(self, model, *, num_pages: int, page_size: int, max_seq_len: int, mesh=None,
               rules=None):
    cfg = model.config
    self.model = model
    self.num_pages, self.page_size, self.max_seq_len = int(num_pages), int(page_size), int(max_seq_len)
    self.layout = MeshLayout.of(model, mesh, rules)
    shape = (cfg.num_layers, self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
    self.k_pool = self.layout.zeros(shape, model.dtype, self.layout.kv)
    self.v_pool = self.layout.zeros(shape, model.dtype, self.layout.kv)
    self.graphdef, self.state = nnx.split(model)
    self._run, self._copy_pages = self.layout.jit_step(
      functools.partial(run_impl, self.graphdef), copy_pages_impl)
    self.vocab_size = cfg.vocab_size + cfg.extra_vocab  # the width of the logits
    self._neutral: dict[int, LogitControls] = {}  # rows -> device arrays, reused every step
    self.local = self.layout.mesh is None or all(
      d.process_index == jax.process_index() for d in self.layout.mesh.devices.flat)

  @property
  def mesh(self):
    return self.layout.mesh

  @property
  def kv_bytes(self) -> int:
    return 2 * self.k_pool.size * self.k_pool.dtype.itemsize

  @property
  def compiles(self) -> int:
    return self._run._cache_size()

  # -- the calls ------------------------------------------------------------------------------
  def run(self, batch: PagedBatch, base_only: bool) -> StepOutput:
    """One step over ``batch`` (host arrays); the pools are donated and replaced."""
    self.k_pool, self.v_pool, out = self._run(self.state, self.k_pool, self.v_pool,
                                              self._inputs(batch), bool(base_only))
    return out

  def lower(self, batch: PagedBatch, base_only: bool):
    """The step over ``batch``'s shapes, lowered (``.compile()`` it; nothing runs)."""
    return self._run.lower(self.state, self.k_pool, self.v_pool, self._inputs(batch),
                           bool(base_only))

  def _inputs(self, batch: PagedBatch) -> PagedBatch:
    if batch.controls is None:
      batch = dataclasses.replace(batch, controls=self.neutral(batch.out_index.shape[0]))
    if not self.local:
      batch = self.layout.replicate(batch)
    return batch

  def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    if not self.local:
      src, dst = self.layout.replicate((src, dst))
    self.k_pool, self.v_pool = self._copy_pages(self.k_pool, self.v_pool, src, dst)

  def load_variant(self, slot: int, delta) -> None:
    """``delta``: an in-memory delta dict, or (on a mesh) also a delta directory, written
    shard by shard."""
    if self.mesh is not None:
      from bitdelta_jax.sharding.restore import load_variant_sharded

      load_variant_sharded(self.model, slot, delta)
    else:
      slots_lib.load_variant(self.model, slot, delta)
    self.refresh()

  def clear_slot(self, slot: int) -> None:
    if self.mesh is not None:
      self.load_variant(slot, {})
      return
    slots_lib.clear_slot(self.model, slot)
    self.refresh()

  def refresh(self) -> None:
    """Re-reads the model's state (after its banks or parameters changed)."""
    self.state = self.layout.place_state(nnx.state(self.model))

  # -- helpers --------------------------------------------------------------------------------
  def neutral(self, rows: int) -> LogitControls:
    """Controls that change nothing, for ``rows`` outputs, as cached device arrays."""
    if rows not in self._neutral:
      self._neutral[rows] = self.layout.replicate(
        LogitControls.neutral(rows, self.vocab_size, self.max_seq_len))
    return self._neutral[rows]

  def fetch(self, x) -> np.ndarray:
    """A replicated output as a host array (from this process's first shard off one host)."""
    if self.local:
      return np.asarray(x)
    return np.asarray(x.addressable_data(0))
