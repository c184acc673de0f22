"""The real-model K-Merge bench's pieces that need no trained adapters: the OPCM group merge,
the content cache of scores, and the goal marks of its report."""

from __future__ import annotations

import numpy as np
import pytest

from bitdelta_jax.kmerge import KMergePool, PoolConfig
from bitdelta_jax.merge.lora import from_factors


@pytest.fixture(scope="module")
def bench():
  from bench.merge import kmerge_real

  return kmerge_real


def _adapter(seed, r=2, d=12):
  rng = np.random.default_rng(seed)
  mods = {f"model.layers.{i}.self_attn.q_proj": (rng.normal(size=(r, d)).astype(np.float32),
                                                   rng.normal(size=(d, r)).astype(np.float32))
          for i in range(2)}
  return from_factors(mods, {"r": r, "lora_alpha": r})


def test_merged_group_is_a_one_member_pool_in_arrival_order(bench):
  ads = {t: _adapter(i) for i, t in enumerate("abc")}
  cfg = bench.Config(tasks=tuple("abc"))
  got = bench.merged_group(ads, ["c", "a", "b"], cfg)
  pool = KMergePool(PoolConfig(k=1, budget_bytes=10**9, merge="opcm", alpha=cfg.opcm_alpha))
  for t in ("c", "a", "b"):
    pool.add(t, ads[t])
  (want,) = pool.members.values()
  for name, m in want.adapter.modules.items():
    np.testing.assert_array_equal(got.modules[name].delta(), m.delta())
  assert bench.fingerprint(got) == bench.fingerprint(want.adapter)
  assert bench.fingerprint(got) != bench.fingerprint(ads["a"])


def test_scores_are_cached_by_content_and_on_disk(bench, tmp_path):
  calls = []

  class Ctx:
    def score(self, adapter, examples, seq, batch):
      calls.append(len(examples))
      return {"score": 50.0}

  cfg = bench.Config(tasks=("lora-add",), n_eval=4, n_val=3)
  s = bench.Scorer(Ctx(), cfg, tmp_path / "scores.json")
  a = _adapter(0)
  assert s(a, "lora-add") == 50.0 and s(_adapter(0), "lora-add") == 50.0  # same content
  s(a, "lora-add", "val")
  s(_adapter(1), "lora-add")
  assert calls == [4, 3, 4] and s.calls == 3
  s.save()
  again = bench.Scorer(Ctx(), cfg, tmp_path / "scores.json")
  assert again(a, "lora-add", "val") == 50.0 and again.calls == 0 and calls == [4, 3, 4]


def _data(km, rd, violations=()):
  res = {"kmerge": {"4": {"mean": km[0], "std": km[1]}}, "random": {"4": {"mean": rd[0], "std": rd[1]}}}
  return {"results": res, "gate_violations": list(violations), "gate_log": [{}] * 6,
          "config": {"gate": 0.8}}


@pytest.mark.parametrize("km, rd, mark", [((0.8, 0.02), (0.6, 0.05), "met"),
                                          ((0.62, 0.02), (0.6, 0.05), "**missed**"),
                                          ((0.5, 0.01), (0.6, 0.01), "**missed**")])
def test_goal_needs_a_margin_over_the_spread(bench, km, rd, mark):
  (row, gate) = bench._goal_rows(_data(km, rd))
  assert row[2] == mark and gate[2] == "met"
  assert bench._goal_rows(_data(km, rd, [{"task": "x"}]))[1][2] == "**missed**"
