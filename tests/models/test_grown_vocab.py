"""A variant that grew the vocabulary (added tokens) served from a slot's extra-vocabulary rows,
against transformers running the grown fine-tune itself."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bitdelta_jax.delta.compress import CompressPolicy, compress  # noqa: E402
from bitdelta_jax.models import from_pretrained, load_variant  # noqa: E402

V, ADDED = 64, 3


def _pair(root, tied: bool, move_embeddings: bool = True):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=tied)
  base = transformers.LlamaForCausalLM(cfg).eval()
  base.save_pretrained(root / "base", safe_serialization=True)
  base_sd = {k: v.detach().numpy().copy() for k, v in base.state_dict().items()}
  ft = transformers.LlamaForCausalLM.from_pretrained(root / "base").eval()
  ft.resize_token_embeddings(V + ADDED)
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in ft.named_parameters():
      noise = 0.02 * torch.randn(p.shape, generator=g)
      if ("embed" in name or "lm_head" in name) and not move_embeddings:
        noise[:V] = 0  # only the added tokens' rows are new
      p.add_(noise)  # the new rows move too
  ft_sd = {k: v.detach().numpy().copy() for k, v in ft.state_dict().items()}
  if tied:
    ft_sd.pop("lm_head.weight", None)
    base_sd.pop("lm_head.weight", None)
  delta, _ = compress(base_sd, ft_sd, CompressPolicy(granularity="column"), hf_layout=True)
  return ft, delta


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_grown_vocab_slot_matches_the_finetune(tmp_path, tied):
  ft, delta = _pair(tmp_path, tied)
  model = from_pretrained(tmp_path / "base", dtype=jnp.float32, num_slots=3,
                          dense_embedding_slots=True, extra_vocab=8)
  load_variant(model, 2, delta)
  ids = np.array([[1, 5, V, 9, V + 2, 3, V + 1]])  # added tokens in the input
  out = np.asarray(model(jnp.asarray(np.repeat(ids, 2, axis=0)), slot_ids=jnp.array([2, 0])))
  assert out.shape[-1] == V + 8
  # the served variant against transformers running the applied (dense) weights of the delta:
  # the same model the slot should compute, grown vocabulary included
  from bitdelta_jax.delta.compress import apply_delta

  applied = apply_delta(_base_tensors(tmp_path / "base"), delta, hf_layout=True)
  ref = transformers.LlamaForCausalLM(ft.config).eval()
  ref.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in applied.items()},
                      strict=False)
  if tied:
    ref.tie_weights()
  with torch.no_grad():
    want = ref(torch.from_numpy(ids)).logits.numpy()[0]
  np.testing.assert_allclose(out[0, :, :V + ADDED], want, atol=2e-4, rtol=1e-4)
  assert np.all(np.isneginf(out[0, :, V + ADDED:]))  # this slot's unused extra ids
  assert np.all(np.isneginf(out[1, :, V:]))  # the base has no added tokens
  # the base row equals the base model alone on base-only ids
  base_model = from_pretrained(tmp_path / "base", dtype=jnp.float32)
  plain = np.asarray(base_model(jnp.asarray(ids[:, :2])))[0]
  np.testing.assert_allclose(out[1, :2, :V], plain, atol=1e-5)


def _base_tensors(path):
  from safetensors.numpy import load_file

  return load_file(str(path / "model.safetensors"))


def test_grown_vocab_needs_room(tmp_path):
  _, delta = _pair(tmp_path, True)
  small = from_pretrained(tmp_path / "base", dtype=jnp.float32, num_slots=2,
                          dense_embedding_slots=True, extra_vocab=2)
  with pytest.raises(ValueError, match="grew the vocabulary by 3 tokens.*room for 2"):
    load_variant(small, 1, delta)
  none = from_pretrained(tmp_path / "base", dtype=jnp.float32, num_slots=2,
                         dense_embedding_slots=True)
  with pytest.raises(ValueError, match="room for 0 added tokens"):
    load_variant(none, 1, delta)


@pytest.mark.slow
def test_added_tokens_only_need_no_dense_bank(tmp_path):
  """A fine-tune that only added tokens (old rows unchanged) fits a model without per-slot
  dense embedding banks: the added rows go to the extra-vocabulary rows alone."""
  ft, delta = _pair(tmp_path, False, move_embeddings=False)
  model = from_pretrained(tmp_path / "base", dtype=jnp.float32, num_slots=2, extra_vocab=4)
  load_variant(model, 1, delta)
  ids = np.array([[2, V + 1, 7, V]])
  out = np.asarray(model(jnp.asarray(ids), slot_ids=jnp.array([1])))[0]
  from bitdelta_jax.delta.compress import apply_delta

  applied = apply_delta(_base_tensors(tmp_path / "base"), delta, hf_layout=True)
  ref = transformers.LlamaForCausalLM(ft.config).eval()
  ref.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in applied.items()})
  with torch.no_grad():
    want = ref(torch.from_numpy(ids)).logits.numpy()[0]
  np.testing.assert_allclose(out[:, :V + ADDED], want, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("tied,native", [(True, True), (False, True), (True, False)])
def test_packed_embedding_delta_served_from_one_bit_banks(tmp_path, monkeypatch, tied, native):
  """A 1-bit embedding / LM-head delta with a per-token α (``PackedDelta`` in the ``[D, V]``
  orientation) served from the packed banks equals the base plus α·sign(Δ) computed in numpy,
  on both the input (gathered tokens) and the output (logits) side, beside a base row."""
  from bitdelta_jax.delta.format import pack
  from bitdelta_jax.models import from_tensors
  from bitdelta_jax.models.loading import load_config
  from pallas_kernels.delta_matmul import cpu

  if native and cpu.unavailable_reason() is not None:
    pytest.skip(cpu.unavailable_reason())
  if not native:  # the portable path: per-slot unpack under lax.cond
    monkeypatch.setattr(cpu, "unavailable_reason", lambda: "disabled by the test")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=40, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=tied)
  transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "base",
                                                             safe_serialization=True)
  base = _base_tensors(tmp_path / "base")
  rng = np.random.default_rng(3)
  names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
  delta, want = {}, dict(base)
  for n in names:
    d_hf = (0.05 * rng.standard_normal(base[n].shape)).astype(np.float32)  # [V, D]
    pd = jax_tree_np(pack(jnp.asarray(d_hf.T), "column"))  # [D, V], one α per token
    delta[n] = pd
    signs = np.where(d_hf >= 0, 1.0, -1.0)
    alpha = np.abs(d_hf).mean(axis=1, keepdims=True)  # per token (row of the HF tensor)
    want[n] = (base[n].astype(np.float64) + alpha * signs).astype(np.float32)
  model = from_pretrained(tmp_path / "base", dtype=jnp.float32, num_slots=3,
                          packed_embedding_slots=True)
  load_variant(model, 2, delta)
  ids = np.array([[1, 5, 9, 3, 63, 0, 17]])
  out = np.asarray(model(jnp.asarray(np.repeat(ids, 2, axis=0)), slot_ids=jnp.array([2, 0])))
  mc = load_config(tmp_path / "base")
  ref = np.asarray(from_tensors(mc, want, jnp.float32)(jnp.asarray(ids)))[0]
  np.testing.assert_allclose(out[0], ref, atol=2e-4, rtol=1e-4)
  plain = np.asarray(from_tensors(mc, base, jnp.float32)(jnp.asarray(ids)))[0]
  np.testing.assert_allclose(out[1], plain, atol=1e-5)


def jax_tree_np(pd):
  import jax

  return jax.tree.map(np.asarray, pd)


@pytest.mark.slow
def test_packed_embedding_products_gradient_equals_the_reference():
  """The fused kernel's custom VJP (the reference's) against the reference differentiated
  directly: gradients w.r.t. the hidden states, the base logits and α."""
  import jax

  from bitdelta_jax.delta.format import pack
  from bitdelta_jax.models.layers import (
    _packed_products_fused,
    _packed_products_reference,
  )
  from pallas_kernels.delta_matmul import cpu

  if cpu.unavailable_reason() is not None:
    pytest.skip(cpu.unavailable_reason())
  rng = np.random.default_rng(0)
  k, v = 40, 24
  pds = [pack(jnp.asarray(rng.standard_normal((k, v)), jnp.float32), "column") for _ in range(2)]
  bits = jnp.stack([jnp.zeros_like(pds[0].bits)] + [p.bits for p in pds])
  scale = jnp.stack([jnp.zeros((v,), jnp.float32)] + [p.scale for p in pds])
  h = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)
  base = jnp.asarray(rng.standard_normal((5, v)), jnp.float32)
  slots = jnp.asarray([1, -1, 2, 1, 2], jnp.int32)
  w = jnp.asarray(rng.standard_normal((5, v)), jnp.float32)
  g = pds[0].group_k

  def loss(fn):
    return lambda b, x, a: jnp.sum(w * fn(b, x, bits, a, slots, g))

  np.testing.assert_allclose(_packed_products_fused(base, h, bits, scale, slots, g),
                             _packed_products_reference(base, h, bits, scale, slots, g),
                             rtol=1e-5, atol=1e-5)
  got = jax.grad(loss(_packed_products_fused), argnums=(0, 1, 2))(base, h, scale)
  want = jax.grad(loss(_packed_products_reference), argnums=(0, 1, 2))(base, h, scale)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
