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

from bitdelta_jax.models.config import ConfigError, ModelConfig, RopeConfig
from bitdelta_jax.models.layers import DeltaDense, SlotBank
from bitdelta_jax.models.llama import LlamaForCausalLM
from bitdelta_jax.models.loading import base_tensors, from_pretrained, from_tensors, load_config
from bitdelta_jax.models.paged import PagedGenerator
from bitdelta_jax.models.paged_batch import Generation
from bitdelta_jax.models.sampling import SamplingParams
from bitdelta_jax.models.slots import clear_slot, load_lora, load_variant, slot_bank_bytes
from bitdelta_jax.models.tokenizer import Tokenizer

Generator = PagedGenerator  # the public name of the one engine's offline interface

__all__ = [
  "ConfigError",
  "ModelConfig",
  "RopeConfig",
  "Generation",
  "Generator",
  "PagedGenerator",
  "DeltaDense",
  "SlotBank",
  "LlamaForCausalLM",
  "base_tensors",
  "from_pretrained",
  "from_tensors",
  "load_config",
  "SamplingParams",
  "clear_slot", "load_lora",
  "load_variant",
  "load_lora",
  "slot_bank_bytes",
  "Tokenizer",
]
