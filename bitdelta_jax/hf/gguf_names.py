"""How a HF Llama checkpoint's tensors are named and laid out in a llama.cpp GGUF file.

The one table both directions read (`gguf_import`: GGUF → HF, `gguf_export`: HF → GGUF, and the
readers of a GGUF base, `gguf_base` and `gguf_checkpoint`), and llama.cpp's RoPE row order:
its converter reorders the rows of every q_proj / k_proj head from HF's "rotate half" layout
(pairs ``(i, i + d/2)``) to the interleaved one ggml's RoPE reads (pairs ``(2i, 2i + 1)``);
`permute_rows` does that, `unpermute_rows` undoes it (per kv head for k_proj: GQA).
"""

from __future__ import annotations

import re

import numpy as np


class GGUFImportError(ValueError):
  """A GGUF file this importer does not convert exactly."""


class GGUFExportError(GGUFImportError):
  """A checkpoint this exporter does not write exactly."""


# GGUF tensor name (``blk.N.`` stripped) → HF name (``model.layers.N.`` stripped).
LAYER_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {hf: gg for gg, hf in LAYER_NAMES.items()}
_GGUF_TOP = {hf: gg for gg, hf in TOP_NAMES.items()}


def hf_tensor_name(gguf_name: str) -> str:
  m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
  if m and m.group(2) in LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
  if gguf_name in TOP_NAMES:
    return TOP_NAMES[gguf_name]
  raise GGUFImportError(f"GGUF tensor {gguf_name!r} has no counterpart in a HF Llama checkpoint")


def gguf_tensor_name(hf_name: str) -> str:
  if hf_name in _GGUF_TOP:
    return _GGUF_TOP[hf_name]
  parts = hf_name.split(".", 3)  # model.layers.N.rest
  if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _GGUF_LAYER:
    return f"blk.{int(parts[2])}.{_GGUF_LAYER[parts[3]]}"
  raise GGUFExportError(f"tensor {hf_name!r} has no llama.cpp counterpart")


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's q/k ``permute``: per head, rows ``[0, d/2, 1, d/2 + 1, ...]`` (inverse of
  `unpermute_rows`)."""
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise GGUFExportError(f"{rows} rows do not split into {num_heads} heads of even size")
  return (
    w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k ``permute``: per head, rows ``[0, 2, 4, ..., 1, 3, 5, ...]``."""
  rows = w.shape[0]
  half = rows // num_heads // 2
  if rows != num_heads * 2 * half:
    raise GGUFImportError(f"{rows} rows do not split into {num_heads} heads of even size")
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
