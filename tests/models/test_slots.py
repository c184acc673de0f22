"""Variant slots: mixed batches are exact, loading never recompiles, bad deltas fail clearly."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_fixtures import _jit_forward, forward

from bitdelta_jax.delta.compress import CompressPolicy, Dense, apply_delta, compress
from bitdelta_jax.delta.format import pack
from bitdelta_jax.models import base_tensors, from_pretrained, from_tensors
from bitdelta_jax.models.slots import clear_slot, load_variant

IDS = np.random.RandomState(0).randint(0, 256, (3, 10))



def finetune(base, seed, *, embeddings=False, scale=0.01):
  rng = np.random.RandomState(seed)
  out = {}
  for k, a in base.items():
    keep = ("embed" in k or "lm_head" in k) and not embeddings
    out[k] = a if keep else a + scale * rng.randn(*a.shape).astype(a.dtype)
  return out


def materialised(model, base, delta):
  cfg = dataclasses.replace(model.config, num_slots=1, dense_embedding_slots=False)
  return from_tensors(cfg, apply_delta(base, delta, hf_layout=True))


@pytest.fixture(scope="module")
def qwen(hf_models):
  _, path = hf_models("qwen2")
  model = from_pretrained(path, jnp.float32, num_slots=3)
  base = base_tensors(model)
  delta_a, _ = compress(base, finetune(base, 1), CompressPolicy(dense="value"), hf_layout=True)
  delta_b, _ = compress(
    base, finetune(base, 2), CompressPolicy(granularity="column", dense="delta"), hf_layout=True
  )
  return model, base, delta_a, delta_b


def test_mixed_batch_rows_match_their_materialised_models(qwen):
  model, base, delta_a, delta_b = qwen
  load_variant(model, 1, delta_a)
  load_variant(model, 2, delta_b)
  slots = [0, 1, 2]
  out = forward(model, IDS, slots)
  refs = [
    base,
    apply_delta(base, delta_a, hf_layout=True),
    apply_delta(base, delta_b, hf_layout=True),
  ]
  for r, slot in enumerate(slots):
    cfg = dataclasses.replace(model.config, num_slots=1)
    ref = forward(from_tensors(cfg, refs[slot]), IDS[r : r + 1])[0]
    assert np.abs(out[r] - ref).max() <= 1e-4, (slot, np.abs(out[r] - ref).max())
  # the variants really differ from the base and from each other
  assert np.abs(out[1] - forward(model, IDS[1:2], [0])[0]).max() > 1e-3


def test_loading_and_clearing_never_recompile(qwen):
  model, base, delta_a, delta_b = qwen
  graphdef, _ = nnx.split(model)
  before = forward(model, IDS, [1, 1, 1])
  n = _jit_forward(graphdef)._cache_size()
  load_variant(model, 1, delta_b)
  after = forward(model, IDS, [1, 1, 1])
  clear_slot(model, 1)
  cleared = forward(model, IDS, [1, 1, 1])
  assert _jit_forward(nnx.split(model)[0])._cache_size() == n
  assert np.abs(before - after).max() > 1e-4
  np.testing.assert_allclose(cleared, forward(model, IDS, [0, 0, 0]), atol=1e-6)
  load_variant(model, 1, delta_a)  # leave the shared fixture as it was


def test_slot_zero_and_out_of_range_are_rejected(qwen):
  model, _, delta_a, _ = qwen
  for slot in (0, 3):
    with pytest.raises(ValueError, match="slot must be in"):
      load_variant(model, slot, delta_a)


def test_changed_embeddings_need_a_dense_bank(qwen):
  model, base, _, _ = qwen
  delta, _ = compress(base, finetune(base, 3, embeddings=True), hf_layout=True)
  with pytest.raises(
    ValueError, match=r"(model.embed_tokens|lm_head).weight.*dense_embedding_slots"
  ):
    load_variant(model, 1, delta)


@pytest.mark.slow
def test_dense_embedding_slots_are_exact(hf_models):
  for preset in ("llama", "llama_linear_tied_bias"):
    _, path = hf_models(preset)
    model = from_pretrained(path, jnp.float32, num_slots=2, dense_embedding_slots=True)
    base = base_tensors(model)
    delta, _ = compress(base, finetune(base, 4, embeddings=True), hf_layout=True)
    assert any(
      isinstance(v, Dense) and v.kind == "value" and "embed" in k for k, v in delta.items()
    )
    load_variant(model, 1, delta)
    out = forward(model, IDS[:2], [1, 0])
    ref1 = forward(materialised(model, base, delta), IDS[:1])[0]
    ref0 = forward(materialised(model, base, {}), IDS[1:2])[0]
    assert np.abs(out[0] - ref1).max() <= 1e-4
    assert np.abs(out[1] - ref0).max() <= 1e-4


def test_grown_vocabulary_is_rejected(hf_models):
  _, path = hf_models("llama")
  model = from_pretrained(path, jnp.float32, num_slots=2, dense_embedding_slots=True)
  base = base_tensors(model)
  emb = base["model.embed_tokens.weight"]
  delta = {
    "model.embed_tokens.weight": Dense(
      "delta", np.zeros_like(emb), np.ones((2, emb.shape[1]), np.float32)
    )
  }
  with pytest.raises(ValueError, match="grew the vocabulary"):
    load_variant(model, 1, delta)


def test_other_group_k_is_repacked(qwen):
  model, base, delta_a, _ = qwen
  name = "model.layers.0.mlp.down_proj.weight"  # K = 128: bank group_k 128
  ft = finetune(base, 5)
  d = (ft[name] - base[name]).T
  load_variant(model, 1, {name: pack(d, "column", group_k=128)})
  ref = forward(model, IDS, [1, 1, 1])
  load_variant(model, 1, {name: pack(d, "column", group_k=8)})
  np.testing.assert_allclose(forward(model, IDS, [1, 1, 1]), ref, atol=1e-6)
  load_variant(model, 1, delta_a)


def test_unknown_tensor_and_dense_linear_are_rejected(qwen):
  model, base, _, _ = qwen
  with pytest.raises(ValueError, match="lacks"):
    load_variant(model, 1, {"model.layers.9.mlp.up_proj.weight": Dense("same")})
  name = "model.layers.0.mlp.up_proj.weight"
  with pytest.raises(ValueError, match="cannot go into a 1-bit slot"):
    load_variant(model, 1, {name: Dense("value", base[name])})


def test_kernel_implementations_agree(qwen, hf_models):
  """The default delta_matmul (fastest for the backend) and the plain reference agree."""
  model, _, delta_a, delta_b = qwen
  _, path = hf_models("qwen2")
  ref_model = from_pretrained(path, jnp.float32, num_slots=3, delta_implementation="reference")
  load_variant(ref_model, 1, delta_a)
  load_variant(ref_model, 2, delta_b)
  load_variant(model, 1, delta_a)
  load_variant(model, 2, delta_b)
  np.testing.assert_allclose(
    forward(model, IDS, [2, 0, 1]), forward(ref_model, IDS, [2, 0, 1]), atol=1e-5
  )
