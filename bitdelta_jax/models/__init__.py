"""Llama-family decoder (Llama, Mistral, Qwen2) with per-row 1-bit variant slots.

    from bitdelta_jax.models import Generator, SamplingParams, from_pretrained, load_variant
    model = from_pretrained("path/to/hf_dir", dtype=jnp.bfloat16, num_slots=4)
    load_variant(model, 1, delta_dict)          # slot 1 ← a variant (no recompilation)
    gen = Generator(model, max_rows=8, max_seq_len=1024)
    gen.generate([[1, 2, 3]], slot_ids=[1], params=SamplingParams(max_new_tokens=16))

Modules: `config` (ModelConfig), `layers` (DeltaDense, slot banks), `llama` (the decoder),
`loading` (from_pretrained), `slots` (load_variant / clear_slot), `sampling`, `paged` (the
one engine's scheduler: `PagedGenerator`, also exported as `Generator`), `paged_runner` (its
device side), `paged_batch` (one call's data), `kv_pages`, `tokenizer` (tokenizer.json + chat
template).
"""

import importlib

# Public name -> module that defines it, imported on first use: the scheduler's modules
# (`paged`, `paged_batch`, `kv_pages`, `sampling_params`) import without JAX.
_EXPORTS = {
  "ConfigError": "config",
  "ModelConfig": "config",
  "RopeConfig": "config",
  "DeltaDense": "layers",
  "SlotBank": "layers",
  "LlamaForCausalLM": "llama",
  "base_tensors": "loading",
  "from_pretrained": "loading",
  "from_tensors": "loading",
  "load_config": "loading",
  "PagedGenerator": "paged",
  "Generation": "paged_batch",
  "SamplingParams": "sampling_params",
  "clear_slot": "slots",
  "load_lora": "slots",
  "load_variant": "slots",
  "slot_bank_bytes": "slots",
  "Tokenizer": "tokenizer",
}

__all__ = [*_EXPORTS, "Generator"]


def __getattr__(name: str):
  if name == "Generator":  # the public name of the one engine's offline interface
    name = "PagedGenerator"
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__():
  return sorted(__all__)
