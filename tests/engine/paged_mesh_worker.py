"""Mesh side of tests/engine/test_data_groups_and_mesh.py: the paged engine on 8 simulated CPU
devices, run in the session's mesh worker (tests/mesh/worker.py)::

    mesh_worker.call("engine/paged_mesh_worker.py:run_report")

Runs one mixed batch (base, two 1-bit variants, one of them with changed embeddings and norms,
a LoRA; n=2, log probabilities, prompt log probabilities, penalties and bias, a token mask, a
prompt longer than a prefill chunk, prefix-cache hits) through `Generator` on one device and
on 2x4 and (layers scanned) 1x8 ``(data, model)`` meshes, and writes every choice's tokens and
log probabilities plus where the KV pages live.
"""

from __future__ import annotations

import re
import sys

import jax
import numpy as np
from flax import nnx

from bitdelta_jax import sharding
from bitdelta_jax.delta.entries import Dense, LoraEntry
from bitdelta_jax.delta.format import PackedDelta, packed_rows
from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.runner import _is_layer_kernel
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.engine.stops import check_stop
from bitdelta_jax.models import LlamaForCausalLM, ModelConfig
from bitdelta_jax.models.slots import _targets, load_variant

# 4 kv heads: split over model=4 (2x4), replicated on model=8 (1x8); hidden 512 keeps o_proj
# row-parallel on model=4 and column-parallel on model=8 (whole bit-plane groups, rules.py)
CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=512, intermediate_size=1024,
                  num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64, qkv_bias=True,
                  num_slots=6, dense_embedding_slots=True, lora_rank=4,
                  packed_embedding_slots=True, extra_vocab=8)


def variants(model) -> dict[int, dict]:
  """slot 1: 1-bit, one α per matrix; slot 2: 1-bit per column + changed embeddings, LM head,
  norms and biases; slot 3: a LoRA of rank 4 on every linear layer; slot 4: 3 added tokens
  (rows past the base vocabulary in the embedding and the LM head, the head's strongly
  preferred); slot 5: 1-bit embeddings and LM head (packed banks, one α per token)."""
  out: dict[int, dict] = {1: {}, 2: {}, 3: {}, 4: {}, 5: {}}
  rng = np.random.default_rng(4)
  for name, (mod, role) in _targets(model).items():
    if role not in ("embed", "head"):
      continue
    w = np.asarray(mod.weight.get_value() if role == "embed" else mod.kernel.get_value().T)
    added = (0.5 if role == "head" else 0.05) * rng.standard_normal((3, w.shape[1]))
    out[4][name] = Dense("value", np.concatenate([w, added]).astype(np.float32))
    gk = mod.group_k
    kp = packed_rows(w.shape[1], gk)
    out[5][name] = PackedDelta(rng.integers(0, 256, (kp, w.shape[0]), dtype=np.uint8),
                               rng.uniform(0.005, 0.01, (w.shape[0],)).astype(np.float32),
                               (w.shape[1], w.shape[0]), gk, "column")
  for seed, slot in ((1, 1), (2, 2), (3, 3)):
    rng = np.random.default_rng(seed)
    for name, (mod, role) in _targets(model).items():
      if role == "linear" and slot in (1, 2):
        kp, n = mod.delta_bits.shape[1:]
        scale = (np.full((1,), 0.02, np.float32) if slot == 1
                 else rng.uniform(0.01, 0.03, (n,)).astype(np.float32))
        out[slot][name] = PackedDelta(rng.integers(0, 256, (kp, n), dtype=np.uint8), scale,
                                      (mod.in_features, mod.out_features), mod.group_k,
                                      "matrix" if slot == 1 else "column")
      elif role == "linear":
        a = 0.05 * rng.standard_normal((mod.in_features, 4)).astype(np.float32)
        b = 0.05 * rng.standard_normal((4, mod.out_features)).astype(np.float32)
        out[slot][name] = LoraEntry(a, b)
      elif slot == 2 and role in ("norm", "bias"):
        shape = np.shape(mod.weight.get_value() if role == "norm" else mod.bias.get_value())
        out[slot][name] = Dense("delta", (0.05 * rng.standard_normal(shape)).astype(np.float32))
      elif slot == 2 and role in ("embed", "head"):
        w = np.asarray(mod.weight.get_value() if role == "embed" else mod.kernel.get_value().T)
        out[slot][name] = Dense("value", (w + 0.02 * rng.standard_normal(w.shape)).astype(np.float32))
  return out


