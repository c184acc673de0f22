"""`bitdelta merge` end to end on tiny HF safetensors checkpoints: every method streams to the
same result as the tree function, keeps the base's layout and files, and writes atomically."""

import argparse
import json

import numpy as np
import pytest

from bitdelta_jax import merge as M
from bitdelta_jax.hf.safetensors_io import INDEX_FILE, CheckpointReader, save_file, save_sharded
from bitdelta_jax.merge.cli import add_merge_parser

RNG = np.random.default_rng(4)
SHAPES = {
  "model.embed_tokens.weight": (16, 8),
  "model.layers.0.self_attn.q_proj.weight": (8, 8),
  "model.layers.0.mlp.up_proj.weight": (12, 8),
  "model.norm.weight": (8,),
}


def run(*argv):
  parser = argparse.ArgumentParser(prog="bitdelta")
  add_merge_parser(parser.add_subparsers(dest="command"))
  args = parser.parse_args(["merge", *argv])
  return args.func(args)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpts")
  base = {k: RNG.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  base["model.position_ids"] = np.arange(6, dtype=np.int64)
  (root / "base").mkdir()
  save_sharded(base, root / "base", max_shard_bytes=600)
  (root / "base" / "config.json").write_text(json.dumps({"model_type": "llama"}))
  (root / "base" / "tokenizer.json").write_text("{}")
  models = []
  for i in range(3):
    m = {
      k: (v + 0.1 * RNG.normal(size=v.shape)).astype(v.dtype) if v.dtype == np.float32 else v
      for k, v in base.items()
    }
    (root / f"m{i}").mkdir()
    save_file(m, root / f"m{i}" / "model.safetensors")
    models.append(m)
  return root, base, models


def read(path):
  with CheckpointReader(path) as r:
    return {n: r.read(n) for n in r.names()}


def floats(t):
  return {k: v for k, v in t.items() if v.dtype == np.float32}


CASES = {
  "linear": (["--weights", "1", "2", "3"], lambda b, ms: M.linear(ms, [1, 2, 3])),
  "task-arithmetic": (["--lambda", "0.5"], lambda b, ms: M.task_arithmetic(b, ms, lambda_=0.5)),
  "ties": (
    ["--density", "0.3", "--weights", "1", "0.5", "1"],
    lambda b, ms: M.ties(b, ms, density=0.3, weights=[1, 0.5, 1]),
  ),
  "dare-linear": (
    ["--density", "0.5", "--seed", "7"],
    lambda b, ms: M.dare_linear(b, ms, density=0.5, seed=7),
  ),
  "dare_ties": (
    ["--density", "0.4", "0.5", "0.6", "--normalize"],
    lambda b, ms: M.dare_ties(b, ms, density=[0.4, 0.5, 0.6], normalize=True),
  ),
  "svd-soup": (["--rank", "2"], lambda b, ms: M.svd_soup(b, ms, 2)),
  "opcm": (["--alpha", "0.6"], lambda b, ms: M.opcm(b, ms, 0.6)),
}


@pytest.mark.parametrize("method", list(CASES))
def test_method_matches_tree_function(ckpts, tmp_path, method):
  root, base, models = ckpts
  extra, tree_fn = CASES[method]
  out = tmp_path / "out"
  run(
    method,
    "--base",
    str(root / "base"),
    "--models",
    *[str(root / f"m{i}") for i in range(3)],
    *extra,
    "--out",
    str(out),
  )
  got = read(out)
  ref = tree_fn(floats(base), [floats(m) for m in models])
  for k in SHAPES:
    np.testing.assert_allclose(got[k], np.asarray(ref[k]), atol=2e-5, err_msg=k)
  np.testing.assert_array_equal(got["model.position_ids"], base["model.position_ids"])
  # layout and side files come from the base
  assert (
    json.loads((out / INDEX_FILE).read_text())["weight_map"]
    == json.loads((root / "base" / INDEX_FILE).read_text())["weight_map"]
  )
  assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
  assert json.loads((out / "bitdelta_merge.json").read_text())["method"] == method.replace("_", "-")
  assert not list(tmp_path.glob(".out.*"))


def test_monosoup_and_dtype(ckpts, tmp_path):
  root, base, models = ckpts
  out = tmp_path / "mono"
  run(
    "monosoup",
    "--base",
    str(root / "base"),
    "--models",
    str(root / "m0"),
    "--mode",
    "variance",
    "--energy",
    "0.9",
    "--dtype",
    "bfloat16",
    "--out",
    str(out),
  )
  got = read(out)
  ref = M.monosoup(floats(base), floats(models[0]), "variance", 0.9)
  for k in SHAPES:
    assert got[k].dtype.name == "bfloat16"
    np.testing.assert_allclose(got[k].astype(np.float32), np.asarray(ref[k]), atol=3e-2, rtol=1e-2)
  assert got["model.position_ids"].dtype == np.int64


def test_refuses_existing_out_unless_overwrite(ckpts, tmp_path):
  root, _, _ = ckpts
  out = tmp_path / "o"
  out.mkdir()
  (out / "keep").write_text("x")
  argv = ["linear", "--models", str(root / "m0"), str(root / "m1"), "--out", str(out)]
  with pytest.raises(SystemExit, match="exists"):
    run(*argv)
  assert (out / "keep").exists()
  run(*argv, "--overwrite")
  assert not (out / "keep").exists() and (out / "model.safetensors").exists()


def test_bad_arguments(ckpts, tmp_path):
  root, _, _ = ckpts
  m = [str(root / "m0"), str(root / "m1")]
  with pytest.raises(SystemExit, match="--base"):
    run("ties", "--models", *m, "--out", str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="rank"):
    run("svd-soup", "--base", str(root / "base"), "--models", *m, "--out", str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="exactly one"):
    run("monosoup", "--base", str(root / "base"), "--models", *m, "--out", str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="weights"):
    run("linear", "--models", *m, "--weights", "1", "2", "3", "--out", str(tmp_path / "x"))


def test_failure_leaves_no_output(ckpts, tmp_path):
  root, base, _ = ckpts
  bad = tmp_path / "bad"
  bad.mkdir()
  save_file({"model.norm.weight": np.ones(8, np.float32)}, bad / "model.safetensors")
  with pytest.raises(Exception, match="lacks tensor"):
    run(
      "task-arithmetic",
      "--base",
      str(root / "base"),
      "--models",
      str(bad),
      "--out",
      str(tmp_path / "o"),
    )
  assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))
