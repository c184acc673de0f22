"""The serving step of a GGUF-based model (its Linear kernels and tied embedding in ggml blocks)
lowered for CUDA on a machine without a GPU.

`build_runner` makes a small Llama of SmolLM2's widths (2 layers, a 4096-token vocabulary),
replaces every Linear kernel and the tied embedding by `QuantizedKernel` blocks of the chosen
format (as `models.loading` puts a GGUF's tensors into the parameter tree: no dense copy) and
builds the engine's `PagedRunner` over it (layers as one scan, as on a GPU). On a mesh the
blocks are replicated and the embedding stays dense (see `build_runner`).

`dequantized_outside` finds a weight dequantized outside a kernel: an op of the module that
computes on an 8-bit tensor with a weight's column count N as its last dimension (the blocks'
``qs [.., K/32, 32|16, N]``, the delta bits ``[.., K/8, N]``): a convert to float, or the
shifts and masks of nibbles or bit planes before it. A dense ``[K, N]`` cannot be formed from
the blocks (nor a variant's signs from its bits) without such ops. The
embedding lookup (`take_columns`) gathers the batch's columns first, so its converts have the
batch's token count there, not N.

`mesh_report` lowers over a mesh in the session's 8-device mesh worker (tests/mesh/worker.py;
tests/kernels/test_quant_matmul_mosaic_gpu.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from cuda_lowering import SMOLLM2, custom_calls, lower_step

SMALL = dict(SMOLLM2, num_hidden_layers=2, vocab_size=4096)
_OP = re.compile(r"stablehlo\.(convert|shift_right_logical|and|multiply)\b(.*)$")
_TENSOR = re.compile(r"tensor<((?:\d+x)+)(ui8|i8)>")


def quantized_model(fmt: str, *, embedding: bool = True, num_slots: int = 3, seed: int = 0):
  """(model, cfg): random bf16 model whose 2-D Linear kernels (and with ``embedding`` the tied
  embedding) are blocks."""
  from flax import nnx

  from bitdelta_jax.models.config import ModelConfig
  from bitdelta_jax.models.llama import LlamaForCausalLM
  from pallas_kernels.quant_matmul import quantize

  cfg = ModelConfig.from_hf_dict(SMALL, num_slots=num_slots)
  model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
  graphdef, state = nnx.split(model)
  pure = nnx.to_pure_dict(state)

  def fill(path, leaf):
    name = "/".join(str(k.key) for k in path)
    if embedding and name.endswith("embed_tokens/weight"):  # [V, D] → [D, V] blocks, as the loader does
      return jax.tree.map(jnp.asarray, quantize(np.asarray(leaf, np.float32).T, fmt))
    if name.endswith("/kernel") and leaf.ndim == 2:
      return jax.tree.map(jnp.asarray, quantize(np.asarray(leaf, np.float32), fmt))
    return leaf

  pure = jax.tree_util.tree_map_with_path(fill, pure)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state), cfg


def build_runner(fmt: str, *, mesh=None):
  """The runner over `quantized_model`. On a mesh the blocks are replicated (the sharding
  rules do not split `QuantizedKernel` yet: every Linear replicated, the embedding dense and
  split by its usual rule)."""
  from bitdelta_jax.engine.batch import StepShapes
  from bitdelta_jax.engine.runner import PagedRunner
  from bitdelta_jax.sharding.rules import PartitionRules

  model, cfg = quantized_model(fmt, embedding=mesh is None)
  rules = None if mesh is None else PartitionRules(column=(), row=())
  shapes = StepShapes(max_rows=32, max_step_tokens=32 + 512, max_pages_per_seq=128,
                      page_size=16, block_pages=8, vocab_size=cfg.vocab_size, max_seq_len=2048)
  if mesh is not None:
    from bitdelta_jax.engine.mesh_layout import data_groups

    model, mesh = data_groups(model, mesh, rules)[0]
  runner = PagedRunner(model, shapes=shapes, num_pages=256, mesh=mesh, rules=rules,
                       scan_layers=True)
  return runner, cfg


def weight_columns(cfg) -> set[int]:
  """The column counts N of the model's quantized weights (the tied embedding's is V)."""
  d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  return {cfg.num_heads * hd, cfg.num_kv_heads * hd, d, f, cfg.vocab_size}


def dequantized_outside(text: str, columns: set[int]) -> list[str]:
  """Lines that compute on an 8-bit tensor whose last dimension is one of ``columns``."""
  hits = []
  for line in text.splitlines():
    m = _OP.search(line)
    if not m or "custom_call" in line:
      continue
    for dims, _ in _TENSOR.findall(m.group(2)):
      if int(dims.rstrip("x").split("x")[-1]) in columns:
        hits.append(line.strip()[:200])
        break
  return hits


def report(runner, cfg, programs, columns=None) -> list[dict]:
  rows = []
  for n, base_only in programs:
    text = lower_step(runner, n, base_only)
    rows.append({"tokens": n, "base_only": base_only, "custom_calls": custom_calls(text),
                 "kernels": sorted(set(re.findall(r"bitdelta_\w+", text))),
                 "partitions": re.findall(r"mhlo.num_partitions = (\d+)", text),
                 "dequantized": dequantized_outside(text, columns or weight_columns(cfg))})
  return rows


def mesh_report(mesh_spec: str, fmt: str, tokens: list[int]) -> dict:
  """`report`'s rows for steps of ``tokens`` lowered over ``mesh_spec`` (in the session's
  8-device mesh worker, tests/mesh/worker.py)."""
  from bitdelta_jax.sharding import make_mesh

  mesh = make_mesh(mesh_spec)
  runner, cfg = build_runner(fmt, mesh=mesh)
  model_axis = dict(mesh.shape).get("model", 1)
  cols = weight_columns(cfg) | {c // model_axis for c in weight_columns(cfg)}
  rows = report(runner, cfg, [(t, False) for t in tokens], columns=cols)
  return {"devices": jax.device_count(), "mesh": dict(mesh.shape), "rows": rows}
