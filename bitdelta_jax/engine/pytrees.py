"""Registers the data that crosses from the scheduler to the jitted step as JAX pytrees.

The scheduler's types (`batch.PagedBatch`, `StepOutput`, `logit_controls.LogitControls`)
are plain frozen dataclasses of arrays, defined without JAX so the scheduler runs in a process
that never imports it; every module that hands them to JAX calls `register_step_data` first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax


@functools.cache
def register_step_data() -> None:
  """Idempotent: registers each type once, every field a data field (and the batch's
  `AttentionInputs`, whose ``block_pages`` is static)."""
  from bitdelta_jax.engine.batch import PagedBatch, StepOutput
  from bitdelta_jax.engine.logit_controls import LogitControls
  from pallas_kernels.attention_inputs import register_pytree

  register_pytree()
  for cls in (LogitControls, PagedBatch, StepOutput):
    jax.tree_util.register_dataclass(
      cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])