class EvenTokens:
  """A token mask (the grammar interface): only even ids, finished after 5 tokens."""

  def matcher(self):
    return _EvenMatcher()


class _EvenMatcher:
  def __init__(self):
    self.n = 0

  def fill_bitmask(self, words):
    words[:] = np.int32(0x55555555)

  def accept(self, tok):
    if tok % 2:
      raise ValueError(f"odd token {tok}")
    self.n += 1

  def is_finished(self):
    return self.n >= 5


def requests():
  rng = np.random.default_rng(7)

  def prompt(n):
    return rng.integers(3, CFG.vocab_size, n).tolist()

  shared = prompt(24)  # prefix-cache hits for the two that repeat it
  greedy = SamplingParams(max_new_tokens=8)
  return [
    ("base", shared, 0, greedy, 1),
    ("base_again", shared, 0, greedy, 1),  # 3 cached pages of 8
    ("v1", shared, 1, SamplingParams(max_new_tokens=8, logprobs=3), 1),
    ("v2_long", prompt(70), 2, greedy, 1),  # > prefill_chunk: three chunks
    ("v2_n2", prompt(9), 2, SamplingParams(temperature=0.8, seed=5, max_new_tokens=6), 2),
    ("lora_echo", prompt(12), 3, SamplingParams(max_new_tokens=4, prompt_logprobs=2), 1),
    ("v1_controls", prompt(5), 1,
     SamplingParams(max_new_tokens=8, repetition_penalty=1.3, presence_penalty=0.5,
                    logit_bias=((17, 5.0),)), 1),
    ("v2_mask", prompt(6), 2, SamplingParams(max_new_tokens=12, grammar=EvenTokens()), 1),
    ("lora_1tok_n3", [5], 3, SamplingParams(temperature=1.0, seed=2, max_new_tokens=3), 3),
    ("grown", prompt(7), 4, SamplingParams(max_new_tokens=6, logprobs=2), 1),
    ("packed_emb", prompt(11), 5, SamplingParams(max_new_tokens=8, logprobs=2), 1),
  ]


def kernel_bytes(runner, total: int) -> dict:
  """The decoder layers' linear kernels as the runner holds them, in bytes on the first
  device: in the step's per-layer arguments (the model's own) and in the stacked copy it scans
  over; ``total``: all of them, unsharded."""
  dev = runner.mesh.devices.flat[0] if runner.mesh is not None else jax.devices()[0]

  def on_dev(arrays) -> int:
    seen, n = set(), 0
    for a in arrays:
      for sh in a.addressable_shards:
        if sh.device == dev and id(sh.data) not in seen:
          seen.add(id(sh.data))
          n += int(sh.data.nbytes)
    return n

  flat = jax.tree_util.tree_leaves_with_path(nnx.state(runner.model))
  per_layer = on_dev(a for p, a in flat if _is_layer_kernel(p))
  paths = jax.tree_util.tree_leaves_with_path(runner._stacked[1])
  stacked = on_dev(a for p, a in paths if "kernel" in [getattr(k, "key", None) for k in p])
  model_axis = dict(runner.mesh.shape).get("model", 1) if runner.mesh is not None else 1
  return {"per_layer": per_layer, "stacked": stacked, "total": total, "model_axis": model_axis}


def run(mesh, scan: bool = False) -> dict:
  """The requests on ``mesh`` (None: one device). ``scan``: the layers as one scan over stacked
  states, every step program compiled ahead of time and the compile guard on."""
  model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
  # every decoder layer's linear kernels, before anything is sharded or stacked
  kernel_total = sum(int(a.nbytes) for p, a in jax.tree_util.tree_leaves_with_path(
    nnx.state(model)) if _is_layer_kernel(p))
  vs = variants(model)
  for slot in (1, 2, 4, 5):
    load_variant(model, slot, vs[slot])
  gen = Generator(model, mesh=mesh, max_rows=8, max_seq_len=128, page_size=8,
                       prefill_chunk=32, scan_layers=scan)
  gen.load_variant(3, vs[3])  # after sharding: written shard by shard on a mesh
  if scan:
    gen.warmup()
    for r in gen.runners:
      r.guard = True
  out: dict = {}
  for name, prompt, slot, params, n in requests():
    gen.add_n(prompt, slot, params, [(name, c) for c in range(n)])
  while gen.has_work:
    res = gen.step()
    if res.errors:
      raise RuntimeError(res.errors)
    for s, _ in res.tokens:
      if check_stop(s, gen.max_seq_len) is not None:
        out[f"{s.tag[0]}/{s.tag[1]}"] = {
          "tokens": list(s.generated),
          "logprobs": [[lp, ids, vals] for lp, ids, vals in s.token_logprobs],
          "prompt_logprobs": {str(k): list(v) for k, v in sorted(s.prompt_logprobs.items())},
        }
        gen.finish(s)
  k = gen.runners[0].k_pool
  gathers = all_gathers(gen) if mesh is not None else {}
  held = kernel_bytes(gen.runners[0], kernel_total) if scan else None
  return {"kernel_bytes": held, "choices": out, "gathers": gathers, "kv_spec": str(getattr(k.sharding, "spec", None)),
          "kv_shard_shape": list(k.addressable_shards[0].data.shape),
          "kv_devices": [len(r.k_pool.sharding.device_set) for r in gen.runners],
          "groups": gen.data_groups, "compiles": gen.compiles}


