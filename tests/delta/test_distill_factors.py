"""Distillation of the low-rank delta modes (dqrelo: α·sign + a·b; svd: a·b): α and the
factors train, are written back at their stored widths, and the written delta serves exactly
W_base + α·S + a·b computed in numpy from the stored arrays."""

import dataclasses
import json
import shutil
import sys

import numpy as np
import pytest

from bitdelta_jax.cli import main
from bitdelta_jax.delta import residual
from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.store import (
  DeltaStoreError,
  load_delta,
  read_array,
  read_manifest,
  update_entries,
)
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.distill import (
  SLOT,
  DistillConfig,
  build_student,
  distill_checkpoint,
  token_windows,
)
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models.loading import from_tensors, load_config
from bitdelta_jax.models.slots import load_variant
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from model_fixtures import forward, make_tokenizer_dir  # noqa: E402

CFG = SyntheticConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
POLICIES = {
  "dqrelo-bf16": CompressPolicy(granularity="column", mode="dqrelo", rank=2, iters=1),
  "dqrelo-matrix-f16": CompressPolicy(granularity="matrix", mode="dqrelo", rank=2, iters=1,
                                      factor_dtype="float16"),
  "svd-4bit": CompressPolicy(mode="svd", rank=3, factor_width=4),
}
DCFG = DistillConfig(steps=40, lr=3e-4, seq=16, batch=4, eval_every=5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  root = tmp_path_factory.mktemp("distill_factors")
  base = make_base(CFG, 0, dtype=np.float32)
  ft = make_finetune(base, 1, rel=0.05)
  b = write_checkpoint(base, root / "base", CFG.hf_config())
  f = write_checkpoint(ft, root / "ft", CFG.hf_config())
  make_tokenizer_dir(b, CFG.vocab_size)
  ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 4000).astype(np.int32)
  return {"root": root, "base": b, "ft": f, "base_t": base, "ft_t": ft, "ids": ids}


def _signs_numpy(bits, k, group_k):
  """±1 [K, N] from the documented layout: row g·G + j·P + p is bit j of byte g·P + p."""
  p = group_k // 8
  s = np.zeros((k, bits.shape[1]), np.float32)
  for row in range(k):
    g, rem = divmod(row, group_k)
    j, q = divmod(rem, p)
    s[row] = np.where((bits[g * p + q] >> j) & 1, 1.0, -1.0)
  return s


