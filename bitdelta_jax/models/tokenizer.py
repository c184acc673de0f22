"""Tokenizer (``tokenizer.json`` via `tokenizers`) and chat template (jinja2) of an HF directory.

    tok = Tokenizer.from_dir(path)
    ids = tok.encode("hello", add_special_tokens=True)
    text = tok.decode(ids, skip_special_tokens=True)
    tok.stop_token_ids                  # EOS + generation_config.json's eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, tokenize=True)

The chat template comes from ``chat_template.jinja`` or ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of named templates: "default" is used). It is rendered
as transformers does: a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` that
keeps non-ASCII text; ``bos_token``, ``eos_token`` and the other special tokens are passed in.
A rendered chat prompt already holds its special tokens, so it is encoded without adding more.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
  pass


def _token_str(t: Any) -> str | None:
  if isinstance(t, Mapping):
    return t.get("content")
  return t


@functools.lru_cache(maxsize=32)
def _compile_template(source: str):
  import jinja2
  from jinja2.ext import loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(source)


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special tokens and chat template of its directory."""

  def __init__(
    self, tokenizer, config: Mapping[str, Any] | None = None, chat_template: str | None = None,
    generation_eos: Sequence[int] = (),
  ):
    self.tok = tokenizer
    self.config = dict(config or {})
    self.chat_template = chat_template
    self.generation_eos = tuple(int(t) for t in generation_eos)
    self.special_tokens = {
      k: _token_str(self.config.get(k))
      for k in ("bos_token", "eos_token", "unk_token", "pad_token")
      if self.config.get(k) is not None
    }

  @classmethod
  def from_dir(cls, path: str | os.PathLike, fallback: str | os.PathLike | None = None
               ) -> Tokenizer:
    """Reads ``path``; a file it lacks is read from ``fallback`` (e.g. a variant's kept
    tokenizer files over its base's)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)

    def find(name: str) -> Path:
      p = path / name
      return p if p.exists() or fallback is None else Path(fallback) / name

    tj = find("tokenizer.json")
    if not tj.exists():
      raise TokenizerError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    config = {}
    cfg_file = find("tokenizer_config.json")
    if cfg_file.exists():
      config = json.loads(cfg_file.read_text())
    smap_file = find("special_tokens_map.json")  # where tokenizer_config names none
    if smap_file.exists():
      smap = json.loads(smap_file.read_text())
      for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if config.get(k) is None and smap.get(k) is not None:
          config[k] = smap[k]
    template = None
    jinja_file = path / "chat_template.jinja"
    if not jinja_file.exists() and fallback is not None and not (path / "tokenizer_config.json").exists():
      jinja_file = Path(fallback) / "chat_template.jinja"
    if jinja_file.exists():
      template = jinja_file.read_text()
    else:
      template = config.get("chat_template")
      if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    gen_eos: list[int] = []
    gen_file = find("generation_config.json")
    if gen_file.exists():
      eos = json.loads(gen_file.read_text()).get("eos_token_id")
      gen_eos = [eos] if isinstance(eos, int) else [t for t in (eos or []) if isinstance(t, int)]
    return cls(HFTokenizer.from_file(str(tj)), config, template, gen_eos)

  # -- ids -------------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str) -> int | None:
    return self.tok.token_to_id(token)

  @property
  def eos_token_id(self) -> int | None:
    eos = self.special_tokens.get("eos_token")
    return None if eos is None else self.token_id(eos)

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    """Tokens that end a generation: the EOS token and ``generation_config.json``'s
    ``eos_token_id`` (an int or a list), in that order, without repeats."""
    ids = [self.eos_token_id, *self.generation_eos]
    return tuple(dict.fromkeys(t for t in ids if t is not None))

  @property
  def bos_token_id(self) -> int | None:
    bos = self.special_tokens.get("bos_token")
    return None if bos is None else self.token_id(bos)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  # -- chat ------------------------------------------------------------------------------------
  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    **kwargs,
  ) -> str | list[int]:
    """Renders chat messages with the directory's template (optionally tokenised)."""
    if not self.chat_template:
      raise TokenizerError("this tokenizer has no chat template")
    text = _compile_template(self.chat_template).render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      **self.special_tokens,
      **kwargs,
    )
    return self.encode(text, add_special_tokens=False) if tokenize else text
