"""compress / apply_delta on parameter trees, checked against numpy."""

import ml_dtypes
import numpy as np
import pytest

from bitdelta_jax.delta.compress import (
  CompressPolicy,
  DeltaMismatchError,
  Dense,
  apply_delta,
  compress,
)
from bitdelta_jax.delta.format import PackedDelta


def _trees(seed=0):
  r = np.random.default_rng(seed)
  base = {
    "layers": {"0": {"attn": {"q": {"kernel": r.standard_normal((48, 40)).astype(np.float32)}},
                     "mlp": {"up": {"kernel": r.standard_normal((40, 96)).astype(np.float32)}}},
               "norm": {"scale": np.ones(40, np.float32)}},
    "embed": {"embedding": r.standard_normal((30, 40)).astype(np.float32)},
  }
  ft = {
    "layers": {"0": {"attn": {"q": {"kernel": base["layers"]["0"]["attn"]["q"]["kernel"]
                                   + 0.01 * r.standard_normal((48, 40)).astype(np.float32)}},
                     "mlp": {"up": {"kernel": base["layers"]["0"]["mlp"]["up"]["kernel"]
                                    + 0.01 * r.standard_normal((40, 96)).astype(np.float32)}}},
               "norm": {"scale": np.ones(40, np.float32)}},
    "embed": {"embedding": base["embed"]["embedding"] + 0.5},
  }
  return base, ft


@pytest.mark.parametrize("gran", ["matrix", "column"])
@pytest.mark.parametrize("dense", ["value", "delta"])
def test_compress_apply_matches_numpy(gran, dense):
  base, ft = _trees()
  delta, report = compress(base, ft, CompressPolicy(granularity=gran, group_k=16, dense=dense))
  q = delta["layers"]["0"]["attn"]["q"]["kernel"]
  assert isinstance(q, PackedDelta) and q.shape == (48, 40)
  assert delta["layers"]["norm"]["scale"].kind == "same"
  assert delta["embed"]["embedding"].kind == dense
  out = apply_delta(base, delta)
  for path in (("layers", "0", "attn", "q", "kernel"), ("layers", "0", "mlp", "up", "kernel")):
    b, f, got = base, ft, out
    for k in path:
      b, f, got = b[k], f[k], got[k]
    d = f - b
    alpha = np.abs(d).mean() if gran == "matrix" else np.abs(d).mean(axis=0)
    want = b + alpha * np.where(d >= 0, 1.0, -1.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    line = next(t for t in report.tensors if t.name == ".".join(path))
    rel = np.linalg.norm(d - (want - b)) / np.linalg.norm(d)
    assert line.rel_error == pytest.approx(rel, rel=1e-4)
    assert line.bytes_after == q.nbytes if path[3] == "q" else True
  np.testing.assert_allclose(out["embed"]["embedding"], ft["embed"]["embedding"], rtol=1e-6)
  np.testing.assert_array_equal(out["layers"]["norm"]["scale"], base["layers"]["norm"]["scale"])
  tot = report.totals
  assert tot["bytes_before"] == sum(t.bytes_before for t in report.tensors)


def test_hf_layout_bf16_and_identical_tensors():
  r = np.random.default_rng(5)
  bf = ml_dtypes.bfloat16
  base = {"model.layers.0.mlp.down_proj.weight": r.standard_normal((24, 72)).astype(bf),
          "model.layers.0.mlp.up_proj.weight": r.standard_normal((72, 24)).astype(bf)}
  ft = {"model.layers.0.mlp.down_proj.weight":
        (base["model.layers.0.mlp.down_proj.weight"].astype(np.float32)
         + 0.05 * r.standard_normal((24, 72))).astype(bf),
        "model.layers.0.mlp.up_proj.weight": base["model.layers.0.mlp.up_proj.weight"].copy()}
  delta, report = compress(base, ft, CompressPolicy(granularity="column"), hf_layout=True)
  pd = delta["model.layers.0.mlp.down_proj.weight"]
  assert pd.shape == (72, 24)  # Flax [in, out] of an HF [out, in] weight
  assert delta["model.layers.0.mlp.up_proj.weight"] == Dense("same")
  assert next(t for t in report.tensors if t.kind == "same").bytes_after == 0
  out = apply_delta(base, delta, hf_layout=True)
  n = "model.layers.0.mlp.down_proj.weight"
  d = ft[n].astype(np.float32) - base[n].astype(np.float32)  # [out, in]
  alpha = np.abs(d).mean(axis=1, keepdims=True)  # one α per output feature
  want = (base[n].astype(np.float32) + alpha * np.where(d >= 0, 1, -1)).astype(bf)
  np.testing.assert_array_equal(out[n].astype(np.float32), want.astype(np.float32))
  assert out[n].dtype == bf


def test_grown_vocab_and_mismatches():
  r = np.random.default_rng(6)
  base = {"embed_tokens.weight": r.standard_normal((10, 8)).astype(np.float32),
          "q_proj.weight": r.standard_normal((8, 8)).astype(np.float32)}
  ft = {"embed_tokens.weight": np.concatenate([base["embed_tokens.weight"] + 1,
                                               np.full((3, 8), 7, np.float32)]),
        "q_proj.weight": base["q_proj.weight"] + 0.1}
  delta, report = compress(base, ft, CompressPolicy(dense="delta"), hf_layout=True)
  e = delta["embed_tokens.weight"]
  assert e.kind == "delta" and e.value.shape == (10, 8) and e.extra_rows.shape == (3, 8)
  out = apply_delta(base, delta, hf_layout=True)
  np.testing.assert_allclose(out["embed_tokens.weight"], ft["embed_tokens.weight"], rtol=1e-6)
  with pytest.raises(DeltaMismatchError, match="q_proj.weight"):
    compress(base, {**ft, "q_proj.weight": np.zeros((8, 9), np.float32)}, hf_layout=True)
  with pytest.raises(DeltaMismatchError, match="lacks base tensors"):
    compress(base, {"q_proj.weight": ft["q_proj.weight"]}, hf_layout=True)
