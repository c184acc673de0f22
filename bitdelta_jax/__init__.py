"""bitdelta-jax: 1-bit deltas of fine-tunes, served side by side on one base (JAX).

    import bitdelta_jax as bdj
    model = bdj.from_pretrained("base_dir", num_slots=3)
    gen = bdj.Generator(model, max_rows=4, max_seq_len=256)
    gen.load_variant(1, bdj.load_delta("delta_dir")[0])
    gen.generate([[1, 2, 3]], slot_ids=[1], params=bdj.SamplingParams(max_new_tokens=8))

The names in `__all__` are the stable API (docs/API.md); deeper module paths may change. They
are imported lazily, on first use, so ``import bitdelta_jax`` does not import JAX.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata

try:
  __version__ = _metadata.version("bitdelta-jax")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
  __version__ = "0.1.0"

# Public name → module that defines it.
_EXPORTS = {
  # compression and materialisation, on parameter trees and on HF checkpoint directories
  "CompressPolicy": "bitdelta_jax.delta.compress",
  "Dense": "bitdelta_jax.delta.compress",
  "DeltaMismatchError": "bitdelta_jax.delta.compress",
  "compress": "bitdelta_jax.delta.compress",
  "apply_delta": "bitdelta_jax.delta.compress",
  "PackedDelta": "bitdelta_jax.delta.format",
  "pack": "bitdelta_jax.delta.format",
  "dense_delta": "bitdelta_jax.delta.format",
  "Report": "bitdelta_jax.delta.report",
  "compress_checkpoints": "bitdelta_jax.delta.stream",
  "apply_checkpoint": "bitdelta_jax.delta.stream",
  "fingerprint_checkpoint": "bitdelta_jax.hf.fingerprint",
  # the delta store
  "DeltaStoreError": "bitdelta_jax.delta.store",
  "load_delta": "bitdelta_jax.delta.store",
  "save_delta": "bitdelta_jax.delta.store",
  "read_manifest": "bitdelta_jax.delta.store",
  # models, variant slots and generation
  "from_pretrained": "bitdelta_jax.models",
  "from_tensors": "bitdelta_jax.models",
  "Generator": "bitdelta_jax.engine",
  "Generation": "bitdelta_jax.engine",
  "SamplingParams": "bitdelta_jax.engine",
  "Tokenizer": "bitdelta_jax.models",
  "load_variant": "bitdelta_jax.models",
  "clear_slot": "bitdelta_jax.models",
  "load_lora": "bitdelta_jax.models",
  # scale distillation
  "DistillConfig": "bitdelta_jax.distill",
  "distill": "bitdelta_jax.distill",
  "Distilled": "bitdelta_jax.distill",
  "distill_checkpoint": "bitdelta_jax.distill",
  "slot_scales": "bitdelta_jax.distill",
  # merging (parameter trees) and the K-Merge LoRA pool
  "linear": "bitdelta_jax.merge",
  "task_arithmetic": "bitdelta_jax.merge",
  "ties": "bitdelta_jax.merge",
  "dare_linear": "bitdelta_jax.merge",
  "dare_ties": "bitdelta_jax.merge",
  "KMergePool": "bitdelta_jax.kmerge",
  "PoolConfig": "bitdelta_jax.kmerge",
  # outputs that never lose data
  "OutputError": "bitdelta_jax.outputs",
  "atomic_output_dir": "bitdelta_jax.outputs",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'bitdelta_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # later look-ups skip this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
