"""The K-Merge validation gate (`bitdelta_jax.kmerge_gate`) on the nano base, with two LoRAs
trained to contradict each other (one answers "7" to every prompt, the other "3"): no merge of
the two keeps both, so the gate must refuse it; the CLI's --gate-threshold does the same."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kmerge_fixtures import NANO, ConstantTrainer, prompts  # noqa: E402

from bitdelta_jax.cli import main  # noqa: E402
from bitdelta_jax.kmerge import KMergePool, PoolConfig, canonical  # noqa: E402
from bitdelta_jax.kmerge_gate import encode_examples, read_val_set, validation_gate  # noqa: E402
from bitdelta_jax.merge.lora import save_adapter  # noqa: E402
from bitdelta_jax.models.tokenizer import Tokenizer  # noqa: E402
from bitdelta_jax.zoo.data import encode_example  # noqa: E402

pytestmark = pytest.mark.slow  # starts servers / subprocesses / the real model

VAL = {"seven": [(p, "7") for p in prompts(99, 16)], "three": [(p, "3") for p in prompts(98, 16)]}


@pytest.fixture(scope="module")
def trained():
  t = ConstantTrainer()
  return {"seven": t.train("7", seed=1), "three": t.train("3", seed=2)}


@pytest.fixture(scope="module")
def gate(trained):
  return validation_gate(NANO, trained, VAL, 0.9)


def test_prompts_use_the_chat_template():
  tok = Tokenizer.from_dir(NANO)
  assert tok.chat_template
  toks, mask = encode_examples(tok, [("abc", "7")])
  want, start = encode_example("abc", "7")  # <bos><|user|>abc<|assistant|>7<eos>
  assert toks[0, :len(want)].tolist() == want.tolist() and not toks[0, len(want):].any()
  assert mask[0].nonzero()[0].tolist() == list(range(start - 1, len(want) - 1))


def test_val_file_errors_name_the_line(tmp_path):
  f = tmp_path / "v.jsonl"
  f.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
  with pytest.raises(ValueError, match=r"v.jsonl:3: expected"):
    read_val_set(f)
  f.write_text('{"prompt": "a", "answer": "1"}\n')
  assert read_val_set(f) == [("a", "1")]


def _pool(gate, fallback, threshold=0.9):
  nbytes = canonical(next(iter(gate.own_adapters.values()))).nbytes
  return KMergePool(PoolConfig(k=1, budget_bytes=nbytes, gate_threshold=threshold,
                               fallback=fallback), gate=gate)


def test_own_adapters_pass_and_the_other_fails(gate, trained):
  assert gate.own_score("seven") == 1.0 and gate.own_score("three") == 1.0
  assert gate(trained["three"], "seven") == 0.0 and gate(trained["seven"], "seven") == 1.0


def test_gate_refuses_a_bad_merge_route_closest_keeps_the_member(gate, trained):
  pool = _pool(gate, "route_closest")
  pool.add("seven", trained["seven"])
  before = {n: (m.A.copy(), m.B.copy()) for n, m in pool.members["m1"].adapter.modules.items()}
  r = pool.add("three", trained["three"])
  assert r.action == "routed" and r.member == "m1" and min(r.scores.values()) < 0.9
  assert pool.routing == {"seven": "m1", "three": "m1"} and pool.members["m1"].tasks == ["seven"]
  for n, m in pool.members["m1"].adapter.modules.items():  # unchanged
    np.testing.assert_array_equal(m.A, before[n][0])
    np.testing.assert_array_equal(m.B, before[n][1])
  assert pool.nbytes <= pool.config.budget_bytes


def test_gate_refuses_a_bad_merge_evict_least_used(gate, trained):
  pool = _pool(gate, "evict_least_used")
  pool.add("seven", trained["seven"])
  r = pool.add("three", trained["three"])
  assert r.action == "evicted" and r.evicted == "m1" and list(pool.members) == ["m2"]
  assert pool.routing == {"seven": "m2", "three": "m2"}
  assert pool.nbytes <= pool.config.budget_bytes


def test_without_a_threshold_the_merge_is_kept(gate, trained):
  pool = _pool(gate, "route_closest", threshold=0.0)
  pool.add("seven", trained["seven"])
  assert pool.add("three", trained["three"]).action == "merged"
  assert pool.members["m1"].tasks == ["seven", "three"]
  assert pool.nbytes <= pool.config.budget_bytes


def test_cli_gate_threshold(trained, tmp_path, capsys):
  args = ["kmerge", "build", "--base", str(NANO), "--k", "1", "--out", str(tmp_path / "pool")]
  nbytes = canonical(trained["seven"]).nbytes
  args += ["--budget-mb", str(nbytes / (1 << 20))]
  for t, a in trained.items():
    save_adapter(a, tmp_path / t)
    (tmp_path / f"{t}.jsonl").write_text(
      "".join(json.dumps({"prompt": p, "answer": x}) + "\n" for p, x in VAL[t]))
    args += ["--adapter", f"{t}={tmp_path / t}", "--val", f"{t}={tmp_path / t}.jsonl"]
  assert main(args + ["--gate-threshold", "0.9"]) == 0
  out = capsys.readouterr().out
  assert "three: routed m1" in out and "three -> m1" in out
  pool = KMergePool.load(tmp_path / "pool")
  assert pool.members["m1"].tasks == ["seven"] and pool.config.gate_threshold == 0.9
  x = ["--adapter", f"x={tmp_path / 'seven'}", "--gate-threshold", "0.9"]
  assert main(args + x) == 2
  assert "needs a --val set for every task; missing: ['x']" in capsys.readouterr().err
