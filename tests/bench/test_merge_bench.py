"""Smoke test of bench/merge/merge_builtin.py: both parts on a randomly initialised micro base."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from bench.merge import merge_builtin as merge_bench
from bitdelta_jax.models import ModelConfig
from bitdelta_jax.models.llama import LlamaForCausalLM
from bitdelta_jax.zoo.recipe import ZooConfig, _save_hf


def test_set_partitions_counts_are_stirling_numbers():
  items = list("abcdef")
  counts = [sum(1 for _ in merge_bench.set_partitions(items, k)) for k in range(1, 7)]
  assert counts == [1, 31, 90, 65, 15, 1]
  for p in merge_bench.set_partitions(items, 3):
    assert sorted(x for block in p for x in block) == items and len(p) == 3


@pytest.mark.slow
def test_micro_bench_writes_both_tables(tmp_path):
  cfg = ZooConfig.micro()
  model = LlamaForCausalLM(
    ModelConfig.from_hf_dict(cfg.hf_config()), dtype=jnp.float32, rngs=nnx.Rngs(0)
  )
  base = _save_hf(model, tmp_path / "nano", cfg, ml_dtypes.bfloat16)
  out = tmp_path / "out"
  merge_bench.main(["--micro", "--base", str(base), "--out-dir", str(out)])
  soups = json.loads((out / "merge_soups.json").read_text())
  assert {r["variant"] for r in soups["rows"]} == set(merge_bench.VARIANTS)
  for r in soups["rows"]:
    assert np.isfinite(r["loss_diff_std"]) and 0 <= r["exact_match"] <= 100
    assert (r["merge_steps"] == []) == (r["variant"] == "none")
  km = json.loads((out / "kmerge.json").read_text())
  n = len(km["config"]["tasks"])
  assert km["methods"] == ["kmerge", "kmerge++@0", "random", "oracle"]
  for m in km["methods"]:
    assert set(km["summary_likelihood"][m]) == {str(k) for k in range(1, n + 1)}
  for run in km["runs"]:  # with K = #tasks nothing merges: every task keeps its own LoRA
    if run["k"] == n:
      assert abs(run["results"]["kmerge"]["lik"] - 1.0) < 1e-6
      assert abs(run["results"]["oracle"]["lik"] - 1.0) < 1e-6
  for stem in ("merge_soups", "kmerge"):
    for ext in ("md", "png"):
      assert (out / f"{stem}.{ext}").stat().st_size > 0
