"""Deterministic synthetic Llama-style HF checkpoints: a base and a fine-tune of it.

Used by `bitdelta demo` (until the built-in family lands), the tests and the compression bench.
The fine-tune adds a small low-rank update plus noise to every linear layer, as real fine-tunes
do (‖Δ‖/‖W‖ of a few percent), and optionally grows the vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from bitdelta_jax.hf.safetensors_io import save_file, save_sharded


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 160
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  tie_word_embeddings: bool = False

  def hf_config(self, vocab_size: int | None = None) -> dict:
    return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": vocab_size or self.vocab_size, "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
      "num_attention_heads": self.num_attention_heads,
      "num_key_value_heads": self.num_key_value_heads, "hidden_act": "silu",
      "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
      "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": "bfloat16",
      "bos_token_id": 1, "eos_token_id": 2,
    }


def linear_shapes(c: SyntheticConfig) -> dict[str, tuple[int, int]]:
  """HF ``[out, in]`` shapes of every linear weight."""
  d, f = c.hidden_size, c.intermediate_size
  hd = d // c.num_attention_heads
  kv = hd * c.num_key_value_heads
  out = {}
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}."
    out |= {p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f)}
  return out


def make_base(c: SyntheticConfig, seed: int = 0, dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
  r = np.random.default_rng(seed)
  t = {"model.embed_tokens.weight": (0.02 * r.standard_normal((c.vocab_size, c.hidden_size)))}
  for name, shape in linear_shapes(c).items():
    t[name] = r.standard_normal(shape, np.float32) / np.sqrt(shape[1])
    layer = name.rsplit(".", 3)[0]
    t.setdefault(layer + ".input_layernorm.weight", np.ones(c.hidden_size))
    t.setdefault(layer + ".post_attention_layernorm.weight", np.ones(c.hidden_size))
  t["model.norm.weight"] = np.ones(c.hidden_size)
  if not c.tie_word_embeddings:
    t["lm_head.weight"] = 0.02 * r.standard_normal((c.vocab_size, c.hidden_size))
  return {k: np.asarray(v).astype(dtype) for k, v in t.items()}


def make_finetune(base: dict[str, np.ndarray], seed: int = 1, rel: float = 0.03, rank: int = 4,
                  extra_vocab: int = 0) -> dict[str, np.ndarray]:
  """``base`` plus a rank-``rank`` update and noise of relative size ``rel`` on linear layers."""
  r = np.random.default_rng(seed)
  out = {}
  for name, w in base.items():
    w32 = w.astype(np.float32)
    if w.ndim == 2 and "embed" not in name and "lm_head" not in name:
      a = r.standard_normal((w.shape[0], rank), np.float32)
      b = r.standard_normal((rank, w.shape[1]), np.float32)
      upd = a @ b + r.standard_normal(w.shape, np.float32)
      upd *= rel * np.linalg.norm(w32) / np.linalg.norm(upd)
      w32 = w32 + upd
    elif "norm" in name:
      w32 = w32 + 0.01 * r.standard_normal(w.shape)
    out[name] = w32.astype(w.dtype)
  if extra_vocab:
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
      if name in out:
        rows = 0.02 * r.standard_normal((extra_vocab, out[name].shape[1]))
        out[name] = np.concatenate([out[name], rows.astype(out[name].dtype)])
  return out


def write_checkpoint(tensors: dict[str, np.ndarray], directory: str | Path, config: dict,
                     max_shard_bytes: int | None = None) -> Path:
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  if max_shard_bytes:
    save_sharded(tensors, directory, max_shard_bytes)
  else:
    save_file(tensors, directory / "model.safetensors")
  (directory / "config.json").write_text(json.dumps(config, indent=2))
  return directory


def write_pair(root: str | Path, c: SyntheticConfig = SyntheticConfig(), *, seed: int = 0,
               extra_vocab: int = 0, max_shard_bytes: int | None = None) -> tuple[Path, Path]:
  """Writes ``root/base`` and ``root/finetuned``; returns both paths."""
  root = Path(root)
  base = make_base(c, seed)
  ft = make_finetune(base, seed + 1, extra_vocab=extra_vocab)
  b = write_checkpoint(base, root / "base", c.hf_config())
  f = write_checkpoint(ft, root / "finetuned", c.hf_config(c.vocab_size + extra_vocab),
                       max_shard_bytes)
  return b, f
