"""Opens a base or fine-tune checkpoint directory with the reader its format needs.

    with open_checkpoint(base_dir) as r:    # CheckpointReader interface: names, info, read, ...
      w = r.read("model.layers.0.self_attn.q_proj.weight")

A GGUF base's metadata directory (`gguf_checkpoint.resolve_base`) gives a `GGUFCheckpoint`
(its tensors dequantized to f32 in HF layout); anything else, a safetensors `CheckpointReader`.
"""

from __future__ import annotations

import os

from bitdelta_jax.hf.gguf_checkpoint import GGUFCheckpoint, is_gguf_dir
from bitdelta_jax.hf.safetensors_io import CheckpointReader


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
  """The reader of the checkpoint at ``path`` (a directory, or one safetensors file)."""
  if is_gguf_dir(path):
    return GGUFCheckpoint(path)
  return CheckpointReader(path)
