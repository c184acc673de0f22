"""Each variant with its own tokenizer, chat template, stop tokens and vocabulary (issue 14, item 3).

A fine-tune of the synthetic base that added five tokens (the tokenizer's ids 261-265; the
model's rows grow 264 -> 266), brings its own chat template and its own EOS (``<|end|>``):
``compress`` keeps its tokenizer files with the delta, ``apply`` writes them back, and the
server uses them for that variant only. Its greedy output through HTTP equals the same model
decoded in process with the variant's tokenizer and stop token; an added token id is valid for
it and a 400 for the base and for another variant.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import requests

from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.store import load_delta, read_manifest
from bitdelta_jax.delta.stream import apply_checkpoint, compress_checkpoints
from bitdelta_jax.models import from_pretrained, load_variant
from bitdelta_jax.models.tokenizer import Tokenizer
from bitdelta_jax.synthetic import make_base, make_finetune, write_checkpoint
from serving.testing import TINY, synthetic_family

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

ADDED = ["<think>", "</think>", "<a1>", "<a2>"]  # ids 261-264
END = "<|end|>"  # id 265: the variant's EOS
TEMPLATE = ("{% for m in messages %}<think>{{ m['content'] }}</think>{% endfor %}"
            "{% if add_generation_prompt %}<a1>{% endif %}")
PROMPT = "the cat"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  from tokenizers import Tokenizer as HFTokenizer

  root = tmp_path_factory.mktemp("vocab")
  base_dir, deltas = synthetic_family(root, n=1)
  ft = make_finetune(make_base(TINY, 0), seed=13, rel=0.3, extra_vocab=2)
  ft["lm_head.weight"][TINY.vocab_size:] *= 50  # seed 13: base-vocab tokens, "<a2>"s, then "<|end|>"
  ft_dir = write_checkpoint(ft, root / "grown", TINY.hf_config(vocab_size=TINY.vocab_size + 2))
  tk = HFTokenizer.from_file(str(base_dir / "tokenizer.json"))
  tk.add_tokens(ADDED)
  tk.add_special_tokens([END])
  assert [tk.token_to_id(t) for t in [*ADDED, END]] == list(range(261, 266))
  tk.save(str(ft_dir / "tokenizer.json"))
  cfg = json.loads((base_dir / "tokenizer_config.json").read_text())
  cfg.update(eos_token=END, chat_template=TEMPLATE)
  (ft_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
  shutil.copy(base_dir / "special_tokens_map.json", ft_dir)
  grown = compress_checkpoints(base_dir, ft_dir, root / "deltas" / "grown", CompressPolicy(),
                               overwrite=True, progress=False)
  return base_dir, deltas["v0"], root / "deltas" / "grown", ft_dir, grown


def test_compress_keeps_and_apply_restores_the_finetunes_tokenizer(family, tmp_path):
  base_dir, v0, grown_dir, ft_dir, manifest = family
  assert manifest["tokenizer"] == "tokenizer"
  assert any("tokenizer" in n for n in manifest["notes"])
  for f in ("tokenizer.json", "tokenizer_config.json"):
    assert (grown_dir / "tokenizer" / f).read_bytes() == (ft_dir / f).read_bytes()
  assert read_manifest(v0).get("tokenizer") is None  # same tokenizer as the base: nothing kept
  assert not (v0 / "tokenizer").exists()
  out = apply_checkpoint(base_dir, grown_dir, tmp_path / "applied", progress=False)
  assert (out / "tokenizer.json").read_bytes() == (ft_dir / "tokenizer.json").read_bytes()
  tok = Tokenizer.from_dir(out)
  assert tok.chat_template == TEMPLATE and tok.eos_token_id == 265


def _reference(base_dir, grown_dir, prompt_ids, max_new):
  """Greedy decoding of the variant in process (full forward each step), stopped by the
  variant's own stop tokens, decoded with its own tokenizer."""
  tok = Tokenizer.from_dir(grown_dir / "tokenizer")
  model = from_pretrained(base_dir, jnp.float32, num_slots=2, dense_embedding_slots=True,
                          extra_vocab=64)
  load_variant(model, 1, load_delta(grown_dir)[0])
  ids, out, reason = list(prompt_ids), [], "length"
  for _ in range(max_new):  # one padded shape (causal: the padding after is never attended)
    padded = np.zeros((1, 64), np.int32)
    padded[0, :len(ids)] = ids
    logits = np.asarray(model(jnp.asarray(padded), slot_ids=jnp.array([1])))[0, len(ids) - 1]
    t = int(np.argmax(logits))
    if t in tok.stop_token_ids:
      reason = "stop"
      break
    out.append(t)
    ids.append(t)
  return out, tok.decode(out), reason


@pytest.fixture(scope="module")
def server(family, serve):
  base_dir, v0, grown_dir, _, _ = family
  with serve(base_dir, {"v0": v0, "grown": grown_dir}, device_slots=2, max_batch=4,
             max_seq_len=256, default_max_tokens=24, warmup=False) as h:
    yield h


def post(h, path, body):
  return requests.post(h.url + path, json=body, timeout=120)


