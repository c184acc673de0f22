"""`bitdelta merge` end to end on tiny HF safetensors checkpoints: every method streams to the
same result as the tree function, keeps the base's layout and files, and writes atomically."""

import argparse
import json
import shutil

import numpy as np
import pytest

from bitdelta_jax import merge as M
from bitdelta_jax.hf.safetensors_io import INDEX_FILE, CheckpointReader, save_file, save_sharded
from bitdelta_jax.merge.cli import add_merge_parser
from bitdelta_jax.outputs import OutputError

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


@pytest.mark.slow
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
  assert not list(tmp_path.glob(".out.*")) and not list(tmp_path.glob(".bitdelta-*"))


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
  argv = ["linear", "--models", str(root / "m0"), str(root / "m1"), "--out", str(out)]
  run(*argv, "--weights", "1", "3")
  first = read(out)
  with pytest.raises(OutputError, match="exists"):
    run(*argv)
  np.testing.assert_array_equal(read(out)["model.norm.weight"], first["model.norm.weight"])
  run(*argv, "--overwrite")  # our own earlier output is replaced
  assert not np.array_equal(read(out)["model.norm.weight"], first["model.norm.weight"])
  assert not list(tmp_path.glob(".bitdelta-*"))


def test_overwrite_never_replaces_what_is_not_a_merge_output(ckpts, tmp_path):
  """A regular file, a directory of unrelated files, and a user's own checkpoint (config.json +
  safetensors, no bitdelta marker) are refused with --overwrite and left as they were."""
  root, _, _ = ckpts
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  unrelated = tmp_path / "somedir"
  unrelated.mkdir()
  (unrelated / "notes.md").write_text("mine")
  for target in (victim, unrelated, root / "m2"):
    before = sorted(p.name for p in target.parent.iterdir())
    argv = ["linear", "--models", str(root / "m0"), str(root / "m1"), "--out", str(target)]
    with pytest.raises(OutputError, match="refusing"):
      run(*argv, "--overwrite")
    assert sorted(p.name for p in target.parent.iterdir()) == before
  assert victim.read_text() == "precious"
  assert [p.name for p in unrelated.iterdir()] == ["notes.md"]
  assert (root / "m2" / "model.safetensors").exists()


def test_cli_exit_code_2_for_a_regular_file(ckpts, tmp_path, capsys):
  from bitdelta_jax.cli import main

  root, _, _ = ckpts
  victim = tmp_path / "a_regular_file"
  victim.write_bytes(b"\x00data")
  argv = ["merge", "linear", "--models", str(root / "m0"), str(root / "m1")]
  assert main([*argv, "--out", str(victim), "--overwrite"]) == 2
  assert victim.read_bytes() == b"\x00data"
  assert "regular file" in capsys.readouterr().err


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
  assert not list(tmp_path.glob(".bitdelta-*"))


@pytest.mark.parametrize("method", ["task-arithmetic", "opcm"])
def test_a_non_finite_input_or_result_is_refused_and_nothing_written(ckpts, tmp_path, capsys,
                                                                    method):
  from bitdelta_jax.cli import main

  root, base, models = ckpts
  poisoned = {k: v.copy() for k, v in models[0].items()}
  poisoned["model.layers.0.mlp.up_proj.weight"][3, 2] = np.nan
  (tmp_path / "nan").mkdir()
  save_file(poisoned, tmp_path / "nan" / "model.safetensors")
  out = tmp_path / "o"
  code = main(["merge", method, "--base", str(root / "base"), "--models", str(tmp_path / "nan"),
               str(root / "m1"), "--out", str(out)])
  err = capsys.readouterr().err
  assert code == 2 and "model.layers.0.mlp.up_proj.weight" in err and str(tmp_path / "nan") in err
  assert "1 non-finite" in err and "Traceback" not in err
  assert not out.exists() and not list(tmp_path.glob(".o.*"))
  # a result that overflows the output dtype: 3 models of 1e5 + ... summed into float16
  big = {k: (v * 1e4 if v.dtype == np.float32 else v) for k, v in models[1].items()}
  (tmp_path / "big").mkdir()
  save_file(big, tmp_path / "big" / "model.safetensors")
  code = main(["merge", "task-arithmetic", "--base", str(root / "base"), "--models",
               str(tmp_path / "big"), "--lambda", "10", "--dtype", "float16", "--out", str(out)])
  err = capsys.readouterr().err
  assert code == 2 and "the merge's result" in err and "non-finite" in err, err
  assert not out.exists()


def _merge(root, method, out, *extra):
  models = [str(root / f"m{i}") for i in range(3)]
  run(method, "--base", str(root / "base"), "--models", *models, *extra, "--out", str(out))
  return read(out)


