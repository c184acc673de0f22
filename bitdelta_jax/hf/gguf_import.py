"""A llama-architecture GGUF file → a Hugging Face checkpoint directory, without torch.

Tensors are dequantized to float32 with the `gguf` package (llama.cpp's numpy reference code,
the routine transformers' GGUF loader calls too) and renamed to the HF names. llama.cpp's
converter reorders the rows of every q_proj / k_proj head from HF's "rotate half" RoPE layout
(pairs ``(i, i + d/2)``) to the interleaved one ggml's RoPE reads (pairs ``(2i, 2i + 1)``);
`gguf_names.unpermute_rows` undoes that, per kv head for k_proj (GQA). Without an
``output.weight`` tensor the LM head is the embedding (``tie_word_embeddings``) and no
``lm_head.weight`` is written.

The tokenizer is rebuilt from the metadata as a byte-level BPE `tokenizers.Tokenizer`: the
file's vocabulary (already spelled in GPT-2's byte alphabet), its merges, its control tokens as
special added tokens, and the pre-tokenizer its ``tokenizer.ggml.pre`` names.

    config = write_hf_checkpoint(reader, out_dir)   # model.safetensors, config.json, tokenizer*
    reader = gguf.GGUFReader(path)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bitdelta_jax.hf.gguf_names import GGUFImportError, hf_tensor_name, unpermute_rows
from bitdelta_jax.hf.safetensors_io import SafetensorsWriter

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def field(reader, key: str, default: Any = None) -> Any:
  """One metadata value (str, number, bool or list), or ``default`` if absent."""
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def _shortest_f32(x: float) -> float:
  """The float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
  return float(str(np.float32(x)))


def hf_config(reader) -> dict[str, Any]:
  """``config.json`` of `LlamaForCausalLM` from the GGUF metadata."""
  arch = field(reader, "general.architecture")
  if arch != "llama":
    raise GGUFImportError(f"GGUF architecture {arch!r}: only 'llama' is imported")
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names:
    raise GGUFImportError("GGUF carries rope_freqs (Llama-3 RoPE scaling): not imported")
  scaling = field(reader, f"{arch}.rope.scaling.type", "none")
  if scaling != "none":
    raise GGUFImportError(f"GGUF RoPE scaling {scaling!r}: not imported")

  def req(key: str):
    v = field(reader, f"{arch}.{key}")
    if v is None:
      raise GGUFImportError(f"GGUF metadata lacks {arch}.{key}")
    return v

  hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
  head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // heads))
  rope_dim = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise GGUFImportError(f"partial rotary embedding ({rope_dim} of {head_dim} dims): not imported")
  tokens = field(reader, "tokenizer.ggml.tokens") or []
  cfg = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": hidden,
    "intermediate_size": int(req("feed_forward_length")),
    "num_hidden_layers": int(req("block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", heads)),
    "head_dim": head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": int(req("context_length")),
    "rms_norm_eps": _shortest_f32(req("attention.layer_norm_rms_epsilon")),
    "rope_theta": _shortest_f32(field(reader, f"{arch}.rope.freq_base", 10000.0)),
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": "output.weight" not in names,
    "vocab_size": int(field(reader, f"{arch}.vocab_size", len(tokens))),
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "torch_dtype": "float32",
  }
  for key in ("bos", "eos", "pad"):
    gguf_key = "padding" if key == "pad" else key
    v = field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
    if v is not None:
      cfg[f"{key}_token_id"] = int(v)
  return cfg


