"""Portable deltas: one delta, compressed against the unquantized base, serves over that base and
over every GGUF quantized from it (`bitdelta_jax.hf.lineage`); a delta compressed against a GGUF
without its source keeps the tensors the fine-tune left unchanged as the base's.

The references are independent numpy: the `gguf` package's dequantization of the file plus
α·sign(W_ft − W_source) computed here, and llama.cpp's reference quantizer as the `gguf`
package implements it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_fixtures import forward, make_bpe_tokenizer, make_hf_model

from bitdelta_jax.delta.store import DeltaMismatchError, load_delta, read_manifest
from bitdelta_jax.delta.stream import apply_checkpoint, compress_checkpoints
from bitdelta_jax.hf import lineage, lineage_record
from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint
from bitdelta_jax.hf.gguf_checkpoint import resolve_base
from bitdelta_jax.hf.gguf_export import write_gguf
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models import slots as slots_lib

pytestmark = pytest.mark.slow

VOCAB = 320
IDS = np.array([[5, 17, 42, 99, 3, 250, 7, 8, 301, 64, 11, 12]], np.int32)
EMBED = "model.embed_tokens.weight"
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module", autouse=True)
def _f32_activations():
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("BITDELTA_QUANT_ACTIVATIONS", "f32")  # parity with the f32 reference below
    yield


def _finetune(model, out, *, embedding: bool, seed: int):
  """``model`` with every linear weight moved by 0.3% noise and the norms by 1%; the embedding
  (tied: also the head) left as it is unless ``embedding``: a fine-tune as users make them."""
  import copy

  import torch

  ft = copy.deepcopy(model)
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in ft.named_parameters():
      if name == EMBED and not embedding:
        continue
      scale = 0.01 if p.ndim == 1 else 0.003 * float(p.std())
      p.add_(scale * torch.randn(p.shape, generator=g))
  ft.save_pretrained(out)
  make_bpe_tokenizer(out)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  d = tmp_path_factory.mktemp("portable")
  model = make_hf_model("llama", d / "base", vocab_size=VOCAB, tie_word_embeddings=True)
  make_bpe_tokenizer(d / "base")
  _finetune(model, d / "ft", embedding=False, seed=1)
  _finetune(model, d / "ft-emb", embedding=True, seed=2)
  delta = d / "delta"
  compress_checkpoints(d / "base", d / "ft", delta, progress=False)
  return d, delta


def _applied_numpy(gguf_path, base_dir, ft_dir, name, manifest) -> np.ndarray:
  """dequant(W_q) + α·sign(W_ft − W_source) in HF layout, from the `gguf` package and numpy."""
  import gguf

  from bitdelta_jax.hf.gguf_names import hf_tensor_name, unpermute_rows

  r = gguf.GGUFReader(gguf_path)
  t = next(t for t in r.tensors if hf_tensor_name(t.name) == name)
  w = gguf.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(s) for s in t.shape])))
  if name.endswith("q_proj.weight"):
    w = unpermute_rows(w, 4)
  with CheckpointReader(base_dir) as b, CheckpointReader(ft_dir) as f:
    diff = f.read(name).astype(np.float32) - b.read(name).astype(np.float32)
  sign = np.where(diff >= 0, 1.0, -1.0)
  (alpha,) = np.abs(diff).mean(keepdims=True).reshape(1)  # per-matrix α = mean |Δ|
  return (w + alpha * sign).astype(np.float32)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_one_delta_serves_over_the_source_and_its_quantizations(family, fmt):
  d, delta = family
  path = write_gguf(d / "base", d / f"base-{fmt}.gguf", dtype=fmt)  # records its source
  base_dir = resolve_base(path)
  fp = fingerprint_checkpoint(base_dir)
  manifest = read_manifest(delta)
  assert fp["source"]["digest"] == manifest["base"]["digest"] != fp["digest"]
  entries, _ = load_delta(delta, base_fingerprint=fp)  # accepted: made against the source

  # apply over the file = the gguf package's dequantization + α·sign(Δ against the source)
  merged = apply_checkpoint(path, delta, d / f"merged-{fmt}", overwrite=True, progress=False)
  with CheckpointReader(merged) as m:
    got = m.read(Q_PROJ)
  want = _applied_numpy(path, d / "base", d / "ft", Q_PROJ, manifest)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

  # served: the blocks in the model, the delta in slot 1 = that applied checkpoint, in f32
  model = from_pretrained(path, num_slots=2, variants=[delta])
  slots_lib.load_variant(model, 1, entries)
  want_logits = forward(from_pretrained(merged, np.float32), IDS)
  got_logits = forward(model, IDS, slot_ids=[1])
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4,
                             atol=1e-4 * np.abs(want_logits).max())
  # and the same delta still serves over its unquantized source
  load_delta(delta, base_fingerprint=fingerprint_checkpoint(d / "base"))


def test_a_gguf_without_recorded_source_refuses_until_its_source_is_checked(family):
  d, delta = family
  path = write_gguf(d / "base", d / "foreign-q4_1.gguf", dtype="q4_1", record_source=False)
  base_dir = resolve_base(path)
  lineage_record.forget(base_dir)
  with pytest.raises(DeltaMismatchError) as e:
    load_delta(delta, base_fingerprint=fingerprint_checkpoint(base_dir))
  assert "--base-source" in str(e.value) and path.name in str(e.value)

  # another checkpoint is not its source: the fine-tune with a changed embedding moves the
  # embedding rows by ~0.3% of their spread, more than Q4_1's rounding for some block
  with pytest.raises(lineage.LineageError) as e:
    lineage.establish(base_dir, d / "ft-emb")
  assert path.name in str(e.value) and "tensor" in str(e.value)
  assert lineage_record.source_of(base_dir) is None  # nothing recorded

  rec = lineage.establish(base_dir, d / "base")
  assert rec["name"] == "base" and "checked against" in rec["how"]
  load_delta(delta, base_fingerprint=fingerprint_checkpoint(base_dir))  # now accepted


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantization_bound_accepts_llama_cpp_reference_blocks_and_rejects_other_weights(
    family, fmt):
  """`check_tensor` on blocks made by the `gguf` package's own quantizer (the reference, not
  ours): within the bound; the same blocks against a tensor moved by one step of one block: not."""
  import gguf

  d, _ = family
  path = write_gguf(d / "base", d / f"bound-{fmt}.gguf", dtype=fmt, record_source=False)
  from bitdelta_jax.hf.gguf_base import open_gguf_base

  base = open_gguf_base(path)
  with CheckpointReader(d / "base") as r:
    src = r.read(Q_PROJ).astype(np.float32)
  from bitdelta_jax.hf.gguf_names import permute_rows

  ref_bytes = gguf.quants.quantize(permute_rows(src, 4), getattr(gguf.GGMLQuantizationType,
                                                                 fmt.upper()))
  np.testing.assert_array_equal(base._stored(Q_PROJ).reshape(ref_bytes.shape), ref_bytes)
  assert lineage.check_tensor(Q_PROJ, fmt, src, base) is None
  moved = src.copy()
  moved[3, 40] += float(np.abs(src[3, 32:64]).max())  # far outside that block's rounding
  why = lineage.check_tensor(Q_PROJ, fmt, moved, base)
  assert why is not None and "1 of" in why and "block" in why


def test_compress_against_a_gguf_keeps_the_unchanged_embedding_as_the_base(family):
  d, delta = family
  path = write_gguf(d / "base", d / "base-q4_0.gguf", dtype="q4_0")
  m = compress_checkpoints(path, d / "ft", d / "delta-vs-q4_0", progress=False, overwrite=True)
  t = m["tensors"]
  assert t[EMBED]["kind"] == "same" and not t[EMBED]["arrays"]
  assert any("quantize to exactly the base's own blocks" in n for n in m["notes"])
  assert any("--base-source" in n for n in m["notes"])  # the file records its source
  rows = {r["name"]: r for r in m["report"]["tensors"]}
  assert "requantizes to the base's q4_0 blocks" in rows[EMBED]["note"]
  assert t[Q_PROJ]["kind"] == "packed"  # a changed linear weight: Δ against the blocks
  # the delta against the blocks is no larger than the one against the source
  size = lambda man: man["report"]["totals"]["bytes_after"]  # noqa: E731
  assert size(m) == size(read_manifest(delta))
  # the fine-tune that did change its embedding: not the base's blocks, so stored
  m2 = compress_checkpoints(path, d / "ft-emb", d / "delta-emb-vs-q4_0", progress=False,
                            overwrite=True)
  assert m2["tensors"][EMBED]["kind"] != "same"


def test_compress_with_base_source_takes_delta_against_the_source(family):
  d, delta = family
  path = write_gguf(d / "base", d / "src-q8_0.gguf", dtype="q8_0", record_source=False)
  lineage_record.forget(resolve_base(path))
  m = compress_checkpoints(path, d / "ft", d / "delta-src", progress=False, overwrite=True,
                           base_source=d / "base")
  assert m["base"]["digest"] == read_manifest(delta)["base"]["digest"]
  assert "quantization" not in m["base"]
  assert any("serves over it and over every GGUF" in n for n in m["notes"])
  load_delta(d / "delta-src", base_fingerprint=fingerprint_checkpoint(resolve_base(path)))


def test_delta_made_against_a_gguf_over_the_source_names_the_fix(family):
  d, _ = family
  path = write_gguf(d / "base", d / "fix-q4_0.gguf", dtype="q4_0")
  compress_checkpoints(path, d / "ft-emb", d / "delta-fix", progress=False, overwrite=True)
  with pytest.raises(DeltaMismatchError) as e:
    load_delta(d / "delta-fix", base_fingerprint=fingerprint_checkpoint(d / "base"))
  msg = str(e.value)
  assert path.name in msg and "serve it over that file" in msg
  assert "unquantized checkpoint that file was made from" in msg


def test_quantize_exports_a_transformers_5_directory(family, tmp_path):
  """``rope_parameters`` (no ``rope_theta``), the chat template in ``chat_template.jinja``,
  special tokens in ``special_tokens_map.json``: what the GGUF says is what the loader reads;
  and compress against the GGUF finds the fine-tune's byte-identical tokenizer the same."""
  import shutil

  import gguf

  from bitdelta_jax.models.loading import load_config
  from bitdelta_jax.models.tokenizer import Tokenizer

  d, _ = family
  src = tmp_path / "tf5"
  shutil.copytree(d / "base", src)
  cfg = json.loads((src / "config.json").read_text())
  cfg.pop("rope_theta", None)
  cfg.pop("rope_scaling", None)
  cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
  (src / "config.json").write_text(json.dumps(cfg))
  tc = json.loads((src / "tokenizer_config.json").read_text())
  template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
  tc.pop("chat_template")
  specials = {k: tc.pop(k) for k in ("bos_token", "eos_token")}
  (src / "tokenizer_config.json").write_text(json.dumps(tc))
  (src / "chat_template.jinja").write_text(template)
  (src / "special_tokens_map.json").write_text(json.dumps(specials))

  path = write_gguf(src, tmp_path / "tf5-q8_0.gguf", dtype="q8_0")
  r = gguf.GGUFReader(path)

  def field(key):
    f = r.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0]

  assert field("llama.rope.freq_base") == 100000.0
  assert field("tokenizer.chat_template") == template
  meta = resolve_base(path)
  assert load_config(meta).rope.theta == load_config(src).rope.theta == 100000.0
  tok, ref = Tokenizer.from_dir(meta), Tokenizer.from_dir(src)
  assert tok.chat_template == template and tok.eos_token_id == ref.eos_token_id is not None
  msgs = [{"role": "user", "content": "the capital of France"}]
  assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)

  ft = tmp_path / "ft-tf5"  # the fine-tune ships the source's tokenizer files, byte for byte
  shutil.copytree(d / "ft", ft)
  (ft / "tokenizer_config.json").unlink()
  for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "special_tokens_map.json"):
    shutil.copy2(src / f, ft / f)
  m = compress_checkpoints(path, ft, tmp_path / "delta-tf5", progress=False)
  assert m["tokenizer"] is None  # the same tokenizer, by content
  assert not any("tokenizer" in n for n in m["notes"])


