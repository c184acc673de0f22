"""Tokenizer and chat template against transformers' fast tokenizer."""

from __future__ import annotations

import pytest
from model_fixtures import make_tokenizer_dir

from bitdelta_jax.models.tokenizer import Tokenizer, TokenizerError

MESSAGES = [
  {"role": "system", "content": "  be brief  "},
  {"role": "user", "content": "w5 w6 w7"},
  {"role": "assistant", "content": "w8"},
  {"role": "user", "content": "w9 héllo"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def test_encode_decode_match_transformers(tok_dir):
  from transformers import AutoTokenizer

  ours, ref = Tokenizer.from_dir(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
  text = "w3 w17 w200 nope"
  assert ours.encode(text) == ref(text)["input_ids"] == [0, 3, 17, 200, 2]
  assert ours.encode(text, add_special_tokens=False) == [3, 17, 200, 2]
  ids = [0, 5, 6, 1]
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "w5 w6"
  assert ours.eos_token_id == 1 and ours.bos_token_id == 0


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok_dir, add_generation_prompt):
  from transformers import AutoTokenizer

  ours, ref = Tokenizer.from_dir(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
  want = ref.apply_chat_template(
    MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
  )
  got = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
  assert got == want
  assert got.startswith("<s>[SYS] be brief\n<user> w5 w6 w7</s>\n")
  ids = ours.apply_chat_template(MESSAGES, tokenize=True)
  assert ids[0] == 0 and ids.count(0) == 1  # the template's bos only, none added on top


def test_chat_template_file_and_errors(tmp_path, tok_dir):
  import json
  import shutil

  d = tmp_path / "t"
  shutil.copytree(tok_dir, d)
  (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }};{% endfor %}")
  assert Tokenizer.from_dir(d).apply_chat_template(MESSAGES[1:3]) == "w5 w6 w7;w8;"
  cfg = json.loads((d / "tokenizer_config.json").read_text())
  (d / "chat_template.jinja").unlink()
  cfg["chat_template"] = "{{ raise_exception('no system role') }}"
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  with pytest.raises(Exception, match="no system role"):
    Tokenizer.from_dir(d).apply_chat_template(MESSAGES)
  with pytest.raises(TokenizerError, match="tokenizer.json"):
    Tokenizer.from_dir(tmp_path)
