"""bench/common/random_models.py's random variants (they must load against their GGUF base as a
compressed fine-tune does) and bench/serving/quant.py's ratios, goals and report on a synthetic
result (not the bench)."""

from __future__ import annotations

import numpy as np
import pytest
from model_fixtures import make_hf_model

from bench.common import random_models
from bench.serving import quant as quant_bench

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
  from bitdelta_jax.hf.gguf_export import write_gguf
  from bitdelta_jax.zoo.tokenizer_build import write_tokenizer

  d = tmp_path_factory.mktemp("tiny_llama_rand")
  make_hf_model("llama", d, vocab_size=320, tie_word_embeddings=False)
  write_tokenizer(d)  # the built-in family's byte-level BPE
  return {f: write_gguf(d, d.parent / f"tiny-{f}.gguf", dtype=f) for f in ("q4_0", "q8_0")}


def test_random_variant_loads_against_its_base_only(ggufs, tmp_path):
  from bitdelta_jax.delta.entries import DeltaMismatchError
  from bitdelta_jax.delta.format import PackedDelta
  from bitdelta_jax.delta.store import load_delta
  from bitdelta_jax.hf.checkpoints import open_checkpoint
  from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base
  from pallas_kernels.bits import unpack_signs

  out = random_models.write_random_variant(ggufs["q4_0"], tmp_path / "v", seed=3, alpha=0.01)
  delta, manifest = load_delta(out, base_fingerprint=fingerprint_checkpoint(ggufs["q4_0"]))
  with open_checkpoint(resolve_base(ggufs["q4_0"])) as r:
    linear = [n for n in r.names() if n.endswith("_proj.weight")]
    assert linear and set(delta) == set(r.names())
    for n in linear:
      e = delta[n]
      assert isinstance(e, PackedDelta), n
      assert e.shape == tuple(r.info(n).shape[::-1]), n  # HF [out, in] -> (K, N)
      np.testing.assert_allclose(np.asarray(e.scale), [0.01])
      signs = unpack_signs(np.asarray(e.bits), e.shape, e.group_k, dtype=np.float32)
      assert set(np.unique(signs)) == {-1.0, 1.0}
      assert 0.4 < (signs > 0).mean() < 0.6, n  # random signs, not a constant
  assert {delta[n].kind for n in delta if n not in linear} == {"same"}
  # made against the Q4_0 file: the Q8_0 file of the same model is another base
  with pytest.raises(DeltaMismatchError) as e:
    load_delta(out, base_fingerprint=fingerprint_checkpoint(ggufs["q8_0"]))
  assert "q4_0" in str(e.value) and "q8_0" in str(e.value)
  # another seed, other bits; the same seed again is kept (cached), not rewritten
  other = random_models.write_random_variant(ggufs["q4_0"], tmp_path / "w", seed=4)
  d2, _ = load_delta(other)
  assert not np.array_equal(np.asarray(d2[linear[0]].bits), np.asarray(delta[linear[0]].bits))
  mtime = (out / "manifest.json").stat().st_mtime_ns
  random_models.write_random_variant(ggufs["q4_0"], out, seed=5)
  assert (out / "manifest.json").stat().st_mtime_ns == mtime


def _section(tok: dict, **kw) -> dict:
  return {"tokens_per_s": tok, "median_s": {k: 32 / v for k, v in tok.items()},
          "memory_mb": {}, "config": {"rounds": 3, "tokens": 32},
          "machine": {"cpu": "test cpu", "cores": 2}, **kw}


def test_ratios_goals_and_report_from_a_result():
  res = {"sections": {
    "smollm2": _section({"q4_1": 80.0, "llama_q4_1": 100.0, "q4_1_variant": 60.0,
                         "q4_1_memsched": 40.0}, extra_ratios=[["q4_1", "q4_1_memsched"]]),
    "7b": _section({"q4_0": 3.0, "llama_q4_0": 2.5, "q4_0_variant": 2.0, "q4_0_mix14": 7.0},
                   memory_mb={"q4_0": {"peak": 16000.0, "now": 15000.0}},
                   stored_mb={"q4_0": 3600.0},
                   fit={"machine_mb": 24000.0, "served": 14, "peak_mb": 16000.0,
                        "variant_mb": 800.0, "fixed_mb": 4800.0, "fit": 24}),
  }}
  r = quant_bench.ratios(res["sections"]["smollm2"])
  assert r == pytest.approx({"q4_1/llama_q4_1": 0.8, "q4_1_variant/q4_1": 0.75,
                             "q4_1/q4_1_memsched": 2.0})
  r7 = quant_bench.ratios(res["sections"]["7b"])
  assert r7["q4_0/llama_q4_0"] == pytest.approx(1.2)
  assert r7["q4_0_mix14/q4_0"] == pytest.approx(7 / 3)
  md = "\n".join(quant_bench.render(res))
  goals = {line.split(" ≥ ")[0].lstrip("| "): line for line in md.splitlines() if " ≥ " in line}
  assert goals["one stream, SmolLM2 Q4_1 (the wheel's file) vs llama.cpp"].endswith("| 0.80 | yes |")
  assert goals["a variant's stream vs the base's, SmolLM2 Q4_1"].endswith("| 0.75 | yes |")
  assert goals["one stream, 7B Q4_0 vs llama.cpp"].endswith("| 1.20 | yes |")
  assert goals["a variant's stream vs the base's, 7B Q4_0"].endswith("| 0.67 | no |")
  assert goals["one stream, 1B Q4_0 vs llama.cpp"].endswith("| - | - |")  # not run
  assert "14 served, peak 15.6 GiB | yes |" in md
  assert "**24 device slots**" in md
  assert "| q4_0 | 16000 | 15000 | 3600 | 4.44 |" in md