def test_gguf_base_default_context_is_capped_like_an_hf_base(family, tmp_path):
  from serving.cli import default_max_seq_len

  d, _ = family
  path = write_gguf(d / "base", tmp_path / "ctx-q8_0.gguf", dtype="q8_0", record_source=False)
  ctx = json.loads((d / "base" / "config.json").read_text())["max_position_embeddings"]
  assert ctx < 2048
  assert default_max_seq_len(path) == default_max_seq_len(d / "base") == ctx


def test_cli_base_source_for_compress_and_a_wrong_source_is_exit_2(family, tmp_path, capsys):
  from bitdelta_jax.cli import main

  d, delta = family
  path = write_gguf(d / "base", tmp_path / "cli-q4_0.gguf", dtype="q4_0", record_source=False)
  lineage_record.forget(resolve_base(path))
  rc = main(["compress", "--base", str(path), "--base-source", str(d / "ft-emb"), "--finetuned",
             str(d / "ft"), "--out", str(tmp_path / "bad"), "--quiet"])
  err = capsys.readouterr().err
  assert rc == 2 and "is not a quantization of" in err and path.name in err
  assert not (tmp_path / "bad").exists()
  rc = main(["compress", "--base", str(path), "--base-source", str(d / "base"), "--finetuned",
             str(d / "ft"), "--out", str(tmp_path / "good"), "--quiet"])
  assert rc == 0
  assert read_manifest(tmp_path / "good")["base"]["digest"] == read_manifest(delta)["base"]["digest"]
  rc = main(["inspect", str(tmp_path / "good")])
  assert rc == 0 and "serves over it and over every GGUF" in capsys.readouterr().out
