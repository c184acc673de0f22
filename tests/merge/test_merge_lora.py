"""PEFT adapters made by `peft` load through bitdelta_jax.merge.lora and reproduce PEFT's own
merged weights and outputs; adapters we write load back into PEFT."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from bitdelta_jax.merge.lora import apply_adapter, load_adapter, save_adapter  # noqa: E402


def tiny_llama():
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
  )
  return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt2():
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32)
  return transformers.GPT2LMHeadModel(cfg).eval()


def state(model):
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def make_adapter(factory, tmp_path, **lora_kwargs):
  model = factory()
  base = state(model)
  torch.manual_seed(1)
  cfg = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
  pm = peft.get_peft_model(model, cfg)
  pm.save_pretrained(tmp_path)
  merged = pm.merge_and_unload()
  return base, state(merged), merged


CASES = {
  "plain": (tiny_llama, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
  "rslora_patterns": (
    tiny_llama,
    dict(
      r=4,
      lora_alpha=16,
      use_rslora=True,
      target_modules=["q_proj", "k_proj", "gate_proj"],
      rank_pattern={"gate_proj": 2},
      alpha_pattern={"layers.1.self_attn.k_proj": 3},
    ),
  ),
  "gpt2_conv1d": (
    tiny_gpt2,
    dict(r=3, lora_alpha=6, target_modules=["c_attn"], fan_in_fan_out=True),
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deltas_match_merge_and_unload(case, tmp_path):
  factory, kw = CASES[case]
  base, merged, _ = make_adapter(factory, tmp_path, **kw)
  adapter = load_adapter(tmp_path)
  assert adapter.modules
  ours = apply_adapter(base, adapter)
  changed = 0
  for k, v in merged.items():
    np.testing.assert_allclose(ours[k], v, atol=1e-6, err_msg=k)
    changed += not np.array_equal(base[k], v)
  assert changed == len(adapter.modules)


def test_outputs_match_peft_merged_model(tmp_path):
  factory, kw = CASES["rslora_patterns"]
  base, _, merged_model = make_adapter(factory, tmp_path, **kw)
  ours = apply_adapter(base, load_adapter(tmp_path))
  model = factory()
  model.load_state_dict({k: torch.from_numpy(v) for k, v in ours.items()})
  ids = torch.arange(10).reshape(1, 10)
  with torch.no_grad():
    a = model(ids).logits.numpy()
    b = merged_model(ids).logits.numpy()
  np.testing.assert_allclose(a, b, atol=1e-5)


def test_saved_adapter_loads_in_peft(tmp_path):
  factory, kw = CASES["rslora_patterns"]
  base, merged, _ = make_adapter(factory, tmp_path / "src", **kw)
  adapter = load_adapter(tmp_path / "src")
  save_adapter(adapter, tmp_path / "ours")
  again = load_adapter(tmp_path / "ours")
  for name, m in adapter.modules.items():
    np.testing.assert_allclose(again.modules[name].delta(), m.delta(), atol=1e-6)
  pm = peft.PeftModel.from_pretrained(factory(), tmp_path / "ours")
  theirs = state(pm.merge_and_unload())
  for k, v in merged.items():
    np.testing.assert_allclose(theirs[k], v, atol=1e-6, err_msg=k)


def _factors(rank=2, n_in=8, n_out=6):
  rng = np.random.default_rng(0)
  return {"model.layers.0.self_attn.q_proj": (
    rng.standard_normal((rank, n_in)).astype(np.float32),
    rng.standard_normal((n_out, rank)).astype(np.float32))}


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_factors_are_refused_naming_file_and_tensor(tmp_path, side, value):
  from bitdelta_jax.hf.safetensors_io import CheckpointError
  from bitdelta_jax.merge.lora import WEIGHTS_FILE, from_factors

  factors = _factors()
  (a, b), = factors.values()
  (a if side == "A" else b)[1, 1] = value
  save_adapter(from_factors(factors), tmp_path / "bad")
  with pytest.raises(CheckpointError, match="non-finite") as ei:
    load_adapter(tmp_path / "bad")
  name = f"base_model.model.model.layers.0.self_attn.q_proj.lora_{side}.weight"
  assert str(tmp_path / "bad" / WEIGHTS_FILE) in str(ei.value) and repr(name) in str(ei.value)


def test_rank_zero_is_refused(tmp_path):
  """r: 0 in adapter_config.json (or factors of rank 0) is a clear error, not a division by
  zero."""
  import json

  from bitdelta_jax.hf.safetensors_io import CheckpointError
  from bitdelta_jax.merge.lora import CONFIG_FILE, from_factors

  save_adapter(from_factors(_factors()), tmp_path / "r0")
  cfg = json.loads((tmp_path / "r0" / CONFIG_FILE).read_text())
  (tmp_path / "r0" / CONFIG_FILE).write_text(json.dumps(dict(cfg, r=0)))
  with pytest.raises(CheckpointError, match="r is 0; a LoRA rank must be an integer >= 1"):
    load_adapter(tmp_path / "r0")
  save_adapter(from_factors(_factors(rank=0)), tmp_path / "empty")
  cfg = json.loads((tmp_path / "empty" / CONFIG_FILE).read_text())
  (tmp_path / "empty" / CONFIG_FILE).write_text(json.dumps(dict(cfg, r=1)))
  with pytest.raises(CheckpointError, match="has rank 0"):
    load_adapter(tmp_path / "empty")
