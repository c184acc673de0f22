"""The `bitdelta` command line: no data loss, help texts, --version, --quiet, closed pipes,
warnings about the pair, and what `inspect` says."""

import argparse
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from bitdelta_jax import __version__
from bitdelta_jax.cli import EXIT_BAD_INPUT, build_parser, main
from bitdelta_jax.delta.store import read_manifest
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

CFG = SyntheticConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
# Subcommands whose options this module documents; serve/demo are checked in their own tests.
DOCUMENTED = ("compress", "apply", "inspect", "distill", "zoo", "eval", "merge")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  base = make_base(CFG, 0)
  return {
    "root": root,
    "base": write_checkpoint(base, root / "base", CFG.hf_config()),
    "ft": write_checkpoint(make_finetune(base, 1), root / "ft", CFG.hf_config()),
    "grown": write_checkpoint(make_finetune(base, 2, extra_vocab=3), root / "grown",
                              CFG.hf_config(CFG.vocab_size + 3)),
    # An unrelated model (another seed): every linear delta is as large as the weights.
    "other": write_checkpoint(make_base(CFG, 7), root / "other", CFG.hf_config()),
  }


def _compress(pair, out, *extra, ft="ft"):
  return main(["compress", "--base", str(pair["base"]), "--finetuned", str(pair[ft]),
               "--out", str(out), "--quiet", *extra])


def _tree(path):
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_compress_refuses_to_replace_a_regular_file(pair, tmp_path, capsys):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  assert _compress(pair, victim, "--overwrite") == EXIT_BAD_INPUT
  assert victim.read_text() == "precious"
  assert "victim.txt" in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


def test_compress_refuses_a_directory_of_unrelated_files(pair, tmp_path, capsys):
  d = tmp_path / "mine"
  (d / "sub").mkdir(parents=True)
  (d / "notes.md").write_text("precious")
  (d / "sub" / "data.bin").write_bytes(b"\0\1")
  before = _tree(d)
  assert _compress(pair, d, "--overwrite") == EXIT_BAD_INPUT
  assert _tree(d) == before
  assert "not a bitdelta output" in capsys.readouterr().err


def test_apply_refuses_to_overwrite_a_foreign_checkpoint_and_a_delta(pair, tmp_path, capsys):
  delta = tmp_path / "delta"
  assert _compress(pair, delta) == 0
  # The user's own fine-tune (config.json + safetensors, not written by bitdelta).
  before = _tree(pair["ft"])
  argv = ["apply", "--base", str(pair["base"]), "--delta", str(delta), "--quiet", "--overwrite"]
  assert main([*argv, "--out", str(pair["ft"])]) == EXIT_BAD_INPUT
  assert _tree(pair["ft"]) == before
  assert main([*argv, "--out", str(delta)]) == EXIT_BAD_INPUT
  assert read_manifest(delta)["format"] == "bitdelta-jax-delta"
  # Its own output is replaced with --overwrite, refused without.
  out = tmp_path / "applied"
  assert main([*argv, "--out", str(out)]) == 0
  assert main([*argv[:-1], "--out", str(out)]) == EXIT_BAD_INPUT
  assert "--overwrite" in capsys.readouterr().err
  assert main([*argv, "--out", str(out)]) == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == ["applied", "delta"]


def test_replacing_a_previous_delta_works(pair, tmp_path):
  out = tmp_path / "delta"
  assert _compress(pair, out) == 0
  assert _compress(pair, out) == EXIT_BAD_INPUT  # no --overwrite
  assert read_manifest(out)["policy"]["granularity"] == "matrix"
  assert _compress(pair, out, "--overwrite", "--scale", "per-column") == 0
  assert read_manifest(out)["policy"]["granularity"] == "column"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["delta"]


@pytest.mark.slow
def test_orphaned_temp_dir_of_a_dead_process_is_removed(pair, tmp_path):
  """`kill -9` during compress leaves its temporary directory; the next run removes it."""
  out = tmp_path / "delta"
  code = ("import os, sys, time\n"
          "import bitdelta_jax.delta.stream as s\n"
          "orig = s.DeltaWriter.add\n"
          "def add(self, *a, **k):\n"
          "  orig(self, *a, **k)\n"
          "  print('started', flush=True)\n"
          "  time.sleep(60)\n"
          "s.DeltaWriter.add = add\n"
          "from bitdelta_jax.cli import main\n"
          f"main(['compress', '--base', {str(pair['base'])!r}, '--finetuned', "
          f"{str(pair['ft'])!r}, '--out', {str(out)!r}, '--quiet'])\n")
  p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  try:
    assert p.stdout.readline().strip() == "started"
  finally:
    p.kill()
    p.wait()
  orphans = [x for x in tmp_path.iterdir() if x.name.startswith(".bitdelta-tmp-delta-")]
  assert len(orphans) == 1 and str(p.pid) in orphans[0].name and not out.exists()
  assert _compress(pair, out) == 0
  assert sorted(x.name for x in tmp_path.iterdir()) == ["delta"]