# -- tensors -------------------------------------------------------------------------------------
def hf_tensors(reader, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 array in HF layout) for every tensor, in file order."""
  import gguf

  for t in reader.tensors:
    name = hf_tensor_name(t.name)
    shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dims innermost first
    w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if name.endswith("q_proj.weight"):
      w = unpermute_rows(w, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      w = unpermute_rows(w, cfg["num_key_value_heads"])
    yield name, w


def write_safetensors(reader, cfg: dict[str, Any], path: Path) -> None:
  """Streams the dequantized tensors into one float32 safetensors file."""
  specs = {
    hf_tensor_name(t.name): (tuple(int(n) for n in reversed(t.shape)), np.float32)
    for t in reader.tensors
  }
  with SafetensorsWriter(path, specs, {"format": "pt"}) as w:
    for name, arr in hf_tensors(reader, cfg):
      w.write(name, arr)


# -- tokenizer -----------------------------------------------------------------------------------
def _pre_tokenizer(pre: str):
  from tokenizers import pre_tokenizers

  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("gpt2", "gpt-2", "default"):
    return byte_level
  if pre == "smollm":  # llama.cpp: "\p{N}" then the GPT-2 regex; HF: Digits then ByteLevel
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  raise GGUFImportError(f"GGUF pre-tokenizer {pre!r}: not imported (known: smollm, gpt2)")


def build_tokenizer(reader):
  """The file's byte-level BPE tokenizer as a `tokenizers.Tokenizer`."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors

  kind = field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFImportError(f"GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2')")
  tokens = field(reader, "tokenizer.ggml.tokens")
  types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges") or []]  # none: omitted
  vocab = {tok: i for i, tok in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise GGUFImportError("GGUF vocabulary has duplicate tokens")
  tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default"))
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(
    [
      AddedToken(t, normalized=False, special=True)
      for t, ty in zip(tokens, types)
      if ty == _CONTROL
    ]
  )
  tok.add_tokens(
    [
      AddedToken(t, normalized=False, special=False)
      for t, ty in zip(tokens, types)
      if ty == _USER_DEFINED
    ]
  )
  added = {}  # BOS / EOS the file asks to add around every text
  for key in ("bos", "eos"):
    tid = field(reader, f"tokenizer.ggml.{key}_token_id")
    if field(reader, f"tokenizer.ggml.add_{key}_token", False) and tid is not None:
      added[key] = (tokens[tid], int(tid))
  if added:
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    tok.post_processor = processors.TemplateProcessing(
      single=[*bos, "$A", *eos],
      pair=[*bos, "$A", *eos, "$B:1"],
      special_tokens=list(added.values()),
    )
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def tokenizer_config(reader) -> dict[str, Any]:
  """``tokenizer_config.json``: special tokens, BOS/EOS flags and the chat template."""
  tokens = field(reader, "tokenizer.ggml.tokens")
  types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  cfg: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
    "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
    "clean_up_tokenization_spaces": False,
    "model_max_length": int(field(reader, "llama.context_length", 2048)),
  }
  for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
    tid = field(reader, f"tokenizer.ggml.{key}_token_id")
    if tid is not None:
      cfg[f"{name}_token"] = tokens[tid]
  cfg["added_tokens_decoder"] = {
    str(i): {
      "content": t,
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": ty == _CONTROL,
    }
    for i, (t, ty) in enumerate(zip(tokens, types))
    if ty in (_CONTROL, _USER_DEFINED)
  }
  template = field(reader, "tokenizer.chat_template")
  if template:
    cfg["chat_template"] = template
  return cfg


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
  return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}


def dump_json(path: Path, obj: dict) -> None:
  path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_config_files(reader, out_dir: str | os.PathLike) -> dict[str, Any]:
  """Everything but the weights (config.json, generation_config.json, tokenizer.json,
  tokenizer_config.json) into ``out_dir`` (created if missing); returns the config dict."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  cfg = hf_config(reader)
  tok = build_tokenizer(reader)
  if tok.get_vocab_size(with_added_tokens=True) != cfg["vocab_size"]:
    raise GGUFImportError(
      f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, the model "
      f"{cfg['vocab_size']}"
    )
  tok.save(str(out / "tokenizer.json"))
  dump_json(out / "config.json", cfg)
  dump_json(out / "generation_config.json", generation_config(cfg))
  dump_json(out / "tokenizer_config.json", tokenizer_config(reader))
  return cfg


def write_hf_checkpoint(reader, out_dir: str | os.PathLike) -> dict[str, Any]:
  """Writes the checkpoint files into ``out_dir`` (created if missing); returns the config
  dict."""
  cfg = write_config_files(reader, out_dir)
  write_safetensors(reader, cfg, Path(out_dir) / "model.safetensors")
  return cfg
