"""GGUF files in ggml's Q8_0 / Q4_0 / Q4_1 blocks: writing them (`gguf_export.write_gguf`, the
``bitdelta quantize`` command) and reading them back as blocks (`gguf_base`).

The references are the ``gguf`` package's numpy port of llama.cpp: ``gguf.quants.quantize`` for
the bytes written, ``gguf_import`` (``gguf.quants.dequantize``) for the values read."""

from __future__ import annotations

import collections
import json
import os
import shutil

import gguf
import numpy as np
import pytest
from model_fixtures import make_hf_model
from safetensors.numpy import load_file

from bitdelta_jax import cli
from bitdelta_jax.hf import gguf_import
from bitdelta_jax.hf.gguf_base import (
  GGUF_BASE_FILE,
  file_sha256,
  open_gguf_base,
  write_metadata_dir,
)
from bitdelta_jax.hf.gguf_export import (
  QUANTIZED,
  _add_metadata,
  gguf_writer,
  tokenizer_metadata,
  write_gguf,
)
from bitdelta_jax.hf.gguf_names import (
  GGUFExportError,
  GGUFImportError,
  hf_tensor_name,
  permute_rows,
)
from pallas_kernels.quant_matmul.blocks import QuantizedKernel, dequantize

VOCAB = 320
FTYPE = {"q8_0": 7, "q4_0": 2, "q4_1": 3}
LAYERS = 2  # model_fixtures.TINY


def make_byte_tokenizer(out_dir) -> None:
  """The smallest byte-level BPE the GGUF writer takes: the 256 byte symbols, no merges, one
  special token (the model's other ids become [PAD] tokens in the file)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  tok = Tokenizer(models.BPE(vocab, []))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|endoftext|>"])
  tok.save(str(out_dir / "tokenizer.json"))
  (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny untied Llama (so ``output.weight`` is written too) with a byte-level tokenizer."""
  d = tmp_path_factory.mktemp("tiny_llama_q")
  make_hf_model("llama", d, vocab_size=VOCAB, tie_word_embeddings=False)
  make_byte_tokenizer(d)
  return d


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory):
  out = tmp_path_factory.mktemp("gguf_q")
  return {f: write_gguf(tiny, out / f"tiny-{f}.gguf", dtype=f) for f in (*QUANTIZED, "f32")}


def _gguf_layout(name: str, w: np.ndarray) -> np.ndarray:
  """An HF weight as llama.cpp's converter stores it (q/k rows permuted per head)."""
  if name.endswith("q_proj.weight"):
    return permute_rows(w, 4)
  if name.endswith("k_proj.weight"):
    return permute_rows(w, 2)
  return w


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_written_bytes_are_llama_cpp_reference_quantization(fmt, tiny, files):
  hf = load_file(str(tiny / "model.safetensors"))
  reader = gguf.GGUFReader(files[fmt])
  assert reader.fields["general.file_type"].contents() == FTYPE[fmt]
  assert int(gguf.LlamaFileType[f"MOSTLY_{fmt.upper()}"]) == FTYPE[fmt]
  assert reader.fields["general.quantization_version"].contents() == gguf.GGML_QUANT_VERSION
  qtype = gguf.GGMLQuantizationType[fmt.upper()]
  seen = set()
  for t in reader.tensors:
    name = hf_tensor_name(t.name)
    seen.add(name)
    w = _gguf_layout(name, hf[name])
    if w.ndim == 2:
      assert t.tensor_type == qtype, name
      want = gguf.quants.quantize(w, qtype)
      assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), name
    else:
      assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
      assert np.array_equal(np.asarray(t.data), w), name
  assert seen == set(hf)  # untied: lm_head.weight written as output.weight
  assert "lm_head.weight" in seen


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_read_blocks_equal_gguf_import(fmt, files):
  base = open_gguf_base(files[fmt])
  reader = gguf.GGUFReader(files[fmt])
  ref = dict(gguf_import.hf_tensors(reader, gguf_import.hf_config(reader)))
  assert base.config == gguf_import.hf_config(reader)
  assert base.names() == list(ref)
  counts = collections.Counter(base.tensor_formats().values())
  assert counts == {fmt: 7 * LAYERS + 2, "f32": 2 * LAYERS + 1}
  for name, want in ref.items():
    got = base.read(name)
    assert base.shape(name) == want.shape
    if want.ndim == 2:
      assert isinstance(got, QuantizedKernel) and got.format == fmt, name
      assert got.shape == want.shape[::-1]  # [K, N]; the embedding [V, D] as [D, V]
      np.testing.assert_array_equal(dequantize(got).T, want, err_msg=name)
    else:
      assert got.dtype == np.float32
      np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_array_equal(base.dequantized(name), want, err_msg=name)