def test_eval_refuses_a_regular_file_as_out(tmp_path, capsys):
  victim = tmp_path / "victim.txt"
  victim.write_text("precious")
  assert main(["eval", "--out", str(victim), "--quiet"]) == EXIT_BAD_INPUT
  assert victim.read_text() == "precious"
  assert "must be a directory" in capsys.readouterr().err


def test_zoo_build_refuses_unrelated_directory_before_training(tmp_path, capsys):
  d = tmp_path / "mine"
  d.mkdir()
  (d / "notes.md").write_text("precious")
  assert main(["zoo", "build", "--micro", "--out", str(d), "--overwrite", "--quiet",
               "--cache", str(tmp_path / "cache")]) == EXIT_BAD_INPUT
  assert (d / "notes.md").read_text() == "precious" and len(list(d.iterdir())) == 1
  assert not (tmp_path / "cache").exists()  # refused before any training


def test_version(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--version"])
  assert e.value.code == 0
  assert capsys.readouterr().out.strip() == f"bitdelta-jax {__version__}"


def _undocumented(parser, path=()):
  missing = []
  for a in parser._actions:
    if isinstance(a, argparse._SubParsersAction):
      helps = {c.dest: c.help for c in a._choices_actions}
      for name, sub in a.choices.items():
        if path == () and name not in DOCUMENTED:
          continue
        if not helps.get(name):
          missing.append(" ".join((*path, name)))
        missing += _undocumented(sub, (*path, name))
    elif not a.help:
      missing.append(" ".join((*path, *(a.option_strings or [a.dest]))))
  return missing


def test_every_option_and_subcommand_has_help():
  assert _undocumented(build_parser()) == []


def test_quiet_compress_prints_nothing(pair, tmp_path, capfd):
  assert _compress(pair, tmp_path / "d") == 0
  out, err = capfd.readouterr()
  assert out == "" and err == ""


def test_compress_warns_about_a_wrong_base_and_notes_a_grown_vocabulary(pair, tmp_path, capsys):
  assert _compress(pair, tmp_path / "ok") == 0
  assert capsys.readouterr().err == ""
  assert _compress(pair, tmp_path / "wrong", ft="other") == 0
  err = capsys.readouterr().err
  assert err.startswith("warning: ") and "implausibly large" in err and "--base" in err
  assert _compress(pair, tmp_path / "grown", ft="grown") == 0
  err = capsys.readouterr().err
  assert err.startswith("note: ") and f"from {CFG.vocab_size} to {CFG.vocab_size + 3}" in err
  assert read_manifest(tmp_path / "grown")["notes"]


def test_manifest_has_no_absolute_paths(pair, tmp_path):
  assert _compress(pair, tmp_path / "d") == 0
  text = (tmp_path / "d" / "manifest.json").read_text()
  assert str(pair["root"]) not in text and str(tmp_path) not in text
  assert json.loads(text)["source"] == {"base": "base", "finetuned": "ft"}


def test_inspect_explains_policy_scales_and_ratios(pair, tmp_path, capsys):
  assert _compress(pair, tmp_path / "d", "--scale", "per-column") == 0
  capsys.readouterr()
  assert main(["inspect", str(tmp_path / "d")]) == 0
  out = capsys.readouterr().out
  assert "one α per output column" in out and "mean|Δ|" in out
  assert "{" not in out.split("policy:")[1].split("\n")[0]  # words, not JSON
  m = read_manifest(tmp_path / "d")
  packed = [t for t in m["report"]["tensors"] if t["kind"] == "packed"]
  bf16 = sum(2 * np.prod(t["shape"]) for t in packed)
  after = sum(t["bytes_after"] for t in packed)
  assert f"{bf16 / after:.1f}x smaller" in out and "in bf16" in out
  assert "whole checkpoint" in out


@pytest.mark.slow
def test_closed_pipe_ends_quietly(pair, tmp_path):
  """`bitdelta inspect X | head -1`: the reader is gone before we write; no traceback."""
  assert _compress(pair, tmp_path / "d") == 0
  p = subprocess.Popen([sys.executable, "-m", "bitdelta_jax.cli", "inspect", str(tmp_path / "d")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  p.stdout.close()  # like `head -1` after its line: every later write fails with EPIPE
  err = p.stderr.read().decode()
  assert p.wait() == 0 and err == "", err
  r = subprocess.run(f"{sys.executable} -m bitdelta_jax.cli inspect {tmp_path / 'd'} | head -1",
                     shell=True, capture_output=True, text=True)
  assert r.stdout.startswith("delta:") and r.stderr == ""


def test_tpu_backend_warning_is_filtered(capsys):
  from bitdelta_jax.cli import _quiet_backend_warnings

  _quiet_backend_warnings()
  log = logging.getLogger("jax._src.xla_bridge")
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  log.addHandler(handler)
  level = log.level
  log.setLevel(logging.INFO)  # serve logs at INFO: the backend probe's line must still go
  try:
    log.warning("A Google TPU may be present on this machine, but either a TPU-enabled jaxlib "
                "or libtpu is not installed. Falling back to cpu.")
    log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: "
             "libtpu.so: cannot open shared object file: No such file or directory")
    log.warning("something else")
    log.info("another line")
  finally:
    log.removeHandler(handler)
    log.setLevel(level)
  assert [r.getMessage() for r in records] == ["something else", "another line"]


def test_shipped_manifests_have_no_absolute_paths():
  from bitdelta_jax.zoo import SHIPPED

  def strings(x):
    if isinstance(x, dict):
      for v in x.values():
        yield from strings(v)
    elif isinstance(x, list):
      for v in x:
        yield from strings(v)
    elif isinstance(x, str):
      yield x

  manifests = sorted(SHIPPED.glob("deltas/*/manifest.json"))
  assert manifests
  for f in manifests:
    absolute = [s for s in strings(json.loads(f.read_text())) if s.startswith(("/", "~"))]
    assert absolute == [], (f, absolute)


def test_compress_one_bit_embeddings_flag(pair, tmp_path, capsys):
  base = make_base(CFG, 0)
  ft = make_finetune(base, 3)
  ft["model.embed_tokens.weight"] = ft["model.embed_tokens.weight"] + np.float32(0.01)
  ft_dir = write_checkpoint(ft, tmp_path / "ft_emb", CFG.hf_config())
  args = ["compress", "--base", str(pair["base"]), "--finetuned", str(ft_dir), "--quiet"]
  assert main([*args, "--out", str(tmp_path / "d"), "--embeddings", "1bit"]) == 0
  m = read_manifest(tmp_path / "d")
  assert m["embeddings"] == "1bit"
  assert m["tensors"]["model.embed_tokens.weight"]["kind"] == "packed"
  capsys.readouterr()
  assert main(["inspect", str(tmp_path / "d")]) == 0
  policy = capsys.readouterr().out.split("policy:")[1].split("\n")[0]
  assert "embeddings / LM head 1-bit with one α per token" in policy and "embed," not in policy
  assert main([*args, "--out", str(tmp_path / "e"), "--embeddings", "1bit", "--mode", "svd",
               "--rank", "2"]) == EXIT_BAD_INPUT
  assert "mode 'bitdelta' only" in capsys.readouterr().err
  assert not (tmp_path / "e").exists()


def test_ctrl_c_that_a_library_turned_into_another_error_still_reads_interrupted(capsys):
  """Issue 23: Ctrl-C during `eval`'s distillation printed `error: setting an array element
  with a sequence.` (the interrupt surfaced as numpy's ValueError)."""
  import signal as sig

  from bitdelta_jax.cli import run_command

  def command(_args):
    try:
      os.kill(os.getpid(), sig.SIGINT)  # delivered to this (the main) thread before kill returns
      time.sleep(60)  # not reached: the interrupt is raised at the next bytecode
    except KeyboardInterrupt:  # as numpy does inside an array conversion
      raise ValueError("setting an array element with a sequence.") from None

  # Python's own SIGINT handler, as in a terminal: a suite started in the background by a
  # non-interactive shell (`pytest &`) inherits SIGINT ignored, which run_command rightly
  # leaves alone (the signal then never arrived and the command returned None)
  before = sig.signal(sig.SIGINT, sig.default_int_handler)
  try:
    assert run_command(command, None) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert sig.getsignal(sig.SIGINT) is sig.default_int_handler  # restored
    assert run_command(lambda a: (_ for _ in ()).throw(ValueError("bad")), None) == 2
    assert capsys.readouterr().err.strip() == "error: bad"
  finally:
    sig.signal(sig.SIGINT, before)


def test_an_ignored_sigint_stays_ignored():
  """A command started with SIGINT ignored (nohup, a background job) keeps ignoring it."""
  import signal as sig

  from bitdelta_jax.cli import run_command

  before = sig.signal(sig.SIGINT, sig.SIG_IGN)
  try:
    assert run_command(lambda _a: sig.getsignal(sig.SIGINT), None) is sig.SIG_IGN
    assert sig.getsignal(sig.SIGINT) is sig.SIG_IGN
  finally:
    sig.signal(sig.SIGINT, before)


def test_eval_says_what_it_will_train_and_writes_outside_the_repository(monkeypatch, tmp_path,
                                                                        capsys):
  from bitdelta_jax.zoo import fidelity

  seen = {}
  monkeypatch.setenv("BITDELTA_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(fidelity, "run_eval", lambda out, **kw: seen.setdefault("out", out))
  assert main(["eval"]) == 0
  assert seen["out"] == tmp_path / "cache" / "eval"
  base, shipped = fidelity.shipped_family()
  plan = fidelity.eval_plan(base, list(shipped), fidelity.ZooConfig(), 256, tmp_path)
  assert f"{len(shipped)} full fine-tune(s) are not cached yet and are trained first" in plan
  assert str(tmp_path / "cache") in plan and "fidelity.{json,md,png}" in plan


def test_inspect_names_only_what_the_delta_holds(pair, tmp_path, capsys):
  """Issue 23: no GPT-2 names for a Llama, the kept-exactly line says what was kept, layers in
  numeric order, a self-compressed model reads 'nothing changed', --verify reads the arrays."""
  from bitdelta_jax.delta.report import Report, TensorReport

  assert _compress(pair, tmp_path / "d") == 0
  capsys.readouterr()
  assert main(["inspect", str(tmp_path / "d")]) == 0
  out = capsys.readouterr().out
  policy = out.split("policy:")[1].split("\n")[0]
  assert "wpe" not in policy and "wte" not in policy and "norm" in policy
  m = read_manifest(tmp_path / "d")
  exact = sorted(n for n, t in m["tensors"].items() if t["kind"] in ("value", "delta"))
  line = next(x for x in out.splitlines() if x.startswith("whole checkpoint"))
  assert f"{len(exact)} changed tensor(s) kept exactly: {exact[0]}" in line, (line, exact)
  assert "verified:       no" in out
  # against itself: nothing to store, said in words (was "0B vs 0B = infx smaller")
  assert main(["compress", "--base", str(pair["base"]), "--finetuned", str(pair["base"]),
               "--out", str(tmp_path / "same"), "--quiet"]) == 0
  capsys.readouterr()
  assert main(["inspect", str(tmp_path / "same")]) == 0
  out = capsys.readouterr().out
  assert "infx" not in out and "nothing changed, the delta stores no tensor" in out
  assert "no 1-bit matrices" in out
  # numeric order: layers.2 before layers.10
  rows = [TensorReport(f"model.layers.{i}.mlp.up_proj.weight", "packed", (4, 4), "float32", 32,
                       2, 0.5) for i in (10, 2, 1)]
  table = Report(rows).format(max_rows=None).splitlines()[1:4]
  assert [r.split()[0] for r in table] == [f"model.layers.{i}.mlp.up_proj.weight"
                                           for i in (1, 2, 10)]
  # --verify reads every array: a truncated one is an error
  assert main(["inspect", str(tmp_path / "d"), "--verify"]) == 0
  assert "crc32s match" in capsys.readouterr().out
  chunk = max((p for p in (tmp_path / "d").rglob("*") if p.is_file() and "bits" in p.parts
               and not p.name.startswith(".")), key=lambda p: p.stat().st_size)
  chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
  assert main(["inspect", str(tmp_path / "d"), "--verify"]) == EXIT_BAD_INPUT
  assert "error:" in capsys.readouterr().err
