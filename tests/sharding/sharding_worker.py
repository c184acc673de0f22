"""Mesh side of tests/sharding/test_sharding.py: runs on the 8 simulated CPU devices of the
session's mesh worker (tests/mesh/worker.py; the pytest process has one device)::

    mesh_worker.call("sharding/sharding_worker.py:run", "equivalence", ["1x8", "2x4", "8x1"])

Returns a JSON report; the test asserts on it.
"""

from __future__ import annotations

import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax import sharding
from bitdelta_jax.delta.entries import Dense
from bitdelta_jax.delta.format import PackedDelta
from bitdelta_jax.models import LlamaForCausalLM, ModelConfig
from bitdelta_jax.models.layers import DeltaDense, SlotBank
from bitdelta_jax.models.slots import _targets, load_variant

# hidden 512: o_proj (K=512) is row-parallel on model=4 but not on model=8 (512 < 8 x 128:
# falls back to column-parallel); down_proj (K=1024) is row-parallel on both.
CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=512, intermediate_size=1024,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64, qkv_bias=True,
                  num_slots=4, dense_embedding_slots=True)
SLOTS = [0, 1, 2, 3, 1, 2, 3, 0]


def variant(model, seed: int) -> dict:
  """Random 1-bit deltas (slot 1 per-matrix α, others per-column) + dense norm/bias/embedding
  deltas for seed 3, so every bank kind is exercised."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, (mod, role) in _targets(model).items():
    if role == "linear":
      kp, n = mod.delta_bits.shape[1:]
      scale = (np.full((1,), 0.01, np.float32) if seed == 1
               else rng.uniform(0.005, 0.02, (n,)).astype(np.float32))
      out[name] = PackedDelta(rng.integers(0, 256, (kp, n), dtype=np.uint8), scale,
                              (mod.in_features, mod.out_features), mod.group_k,
                              "matrix" if seed == 1 else "column")
    elif seed == 3 and role in ("norm", "bias"):
      shape = np.shape(mod.weight.get_value() if role == "norm" else mod.bias.get_value())
      out[name] = Dense("delta", (0.05 * rng.standard_normal(shape)).astype(np.float32))
    elif seed == 3 and role in ("embed", "head"):
      w = np.asarray(mod.weight.get_value() if role == "embed" else mod.kernel.get_value().T)
      out[name] = Dense("value", (w + 0.01 * rng.standard_normal(w.shape)).astype(np.float32))
  return out


def prompts_batch(rng):
  lengths = np.asarray([16, 5, 9, 12, 3, 16, 7, 11], np.int32)
  ids = rng.integers(3, CFG.vocab_size, (8, 16)).astype(np.int32)
  ids[np.arange(16)[None] >= lengths[:, None]] = 0
  return ids, lengths


def forward(model, ids, slot_ids) -> np.ndarray:
  """Full-sequence logits ``[B, T, V]`` of ``model`` wherever its state lives (one device or
  sharded: the delta matmuls then run per shard)."""
  g, state = nnx.split(model)
  fn = jax.jit(lambda st, i, sl: nnx.merge(g, st)(i, slot_ids=sl))
  return np.asarray(fn(state, jnp.asarray(ids), jnp.asarray(slot_ids, jnp.int32)))


def equivalence(meshes: list[str]) -> dict:
  rng = np.random.default_rng(0)
  ids, lengths = prompts_batch(rng)
  slot_ids = np.asarray(SLOTS, np.int32)
  ref_model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
  variants = {s: variant(ref_model, s) for s in (1, 2, 3)}
  for s, d in variants.items():
    load_variant(ref_model, s, d)
  ref = {"logits": forward(ref_model, ids, slot_ids)}
  base_only = forward(ref_model, ids, np.zeros(8, np.int32))
  report = {"variant_effect": float(np.abs(ref["logits"] - base_only).max()), "meshes": {}}
  for spec in meshes:
    d, m = (int(x) for x in spec.split("x"))
    t0 = time.perf_counter()
    mesh = sharding.make_mesh(f"data={d},model={m}")
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    plan = sharding.shard_model(model, mesh)
    for s, dl in variants.items():
      sharding.load_variant_sharded(model, s, dl)
    out = {"logits": forward(model, ids, slot_ids)}
    bits_frac = {}
    for path, node in nnx.iter_graph(model):
      if isinstance(node, DeltaDense):
        bank = node.delta_bits.get_value()
        bits_frac[str(path[-1])] = max(s.data.nbytes for s in bank.addressable_shards) / bank.nbytes
    banks = nnx.state(model, SlotBank)
    report["meshes"][spec] = {
      "max_abs_diff": {k: float(np.abs(out[k] - ref[k]).max()) for k in ref},
      "max_abs_ref": {k: float(np.abs(ref[k]).max()) for k in ref},
      "modes": sorted({f"{p[-1]}={mo}" for p, mo in plan.modes.items()}),
      "notes": plan.notes,
      "bits_shard_fraction": bits_frac,
      "bank_bytes_per_device": sharding.per_device_bytes(banks),
      "seconds": time.perf_counter() - t0,
    }
  return report


def restore(meshes: list[str]) -> dict:
  from bitdelta_jax.delta.store import load_delta
  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.hf.safetensors_io import CheckpointReader
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.synthetic import SyntheticConfig, write_pair

  syn = SyntheticConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
  tmp = pathlib.Path(tempfile.mkdtemp())
  base_dir, ft_dir = write_pair(tmp, syn)
  compress_checkpoints(base_dir, ft_dir, tmp / "delta", progress=False)
  reads: list[tuple[str, int]] = []
  orig_rows, orig_read = CheckpointReader.read_rows, CheckpointReader.read

  def read_rows(self, name, start, stop):
    a = orig_rows(self, name, start, stop)
    reads.append((name, a.nbytes))
    return a

  def read(self, name, copy=True):
    a = orig_read(self, name, copy)
    if copy:
      reads.append((name, a.nbytes))
    return a

  ref = from_pretrained(base_dir, jnp.float32, num_slots=2)
  load_variant(ref, 1, load_delta(tmp / "delta")[0])
  ref_state = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(ref))}
  ids = np.arange(3, 19, dtype=np.int32)[None].repeat(2, 0)
  slots = np.asarray([1, 0], np.int32)
  ref_logits = forward(ref, ids, slots)
  report = {}
  for spec in meshes:
    d, m = (int(x) for x in spec.split("x"))
    mesh = sharding.make_mesh(f"data={d},model={m}")
    reads.clear()
    CheckpointReader.read_rows, CheckpointReader.read = read_rows, read
    try:
      model = sharding.restore_base(base_dir, mesh, jnp.float32, num_slots=2)
    finally:
      CheckpointReader.read_rows, CheckpointReader.read = orig_rows, orig_read
    sharding.load_variant_sharded(model, 1, tmp / "delta")
    state = nnx.state(model)
    plan = sharding.plan_model(model, dict(mesh.shape))
    mismatch, shard_bad, full_reads = [], [], []
    sharded_names = set()
    for p, v in nnx.to_flat_state(state):
      a = v.get_value()
      if not np.array_equal(np.asarray(a), ref_state[p]):
        mismatch.append(".".join(map(str, p)))
      pspec = plan.specs.get(p, jax.sharding.PartitionSpec())
      split = int(np.prod([mesh.shape[ax] for ax in pspec if ax is not None]))
      if split > 1:
        sharded_names.add(".".join(map(str, p)))
      want = a.nbytes // split
      if any(s.data.nbytes != want for s in a.addressable_shards):
        shard_bad.append(".".join(map(str, p)))
    hf_sizes = {n: CheckpointReader(base_dir).info(n).nbytes for n, _ in reads}
    for name, nbytes in reads:
      flax = name[:-len(".weight")] + ".kernel" if name.endswith("_proj.weight") or name == (
        "lm_head.weight") else name
      if flax in sharded_names and nbytes >= hf_sizes[name]:
        full_reads.append(name)
    ckpt = tmp / f"orbax_{spec}"
    sharding.save_state(ckpt, model)
    back = sharding.restore_state(ckpt, ref.config, mesh)
    back_state = nnx.state(back)
    orbax_bad = [
      ".".join(map(str, p)) for (p, v), (_, w) in zip(nnx.to_flat_state(back_state),
                                                      nnx.to_flat_state(state))
      if not np.array_equal(np.asarray(v.get_value()), np.asarray(w.get_value()))
      or v.get_value().sharding != w.get_value().sharding
    ]
    logits = forward(model, ids, slots)
    per_dev = sharding.per_device_bytes(state)
    report[spec] = {
      "value_mismatch": mismatch,
      "bad_shard_sizes": shard_bad,
      "full_tensor_reads_of_sharded": full_reads,
      "num_reads": len(reads),
      "orbax_mismatch": orbax_bad,
      "logits_max_abs_diff": float(np.abs(logits - ref_logits).max()),
      "per_device_bytes": per_dev,
      "total_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state))),
      "orbax_per_device_bytes": sharding.per_device_bytes(back_state),
    }
  return report


def run(mode: str, meshes: list[str]) -> dict:
  """The ``equivalence`` or ``restore`` report over ``meshes`` (e.g. ``["1x8", "2x4"]``)."""
  t0 = time.perf_counter()
  rep = equivalence(meshes) if mode == "equivalence" else restore(meshes)
  rep["devices"] = jax.device_count()
  rep["seconds_total"] = time.perf_counter() - t0
  return rep
