"""1-bit embedding / LM-head deltas (``compress_checkpoints(..., embeddings="1bit")``): one α
per token, checked against numpy; applied and served from packed slot banks."""

import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.delta.compress import apply_delta
from bitdelta_jax.delta.format import unpack_signs
from bitdelta_jax.delta.store import load_delta
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.models import from_pretrained, from_tensors, load_variant
from bitdelta_jax.models.loading import load_config
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

CFG = SyntheticConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
EMB = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  root = tmp_path_factory.mktemp("emb")
  base = {k: np.asarray(v, np.float32) for k, v in make_base(CFG, 0).items()}
  ft = make_finetune(base, seed=3, rel=0.05)
  rng = np.random.default_rng(4)
  for n in EMB:  # a real instruct tune trains the embeddings too
    ft[n] = ft[n] + 0.003 * rng.standard_normal(ft[n].shape).astype(np.float32)
  b = write_checkpoint(base, root / "base", CFG.hf_config())
  f = write_checkpoint(ft, root / "ft", CFG.hf_config())
  m = compress_checkpoints(b, f, root / "delta", embeddings="1bit", progress=False)
  exact = compress_checkpoints(b, f, root / "exact", progress=False)
  return root, base, ft, m, exact


def test_one_bit_embeddings_match_numpy_and_are_small(pair):
  root, base, ft, m, exact = pair
  assert m["embeddings"] == "1bit"
  delta, _ = load_delta(root / "delta")
  for n in EMB:
    assert m["tensors"][n]["kind"] == "packed"
    pd = delta[n]
    d_hf = ft[n].astype(np.float64) - base[n]  # [V, D]
    v, d = d_hf.shape
    assert tuple(pd.shape) == (d, v)
    np.testing.assert_allclose(np.asarray(pd.scale), np.abs(d_hf).mean(axis=1), rtol=1e-5)
    signs = unpack_signs(np.asarray(pd.bits), (d, v), pd.group_k, np.float32).T
    np.testing.assert_array_equal(signs, np.where(d_hf > 0, 1.0, -1.0))
  size = lambda mm, ns: sum(np.prod(a["shape"]) * (1 if a["dtype"] == "uint8" else 4)
                            for n in ns for a in mm["tensors"][n]["arrays"].values())
  v, d = CFG.vocab_size, CFG.hidden_size
  assert size(m, EMB) == 2 * (v * d // 8 + 4 * v)  # 1 bit per weight + one f32 α per token
  assert size(exact, EMB) == 2 * v * d * 4  # the exact delta: f32 values


def test_one_bit_embeddings_apply_and_serve_from_packed_banks(pair):
  root, base, ft, m, _ = pair
  delta, _ = load_delta(root / "delta")
  applied = apply_delta(base, delta, hf_layout=True)
  mc = load_config(root / "base")
  model = from_pretrained(root / "base", jnp.float32, num_slots=2, packed_embedding_slots=True)
  load_variant(model, 1, delta)
  ids = jnp.asarray([[3, 17, 95, 0, 42, 8]])
  got = np.asarray(model(ids, slot_ids=jnp.array([1])))
  want = np.asarray(from_tensors(mc, applied, jnp.float32)(ids))
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_bad_embeddings_mode_is_refused(pair, tmp_path):
  root, *_ = pair
  with pytest.raises(ValueError, match="embeddings must be 'exact' or '1bit'"):
    compress_checkpoints(root / "base", root / "ft", tmp_path / "x", embeddings="2bit",
                         progress=False)
