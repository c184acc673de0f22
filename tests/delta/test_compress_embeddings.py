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
from bitdelta_jax.zoo.tokenizer_build import write_tokenizer

CFG = SyntheticConfig(vocab_size=264, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
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
  write_tokenizer(b)
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


@pytest.mark.slow
def test_one_bit_embeddings_apply_and_serve_from_packed_banks(pair):
  root, base, ft, m, _ = pair
  delta, _ = load_delta(root / "delta")
  applied = apply_delta(base, delta, hf_layout=True)
  mc = load_config(root / "base")
  model = from_pretrained(root / "base", jnp.float32, num_slots=2, packed_embedding_slots=True)
  load_variant(model, 1, delta)
  ids = jnp.asarray([[3, 17, 95, 0, 42, 263]])
  got = np.asarray(model(ids, slot_ids=jnp.array([1])))
  want = np.asarray(from_tensors(mc, applied, jnp.float32)(ids))
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def _one_bit_error(base_w: np.ndarray, ft_w: np.ndarray) -> float:
  """numpy: ‖W_ft − (W_base + α·sign Δ)‖ / ‖W_base‖ with one α = mean|Δ| per token (row)."""
  d = ft_w.astype(np.float64) - base_w
  alpha = np.abs(d).mean(axis=1, keepdims=True)
  approx = base_w + alpha * np.where(d >= 0, 1.0, -1.0)
  return float(np.linalg.norm(ft_w - approx) / np.linalg.norm(base_w))


@pytest.mark.parametrize("move", [0.0, 0.0002, 0.05])
def test_auto_embeddings_is_the_default_and_chooses_by_the_measured_error(tmp_path, move):
  """Issue 22: with no flag, a fine-tune that moved its embeddings a little (as real fine-tunes
  do: ‖Δ‖/‖W‖ ≈ 1e-3) gets 1-bit embeddings, bit for bit those of ``embeddings="1bit"``; one
  that moved them a lot keeps them exactly, as ``"exact"`` does; unchanged ones stay "same"."""
  from bitdelta_jax.delta.stream import AUTO_EMBEDDING_MAX_ERROR

  base = {k: np.asarray(v, np.float32) for k, v in make_base(CFG, 0).items()}
  ft = make_finetune(base, seed=3, rel=0.05)
  rng = np.random.default_rng(5)
  for n in EMB:
    ft[n] = ft[n] + (move * rng.standard_normal(ft[n].shape)).astype(np.float32)
  b = write_checkpoint(base, tmp_path / "base", CFG.hf_config())
  f = write_checkpoint(ft, tmp_path / "ft", CFG.hf_config())
  m = compress_checkpoints(b, f, tmp_path / "auto", progress=False)  # no embeddings argument
  if move == 0.0:
    assert m["embeddings"] == "exact" and m["embeddings_choice"] == {}
    assert all(m["tensors"][n]["kind"] == "same" for n in EMB)
    return
  errs = {n: _one_bit_error(base[n], ft[n]) for n in EMB}
  want = "1bit" if move < 0.001 else "exact"
  assert all((e <= AUTO_EMBEDDING_MAX_ERROR) == (want == "1bit") for e in errs.values()), errs
  ref = compress_checkpoints(b, f, tmp_path / want, embeddings=want, progress=False)
  got, _ = load_delta(tmp_path / "auto")
  exp, _ = load_delta(tmp_path / want)
  assert m["embeddings"] == want
  for n in EMB:
    c = m["embeddings_choice"][n]
    assert c["stored"] == want and c["chosen_by"] == "auto"
    np.testing.assert_allclose(c["rel_error_1bit"], errs[n], rtol=1e-4)
    assert m["tensors"][n]["kind"] == ref["tensors"][n]["kind"]
    for field in ("bits", "scale", "value", "delta"):
      if hasattr(exp[n], field):
        np.testing.assert_array_equal(np.asarray(getattr(got[n], field)),
                                      np.asarray(getattr(exp[n], field)))
  from bitdelta_jax.delta.report import describe_embeddings

  lines = describe_embeddings(m)
  assert len(lines) == 2 and all(("1-bit" if want == "1bit" else "exact") in x for x in lines)


def test_bad_embeddings_mode_is_refused(pair, tmp_path):
  root, *_ = pair
  with pytest.raises(ValueError, match="embeddings must be one of 'auto', 'exact', '1bit'"):
    compress_checkpoints(root / "base", root / "ft", tmp_path / "x", embeddings="2bit",
                         progress=False)


@pytest.mark.slow
def test_served_one_bit_embedding_variant_equals_its_applied_model(pair):
  """Through HTTP: the server builds packed embedding banks for it, and its greedy output
  equals greedy decoding of the applied dense model."""
  import requests

  from bitdelta_jax.delta.variant import manifest_bytes
  from bitdelta_jax.models.tokenizer import Tokenizer
  from serving.app import ServerThread
  from serving.config import ServerConfig

  root, base, _, _, exact = pair
  delta, _ = load_delta(root / "delta")
  model = from_tensors(load_config(root / "base"), apply_delta(base, delta, hf_layout=True),
                       jnp.float32)
  tok = Tokenizer.from_dir(root / "base")
  ids = tok.encode("hello")
  prompt_len = len(ids)
  for _ in range(8):  # one padded shape; causal, so the padding after is never attended
    padded = np.zeros((1, 32), np.int32)
    padded[0, :len(ids)] = ids
    nxt = int(np.argmax(np.asarray(model(jnp.asarray(padded)))[0, len(ids) - 1]))
    if nxt in tok.stop_token_ids:
      break
    ids.append(nxt)
  want = tok.decode(ids[prompt_len:])
  for mesh in (None, "data=1,model=1"):  # one device, and the sharded restore + mesh engine
    cfg = ServerConfig(base=str(root / "base"), base_name="base", port=0, device_slots=1,
                       max_batch=2, max_seq_len=64, warmup=False, mesh=mesh,
                       variants=(("onebit", str(root / "delta")),))
    with ServerThread(cfg) as h:
      r = requests.post(h.url + "/v1/completions", json={
        "model": "onebit", "prompt": "hello", "max_tokens": 8, "temperature": 0}, timeout=120)
      assert r.status_code == 200, r.text
      assert r.json()["choices"][0]["text"] == want, mesh
      assert h.server.engine.gen.model.config.packed_embedding_slots  # packed banks, not dense
      info = requests.get(h.url + "/v1/variants", timeout=30).json()["data"][0]
      # the whole variant (1-bit linear layers and embeddings) against the same with exact
      # (f32) embeddings: the embedding part dominates the latter
      assert info["bytes"] * 4 < manifest_bytes(exact)


@pytest.mark.slow
def test_distilling_a_delta_with_one_bit_embeddings(pair, tmp_path):
  """Scale distillation runs through the 1-bit embedding banks (the fused kernel's gradient)
  and trains only the linear layers' α; the embeddings' α stays as compressed."""
  import shutil

  from bitdelta_jax.distill import DistillConfig, distill_checkpoint

  root, *_ = pair
  d = shutil.copytree(root / "delta", tmp_path / "d")
  before, _ = load_delta(d)
  ids = np.random.default_rng(0).integers(5, 260, 400).astype(np.int32)
  info = distill_checkpoint(root / "base", root / "ft", d, ids,
                            DistillConfig(steps=3, seq=16, batch=2, lr=1e-2, eval_every=1),
                            progress=False)
  after, m = load_delta(d)
  assert m["scales"]["method"] == "distilled" and info["held_mse_after"] <= info["held_mse_before"]
  for n in EMB:
    np.testing.assert_array_equal(np.asarray(after[n].scale), np.asarray(before[n].scale))
  lin = [n for n in after if n not in EMB and hasattr(after[n], "scale")]
  assert any(not np.array_equal(np.asarray(after[n].scale), np.asarray(before[n].scale))
             for n in lin) or info["held_mse_after"] == info["held_mse_before"]
