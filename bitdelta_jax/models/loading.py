"""Loading a local Hugging Face directory into `LlamaForCausalLM` without random init.

``nnx.eval_shape(factory)`` builds the module with abstract arrays, ``nnx.split`` yields its
state, every `nnx.Param` is filled from the checkpoint one tensor at a time (via
`bitdelta_jax.hf.safetensors_io.CheckpointReader`, sharded directories included), `SlotBank`
variables are zero-filled, and ``nnx.merge`` returns the module.

Name mapping (`hf_name`): a Flax path joined with dots is the HF name, except that a Linear's
``kernel`` is HF ``weight`` transposed (``[in, out]`` vs ``[out, in]``).

    from_pretrained(path, dtype=None, *, num_slots=1, dense_embedding_slots=False, extra_vocab=0,
                    delta_implementation=None)
    from_tensors(config, tensors: Mapping[str, np.ndarray], dtype=jnp.float32)
    load_config(path, **slot_kwargs) -> ModelConfig
    base_tensors(model) -> dict[str, np.ndarray]   # HF names and layout
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.hf.gguf_checkpoint import gguf_file, is_gguf_dir, resolve_base
from bitdelta_jax.hf.safetensors_io import CheckpointError, CheckpointReader
from bitdelta_jax.models.config import ConfigError, ModelConfig
from bitdelta_jax.models.layers import SlotBank, hf_array
from bitdelta_jax.models.llama import LlamaForCausalLM
from pallas_kernels.quant_matmul import QuantizedKernel

# Tensors some checkpoints carry that the forward pass does not use.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def hf_name(path: tuple) -> tuple[str, bool]:
  """Flax state path → (HF tensor name, whether the tensor is transposed)."""
  parts = [str(p) for p in path]
  if parts[-1] == "kernel":
    return ".".join(parts[:-1] + ["weight"]), True
  return ".".join(parts), False


def load_config(path: str | os.PathLike, **slot_kwargs) -> ModelConfig:
  cfg_file = Path(path) / "config.json"
  if not cfg_file.exists():
    raise CheckpointError(f"{path}: no config.json")
  return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()), **slot_kwargs)


def _config_dtype(path: Path):
  d = json.loads((path / "config.json").read_text())
  name = d.get("dtype") or d.get("torch_dtype") or "float32"
  return _DTYPES.get(str(name).replace("torch.", ""), jnp.float32)


def _build(
  cfg: ModelConfig, dtype, names: list[str], read: Callable[[str], np.ndarray], where: str
) -> LlamaForCausalLM:
  abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  wanted = {}
  for path, var in nnx.to_flat_state(state):
    if isinstance(var, nnx.Param):
      wanted[hf_name(path)[0]] = path
  available = set(names)
  missing = sorted(set(wanted) - available)
  if missing:
    raise CheckpointError(
      f"{where}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}"
    )
  extra = sorted(
    n
    for n in available - set(wanted)
    if not n.endswith(_IGNORED_SUFFIXES) and not (cfg.tie_word_embeddings and n == "lm_head.weight")
  )
  if extra:
    raise CheckpointError(
      f"{where}: tensors this {cfg.model_type} decoder does not use: {extra[:8]} (an "
      f"unsupported variant of the architecture?)"
    )

  def fill(path, leaf):
    var_is_bank = path in bank_paths
    if var_is_bank:
      return jnp.zeros(leaf.shape, leaf.dtype)
    name, transpose = hf_name(path)
    arr = read(name)
    if isinstance(arr, QuantizedKernel):  # a GGUF base: kept in its ggml blocks
      return _quantized_param(arr, leaf, name, transpose, where)
    arr = np.asarray(arr)
    if transpose:
      arr = arr.T
    if tuple(arr.shape) != tuple(leaf.shape):
      raise CheckpointError(
        f"{where}: tensor {name!r} has shape {list(arr.shape)}, the config implies "
        f"{list(leaf.shape[::-1] if transpose else leaf.shape)}"
      )
    return jnp.asarray(arr.astype(np.float32) if arr.dtype != leaf.dtype else arr, leaf.dtype)

  bank_paths = {p for p, v in nnx.to_flat_state(state) if isinstance(v, SlotBank)}
  pure = nnx.to_pure_dict(state)
  flat = jax.tree_util.tree_flatten_with_path(pure)[0]
  filled = {}
  for kp, leaf in flat:
    path = tuple(k.key for k in kp)
    filled[path] = fill(path, leaf)
  nnx.replace_by_pure_dict(state, _unflatten(filled))
  return nnx.merge(graphdef, state)


def _quantized_param(qk: QuantizedKernel, leaf, name: str, transpose: bool, where: str):
  """The blocks of a quantized tensor as the parameter's value (device arrays, no copy kept on
  the host). A Linear kernel ``[K, N]`` and an embedding table ``[V, D]`` are both held as
  ``[K, N]`` column blocks: the table as ``[D, V]`` (`Embed` reads its columns)."""
  want = tuple(leaf.shape) if transpose else tuple(leaf.shape[::-1])
  if tuple(qk.shape) != want:
    raise CheckpointError(
      f"{where}: tensor {name!r} ({qk.format}) has shape {list(qk.shape)[::-1]}, the config "
      f"implies {list(want)[::-1]}")
  return jax.tree.map(jnp.asarray, qk)


def _unflatten(flat: dict[tuple, object]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    d = out
    for p in path[:-1]:
      d = d.setdefault(p, {})
    d[path[-1]] = v
  return out


def from_pretrained(
  path: str | os.PathLike,
  dtype=None,
  *,
  num_slots: int = 1,
  dense_embedding_slots: bool = False,
  lora_rank: int = 0,
  extra_vocab: int = 0,
  packed_embedding_slots: bool = False,
  delta_implementation: str | None = None,
  variants: Sequence[str | os.PathLike] = (),
) -> LlamaForCausalLM:
  """Loads ``config.json`` + safetensors from a local HF directory.

  Args:
    path: the directory (single file or sharded with ``model.safetensors.index.json``), or a
      GGUF base (``FILE.gguf`` or its metadata directory): Q8_0 / Q4_0 / Q4_1 tensors are kept
      in their ggml blocks, and the activations are f32 unless ``dtype`` says otherwise.
    dtype: parameter/activation dtype; None uses the config's ``dtype``/``torch_dtype``.
    num_slots: variant-bank size (slot 0 = base); 1 builds the plain base model.
    dense_embedding_slots: give embeddings / LM head per-slot dense delta banks.
    lora_rank: per-slot LoRA factors up to this rank in every linear layer (0: none).
    extra_vocab: per-slot rows for tokens variants added (a grown vocabulary; 0: none).
    packed_embedding_slots: give embeddings / LM head per-slot 1-bit delta banks (per-token α).
    delta_implementation: forced ``delta_matmul`` implementation (None = best available).
    variants: delta / PEFT adapter directories to be loaded into the slots: the banks they
      need (1-bit or exact embedding deltas, added tokens, LoRA rank) are added to the ones
      asked for above (`bitdelta_jax.models.banks`).

  Raises:
    ConfigError: unsupported architecture or config field.
    CheckpointError: missing, unexpected or misshapen tensors.
  """
  path = resolve_base(path)  # FILE.gguf: its metadata directory
  if variants:
    from bitdelta_jax.delta.variant import bank_options

    need = bank_options(variants, load_config(path).vocab_size)
    dense_embedding_slots |= need["dense_embedding_slots"]
    packed_embedding_slots |= need["packed_embedding_slots"]
    lora_rank, extra_vocab = max(lora_rank, need["lora_rank"]), max(extra_vocab,
                                                                    need["extra_vocab"])
  cfg = load_config(path, num_slots=num_slots, dense_embedding_slots=dense_embedding_slots,
                    lora_rank=lora_rank, extra_vocab=extra_vocab,
                    packed_embedding_slots=packed_embedding_slots)
  cfg = dataclasses.replace(cfg, delta_implementation=delta_implementation)
  dtype = _config_dtype(path) if dtype is None else dtype
  if is_gguf_dir(path):  # the weights live in a GGUF file: quantized tensors stay in blocks
    from bitdelta_jax.hf.gguf_base import open_gguf_base

    gguf = gguf_file(path)
    reader = open_gguf_base(gguf)
    return _build(cfg, dtype, reader.names(), reader.read, str(gguf))
  reader = CheckpointReader(path)
  return _build(cfg, dtype, reader.names(), reader.read, str(path))


def from_tensors(
  cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32
) -> LlamaForCausalLM:
  """Builds the model from in-memory HF-named, HF-layout tensors (e.g. `apply_delta`'s output)."""
  return _build(cfg, dtype, list(tensors), lambda n: tensors[n], "tensors")


def base_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
  """The base parameters as HF-named, HF-layout numpy arrays."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = hf_name(path)
    out[name] = hf_array(var.get_value(), transpose)
  return out


__all__ = [
  "ConfigError",
  "CheckpointError",
  "from_pretrained",
  "from_tensors",
  "load_config",
  "base_tensors",
  "hf_name",
]