@pytest.mark.parametrize("method", ["ties", "dare-linear", "dare-ties"])
@pytest.mark.parametrize("extra", [[], ["--normalize"], ["--rescale"], ["--no-rescale"]])
def test_density_zero_writes_the_base(ckpts, tmp_path, method, extra):
  root, base, _ = ckpts
  got = _merge(root, method, tmp_path / "z", "--density", "0", *extra)
  for k in SHAPES:
    assert np.isfinite(got[k]).all()
    np.testing.assert_array_equal(got[k], base[k], err_msg=k)


@pytest.mark.parametrize(
  "method,extra,tree_fn",
  [
    (
      "ties",
      ["--density", "0.3", "--rescale"],
      lambda b, ms: M.ties(b, ms, density=0.3, rescale=True),
    ),
    (
      "dare-linear",
      ["--density", "0.5", "--rescale-mode", "density", "--seed", "2"],
      lambda b, ms: M.dare_linear(b, ms, density=0.5, rescale="density", seed=2),
    ),
    (
      "dare-ties",
      ["--density", "0.5", "--no-rescale"],
      lambda b, ms: M.dare_ties(b, ms, density=0.5, rescale=False),
    ),
  ],
)
@pytest.mark.slow
def test_rescale_options_match_the_tree_function(ckpts, tmp_path, method, extra, tree_fn):
  root, base, models = ckpts
  got = _merge(root, method, tmp_path / "r", *extra)
  ref = tree_fn(floats(base), [floats(m) for m in models])
  for k in SHAPES:
    np.testing.assert_allclose(got[k], np.asarray(ref[k]), atol=2e-5, err_msg=k)
  info = json.loads((tmp_path / "r" / "bitdelta_merge.json").read_text())
  assert info["rescale"] == {"ties": "l1", "dare-linear": "density", "dare-ties": None}[method]


@pytest.mark.slow
def test_dare_default_rescale_is_mergekit_l1(ckpts, tmp_path):
  root, base, models = ckpts
  got = _merge(root, "dare-linear", tmp_path / "d", "--density", "0.5")
  ref = M.dare_linear(floats(base), [floats(m) for m in models], density=0.5, rescale=True)
  by_density = M.dare_linear(
    floats(base), [floats(m) for m in models], density=0.5, rescale="density"
  )
  for k in SHAPES:
    np.testing.assert_allclose(got[k], np.asarray(ref[k]), atol=2e-5, err_msg=k)
  assert any(not np.allclose(got[k], np.asarray(by_density[k]), atol=2e-5) for k in SHAPES)
  info = json.loads((tmp_path / "d" / "bitdelta_merge.json").read_text())
  assert info["rescale"] == "l1" and info["normalize"] is False


@pytest.mark.parametrize(
  "method,extra,match",
  [
    ("task-arithmetic", ["--rescale"], "--rescale does not apply"),
    ("linear", ["--no-rescale"], "--rescale does not apply"),
    ("ties", ["--rescale-mode", "density"], "--rescale-mode does not apply"),
    ("task-arithmetic", ["--density", "0.5"], "--density does not apply"),
    ("ties", ["--seed", "1"], "--seed does not apply"),
    ("dare-linear", ["--consensus", "count"], "--consensus does not apply"),
    ("opcm", ["--lambda", "0.5"], "--lambda does not apply"),
    ("dare-linear", ["--no-rescale", "--rescale-mode", "density"], "contradicts"),
    ("ties", ["--density", "-0.1"], "density must be >= 0"),
    ("dare-ties", ["--density", "0.5", "nan", "0.5"], "density must be >= 0"),
    ("linear", ["--weights", "1", "-1", "0"], "sum to 0"),
  ],
)
def test_options_that_would_be_ignored_or_are_invalid_are_refused(
  ckpts, tmp_path, method, extra, match
):
  root, _, _ = ckpts
  with pytest.raises(SystemExit, match=match):
    _merge(root, method, tmp_path / "x", *extra)
  assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".bitdelta-*"))


def test_a_chat_template_every_model_shares_is_kept(ckpts, tmp_path, capsys):
  """Issue 23: merging two fine-tunes that share a chat template gave the merged model the
  base's; a file they disagree on stays the base's, with a warning."""
  root, _, _ = ckpts
  models = []
  for i, template in enumerate(["{{ shared }}", "{{ shared }}"]):
    d = tmp_path / f"t{i}"
    shutil.copytree(root / f"m{i}", d)
    (d / "chat_template.jinja").write_text(template)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3 + i]}))
    models.append(str(d))
  run("task-arithmetic", "--base", str(root / "base"), "--models", *models, "--out",
      str(tmp_path / "out"))
  assert (tmp_path / "out" / "chat_template.jinja").read_text() == "{{ shared }}"
  assert not (tmp_path / "out" / "generation_config.json").exists()  # they disagree
  assert "generation_config.json differ; the merge keeps the base's" in capsys.readouterr().err
  assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"  # the base's
