"""The one engine's whole serving step lowered for CUDA on a machine without a GPU.

`lower_step` builds a `PagedRunner` over a randomly initialised model of a given config (the
weights do not matter to lowering), selects the GPU kernels with
`pallas_kernels.platform.lowering_platform("cuda")`, and lowers one step program for CUDA
(`PagedRunner.lower(..., platform="cuda")`). Lowering runs every kernel's
own lowering (Mosaic GPU's MLIR, shapes, layouts, unsupported primitives, shardings): what is
left for a GPU is ptxas, shared-memory limits and numbers.

`unpacked_bits` finds delta bits unpacked outside a kernel: an elementwise op (shift, and,
convert, compare, select) of the module whose operand is an 8-bit tensor at least as large as
one packed weight matrix. A dense ``W_eff`` of a variant cannot be formed from the bits
without such ops, and the bits are the only 8-bit tensors of that size in a step. One unpack
is by design: a packed embedding bank's lookup gathers the batch's token columns first
(``bits[s, :, ids]``: ``[T, D/8]`` bytes) and unpacks only those (`token_column_unpacks`); its
size is ``T × D``, proportional to the tokens, never the table's ``D/8 × V``.

`pool_reads` finds the KV pools read outside a kernel: a gather or dynamic slice of a tensor
with the pools' trailing ``[page_size, KV, head_dim]`` (a dense gather of pages, or one
layer's pool copied out of the stacked pools).

`mesh_report` lowers over a device mesh in the session's 8-device mesh worker
(tests/mesh/worker.py; tests/kernels/test_cuda_lowering.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

# SmolLM2-135M-Instruct's config.json (the real model), and a Llama-8B-like attention shape
# (32 heads over 8 KV heads of 128) at small width, whose KV heads shard over 8 devices.
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               max_position_embeddings=8192, hidden_act="silu")
LLAMA_HEADS = dict(model_type="llama", hidden_size=1024, intermediate_size=2048,
                   num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, vocab_size=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                   tie_word_embeddings=False, max_position_embeddings=8192, hidden_act="silu")
CONFIGS = {"smollm2": SMOLLM2, "llama_heads": LLAMA_HEADS}
# The per-slot banks a server may hold (`models.banks.Banks`): "linear" the 1-bit linear
# slots alone; "all" every kind at once (1-bit linear, packed and dense embedding / LM-head
# banks, LoRA factors, a grown vocabulary), as a server holding variants of every kind builds.
BANKS = {"linear": {},
         "all": dict(packed_embedding_slots=True, dense_embedding_slots=True, lora_rank=8,
                     extra_vocab=64)}

_ELEMENTWISE = ("shift_right_logical", "shift_left", "and", "convert", "compare", "select")
_OP = re.compile(r"stablehlo\.(" + "|".join(_ELEMENTWISE) + r")\b(.*)$")
_TENSOR = re.compile(r"tensor<((?:\d+x)+)(ui8|i8)>")


def unpacked_bits(text: str, min_elements: int) -> list[str]:
  """Lines of the module that compute on an 8-bit tensor of ``>= min_elements`` elements."""
  hits = []
  for line in text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    for dims, _ in _TENSOR.findall(m.group(2)):
      size = 1
      for d in dims.rstrip("x").split("x"):
        size *= int(d)
      if size >= min_elements:
        hits.append(line.strip()[:200])
        break
  return hits


def _size(dims: str) -> int:
  size = 1
  for d in dims.rstrip("x").split("x"):
    size *= int(d)
  return size


def token_column_unpacks(text: str, n_tokens: int, dim: int) -> list[int]:
  """Sizes of the 8-bit elementwise operands that are the batch's token columns of a packed
  embedding (leading dim ``n_tokens``, at most ``n_tokens × dim`` elements)."""
  sizes = []
  for line in text.splitlines():
    m = _OP.search(line)
    if m:
      sizes += [_size(d) for d, _ in _TENSOR.findall(m.group(2))
                if int(d.split("x")[0]) == n_tokens and _size(d) <= n_tokens * dim]
  return sizes


def _without_token_columns(hits: list[str], n_tokens: int, dim: int) -> list[str]:
  def columns_only(line):
    m = _OP.search(line)
    return all(int(d.split("x")[0]) == n_tokens and _size(d) <= n_tokens * dim
               for d, _ in _TENSOR.findall(m.group(2)))
  return [h for h in hits if not columns_only(h)]


_READ = re.compile(r'stablehlo\.(gather|dynamic_slice)\b.*?:\s*\(?tensor<((?:\d+x)+)(\w+)>')


def pool_reads(text: str, page_size: int, head_dim: int) -> list[str]:
  """Gathers / dynamic slices whose operand ends in ``[page_size, KV, head_dim]`` (a KV pool or
  a slice of one, any KV: a device's own heads under shard_map)."""
  hits = []
  for line in text.splitlines():
    m = _READ.search(line)
    if not m:
      continue
    dims = m.group(2).rstrip("x").split("x")
    if len(dims) >= 4 and dims[-3] == str(page_size) and dims[-1] == str(head_dim):
      hits.append(line.strip()[:200])
  return hits


_KERNEL_NAMES = re.compile(r"(bitdelta_\w+?|ragged_paged_\w+?)(?:_mosaic_gpu)?\b")


def kernel_names(text: str) -> list[str]:
  """The named Mosaic GPU kernels of the module (the names their modules carry)."""
  return sorted(set(_KERNEL_NAMES.findall(text)))


def custom_calls(text: str) -> dict[str, int]:
  """call target -> count, over ``stablehlo.custom_call @target`` ops."""
  out: dict[str, int] = {}
  for name in re.findall(r"stablehlo\.custom_call @([\w.]+)", text):
    out[name] = out.get(name, 0) + 1
  return out


def build_runner(config: str, *, mesh=None, delta_implementation=None, num_slots: int = 3,
                 banks: str = "linear"):
  from flax import nnx

  from bitdelta_jax.engine.batch import StepShapes
  from bitdelta_jax.engine.runner import PagedRunner
  from bitdelta_jax.models.config import ModelConfig
  from bitdelta_jax.models.llama import LlamaForCausalLM

  cfg = ModelConfig.from_hf_dict(CONFIGS[config], num_slots=num_slots, **BANKS[banks])
  if delta_implementation is not None:
    import dataclasses

    cfg = dataclasses.replace(cfg, delta_implementation=delta_implementation)
  model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  shapes = StepShapes(max_rows=32, max_step_tokens=32 + 512, max_pages_per_seq=128,
                      page_size=16, block_pages=8, vocab_size=cfg.vocab_size, max_seq_len=2048)
  if mesh is not None:  # data > 1: the engine runs one data group's runner per mesh row
    from bitdelta_jax.engine.mesh_layout import data_groups

    model, mesh = data_groups(model, mesh)[0]
  # the layers as one scan, as the engine runs them on a GPU (`scan_layers_default`)
  return PagedRunner(model, shapes=shapes, num_pages=256, mesh=mesh, scan_layers=True), cfg


def lower_step(runner, n_tokens: int, base_only: bool, platform: str = "cuda") -> str:
  """The step program of ``n_tokens`` tokens, lowered for ``platform``; its text."""
  return runner.lower(runner.shapes.empty(n_tokens), base_only, platform=platform).as_text()


def packed_matrix_elements(cfg) -> int:
  """Bytes of the smallest packed weight matrix of the model (K/8 × N)."""
  d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  shapes = [(d, cfg.num_heads * hd), (d, cfg.num_kv_heads * hd), (cfg.num_heads * hd, d),
            (d, f), (f, d)]
  return min(k * n // 8 for k, n in shapes)


def embedding_packed_elements(cfg) -> int:
  """Bytes of one slot's packed embedding / LM-head bank (D/8 × V)."""
  return cfg.hidden_size // 8 * cfg.vocab_size


def report(runner, cfg, programs, per_device_elements: int | None = None) -> list[dict]:
  """Per program ``(tokens, base_only)``: its custom calls and named kernels, the packed bits
  unpacked outside a kernel (``unpacked``; the embedding lookup's token columns apart, their
  sizes in ``token_columns``), the largest 8-bit operand of an elementwise op (``largest_8bit``)
  and the reads of the KV pools outside a kernel (``pool_reads``)."""
  rows = []
  threshold = per_device_elements or packed_matrix_elements(cfg)
  for n, base_only in programs:
    text = lower_step(runner, n, base_only)
    d = cfg.hidden_size
    largest = max([_size(dims) for line in text.splitlines() if (m := _OP.search(line))
                   for dims, _ in _TENSOR.findall(m.group(2))], default=0)
    rows.append({"tokens": n, "base_only": base_only, "custom_calls": custom_calls(text),
                 "unpacked": _without_token_columns(unpacked_bits(text, threshold), n, d),
                 "token_columns": token_column_unpacks(text, n, d),
                 "largest_8bit": largest,
                 "pool_reads": pool_reads(text, runner.shapes.page_size, cfg.head_dim),
                 "kernels": kernel_names(text)})
  return rows


def mesh_report(mesh_spec: str, config: str, banks: str = "linear") -> dict:
  """The step programs of 32 and 544 tokens lowered for CUDA over ``mesh_spec`` (run in the
  session's 8-device mesh worker, tests/mesh/worker.py): `report`'s rows and the sizes the
  checks compare them with."""
  from bitdelta_jax.sharding import make_mesh

  mesh = make_mesh(mesh_spec)
  runner, cfg = build_runner(config, mesh=mesh, banks=banks)
  model_axis = dict(mesh.shape).get("model", 1)
  # a packed matrix split over `model` devices: each device holds 1/model of it
  rows = report(runner, cfg, [(32, False), (544, False)],
                per_device_elements=packed_matrix_elements(cfg) // model_axis)
  return {"devices": jax.device_count(), "mesh": dict(mesh.shape),
          "embedding_elements": embedding_packed_elements(cfg),
          "hidden": cfg.hidden_size, "rows": rows}
