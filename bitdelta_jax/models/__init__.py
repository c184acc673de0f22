"""Llama-family decoder (Llama, Mistral, Qwen2) with per-row 1-bit variant slots: the network.

    from bitdelta_jax.models import from_pretrained, load_variant
    model = from_pretrained("path/to/hf_dir", dtype=jnp.bfloat16, num_slots=4)
    load_variant(model, 1, delta_dict)          # slot 1 ← a variant (no recompilation)

Modules: `config` (ModelConfig), `layers` (DeltaDense, slot banks), `llama` (the decoder),
`loading` (from_pretrained), `slots` (load_variant / clear_slot), `tokenizer` (tokenizer.json +
chat template). What runs the model (scheduler, runner, sampling, KV pages) is
`bitdelta_jax.engine`.
"""

import importlib

# Public name -> module that defines it, imported on first use.
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
  "clear_slot": "slots",
  "load_lora": "slots",
  "load_variant": "slots",
  "slot_bank_bytes": "slots",
  "Tokenizer": "tokenizer",
}

__all__ = [*_EXPORTS]


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__():
  return sorted(__all__)