def all_gathers(gen) -> dict:
  """What the all-gathers of a compiled mixed-variant prefill step gather: (dtype, shape) of
  each, and the KV pool's shape."""
  r = gen.add(list(range(3, 40)), 2, SamplingParams(max_new_tokens=1))
  plan = gen.schedulers[r.group_index].schedule()
  runner = gen.runners[r.group_index]
  txt = runner.lower(plan.batch, plan.base_only).compile().as_text()
  shapes = [re.search(r"=\s*\(?(\w+)\[([\d,]*)\]", line) for line in txt.splitlines()
            if " all-gather(" in line or "all-gather-start(" in line]
  return {"gathered": [[m.group(1), [int(d) for d in m.group(2).split(",") if d]]
                       for m in shapes if m],
          "pool_shape": list(runner.k_pool.shape)}


def decode_costs(mesh) -> list[dict]:
  """Eight sequences decoding with mixed variants on ``mesh``: per data group, the sequences its
  scheduler holds and its decode step's compiled cost (`cost_analysis`: per device)."""
  model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
  vs = variants(model)
  gen = Generator(model, mesh=mesh, max_rows=8, max_seq_len=128, page_size=8, prefill_chunk=32)
  gen.load_variant(1, vs[1])
  rng = np.random.default_rng(3)
  reqs = [gen.add(rng.integers(3, CFG.vocab_size, 6).tolist(), i % 2,
                  SamplingParams(max_new_tokens=100)) for i in range(8)]
  while any(r.num_generated == 0 for r in reqs):  # every prompt computed: all decode now
    gen.step()
  out = []
  for sched, runner in zip(gen.schedulers, gen.runners):
    plan = sched.schedule()
    cost = runner.lower(plan.batch, plan.base_only).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out.append({"sequences": len(sched.running), "decode_tokens": len(plan.decode),
                "step_tokens": int(plan.batch.num_tokens), "flops": float(cost["flops"]),
                "bytes": float(cost.get("bytes accessed", 0.0)),
                "devices": len(runner.mesh.devices.flat)})
  return out


def run_report() -> dict:
  """Every check's data: one device, the 2x4 and scanned 1x8 meshes, the decode costs of one
  and two data groups, and the seconds each took."""
  import time

  t0, seconds = time.perf_counter(), {}

  def timed(name, value):
    nonlocal t0
    seconds[name] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    return value

  assert len(jax.devices()) == 8, jax.devices()
  rep = {"devices": len(jax.devices()), "one_device": timed("one_device", run(None)),
         "meshes": {}}
  rep["meshes"]["2x4"] = timed("2x4", run(sharding.make_mesh("data=2,model=4")))
  # 1x8 scanned only (an unscanned 1x8 run repeated its shardings: 2x4 covers unscanned layers
  # on a mesh); one data group: the warm-up compiles every bucket once
  rep["meshes"]["1x8_scan"] = timed("1x8_scan",
                                    run(sharding.make_mesh("data=1,model=8"), scan=True))
  rep["decode_costs"] = {
    "1x4": timed("costs_1x4", decode_costs(sharding.make_mesh("data=1,model=4",
                                                               jax.devices()[:4]))),
    "2x4": timed("costs_2x4", decode_costs(sharding.make_mesh("data=2,model=4")))}
  rep["seconds"] = seconds  # where the worker's time goes (the suite's slowest fixture)
  print("paged_mesh_worker seconds:", seconds, file=sys.stderr, flush=True)
  return rep
