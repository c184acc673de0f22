"""Bad GGUF files are refused before use, by name, with exit 2 and nothing left behind (issue 50
item 1): each file is a good one written by `write_gguf`, then broken byte by byte as the
reliability run found them (an +inf block scale, a header that lies about a type, counts and
lengths of 2^62 / 2^40, truncation, an empty file, a directory, another architecture, an
unknown type). `compress` runs in-process through the CLI; `serve` in a subprocess for two."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from model_fixtures import make_bpe_tokenizer, make_hf_model

from bitdelta_jax.hf.gguf_export import write_gguf

pytestmark = pytest.mark.slow

TENSOR = "blk.0.ffn_down.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  d = tmp_path_factory.mktemp("gguf_validation")
  make_hf_model("llama", d / "base", vocab_size=320, tie_word_embeddings=True)
  make_bpe_tokenizer(d / "base")
  return d, write_gguf(d / "base", d / "good.Q4_1.gguf", dtype="q4_1", record_source=False)


def _tensor_info_pos(data: bytes, name: str) -> int:
  """Offset of the tensor entry's n_dims field (just after its name) in the header."""
  key = struct.pack("<Q", len(name)) + name.encode()
  i = data.index(key)
  return i + len(key)


def _break(kind: str, good_path, out):
  import gguf

  data = bytearray(good_path.read_bytes())
  if kind == "inf_scale":
    t = next(t for t in gguf.GGUFReader(good_path).tensors if t.name == TENSOR)
    data[int(t.data_offset):int(t.data_offset) + 2] = np.float16(np.inf).tobytes()
  elif kind in ("type_lie", "unknown_type"):
    p = _tensor_info_pos(bytes(data), TENSOR)
    n_dims = struct.unpack_from("<I", data, p)[0]
    q = p + 4 + 8 * n_dims
    new = 14 if kind == "type_lie" else 99  # Q6_K | no such type
    data[q:q + 4] = struct.pack("<I", new)
  elif kind == "tensor_count":
    data[8:16] = struct.pack("<Q", 1 << 62)
  elif kind == "key_length":
    data[24:32] = struct.pack("<Q", 1 << 40)
  elif kind == "truncated":
    data = data[:int(len(data) * 0.8)]
  elif kind == "empty":
    data = bytearray()
  elif kind == "architecture":
    i = bytes(data).index(b"general.architecture")
    j = bytes(data).index(b"llama", i)
    data[j:j + 5] = b"gemma"
  if kind == "directory":
    out.mkdir()
    return out
  out.write_bytes(bytes(data))
  return out


KINDS = {  # kind → a phrase the message must hold
  "inf_scale": "non-finite scale",
  "type_lie": "Q6_K",
  "unknown_type": "ggml type 99",
  "tensor_count": "cannot fit",
  "key_length": "claims",
  "truncated": "past the end",
  "empty": "empty",
  "directory": "is a directory",
  "architecture": "'gemma'",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_compress_refuses_a_bad_file_by_name_and_leaves_nothing(good, kind, tmp_path, monkeypatch,
                                                                  capsys):
  from bitdelta_jax.cli import main

  d, path = good
  bad = _break(kind, path, tmp_path / f"bad-{kind}.gguf")
  cache = tmp_path / "cache"
  monkeypatch.setenv("BITDELTA_CACHE", str(cache))
  rc = main(["compress", "--base", str(bad), "--finetuned", str(d / "base"), "--out",
             str(tmp_path / "delta"), "--quiet"])
  err = capsys.readouterr().err
  assert rc == 2, err
  assert bad.name in err and KINDS[kind] in err, err
  assert "Traceback" not in err
  assert not (tmp_path / "delta").exists()
  leftovers = [p for p in cache.rglob("*")] if cache.exists() else []
  assert [p for p in leftovers if "gguf" in p.parts] in ([], [cache / "gguf"]), leftovers


def test_the_good_file_passes(good, tmp_path, monkeypatch):
  from bitdelta_jax.hf.gguf_validate import check_file

  _, path = good
  check_file(path)
  monkeypatch.setenv("BITDELTA_CACHE", str(tmp_path / "cache"))
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base

  assert (resolve_base(path) / "config.json").is_file()


@pytest.mark.parametrize("kind", ["inf_scale", "type_lie"])
def test_serve_refuses_a_bad_file_with_exit_2(good, kind, tmp_path):
  _, path = good
  bad = _break(kind, path, tmp_path / f"bad-{kind}.gguf")
  env = {"BITDELTA_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
         "JAX_PLATFORMS": "cpu"}
  import os

  env = {**os.environ, **env}
  p = subprocess.run([sys.executable, "-m", "bitdelta_jax.cli", "serve", "--base", str(bad),
                      "--port", "0"], capture_output=True, text=True, timeout=300, env=env)
  assert p.returncode == 2, p.stderr[-2000:]
  assert bad.name in p.stderr and KINDS[kind] in p.stderr
  assert "Traceback" not in p.stderr
  gguf_dir = tmp_path / "cache" / "gguf"
  assert not gguf_dir.exists() or not any(gguf_dir.iterdir())
  shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_no_command_writes_a_non_finite_tensor(good, tmp_path, capsys):
  """A fine-tune with one NaN weight and one +inf norm: compress refuses it naming the tensor
  (exit 2, no delta), quantize refuses to write it (exit 2, no file)."""
  from bitdelta_jax.cli import main
  from bitdelta_jax.hf.safetensors_io import CheckpointReader, save_file

  d, path = good
  bad = tmp_path / "ft-nan"
  shutil.copytree(d / "base", bad)
  with CheckpointReader(d / "base") as r:
    tensors = {n: r.read(n) for n in r.names()}
  tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
  (bad / "model.safetensors").unlink()
  save_file(tensors, bad / "model.safetensors")
  rc = main(["compress", "--base", str(path), "--finetuned", str(bad), "--out",
             str(tmp_path / "delta"), "--quiet"])
  err = capsys.readouterr().err
  assert rc == 2 and "model.layers.1.mlp.up_proj.weight" in err and "non-finite" in err, err
  assert not (tmp_path / "delta").exists()
  rc = main(["quantize", "--base", str(bad), "--format", "q8_0", "--out",
             str(tmp_path / "nan.gguf"), "--quiet"])
  err = capsys.readouterr().err
  assert rc == 2 and "model.layers.1.mlp.up_proj.weight" in err and "non-finite" in err, err
  assert not list(tmp_path.glob("*.gguf*")) and not list(tmp_path.glob(".nan*"))