def test_served_variant_uses_its_tokenizer_stop_token_and_added_rows(family, server):
  base_dir, _, grown_dir, _, _ = family
  tok = Tokenizer.from_dir(grown_dir / "tokenizer")
  prompt_ids = tok.encode(PROMPT)
  want_ids, want_text, want_reason = _reference(base_dir, grown_dir, prompt_ids, 24)
  assert any(t >= 264 for t in want_ids), "the test needs the variant to emit an added row"
  assert want_reason == "stop", "the test needs the variant to emit its own EOS"
  r = post(server, "/v1/completions", {"model": "grown", "prompt": PROMPT, "max_tokens": 24,
                                       "temperature": 0})
  assert r.status_code == 200, r.text
  choice = r.json()["choices"][0]
  assert choice["text"] == want_text
  assert choice["finish_reason"] == want_reason
  assert r.json()["usage"]["completion_tokens"] == len(want_ids)


def test_a_mesh_server_serves_the_added_tokens_too(family, serve):
  """The sharded restore builds the added-token banks (replicated) and the mesh engine gives
  the single-device answer (a 1x1 mesh: the path every mesh takes; 8 devices in
  test_paged_mesh)."""
  base_dir, v0, grown_dir, _, _ = family
  tok = Tokenizer.from_dir(grown_dir / "tokenizer")
  want_ids, want_text, want_reason = _reference(base_dir, grown_dir, tok.encode(PROMPT), 24)
  with serve(base_dir, {"grown": grown_dir}, device_slots=2, max_batch=4, max_seq_len=256,
             default_max_tokens=24, warmup=False, mesh="data=1,model=1") as h:
    r = post(h, "/v1/completions", {"model": "grown", "prompt": PROMPT, "max_tokens": 24,
                                    "temperature": 0})
  assert r.status_code == 200, r.text
  choice = r.json()["choices"][0]
  assert (choice["text"], choice["finish_reason"]) == (want_text, want_reason)


def test_chat_uses_the_variants_template(family, server):
  _, _, grown_dir, _, _ = family
  msgs = [{"role": "user", "content": "hello"}]
  own = Tokenizer.from_dir(grown_dir / "tokenizer").apply_chat_template(msgs, tokenize=True)
  base = Tokenizer.from_dir(family[0]).apply_chat_template(msgs, tokenize=True)
  assert own != base and own[0] == 261  # "<think>" is one added token
  for model, want in (("grown", own), ("v0", base)):
    r = post(server, "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_an_added_token_id_is_valid_only_for_its_variant(server):
  ok = post(server, "/v1/completions", {"model": "grown", "prompt": [5, 264, 265, 7],
                                        "max_tokens": 2})
  assert ok.status_code == 200, ok.text
  for model in ("v0", "base"):
    r = post(server, "/v1/completions", {"model": model, "prompt": [5, 264, 7], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "264" in err["message"] and "added" in err["message"]
  r = post(server, "/v1/completions", {"model": "grown", "prompt": [5, 266], "max_tokens": 2})
  assert r.status_code == 400 and "266" in r.json()["error"]["message"]


def test_a_variant_adding_more_tokens_than_the_slots_hold_is_refused(family, tmp_path, serve):
  base_dir, v0, grown_dir, _, _ = family
  from serving.app import BadVariantsError

  with pytest.raises(BadVariantsError, match="adds 2 tokens.*room for 1.*--extra-vocab 2"):
    with serve(base_dir, {"grown": grown_dir}, warmup=False, extra_vocab=1):
      pass


def test_only_the_changed_tokenizer_files_are_kept(family, tmp_path):
  """A fine-tune that changed only its chat template keeps only tokenizer_config.json (a few
  KB); the rest comes from the base, in the server and in apply."""
  base_dir, _, _, _, _ = family
  ft = make_finetune(make_base(TINY, 0), seed=21, rel=0.1)
  ft_dir = write_checkpoint(ft, tmp_path / "ft", TINY.hf_config())
  for f in ("tokenizer.json", "special_tokens_map.json"):
    shutil.copy(base_dir / f, ft_dir)
  cfg = json.loads((base_dir / "tokenizer_config.json").read_text())
  cfg["chat_template"] = TEMPLATE
  (ft_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
  m = compress_checkpoints(base_dir, ft_dir, tmp_path / "delta", CompressPolicy(), progress=False)
  assert m["tokenizer"] == "tokenizer"
  assert sorted(p.name for p in (tmp_path / "delta" / "tokenizer").iterdir()) == [
    "tokenizer_config.json"]
  tok = Tokenizer.from_dir(tmp_path / "delta" / "tokenizer", fallback=base_dir)
  base_tok = Tokenizer.from_dir(base_dir)
  assert tok.chat_template == TEMPLATE and tok.vocab_size == base_tok.vocab_size
  assert tok.encode("hello world") == base_tok.encode("hello world")
  out = apply_checkpoint(base_dir, tmp_path / "delta", tmp_path / "applied", progress=False)
  assert (out / "tokenizer.json").read_bytes() == (base_dir / "tokenizer.json").read_bytes()
  assert Tokenizer.from_dir(out).chat_template == TEMPLATE