def test_f32_file_reads_back_the_checkpoint(tiny, files):
  """Dense q/k rows are un-permuted too: an f32 GGUF reads back as the HF weights exactly."""
  hf = load_file(str(tiny / "model.safetensors"))
  base = open_gguf_base(files["f32"])
  assert set(base.tensor_formats().values()) == {"f32"}
  for name in base.names():
    got = base.read(name)
    assert isinstance(got, np.ndarray) and got.flags.writeable
    np.testing.assert_array_equal(got, hf[name], err_msg=name)


def test_fingerprint_is_stable_and_tells_files_apart(files, tmp_path):
  fps = {f: open_gguf_base(p).fingerprint() for f, p in files.items()}
  assert open_gguf_base(files["q4_0"]).fingerprint() == fps["q4_0"]
  assert len(set(fps.values())) == len(fps)
  # one byte of the last tensor's data changed: another base
  copy = tmp_path / "flipped.gguf"
  shutil.copy(files["q4_0"], copy)
  t = gguf.GGUFReader(copy).tensors[-1]
  with open(copy, "r+b") as f:
    f.seek(t.data_offset + 5)
    b = f.read(1)
    f.seek(t.data_offset + 5)
    f.write(bytes([b[0] ^ 1]))
  assert open_gguf_base(copy).fingerprint() != fps["q4_0"]


def test_metadata_dir_has_config_tokenizer_and_no_weights(files, tmp_path):
  path = files["q4_1"]
  out = write_metadata_dir(path, tmp_path / "meta")
  reader = gguf.GGUFReader(path)
  assert json.loads((out / "config.json").read_text()) == gguf_import.hf_config(reader)
  for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert (out / f).is_file(), f
  meta = json.loads((out / GGUF_BASE_FILE).read_text())
  base = open_gguf_base(path)
  assert meta == {"gguf": str(path.resolve()), "size": path.stat().st_size,
                  "sha256": file_sha256(path),
                  "fingerprint": base.fingerprint(), "formats": base.tensor_formats()}
  assert not list(out.glob("*.safetensors")) and not list(out.glob(".*"))
  assert not [p for p in tmp_path.iterdir() if p.name != "meta"]  # no temporary left


