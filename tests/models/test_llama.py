"""Logit parity with transformers for Llama / Mistral / Qwen2, and checkpoint loading."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import PRESETS, forward, hf_logits, make_hf_model

from bitdelta_jax.hf.safetensors_io import CheckpointError
from bitdelta_jax.models import ConfigError, from_pretrained
from bitdelta_jax.models.layers import SlotBank

IDS = np.random.RandomState(0).randint(0, 256, (2, 14))



@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_logits_match_transformers(hf_models, preset):
  hf, path = hf_models(preset)
  model = from_pretrained(path, dtype=jnp.float32)
  diff = np.abs(forward(model, IDS) - hf_logits(hf, IDS)).max()
  assert diff <= 1e-4, diff


def test_sliding_window_and_scaled_rope_change_the_numbers(hf_models):
  """Guards the parity test: the presets' windows / RoPE scaling really matter at this length."""
  _, path = hf_models("mistral_sliding")
  cfg = json.loads((path / "config.json").read_text())
  base = forward(from_pretrained(path, jnp.float32), IDS)
  cfg_dir = path.parent / "mistral_nowindow"
  cfg_dir.mkdir(exist_ok=True)
  for f in path.iterdir():
    if f.suffix == ".safetensors":
      (cfg_dir / f.name).write_bytes(f.read_bytes())
  (cfg_dir / "config.json").write_text(json.dumps(dict(cfg, sliding_window=None)))
  assert np.abs(forward(from_pretrained(cfg_dir, jnp.float32), IDS) - base).max() > 1e-3


def test_sharded_checkpoint(tmp_path):
  hf = make_hf_model("llama", tmp_path, max_shard_size="100KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  model = from_pretrained(tmp_path, jnp.float32)
  assert np.abs(forward(model, IDS) - hf_logits(hf, IDS)).max() <= 1e-4


def test_param_tree_is_the_hf_tree_and_banks_sit_beside_it(hf_models):
  from flax import nnx

  from bitdelta_jax.models.loading import base_tensors

  hf, path = hf_models("qwen2")
  model = from_pretrained(path, jnp.float32, num_slots=3)
  tensors = base_tensors(model)
  ref = {k: v.numpy() for k, v in hf.state_dict().items()}
  assert set(tensors) == set(ref)
  for k, v in ref.items():
    np.testing.assert_array_equal(tensors[k], v)
  banks = nnx.to_flat_state(nnx.state(model, SlotBank))
  assert banks and all(not np.any(np.asarray(v[...])) for _, v in banks)


def test_bf16_load_keeps_dtype(hf_models):
  _, path = hf_models("llama")
  model = from_pretrained(path, dtype=jnp.bfloat16)
  assert model.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
  logits = forward(model, IDS[:, :4])
  assert logits.shape == (2, 4, 256) and np.isfinite(logits).all()


def _write_config(tmp_path, **changes):
  cfg = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=8,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
  )
  cfg.update(changes)
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  return tmp_path


@pytest.mark.parametrize(
  "changes, match",
  [
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), "model_type 'gemma'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope type 'yarn'"),
    (dict(quantization_config=dict(quant_method="gptq")), "quantization_config"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
  ],
)
def test_unsupported_configs_fail_clearly(tmp_path, changes, match):
  with pytest.raises(ConfigError, match=match):
    from_pretrained(_write_config(tmp_path, **changes))


def test_missing_and_unexpected_tensors_fail_clearly(tmp_path, hf_models):
  from safetensors.numpy import load_file, save_file

  _, path = hf_models("llama")
  tensors = load_file(str(path / "model.safetensors"))
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  save_file(
    {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k},
    str(tmp_path / "model.safetensors"),
  )
  with pytest.raises(CheckpointError, match="missing tensors.*layers.1.mlp.up_proj"):
    from_pretrained(tmp_path)
  save_file(
    dict(tensors, **{"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}),
    str(tmp_path / "model.safetensors"),
  )
  with pytest.raises(CheckpointError, match="q_norm"):
    from_pretrained(tmp_path)


def test_v4_config_spelling_matches_v5():
  from bitdelta_jax.models import ModelConfig

  common = dict(
    model_type="llama",
    vocab_size=8,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
  )
  v5 = ModelConfig.from_hf_dict(
    dict(
      common,
      rope_parameters=dict(
        rope_type="llama3",
        rope_theta=5e5,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
      ),
    )
  )
  v4 = ModelConfig.from_hf_dict(
    dict(
      common,
      rope_theta=5e5,
      rope_scaling=dict(
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
      ),
    )
  )
  assert v4 == v5


def test_qwen2_v4_sliding_window_layers():
  from bitdelta_jax.models import ModelConfig

  cfg = ModelConfig.from_hf_dict(
    dict(
      model_type="qwen2",
      vocab_size=8,
      hidden_size=8,
      intermediate_size=16,
      num_hidden_layers=4,
      num_attention_heads=2,
      use_sliding_window=True,
      sliding_window=16,
      max_window_layers=2,
    )
  )
  assert cfg.layer_windows == (None, None, 16, 16)
  assert cfg.qkv_bias and not cfg.o_bias
