"""The built-in family's byte-level tokenizer (tokenizer.json) and chat template.

ids 0..4 are special tokens, ids 5..260 are the 256 bytes (one token per byte, no merges), so
any text round-trips exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS, USER, ASSISTANT = range(5)
VOCAB_SIZE = 264  # 5 specials + 256 bytes, padded to a multiple of 8
CHAT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}"
  "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
  "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
  "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Tokenizer:
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
  vocab = {s: i for i, s in enumerate(SPECIALS)}
  vocab |= {c: len(SPECIALS) + i for i, c in enumerate(byte_chars)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(SPECIALS)
  return tok


def _byte_of(c: str) -> int:
  # GPT-2 byte-to-unicode map, inverted: printable bytes map to themselves, others are shifted.
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
    range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(map(chr, cs), bs))[c]


def write_tokenizer(directory: str | Path) -> None:
  d = Path(directory)
  build_tokenizer().save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
    "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": 512,
    "clean_up_tokenization_spaces": False,
  }, indent=2))
  (d / "special_tokens_map.json").write_text(json.dumps(
    {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, indent=2))
