"""A Hugging Face Llama checkpoint directory → a llama-architecture GGUF file (f32 or bf16).

The inverse of `bitdelta_jax.hf.gguf_import`, for running the same weights in llama.cpp (the
CPU bench compares against it). Tensors are renamed to llama.cpp's names and the rows of every
q_proj / k_proj head are permuted from HF's "rotate half" RoPE layout to the interleaved one
ggml's RoPE reads (llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``; k_proj per kv
head). In bf16 the 2-D weights are rounded to nearest even (``gguf.quants``, as ggml does) and
the 1-D norm weights stay f32, as llama.cpp's own converter writes them. A tied LM head is the
embedding: no ``output.weight`` is written.

The tokenizer metadata comes from ``tokenizer.json`` (byte-level BPE only: vocabulary, merges,
added tokens as control / user-defined tokens) and ``tokenizer_config.json`` (BOS/EOS/UNK/PAD,
``add_bos_token``, the chat template). The pre-tokenizer is named for llama.cpp from its
structure (``Digits`` then ``ByteLevel``: ``smollm``; ``ByteLevel`` alone: ``gpt2``).

    path = write_gguf(hf_dir, "model-f32.gguf", dtype="f32")   # or dtype="bf16"
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from bitdelta_jax.hf.gguf_import import _LAYER_NAMES, _TOP_NAMES, GGUFImportError

DTYPES = ("f32", "bf16")
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types

_GGUF_LAYER = {hf: gg for gg, hf in _LAYER_NAMES.items()}
_GGUF_TOP = {hf: gg for gg, hf in _TOP_NAMES.items()}


class GGUFExportError(GGUFImportError):
  """A checkpoint this exporter does not write exactly."""


def gguf_tensor_name(hf_name: str) -> str:
  if hf_name in _GGUF_TOP:
    return _GGUF_TOP[hf_name]
  parts = hf_name.split(".", 3)  # model.layers.N.rest
  if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _GGUF_LAYER:
    return f"blk.{int(parts[2])}.{_GGUF_LAYER[parts[3]]}"
  raise GGUFExportError(f"tensor {hf_name!r} has no llama.cpp counterpart")


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's q/k ``permute``: per head, rows ``[0, d/2, 1, d/2 + 1, ...]`` (inverse of
  `gguf_import.unpermute_rows`)."""
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise GGUFExportError(f"{rows} rows do not split into {num_heads} heads of even size")
  return (
    w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def _check_config(cfg: dict[str, Any]) -> None:
  if cfg.get("model_type") != "llama":
    raise GGUFExportError(f"model_type {cfg.get('model_type')!r}: only 'llama' is exported")
  if cfg.get("rope_scaling"):
    raise GGUFExportError(f"rope_scaling {cfg['rope_scaling']!r}: not exported")
  if cfg.get("attention_bias") or cfg.get("mlp_bias"):
    raise GGUFExportError("attention / MLP biases: not exported")


def _pre_name(pre: dict | None) -> str:
  kinds = [p["type"] for p in (pre or {}).get("pretokenizers", [pre] if pre else [])]
  if kinds == ["ByteLevel"]:
    return "gpt2"
  if kinds == ["Digits", "ByteLevel"] and pre["pretokenizers"][0].get("individual_digits"):
    return "smollm"
  raise GGUFExportError(f"pre-tokenizer {kinds}: not exported (known: ByteLevel, Digits+ByteLevel)")


def tokenizer_metadata(hf_dir: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
  """tokens, token types, merges, pre-tokenizer name, special ids, flags, chat template."""
  d = Path(hf_dir)
  tj = json.loads((d / "tokenizer.json").read_text())
  tc_path = d / "tokenizer_config.json"
  tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
  model = tj["model"]
  if model.get("type") != "BPE" or (tj.get("decoder") or {}).get("type") != "ByteLevel":
    raise GGUFExportError("tokenizer: only byte-level BPE is exported")
  tokens: list[str | None] = [None] * vocab_size
  types = [_NORMAL] * vocab_size
  for t, i in model["vocab"].items():
    if i >= vocab_size:
      raise GGUFExportError(f"token id {i} >= the model's vocab_size {vocab_size}")
    tokens[i] = t
  for a in tj.get("added_tokens", []):
    if a["id"] >= vocab_size:
      raise GGUFExportError(f"added token id {a['id']} >= the model's vocab_size {vocab_size}")
    tokens[a["id"]] = a["content"]
    types[a["id"]] = _CONTROL if a.get("special") else _USER_DEFINED
  for i, t in enumerate(tokens):  # ids the tokenizer never produces (a padded embedding)
    if t is None:
      tokens[i], types[i] = f"[PAD{i}]", _UNUSED
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  ids = {t: i for i, t in enumerate(tokens)}

  def token_id(v) -> int | None:
    content = v.get("content") if isinstance(v, dict) else v
    return ids.get(content) if content is not None else None

  out: dict[str, Any] = {
    "tokens": tokens,
    "token_type": types,
    "merges": merges,
    "pre": _pre_name(tj.get("pre_tokenizer")),
    "add_bos_token": bool(tc.get("add_bos_token", False)),
    "add_eos_token": bool(tc.get("add_eos_token", False)),
    "chat_template": tc.get("chat_template"),
  }
  for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
    tid = token_id(tc.get(f"{key}_token"))
    if tid is not None:
      out[f"{name}_token_id"] = tid
  return out


def _add_metadata(w, cfg: dict[str, Any], tok: dict[str, Any], dtype: str, name: str) -> None:
  import gguf

  hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
  head_dim = cfg.get("head_dim") or hidden // heads
  w.add_name(name)
  w.add_context_length(cfg["max_position_embeddings"])
  w.add_embedding_length(hidden)
  w.add_block_count(cfg["num_hidden_layers"])
  w.add_feed_forward_length(cfg["intermediate_size"])
  w.add_head_count(heads)
  w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
  if head_dim != hidden // heads:
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
  w.add_rope_dimension_count(head_dim)
  w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
  w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
  w.add_vocab_size(cfg["vocab_size"])
  w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_BF16)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(tok["pre"])
  w.add_token_list(tok["tokens"])
  w.add_token_types(tok["token_type"])
  w.add_token_merges(tok["merges"])
  w.add_add_space_prefix(False)
  w.add_add_bos_token(tok["add_bos_token"])
  w.add_add_eos_token(tok["add_eos_token"])
  for key, add in (
    ("bos_token_id", w.add_bos_token_id),
    ("eos_token_id", w.add_eos_token_id),
    ("unknown_token_id", w.add_unk_token_id),
    ("padding_token_id", w.add_pad_token_id),
  ):
    if key in tok:
      add(tok[key])
  if tok["chat_template"]:
    w.add_chat_template(tok["chat_template"])


def write_gguf(
  hf_dir: str | os.PathLike,
  out_path: str | os.PathLike,
  *,
  dtype: str = "f32",
  name: str | None = None,
) -> Path:
  """Writes ``hf_dir``'s model (``model.safetensors``, one file) as a GGUF at ``out_path``
  (through a temporary file, renamed when complete); returns the path."""
  import gguf
  from safetensors import safe_open

  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  d, out = Path(hf_dir), Path(out_path)
  cfg = json.loads((d / "config.json").read_text())
  _check_config(cfg)
  tok = tokenizer_metadata(d, cfg["vocab_size"])
  heads, kv_heads = (
    cfg["num_attention_heads"],
    cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(out.name + ".partial")
  w = gguf.GGUFWriter(str(tmp), "llama")
  _add_metadata(w, cfg, tok, dtype, name or d.name)
  with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
    names = list(f.keys())
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in names:
      names.remove("lm_head.weight")  # the embedding is the head
    for hf_name in names:
      a = np.asarray(f.get_tensor(hf_name), dtype=np.float32)
      if hf_name.endswith("q_proj.weight"):
        a = permute_rows(a, heads)
      elif hf_name.endswith("k_proj.weight"):
        a = permute_rows(a, kv_heads)
      a = np.ascontiguousarray(a)
      if dtype == "bf16" and a.ndim >= 2:
        w.add_tensor(
          gguf_tensor_name(hf_name),
          gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
          raw_dtype=gguf.GGMLQuantizationType.BF16,
        )
      else:
        w.add_tensor(gguf_tensor_name(hf_name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
  os.replace(tmp, out)
  return out
