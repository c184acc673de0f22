"""Delta modes beyond BitDelta (`bitdelta_jax.delta.residual`): each against numpy written from
the definitions, store round trips, and a served residual variant against its dense weights."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from bitdelta_jax.delta import residual
from bitdelta_jax.delta.compress import CompressPolicy, apply_delta, compress
from bitdelta_jax.delta.entries import LoraEntry, ResidualEntry
from bitdelta_jax.delta.format import PackedDelta, pack
from bitdelta_jax.delta.residual import MIXED, ModeSpec, compress_linear, stored_nbytes
from bitdelta_jax.delta.store import load_delta, read_manifest, save_delta
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_pair

K, N = 96, 160  # K is not a multiple of the default group size


def _delta(seed=0, k=K, n=N):
  """A fine-tune-like delta: a rank-6 part plus noise of similar norm."""
  r = np.random.default_rng(seed)
  low = r.standard_normal((k, 6)) @ r.standard_normal((6, n)) / np.sqrt(6)
  return (0.01 * (low + r.standard_normal((k, n)))).astype(np.float32)


def _signs_numpy(bits, k, group_k):
  """±1 [K, N] from the documented layout: row g·G + j·P + p is bit j of byte g·P + p."""
  p = group_k // 8
  s = np.zeros((k, bits.shape[1]), np.float32)
  for row in range(k):
    g, rem = divmod(row, group_k)
    j, q = divmod(rem, p)
    s[row] = np.where((bits[g * p + q] >> j) & 1, 1.0, -1.0)
  return s


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _rel(d, approx):
  return float(np.linalg.norm(d - approx) / np.linalg.norm(d))


def test_truncated_svd_equals_numpy_svd():
  d = _delta()
  lr = compress_linear(d, ModeSpec("svd", rank=5))
  u, s, vt = np.linalg.svd(d.astype(np.float64))
  ref = _bf16(u[:, :5] * np.sqrt(s[:5])) @ _bf16(np.sqrt(s[:5])[:, None] * vt[:5])
  np.testing.assert_allclose(lr.a @ lr.b, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
  # Eckart–Young: the error is the tail of the spectrum (plus bf16 rounding of the factors)
  tail = np.sqrt(np.sum(s[5:] ** 2)) / np.linalg.norm(d)
  assert tail <= _rel(d, lr.a @ lr.b) <= tail * 1.01
  assert stored_nbytes(lr) == 5 * (2 * (K + N) + 1)


def _dqrelo_numpy(d, rank, iters):
  """D-QRELO as the residual module documents it, written plainly (per-column α, bf16)."""
  alpha = np.abs(d).mean(0)
  sign = np.where(d >= 0, 1.0, -1.0)

  def lowrank(t):
    u, s, vt = np.linalg.svd(t.astype(np.float64))
    return _bf16(u[:, :rank] * np.sqrt(s[:rank])) @ _bf16(np.sqrt(s[:rank])[:, None] * vt[:rank])

  lr = lowrank(d - alpha * sign)
  for _ in range(iters):
    rest = d - lr
    sign, alpha = np.where(rest >= 0, 1.0, -1.0), np.abs(rest).mean(0)
    lr = lowrank(d - alpha * sign)
  return alpha * sign + lr


@pytest.mark.parametrize("iters", [0, 2])
def test_dqrelo_matches_numpy_and_beats_bitdelta(iters):
  d = _delta(1)
  e = compress_linear(d, ModeSpec("dqrelo", rank=4, iters=iters, granularity="column"))
  assert isinstance(e, ResidualEntry) and e.lora.a.shape == (K, 4)
  # the entry's own reconstruction, from its bits decoded by the documented layout
  signs = _signs_numpy(np.asarray(e.packed.bits), K, e.packed.group_k)
  mine = signs * e.packed.scale[None, :] + e.lora.a @ e.lora.b
  np.testing.assert_allclose(residual.dense_of(e), mine, rtol=1e-6, atol=1e-9)
  ref = _dqrelo_numpy(d, 4, iters)
  assert abs(_rel(d, mine) - _rel(d, ref)) < 1e-4
  bitdelta = _rel(d, np.where(d >= 0, 1.0, -1.0) * np.abs(d).mean(0))
  plain = _rel(d, _dqrelo_numpy(d, 4, 0))  # one SVD of the residual, no compensation
  assert _rel(d, mine) < bitdelta
  assert _rel(d, mine) <= plain + 1e-6


def test_codes_roundtrip_and_grid():
  v = np.random.default_rng(2).standard_normal((3, 37)).astype(np.float32)
  for w in (2, 4, 8):
    dec, steps = residual.code_rows(v, w)
    for row, step in zip(dec, steps):
      q = row / step - 0.5  # on the mid-rise grid, within 2^w levels
      np.testing.assert_allclose(q, np.rint(q), atol=1e-4)
      assert np.rint(q).min() >= -(2 ** (w - 1)) and np.rint(q).max() <= 2 ** (w - 1) - 1
      u = residual.codes_of(row, step, w)
      packed = residual.pack_codes(u[None], w)
      assert packed.shape == (1, -(-37 * w // 8))
      np.testing.assert_array_equal(residual.unpack_codes(packed, w, 37)[0], u)
    # more bits, less error
    if w > 2:
      assert np.sum((v - dec) ** 2) < np.sum((v - residual.code_rows(v, w // 2)[0]) ** 2)


@pytest.mark.parametrize("mode,width", [("svd", 16), ("delta-come", MIXED), ("dqrelo", 16),
                                        ("dqrelo", MIXED), ("dqrelo", 4)])
@pytest.mark.parametrize("budget", [1 / 12, 1 / 8])
def test_budget_is_respected(mode, width, budget):
  d = _delta(3)
  e = compress_linear(d, ModeSpec(mode, budget=budget, width=width, granularity="column"))
  assert stored_nbytes(e) <= 2 * K * N * budget
  if mode == "dqrelo":  # never worse than BitDelta at the same granularity as its 1-bit part
    pd = e.packed if isinstance(e, ResidualEntry) else e
    assert _rel(d, residual.dense_of(e)) <= _rel(d, residual.dense_of(pack(d, pd.granularity)))


def test_mixed_precision_beats_bf16_svd_at_equal_bytes():
  d = _delta(4)
  for budget in (1 / 15, 1 / 8):
    mixed = compress_linear(d, ModeSpec("delta-come", budget=budget))
    svd = compress_linear(d, ModeSpec("svd", budget=budget))
    assert stored_nbytes(mixed) <= 2 * K * N * budget
    assert _rel(d, mixed.a @ mixed.b) < _rel(d, svd.a @ svd.b)
    assert set(mixed.widths) <= {2, 4, 8, 16}


def _array_bytes(meta):
  return sum(int(np.prod(a["shape"])) * np.dtype(
    ml_dtypes.bfloat16 if a["dtype"] == "bfloat16" else a["dtype"]).itemsize
    for a in meta["arrays"].values())


@pytest.mark.parametrize("policy", [
  CompressPolicy(mode="dqrelo", rank=3, granularity="column"),
  CompressPolicy(mode="dqrelo", budget=1 / 8, factor_width=MIXED),
  CompressPolicy(mode="svd", rank=4, factor_dtype="float16"),
  CompressPolicy(mode="delta-come", budget=1 / 15),
])
def test_save_load_apply_roundtrip(tmp_path, policy):
  c = SyntheticConfig(hidden_size=32, intermediate_size=64, vocab_size=64)
  base = make_base(c)
  ft = make_finetune(base)
  delta, report = compress(base, ft, policy, hf_layout=True)
  m = save_delta(tmp_path / "d", delta, base_fingerprint={"tensors": {}, "digest": "x"},
                 report=report, policy=policy.to_dict())
  loaded, m2 = load_delta(tmp_path / "d")
  assert m2["mode"] == policy.mode
  assert m2["lora_rank"] == residual.lora_rank_of(loaded.values()) > 0
  for name, e in delta.items():
    got = loaded[name]
    assert type(got) is type(e)
    if isinstance(e, (ResidualEntry, LoraEntry)):
      lo, lg = getattr(e, "lora", e), getattr(got, "lora", got)
      np.testing.assert_array_equal(lg.a, lo.a)
      np.testing.assert_array_equal(lg.b, lo.b)
      assert lg.widths == lo.widths
      # bytes counted are the bytes stored
      assert stored_nbytes(e) == _array_bytes(m["tensors"][name])
  for name, w in apply_delta(base, loaded, hf_layout=True).items():
    np.testing.assert_array_equal(w, apply_delta(base, delta, hf_layout=True)[name])


@pytest.mark.slow
def test_streamed_compress_and_served_variant(tmp_path):
  """`compress_checkpoints` per mode → `load_delta` → slots of a model with ``lora_rank``: each
  row's logits equal the applied dense model's (BitDelta slots are tested elsewhere)."""
  from bitdelta_jax.models import from_pretrained, from_tensors, load_variant
  from bitdelta_jax.models.loading import load_config

  b, f = write_pair(tmp_path, SyntheticConfig(hidden_size=32, intermediate_size=64, vocab_size=64))
  policies = [CompressPolicy(mode="dqrelo", budget=1 / 8, factor_width=MIXED),
              CompressPolicy(mode="svd", rank=3)]
  deltas = []
  for i, p in enumerate(policies):
    m = compress_checkpoints(b, f, tmp_path / f"d{i}", p, progress=False)
    assert json.loads((tmp_path / f"d{i}" / "manifest.json").read_text())["mode"] == p.mode
    deltas.append(load_delta(tmp_path / f"d{i}")[0])
    assert m["lora_rank"] == residual.lora_rank_of(deltas[-1].values())
  assert any(isinstance(e, ResidualEntry) for e in deltas[0].values())
  rank = max(read_manifest(tmp_path / f"d{i}")["lora_rank"] for i in range(2))
  model = from_pretrained(b, dtype=jnp.float32, num_slots=3, lora_rank=rank)
  for slot, d in enumerate(deltas, start=1):
    load_variant(model, slot, d)
  ids = np.random.default_rng(0).integers(0, 64, (1, 9))
  fwd = nnx.jit(lambda m, x, s: m(x, slot_ids=s))  # one compile instead of op-by-op (4x faster)
  out = np.asarray(fwd(model, jnp.asarray(np.repeat(ids, 2, 0)), jnp.arange(1, 3)))
  from bitdelta_jax.hf.safetensors_io import CheckpointReader

  with CheckpointReader(b) as r:
    base_sd = {n: r.read(n).astype(np.float32) for n in r.names()}  # the dense sum in f32 too
  cfg = load_config(b)
  for row, d in enumerate(deltas):
    dense = from_tensors(cfg, apply_delta(base_sd, d, hf_layout=True), jnp.float32)
    np.testing.assert_allclose(out[row], np.asarray(fwd(dense, jnp.asarray(ids), None))[0],
                               atol=1e-4,
                               err_msg=f"slot {row + 1}")


def test_policy_validation():
  with pytest.raises(ValueError, match="needs --rank"):
    CompressPolicy(mode="svd")
  with pytest.raises(ValueError, match="budget"):
    CompressPolicy(mode="delta-come")
  with pytest.raises(ValueError, match="rank and budget are for the other modes"):
    CompressPolicy(budget=1 / 8)
  with pytest.raises(ValueError, match="mode must be"):
    CompressPolicy(mode="nope", rank=2)
  with pytest.raises(ValueError, match="exceeds the budget"):
    compress_linear(_delta(), ModeSpec("dqrelo", budget=1 / 20))
  assert isinstance(compress_linear(_delta(), ModeSpec("dqrelo", budget=1 / 15)), PackedDelta)


def test_cli_compress_modes(tmp_path, capsys):
  from bitdelta_jax.cli import EXIT_BAD_INPUT, main

  b, f = write_pair(tmp_path, SyntheticConfig(hidden_size=32, intermediate_size=64, vocab_size=64))
  args = ["compress", "--base", str(b), "--finetuned", str(f), "--quiet"]
  assert main([*args, "--out", str(tmp_path / "d"), "--mode", "dqrelo", "--budget", "1/8",
               "--factor-bits", "mixed", "--scale", "per-column"]) == 0
  m = read_manifest(tmp_path / "d")
  assert (m["mode"], m["policy"]["budget"], m["policy"]["factor_width"]) == ("dqrelo", 1 / 8, 0)
  delta, _ = load_delta(tmp_path / "d")
  assert m["lora_rank"] == residual.lora_rank_of(delta.values()) > 0
  assert all(stored_nbytes(e) <= 2 * np.prod(e.packed.shape) / 8
             for e in delta.values() if isinstance(e, ResidualEntry))
  # `bitdelta apply` materialises the same weights as the in-memory apply
  assert main(["apply", "--base", str(b), "--delta", str(tmp_path / "d"), "--out",
               str(tmp_path / "applied"), "--quiet"]) == 0
  from bitdelta_jax.hf.safetensors_io import CheckpointReader

  with CheckpointReader(b) as rb, CheckpointReader(tmp_path / "applied") as ra:
    base_sd = {n: rb.read(n) for n in rb.names()}
    want = apply_delta(base_sd, delta, hf_layout=True)
    for n in ra.names():
      np.testing.assert_array_equal(ra.read(n), want[n])
  assert main([*args, "--out", str(tmp_path / "e"), "--mode", "svd"]) == EXIT_BAD_INPUT
  assert "needs --rank" in capsys.readouterr().err
  assert main([*args, "--out", str(tmp_path / "e"), "--budget", "1/8"]) == EXIT_BAD_INPUT
  with pytest.raises(SystemExit):
    main([*args, "--out", str(tmp_path / "e"), "--mode", "svd", "--budget", "2/1"])
