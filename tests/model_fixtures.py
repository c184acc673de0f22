"""Tiny random HF models (transformers, PyTorch CPU) saved to tmp dirs, for the model tests.

The ``hf_models`` fixture reaches every test through tests/conftest.py; the helpers
(``hf_greedy``, ``forward``, ``make_tokenizer_dir``, ...) are imported from here. Models are
built once per session and shared.
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

TINY = dict(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
)

# name -> (family, config overrides). Windows and scaled RoPE are small enough that the test
# sequences (12+ tokens) exercise them.
PRESETS = {
  "llama": ("llama", {}),
  "llama3_rope": (
    "llama",
    dict(
      rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
      )
    ),
  ),
  "llama_linear_tied_bias": (
    "llama",
    dict(
      rope_scaling=dict(rope_type="linear", factor=2.0),
      attention_bias=True,
      mlp_bias=True,
      tie_word_embeddings=True,
    ),
  ),
  "mistral_sliding": ("mistral", dict(sliding_window=5)),
  "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
  "qwen2": ("qwen2", {}),
}


def make_hf_model(
  family: str, out_dir: pathlib.Path, *, seed: int = 0, max_shard_size=None, **overrides
):
  """Creates, saves (safetensors) and returns a tiny random HF causal LM in float32."""
  import torch
  import transformers as tf

  cfg_cls, model_cls = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
  }[family]
  cfg = cfg_cls(**dict(TINY, **overrides))
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = model_cls(cfg).eval().to(torch.float32)
  # Random init leaves norms at 1 and biases at 0; perturb them so they are tested too.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith(".bias"):
        p.add_(0.1 * torch.randn_like(p))
  kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(out_dir, **kw)
  return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
  """``get(preset) -> (torch_model, dir)``, built once per session."""
  cache = {}

  def get(name: str):
    if name not in cache:
      family, overrides = PRESETS[name]
      d = tmp_path_factory.mktemp(name)
      cache[name] = (make_hf_model(family, d, **overrides), d)
    return cache[name]

  return get


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
  import torch

  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  with torch.no_grad():
    out = model.generate(
      torch.as_tensor([list(prompt)], dtype=torch.long),
      do_sample=False,
      max_new_tokens=max_new_tokens,
      min_new_tokens=max_new_tokens,
    )
  return out[0, len(prompt) :].tolist()


@functools.cache
def _jit_forward(graphdef):
  def f(state, ids, slot_ids):
    return nnx.merge(graphdef, state)(ids, slot_ids=slot_ids)

  return jax.jit(f)


def forward(model, ids, slot_ids=None) -> np.ndarray:
  """Jitted ``model(ids, slot_ids=...)`` (eager NNX calls are slow on CPU)."""
  graphdef, state = nnx.split(model)
  slot_ids = None if slot_ids is None else np.asarray(slot_ids, np.int32)
  return np.asarray(_jit_forward(graphdef)(state, np.asarray(ids, np.int32), slot_ids))


CHAT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] | trim }}\n"
  "{% else %}<{{ m['role'] }}> {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<assistant>{% endif %}"
)


BPE_TEXTS = ["Hello world, 1234 apples!", "  two  spaces\tand a tab",
             "<|im_start|>user\nhi<|im_end|>"]


def make_bpe_tokenizer(out_dir: pathlib.Path):
  """A byte-level BPE like SmolLM2's (Digits then ByteLevel), trained on a few sentences, with
  fewer tokens than the model's vocabulary (the rest become [PAD] tokens)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + BPE_TEXTS, trainer)
  tok.save(str(out_dir / "tokenizer.json"))
  (out_dir / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": "{{ messages[0]['content'] }}",
        "tokenizer_class": "PreTrainedTokenizerFast",
      }
    )
  )
  return tok



def make_tokenizer_dir(out_dir: pathlib.Path, vocab_size: int = 256) -> pathlib.Path:
  """A word-level tokenizer: ids 0-2 are <s>, </s>, <unk>; then "w3" ... "w{V-1}"."""
  import json

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

  vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
  vocab.update({f"w{i}": i for i in range(3, vocab_size)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
  tok.add_special_tokens(["<s>", "</s>", "<unk>"])
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  out_dir.mkdir(parents=True, exist_ok=True)
  tok.save(str(out_dir / "tokenizer.json"))
  (out_dir / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "bos_token": "<s>",
        "eos_token": {
          "__type": "AddedToken",
          "content": "</s>",
          "special": True,
          "lstrip": False,
          "rstrip": False,
          "normalized": False,
          "single_word": False,
        },
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
      }
    )
  )
  return out_dir
