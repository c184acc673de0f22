"""Attention of one ragged token batch over a paged KV cache (see `reference`).

`ragged_paged_attention` dispatches by platform (`api`): the Mosaic GPU decode and prefill
kernels (`mosaic_gpu`, `mosaic_gpu_prefill`) on CUDA, the C++ decode kernel (`cpu`) on the host CPU, the plain-jnp reference
elsewhere; `lowering_platform("cuda")` selects the
GPU path while lowering for CUDA on another backend. `write_kv` stores a step's new K/V into a
pool (in place on the CPU for bf16 pools). What a batch's tokens read (page tables, lengths,
positions) is one pytree, `AttentionInputs`.
"""

from ..attention_inputs import AttentionInputs
from ..platform import lowering_platform
from .api import IMPLEMENTATIONS, ragged_paged_attention, unavailable_reason, write_kv
from .reference import ragged_paged_attention as ragged_paged_attention_reference

__all__ = [
  "AttentionInputs",
  "IMPLEMENTATIONS",
  "lowering_platform",
  "ragged_paged_attention",
  "ragged_paged_attention_reference",
  "unavailable_reason",
  "write_kv",
]
