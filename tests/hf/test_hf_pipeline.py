"""Streaming compress/apply on real-format HF checkpoints, the CLI, and every error case."""

import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from bitdelta_jax.cli import main
from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.store import load_delta, read_manifest
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

CFG = SyntheticConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2)


def _save_with_safetensors(tensors, directory, config, shards=1):
  """Writes with the reference `safetensors` library (torch tensors), sharded like HF."""
  directory.mkdir(parents=True)
  names = list(tensors)
  per = -(-len(names) // shards)
  weight_map = {}
  for i in range(shards):
    part = names[i * per:(i + 1) * per]
    fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    safetensors_torch.save_file(
      {n: torch.from_numpy(tensors[n].astype(np.float32)).to(torch.bfloat16) for n in part},
      str(directory / fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in part})
  if shards > 1:
    (directory / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {}, "weight_map": weight_map}))
  (directory / "config.json").write_text(json.dumps(config))
  return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  root = tmp_path_factory.mktemp("pair")
  base = make_base(CFG, 0)
  ft = make_finetune(base, 1)
  ft_grown = make_finetune(base, 2, extra_vocab=5)
  return {
    "root": root, "base_t": base, "ft_t": ft, "grown_t": ft_grown,
    "base": _save_with_safetensors(base, root / "base", CFG.hf_config()),
    "ft": _save_with_safetensors(ft, root / "ft", CFG.hf_config(), shards=3),
    "grown": _save_with_safetensors(ft_grown, root / "grown", CFG.hf_config(CFG.vocab_size + 5)),
  }


def _expected(base, ft, gran):
  """Independent numpy BitDelta in HF [out, in] layout: α per matrix or per output row."""
  out = {}
  for n, b in base.items():
    f = ft[n].astype(np.float32)
    b32 = b.astype(np.float32)
    if b.ndim == 2 and "embed" not in n and "lm_head" not in n:
      d = f - b32
      a = np.abs(d).mean() if gran == "matrix" else np.abs(d).mean(axis=1, keepdims=True)
      out[n] = (b32 + a * np.where(d >= 0, 1.0, -1.0)).astype(ml_dtypes.bfloat16)
    else:
      out[n] = ft[n]
  return out


@pytest.mark.parametrize("gran", ["matrix", "column"])
def test_compress_apply_sharded_roundtrip(pair, tmp_path, gran):
  delta = tmp_path / "delta"
  assert main(["compress", "--base", str(pair["base"]), "--finetuned", str(pair["ft"]),
               "--out", str(delta), "--scale", f"per-{gran}", "--quiet"]) == 0
  m = read_manifest(delta)
  assert m["format_version"] == 1 and set(m["tensors"]) == set(pair["base_t"])
  tot = m["report"]["totals"]
  # linear delta bytes vs the bf16 fine-tune's linear bytes (tiny K=64 pays padding/scales)
  assert tot["linear_bytes_after"] <= tot["linear_bytes_before"] / 10
  out = tmp_path / "applied"
  assert main(["apply", "--base", str(pair["base"]), "--delta", str(delta), "--out", str(out),
               "--quiet"]) == 0
  want = _expected(pair["base_t"], pair["ft_t"], gran)
  got = safetensors_torch.load_file(str(out / "model.safetensors"))
  assert set(got) == set(want)
  for n, w in want.items():
    np.testing.assert_array_equal(got[n].float().numpy(), w.astype(np.float32), err_msg=n)


def test_transformers_loads_applied_checkpoint(pair, tmp_path):
  transformers = pytest.importorskip("transformers")
  delta, out = tmp_path / "delta", tmp_path / "applied"
  compress_checkpoints(pair["base"], pair["ft"], delta, CompressPolicy(), progress=False)
  assert main(["apply", "--base", str(pair["base"]), "--delta", str(delta), "--out", str(out),
               "--quiet"]) == 0
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
  sd = model.state_dict()
  want = _expected(pair["base_t"], pair["ft_t"], "matrix")
  for n, w in want.items():
    np.testing.assert_array_equal(sd[n].float().numpy(), w.astype(np.float32), err_msg=n)


def test_grown_vocabulary(pair, tmp_path):
  delta = tmp_path / "delta"
  compress_checkpoints(pair["base"], pair["grown"], delta, CompressPolicy(dense="delta"),
                       progress=False)
  entries, m = load_delta(delta)
  e = entries["model.embed_tokens.weight"]
  assert e.kind == "delta" and e.extra_rows.shape == (5, CFG.hidden_size)
  out = tmp_path / "applied"
  main(["apply", "--base", str(pair["base"]), "--delta", str(delta), "--out", str(out), "--quiet"])
  got = CheckpointReader(out)
  for n in ("model.embed_tokens.weight", "lm_head.weight"):
    np.testing.assert_array_equal(got.read(n).astype(np.float32),
                                  pair["grown_t"][n].astype(np.float32))
  assert json.loads((out / "config.json").read_text())["vocab_size"] == CFG.vocab_size + 5


def _run_fail(argv, capsys, match):
  assert main(argv) == 2
  err = capsys.readouterr().err
  line = next((ln for ln in err.splitlines() if ln.startswith("error: ")), "")
  assert match in line, err
  return err


