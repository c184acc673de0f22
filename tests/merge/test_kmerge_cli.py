"""``bitdelta kmerge build`` (`bitdelta_jax.kmerge_cli`) with random LoRAs on the nano base."""

from __future__ import annotations

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kmerge_fixtures import NANO, random_adapter  # noqa: E402

from bitdelta_jax.cli import main  # noqa: E402
from bitdelta_jax.kmerge import KMergePool, canonical  # noqa: E402
from bitdelta_jax.merge.lora import from_factors, save_adapter  # noqa: E402


def _adapters(tmp_path, n=3):
  out = []
  for i in range(n):
    save_adapter(random_adapter(i), tmp_path / f"a{i}")
    out += ["--adapter", f"t{i}={tmp_path / f'a{i}'}"]
  return out


def test_build_writes_the_pool_within_budget(tmp_path, capsys):
  nbytes = canonical(random_adapter(0)).nbytes
  budget = 2 * nbytes
  args = ["kmerge", "build", "--base", str(NANO), *_adapters(tmp_path), "--k", "2",
          "--budget-mb", repr(budget / (1 << 20)), "--out", str(tmp_path / "pool")]
  assert main(args) == 0
  out = capsys.readouterr().out
  assert "t0: slot m1" in out and "t1: slot m2" in out and "t2: merged" in out
  pool = KMergePool.load(tmp_path / "pool")
  assert set(pool.routing) == {"t0", "t1", "t2"} and len(pool.members) == 2
  assert f"t2 -> {pool.route('t2')}" in out
  assert sum(m.adapter.nbytes for m in pool.members.values()) <= budget
  assert sorted(p.name for p in (tmp_path / "pool" / "members").iterdir()) == ["m1", "m2"]
  # average merge, K-Merge++ with a threshold every pair passes: one member serves all
  assert main(args[:-2] + ["--out", str(tmp_path / "pp"), "--plusplus",
                           "--similarity-threshold", "-1", "--merge", "average"]) == 0
  pp = KMergePool.load(tmp_path / "pp")
  assert list(pp.members) == ["m1"] and pp.config.merge == "average"


def test_bad_inputs_exit_2(tmp_path, capsys):
  base = ["kmerge", "build", "--base", str(NANO), "--k", "1", "--budget-mb", "1"]
  save_adapter(random_adapter(0), tmp_path / "ok")
  ok = ["--adapter", f"a={tmp_path / 'ok'}"]

  def err(*args):
    assert main([*base, *args]) == 2
    return capsys.readouterr().err

  rng = np.random.default_rng(0)
  wide = from_factors({"model.layers.0.self_attn.q_proj": (
    rng.standard_normal((2, 64)).astype(np.float32),
    rng.standard_normal((64, 2)).astype(np.float32))})
  save_adapter(wide, tmp_path / "other")
  assert "(an adapter for another base?)" in err(
    "--adapter", f"a={tmp_path / 'other'}", "--out", str(tmp_path / "p"))
  assert "no adapter_config.json" in err("--adapter", f"a={tmp_path / 'nothing'}",
                                         "--out", str(tmp_path / "p"))
  assert "not a valid model name" in err("--adapter", f"a/b={tmp_path / 'ok'}",
                                         "--out", str(tmp_path / "p"))
  assert "--val is only used by the gate" in err(*ok, "--val", "a=x.jsonl",
                                                 "--out", str(tmp_path / "p"))
  (tmp_path / "taken").mkdir()
  assert "is not a K-Merge pool; refusing" in err(*ok, "--out", str(tmp_path / "taken"))
  assert not (tmp_path / "p").exists()
