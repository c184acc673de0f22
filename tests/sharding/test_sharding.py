"""bitdelta_jax.sharding: rules and the per-shard delta matmul in-process (1 device); sharded
prefill/decode/generation and restore with 8 simulated CPU devices in the session's mesh worker
(tests/sharding/sharding_worker.py run by tests/mesh/worker.py), since the device count is fixed
when jax starts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from bitdelta_jax import sharding
from bitdelta_jax.models import LlamaForCausalLM, ModelConfig

WORKER = "sharding/sharding_worker.py:run"
CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=512, intermediate_size=1024,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64, qkv_bias=True,
                  num_slots=4, dense_embedding_slots=True)


def _abstract(cfg=CFG):
  return nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))


def _spec(plan, *path):
  return plan.specs.get(tuple(path), P())


# -- in-process -------------------------------------------------------------------------------
def test_parse_mesh_spec():
  assert sharding.parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
  assert sharding.parse_mesh_spec("model=8") == {"data": 1, "model": 8}
  assert sharding.parse_mesh_spec(" model = 2 , data=3") == {"data": 3, "model": 2}
  for bad in ("tp=2", "data=2,data=2", "model=x", "model=0", "model"):
    with pytest.raises(ValueError, match="mesh spec"):
      sharding.parse_mesh_spec(bad)


def test_make_mesh_checks_device_count():
  mesh = sharding.make_mesh()
  assert dict(mesh.shape) == {"data": 1, "model": jax.device_count()}
  assert sharding.mesh_spec(mesh) == f"data=1,model={jax.device_count()}"
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh("data=2,model=8")


def test_rules_tensor_parallel_layout():
  plan = sharding.plan_model(_abstract(), {"data": 2, "model": 4})
  attn = ("model", "layers", 0, "self_attn")
  mlp = ("model", "layers", 1, "mlp")
  assert _spec(plan, *attn, "q_proj", "kernel") == P(None, "model")
  assert _spec(plan, *attn, "q_proj", "bias") == P("model")
  assert _spec(plan, *attn, "q_proj", "delta_bits") == P(None, None, "model")
  assert _spec(plan, *attn, "q_proj", "delta_scale") == P(None, "model")
  assert _spec(plan, *attn, "q_proj", "bias_delta") == P(None, "model")
  assert _spec(plan, *attn, "o_proj", "kernel") == P("model", None)
  assert _spec(plan, *attn, "o_proj", "delta_bits") == P(None, "model", None)
  assert _spec(plan, *attn, "o_proj", "delta_scale") == P()
  assert _spec(plan, *mlp, "down_proj", "delta_bits") == P(None, "model", None)
  assert _spec(plan, *mlp, "up_proj", "kernel") == P(None, "model")
  assert _spec(plan, "model", "embed_tokens", "weight") == P("model", None)
  assert _spec(plan, "model", "embed_tokens", "weight_delta") == P(None, "model", None)
  assert _spec(plan, "lm_head", "kernel") == P(None, "model")
  assert _spec(plan, "lm_head", "kernel_delta") == P(None, None, "model")
  assert _spec(plan, "model", "norm", "weight") == P()
  assert _spec(plan, "model", "layers", 0, "input_layernorm", "weight_delta") == P()
  assert plan.notes == []
  assert sharding.kv_heads_axis(CFG, {"data": 2, "model": 4}) == "model"
  # GQA with fewer kv heads than model shards: heads replicated; odd rows: rows replicated.
  assert sharding.kv_heads_axis(CFG, {"data": 2, "model": 8}) is None


def test_rules_group_boundary_fallback_and_error():
  # o_proj: K = 512 < 8 x 128, a row shard would split a bit-plane group.
  plan = sharding.plan_model(_abstract(), {"data": 1, "model": 8})
  o = ("model", "layers", 0, "self_attn", "o_proj")
  assert plan.modes[o] == sharding.COLUMN
  assert _spec(plan, *o, "delta_bits") == P(None, None, "model")
  assert any("o_proj" in n and "group_k=128" in n for n in plan.notes)
  assert plan.modes[("model", "layers", 0, "mlp", "down_proj")] == sharding.ROW
  with pytest.raises(sharding.ShardingError, match=r"model=8 x group_k=128.*--group-k 8"):
    sharding.plan_model(_abstract(), {"model": 8},
                        sharding.PartitionRules(on_indivisible="error"))
  # Without a bank only divisibility by `model` matters.
  import dataclasses

  plain = dataclasses.replace(CFG, num_slots=1, dense_embedding_slots=False)
  assert sharding.plan_model(_abstract(plain), {"model": 8}).modes[o] == sharding.ROW
  # A vocabulary that does not divide: replicated, logged.
  odd = dataclasses.replace(plain, vocab_size=250)
  plan = sharding.plan_model(_abstract(odd), {"model": 4})
  assert _spec(plan, "model", "embed_tokens", "weight") == P()
  assert any("vocabulary 250" in n for n in plan.notes)


@pytest.mark.parametrize("mode", [sharding.COLUMN, sharding.ROW, sharding.REPLICATED])
def test_sharded_delta_matmul_one_device(mode):
  from pallas_kernels.delta_matmul.api import delta_matmul

  r = np.random.default_rng(0)
  k, n, s, m = 256, 48, 3, 5
  x = r.standard_normal((m, k), np.float32)
  w = r.standard_normal((k, n), np.float32)
  bits = r.integers(0, 256, (s, k // 8, n), dtype=np.uint8)
  scale = r.random((s, n), np.float32)
  ids = np.asarray([0, 1, 2, 1, 0], np.int32)
  want = delta_matmul(x, w, bits, scale, ids, implementation="reference")
  op = sharding.ShardedDeltaMatmul(sharding.make_mesh("data=1,model=1", jax.devices()[:1]), mode)
  got = jax.jit(lambda *a: op(*a, group_k=128))(x, w, bits, scale, ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


# -- 8 simulated devices (the session's mesh worker) ------------------------------------------
@pytest.mark.mesh
def test_sharded_forward_matches_unsharded(mesh_worker):
  rep = mesh_worker.call(WORKER, "equivalence", ["1x8", "2x4", "8x1"])
  assert rep["devices"] == 8
  assert rep["variant_effect"] > 0.1  # the variants change the logits: the test has teeth
  for spec, r in rep["meshes"].items():
    for key, diff in r["max_abs_diff"].items():
      assert diff <= 1e-5 * max(1.0, r["max_abs_ref"][key]), (spec, key, diff)
    m = int(spec.split("x")[1])
    assert all(f == pytest.approx(1 / m) for f in r["bits_shard_fraction"].values()), spec
    assert len(set(r["bank_bytes_per_device"].values())) == 1, spec
  assert "o_proj=column" in rep["meshes"]["1x8"]["modes"]  # group-boundary fallback
  assert any("o_proj" in n for n in rep["meshes"]["1x8"]["notes"])
  assert "o_proj=row" in rep["meshes"]["2x4"]["modes"]


@pytest.mark.mesh
def test_restore_into_shardings_per_device_bytes(mesh_worker):
  rep = mesh_worker.call(WORKER, "restore", ["1x8", "2x4"])
  for spec in ("1x8", "2x4"):
    r = rep[spec]
    m = int(spec.split("x")[1])
    assert r["value_mismatch"] == [], spec
    assert r["bad_shard_sizes"] == [], spec
    assert r["full_tensor_reads_of_sharded"] == [], spec
    assert r["orbax_mismatch"] == [], spec
    assert r["logits_max_abs_diff"] < 1e-5, spec
    per_dev = list(r["per_device_bytes"].values())
    assert len(per_dev) == 8
    assert max(per_dev) <= r["total_bytes"] / m + 0.01 * r["total_bytes"], spec
    assert r["orbax_per_device_bytes"] == r["per_device_bytes"], spec