def test_error_cases(pair, tmp_path, capsys):
  base, ft = str(pair["base"]), str(pair["ft"])
  delta = tmp_path / "delta"
  compress_checkpoints(base, ft, delta, CompressPolicy(), progress=False)

  # output directory exists
  _run_fail(["compress", "--base", base, "--finetuned", ft, "--out", str(delta), "--quiet"],
            capsys, "already exists")
  assert main(["compress", "--base", base, "--finetuned", ft, "--out", str(delta), "--quiet",
               "--overwrite"]) == 0
  capsys.readouterr()

  # a delta applied to a different base (same shapes, other content)
  other = write_checkpoint(make_base(CFG, 9), tmp_path / "other", CFG.hf_config())
  out = tmp_path / "out"
  _run_fail(["apply", "--base", str(other), "--delta", str(delta), "--out", str(out), "--quiet"],
            capsys, "different base")
  assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))

  # base and fine-tune with mismatched architecture / shapes
  small = SyntheticConfig(vocab_size=96, hidden_size=32, intermediate_size=160)
  mism = write_checkpoint(make_base(small, 1), tmp_path / "mism", small.hf_config())
  _run_fail(["compress", "--base", base, "--finetuned", str(mism), "--out", str(tmp_path / "x")],
            capsys, "hidden_size")
  cfg = json.loads((mism / "config.json").read_text())
  cfg["hidden_size"] = 64
  (mism / "config.json").write_text(json.dumps(cfg))
  _run_fail(["compress", "--base", base, "--finetuned", str(mism), "--out", str(tmp_path / "x")],
            capsys, "shape mismatch")
  assert not (tmp_path / "x").exists()

  # newer format version
  newer = tmp_path / "newer"
  shutil.copytree(delta, newer)
  m = json.loads((newer / "manifest.json").read_text())
  m["format_version"] = 99
  (newer / "manifest.json").write_text(json.dumps(m))
  _run_fail(["inspect", str(newer)], capsys, "newer")

  # missing tensor array
  missing = tmp_path / "missing"
  shutil.copytree(delta, missing)
  shutil.rmtree(missing / "arrays" / "model.layers.1.mlp.up_proj.weight")
  _run_fail(["apply", "--base", base, "--delta", str(missing), "--out", str(out)], capsys,
            "model.layers.1.mlp.up_proj.weight")
  assert not out.exists()

  # corrupt and truncated arrays
  for how in ("corrupt", "truncate"):
    bad = tmp_path / how
    shutil.copytree(delta, bad)
    chunk = bad / "arrays" / "model.layers.0.self_attn.q_proj.weight" / "bits" / "0.0"
    raw = bytearray(chunk.read_bytes())
    if how == "corrupt":
      raw[3] ^= 0xFF
      chunk.write_bytes(bytes(raw))
    else:
      chunk.write_bytes(bytes(raw[: len(raw) // 2]))
    err = _run_fail(["apply", "--base", base, "--delta", str(bad), "--out", str(out)], capsys,
                    "q_proj.weight")
    assert ("checksum" in err) if how == "corrupt" else ("corrupt or truncated" in err)
    assert not out.exists()

  # not a delta directory / no checkpoint
  _run_fail(["inspect", str(tmp_path)], capsys, "manifest.json is missing")
  _run_fail(["compress", "--base", str(tmp_path / "nope"), "--finetuned", ft, "--out",
             str(tmp_path / "y")], capsys, "no such checkpoint")

  # a truncated safetensors file
  trunc = tmp_path / "trunc"
  shutil.copytree(pair["base"], trunc)
  f = trunc / "model.safetensors"
  f.write_bytes(f.read_bytes()[:-100])
  _run_fail(["compress", "--base", str(trunc), "--finetuned", ft, "--out", str(tmp_path / "z")],
            capsys, "truncated")


def test_interrupted_compress_leaves_nothing(pair, tmp_path, monkeypatch):
  from bitdelta_jax.delta import stream

  calls = {"n": 0}
  real = stream._compress_linear_stream

  def boom(*a, **k):
    calls["n"] += 1
    if calls["n"] == 3:
      raise KeyboardInterrupt
    return real(*a, **k)

  monkeypatch.setattr(stream, "_compress_linear_stream", boom)
  out = tmp_path / "delta"
  with pytest.raises(KeyboardInterrupt):
    compress_checkpoints(pair["base"], pair["ft"], out, CompressPolicy(), progress=False)
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_console_script_inspect(pair, tmp_path):
  delta = tmp_path / "delta"
  compress_checkpoints(pair["base"], pair["ft"], delta, CompressPolicy(), progress=False)
  exe = shutil.which("bitdelta")
  cmd = [exe] if exe else [sys.executable, "-m", "bitdelta_jax.cli"]
  r = subprocess.run([*cmd, "inspect", str(delta)], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "group-bitplane-v1" in r.stdout and "linear layers" in r.stdout
  r = subprocess.run([*cmd, "inspect", str(tmp_path / "none")], capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 2 and "no such delta directory" in r.stderr