def test_bpe_without_merges_writes_the_merges_key(files):
  """The byte tokenizer has no merges; gguf-py drops an empty array, and llama.cpp then refuses
  the file ("cannot find tokenizer merges in model file"): the key is written, empty."""
  field = gguf.GGUFReader(files["q8_0"]).fields.get(gguf.Keys.Tokenizer.MERGES)
  assert field is not None
  assert field.types == [gguf.GGUFValueType.ARRAY] and len(field.data) == 0  # an empty array
  import importlib.util
  import subprocess
  import sys

  if importlib.util.find_spec("llama_cpp") is None:
    return
  # llama.cpp itself reads the file (in a child: importing llama_cpp here would leave it in
  # sys.modules for the tests that check what is imported)
  code = ("import sys; from llama_cpp import Llama; "
          "print(Llama(sys.argv[1], n_ctx=64, verbose=False).n_vocab())")
  out = subprocess.run([sys.executable, "-c", code, str(files["q8_0"])], capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert int(out.stdout.split()[-1]) == VOCAB


def test_k_not_a_multiple_of_32_names_the_tensor(tmp_path):
  d = tmp_path / "odd"
  make_hf_model("llama", d, vocab_size=VOCAB, intermediate_size=80)  # down_proj: K = 80
  make_byte_tokenizer(d)
  out = tmp_path / "odd.gguf"
  with pytest.raises(GGUFExportError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*K=80"):
    write_gguf(d, out, dtype="q8_0")
  assert list(tmp_path.glob("*.gguf*")) == [] and list(tmp_path.glob(".*")) == []
  write_gguf(d, out, dtype="bf16")  # no blocks, no constraint


def test_other_ggml_types_are_not_read_as_blocks(tiny, tmp_path):
  cfg = json.loads((tiny / "config.json").read_text())
  path = tmp_path / "q5.gguf"
  w = gguf_writer(str(path))
  _add_metadata(w, cfg, tokenizer_metadata(tiny, VOCAB), "f32", "q5")
  w.add_tensor("output_norm.weight", np.ones(64, np.float32))
  q5 = gguf.quants.quantize(np.ones((64, 64), np.float32), gguf.GGMLQuantizationType.Q5_0)
  w.add_tensor("blk.0.attn_v.weight", q5, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  base = open_gguf_base(path)
  assert base.tensor_formats()["model.layers.0.self_attn.v_proj.weight"] == "q5_0"
  with pytest.raises(GGUFImportError, match=r"self_attn\.v_proj\.weight.*Q5_0"):
    base.read("model.layers.0.self_attn.v_proj.weight")
  # the explicit dequantizing path reads it
  np.testing.assert_allclose(base.dequantized("model.layers.0.self_attn.v_proj.weight"), 1.0)


def test_cli_quantize_writes_refuses_to_overwrite_and_forces(tiny, files, tmp_path, capsys):
  out = tmp_path / "cli.gguf"
  args = ["quantize", "--base", str(tiny), "--format", "q4_0", "--out", str(out)]
  assert cli.main(args) == 0
  assert out.read_bytes() == files["q4_0"].read_bytes()  # same writer, same name: same bytes
  assert "wrote" in capsys.readouterr().out
  umask = os.umask(0)
  os.umask(umask)
  assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # not a temporary file's 0600
  stamp = out.stat().st_mtime_ns
  assert cli.main(args) == 2
  assert "exists" in capsys.readouterr().err and out.stat().st_mtime_ns == stamp
  assert cli.main([*args, "--force", "--quiet"]) == 0
  assert out.read_bytes() == files["q4_0"].read_bytes()
  assert cli.main(["quantize", "--base", str(out), "--format", "q8_0",
                   "--out", str(tmp_path / "x.gguf")]) == 2
  assert "not a directory" in capsys.readouterr().err
  (tiny_bad := tmp_path / "qwen").mkdir()
  (tiny_bad / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
  assert cli.main(["quantize", "--base", str(tiny_bad), "--format", "q8_0",
                   "--out", str(tmp_path / "y.gguf")]) == 2
  assert "qwen2" in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.gguf", "qwen"]


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory):
  from bitdelta_jax.zoo.real_base import locate_gguf

  try:
    source = locate_gguf(download=False)
  except Exception as e:  # no local copy: nothing to test against
    pytest.skip(f"the shipped SmolLM2 GGUF is not available here: {e}")
  return source.materialize(tmp_path_factory.mktemp("real_gguf"))


@pytest.mark.slow
def test_real_q4_1_file_reads_as_gguf_import_dequantizes_it(real_gguf):
  base = open_gguf_base(real_gguf)
  formats = base.tensor_formats()
  assert collections.Counter(formats.values()) == {"q4_1": 210, "f32": 61, "q8_0": 1}
  assert formats["model.embed_tokens.weight"] == "q8_0"
  reader = gguf.GGUFReader(real_gguf)
  n = 0
  for name, want in gguf_import.hf_tensors(reader, base.config):
    got = base.read(name)
    if formats[name] == "f32":
      np.testing.assert_array_equal(got, want, err_msg=name)
    else:
      assert got.shape == want.shape[::-1] and got.format == formats[name], name
      np.testing.assert_array_equal(dequantize(got).T, want, err_msg=name)
    np.testing.assert_array_equal(base.dequantized(name), want, err_msg=name)
    n += 1
  assert n == 272