def _decode_numpy(packed, steps, width, length):
  """Factor vectors from the documented code layout: code j of a byte in bits j·w, value
  (code − 2^(w−1) + ½)·step."""
  per = 8 // width
  out = np.zeros((len(packed), length), np.float32)
  for i, row in enumerate(packed):
    for t in range(length):
      code = (int(row[t // per]) >> (width * (t % per))) & ((1 << width) - 1)
      out[i, t] = (code - 2 ** (width - 1) + 0.5) * steps[i]
  return out


def _stored_dense(d, name, meta) -> np.ndarray:
  """f32 [K, N] ΔW of one linear tensor, from its stored arrays alone."""
  arrays, root = meta["arrays"], d / "arrays" / name

  def read(field):
    return np.asarray(read_array(root / field, arrays[field])).astype(np.float32)

  k, n = meta["shape"]
  out = np.zeros((k, n), np.float32)
  if meta["kind"] in ("packed", "residual"):
    bits = np.asarray(read_array(root / "bits", arrays["bits"]))
    out += read("scale").reshape(1, -1) * _signs_numpy(bits, k, meta["group_k"])
  if meta["kind"] in ("residual", "lora"):
    widths = read("widths").astype(int)
    for w in sorted(set(widths)):
      j = np.nonzero(widths == w)[0]
      if w == 16:
        a, b = read("a16"), read("b16")
      else:
        a = _decode_numpy(np.asarray(read_array(root / f"a{w}", arrays[f"a{w}"])),
                          read(f"a{w}_step"), w, k).T
        b = _decode_numpy(np.asarray(read_array(root / f"b{w}", arrays[f"b{w}"])),
                          read(f"b{w}_step"), w, n)
      assert a.shape == (k, len(j)) and b.shape == (len(j), n)
      out += a @ b
  return out


def _array_bytes(d) -> dict[str, int]:
  m = read_manifest(d)
  return {n: sum(int(np.prod(a["shape"])) * (2 if a["dtype"] == "bfloat16"
                                            else np.dtype(a["dtype"]).itemsize)
                 for a in meta["arrays"].values()) for n, meta in m["tensors"].items()}


@pytest.fixture(scope="module", params=list(POLICIES))
def distilled(request, pair, tmp_path_factory):
  tmp = tmp_path_factory.mktemp(request.param)
  d = tmp / "delta"
  compress_checkpoints(pair["base"], pair["ft"], d, POLICIES[request.param], progress=False)
  before = tmp / "before"
  shutil.copytree(d, before)
  info = distill_checkpoint(pair["base"], pair["ft"], d, pair["ids"], DCFG, progress=False)
  return {"kind": request.param, "delta": d, "before": before, "info": info}


@pytest.mark.slow
def test_distillation_lowers_held_out_mse_and_trains_factors(distilled):
  info = distilled["info"]
  assert info["held_mse_after"] < info["held_mse_before"]
  before, mb = load_delta(distilled["before"])
  after, m = load_delta(distilled["delta"])
  low_rank = [n for n, t in mb["tensors"].items() if t["kind"] in ("residual", "lora")]
  assert low_rank and info["factors_distilled"] == len(low_rank)
  assert m["factors"]["method"] == "distilled" and m["factors"]["tensors"] == len(low_rank)
  assert m["scales"]["method"] == "distilled"
  changed_a = changed_alpha = 0
  for n in low_rank:
    e0, e1 = before[n], after[n]
    lo0, lo1 = getattr(e0, "lora", e0), getattr(e1, "lora", e1)
    assert lo1.widths == lo0.widths and lo1.float_dtype == lo0.float_dtype
    changed_a += not np.array_equal(lo1.a, lo0.a)
    if hasattr(e0, "packed"):  # the 1-bit part: signs kept, α trained
      np.testing.assert_array_equal(e1.packed.bits, e0.packed.bits)
      changed_alpha += not np.array_equal(e1.packed.scale, e0.packed.scale)
  assert changed_a > 0
  assert changed_alpha > 0 or distilled["kind"].startswith("svd")


def test_bytes_and_layout_unchanged(distilled):
  assert _array_bytes(distilled["delta"]) == _array_bytes(distilled["before"])
  mb, m = read_manifest(distilled["before"]), read_manifest(distilled["delta"])
  for n, t in mb["tensors"].items():
    assert sorted(m["tensors"][n]["arrays"]) == sorted(t["arrays"])
    for f, a in t["arrays"].items():
      assert m["tensors"][n]["arrays"][f]["shape"] == a["shape"]
      assert m["tensors"][n]["arrays"][f]["dtype"] == a["dtype"]


def test_written_delta_serves_base_plus_alpha_sign_plus_factors(pair, distilled):
  """Slot 1 of a server model loaded from the written delta == a dense model whose linear
  weights are W_base + α·S + a·b computed in numpy from the stored arrays."""
  d = distilled["delta"]
  m = read_manifest(d)
  tensors = dict(pair["ft_t"])  # norms: as the fine-tune (the delta keeps them exactly)
  for n, meta in m["tensors"].items():
    if meta["kind"] in ("packed", "residual", "lora"):
      tensors[n] = pair["base_t"][n] + _stored_dense(d, n, meta).T  # HF [out, in]
  want_model = from_tensors(load_config(pair["base"]), tensors, np.float32)
  served = from_pretrained(pair["base"], np.float32, num_slots=2, variants=[d])
  load_variant(served, SLOT, load_delta(d)[0])
  ids = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 12))
  np.testing.assert_allclose(forward(served, ids, slot_ids=[SLOT, SLOT]),
                             forward(want_model, ids), rtol=1e-5, atol=1e-5)


def test_recorded_held_out_mse_is_that_of_the_written_delta(pair, distilled):
  """The kept candidate was judged after re-quantisation: its held-out MSE, recomputed from
  the delta as written, is the one recorded."""
  delta, _ = load_delta(distilled["delta"])
  student = build_student(pair["base"], pair["ft"], delta)
  teacher = from_pretrained(pair["ft"], np.float32)
  batches = token_windows(pair["ids"], DCFG)
  held = [next(batches) for _ in range(2)]
  mse = np.mean([np.mean(np.square(forward(student, t, slot_ids=[SLOT] * len(t)).astype(
    np.float64) - forward(teacher, t))) for t in held])
  np.testing.assert_allclose(mse, distilled["info"]["held_mse_after"], rtol=1e-4)


def test_recode_keeps_widths_and_puts_values_on_the_grid():
  r = np.random.default_rng(0)
  a, b = r.standard_normal((24, 3)).astype(np.float32), r.standard_normal((3, 40)).astype(np.float32)
  e = residual.CodedLora(a=a, b=b, widths=(16, 4, 2), a_step=np.zeros(3, np.float32),
                         b_step=np.zeros(3, np.float32))
  c = residual.recode(e, a * 1.1, b)
  assert c.widths == (16, 4, 2) and c.stored_nbytes == e.stored_nbytes
  np.testing.assert_array_equal(c.a[:, 0], (a[:, 0] * 1.1).astype(residual.FLOAT_DTYPES[
    "bfloat16"]).astype(np.float32))
  for i, w in ((1, 4), (2, 2)):  # each code vector decodes from its codes and step
    u = residual.codes_of(c.b[i], c.b_step[i], w)
    np.testing.assert_array_equal(residual.decode(u, c.b_step[i], w), c.b[i])
    assert len(np.unique(c.a[:, i])) <= 2 ** w
  with pytest.raises(ValueError, match="do not match"):
    residual.recode(e, a[:, :2], b)


def test_update_entries_rejects_mismatched_factors_and_kinds(pair, tmp_path):
  d = tmp_path / "delta"
  compress_checkpoints(pair["base"], pair["ft"], d, POLICIES["svd-4bit"], progress=False)
  delta, m = load_delta(d)
  name = next(n for n, t in m["tensors"].items() if t["kind"] == "lora")
  e = delta[name]
  with pytest.raises(DeltaStoreError, match="not a 1-bit"):
    update_entries(d, {name: np.ones(1, np.float32)}, {}, {"method": "x"})
  smaller = residual.CodedLora(a=e.a[:, :2], b=e.b[:2], widths=e.widths[:2],
                               a_step=e.a_step[:2], b_step=e.b_step[:2])
  with pytest.raises(DeltaStoreError, match="not stored like the old ones"):
    update_entries(d, {}, {name: smaller}, {"method": "x"})
  norm = next(n for n, t in m["tensors"].items() if "norm" in n)
  with pytest.raises(DeltaStoreError, match="not a low-rank"):
    update_entries(d, {}, {norm: e}, {"method": "x"})
  # a distillation that diverged: a non-finite factor is refused, naming the tensor
  a = np.array(e.a, np.float32)
  a[0, 0] = np.inf
  with pytest.raises(DeltaStoreError, match=f"new factor a for '{name}'.*1 non-finite"):
    update_entries(d, {}, {name: dataclasses.replace(e, a=a)}, {"method": "x"})
  assert read_manifest(d) == m  # nothing written


@pytest.mark.slow
def test_cli_distills_factors_or_scales_only(pair, tmp_path, capsys):
  d = tmp_path / "delta"
  compress_checkpoints(pair["base"], pair["ft"], d, POLICIES["dqrelo-bf16"], progress=False)
  calib = tmp_path / "calib.txt"
  calib.write_text(" ".join(f"w{i}" for i in np.random.default_rng(2).integers(3, 64, 600)))
  args = ["distill", "--base", str(pair["base"]), "--finetuned", str(pair["ft"]), "--delta",
          str(d), "--calibration", str(calib), "--steps", "3", "--seq", "16", "--batch", "2"]
  before, _ = load_delta(d)
  rc = main(args + ["--scales-only", "--quiet"])
  assert rc == 0, capsys.readouterr().err
  after, m = load_delta(d)
  assert "factors" not in m and m["scales"]["method"] == "distilled"
  for n, e in before.items():
    if hasattr(e, "lora"):
      np.testing.assert_array_equal(after[n].lora.a, e.lora.a)
  rc = main(args)
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert json.loads(out)["factors_distilled"] > 0
  assert read_manifest(d)["factors"]["method"] == "distilled"
