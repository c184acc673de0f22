"""PEFT LoRA adapters in model slots, beside BitDelta variants, in one mixed batch."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from bitdelta_jax.delta.compress import CompressPolicy, apply_delta, compress  # noqa: E402
from bitdelta_jax.merge.lora import load_adapter  # noqa: E402
from bitdelta_jax.models import from_pretrained, from_tensors, load_lora, load_variant  # noqa: E402
from bitdelta_jax.models.loading import load_config  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32)
  base = transformers.LlamaForCausalLM(cfg).eval()
  base.save_pretrained(root / "base", safe_serialization=True)
  base_sd = {k: v.detach().numpy().copy() for k, v in base.state_dict().items()}
  torch.manual_seed(1)
  pm = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(root / "base").eval(),
                           peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                           target_modules=["q_proj", "v_proj", "down_proj"]))
  pm.save_pretrained(root / "adapter")
  ids = np.random.default_rng(0).integers(0, 64, (1, 7))
  with torch.no_grad():
    peft_logits = pm(torch.from_numpy(ids)).logits.numpy()
  rng = np.random.default_rng(2)
  ft = {k: (v + 0.01 * rng.standard_normal(v.shape).astype(np.float32)) if v.ndim == 2 and
        "embed" not in k and "lm_head" not in k else v for k, v in base_sd.items()}
  delta, _ = compress(base_sd, ft, CompressPolicy(granularity="column"), hf_layout=True)
  return root, ids, peft_logits, base_sd, delta


@pytest.mark.slow
def test_lora_slot_matches_peft_and_mixes_with_bitdelta(setup):
  root, ids, peft_logits, base_sd, delta = setup
  model = from_pretrained(root / "base", dtype=jnp.float32, num_slots=3, lora_rank=8)
  load_lora(model, 1, load_adapter(root / "adapter"))
  load_variant(model, 2, delta)
  batch = jnp.asarray(np.repeat(ids, 3, axis=0))
  out = np.asarray(model(batch, slot_ids=jnp.array([0, 1, 2])))
  # row 1: the LoRA adapter, against PEFT's own forward
  np.testing.assert_allclose(out[1], peft_logits[0], atol=1e-4)
  # row 2: the BitDelta variant, against its materialised weights run alone
  cfg = load_config(root / "base")
  alone = from_tensors(cfg, apply_delta(base_sd, delta, hf_layout=True), jnp.float32)
  np.testing.assert_allclose(out[2], np.asarray(alone(jnp.asarray(ids)))[0], atol=1e-4)
  # row 0: the base
  base_alone = from_tensors(cfg, base_sd, jnp.float32)
  np.testing.assert_allclose(out[0], np.asarray(base_alone(jnp.asarray(ids)))[0], atol=1e-4)
  # reloading slot 1 with the BitDelta variant clears its LoRA rows
  load_variant(model, 1, delta)
  again = np.asarray(model(batch, slot_ids=jnp.array([1, 1, 1])))
  np.testing.assert_allclose(again[0], out[2], atol=1e-5)


def test_lora_errors(setup):
  root, *_ = setup
  no_lora = from_pretrained(root / "base", dtype=jnp.float32, num_slots=2)
  with pytest.raises(ValueError, match="no LoRA slots"):
    load_lora(no_lora, 1, load_adapter(root / "adapter"))
  small = from_pretrained(root / "base", dtype=jnp.float32, num_slots=2, lora_rank=2)
  with pytest.raises(ValueError, match="exceeds the model's lora_rank"):
    load_lora(small, 1, load_adapter(root / "adapter"))


@pytest.mark.slow
def test_residual_entry_serves_packed_plus_low_rank(setup):
  """A `ResidualEntry` (1-bit + low-rank) in a slot equals the base plus the dense sum of both,
  computed in numpy, in one batch with a plain 1-bit variant and the base."""
  from bitdelta_jax.delta.entries import LoraEntry, ResidualEntry
  from bitdelta_jax.delta.format import dense_delta

  root, ids, _, base_sd, delta = setup
  rng = np.random.default_rng(5)
  residual, want = {}, dict(base_sd)
  for name, pd in delta.items():
    if not hasattr(pd, "bits"):
      continue
    k, n = pd.shape  # Flax layout [in, out]
    a = (0.05 * rng.standard_normal((k, 3))).astype(np.float32)
    b = (0.05 * rng.standard_normal((3, n))).astype(np.float32)
    residual[name] = ResidualEntry(pd, LoraEntry(a, b))
    dense = np.asarray(dense_delta(pd, np.float32))  # [in, out]
    want[name] = (base_sd[name].astype(np.float64) + (dense + a @ b).T).astype(np.float32)
  assert residual
  model = from_pretrained(root / "base", dtype=jnp.float32, num_slots=3, lora_rank=4)
  load_variant(model, 1, residual)
  load_variant(model, 2, delta)
  out = np.asarray(model(jnp.asarray(np.repeat(ids, 3, axis=0)), slot_ids=jnp.array([1, 2, 0])))
  cfg = load_config(root / "base")
  alone = from_tensors(cfg, want, jnp.float32)
  np.testing.assert_allclose(out[0], np.asarray(alone(jnp.asarray(ids)))[0], atol=1e-4)
  plain = from_tensors(cfg, apply_delta(base_sd, delta, hf_layout=True), jnp.float32)
  np.testing.assert_allclose(out[1], np.asarray(plain(jnp.asarray(ids)))[0], atol=1e-4)


def test_lora_delta_of_many_rows_equals_each_rows_slot_product():
  """A ragged step has a row per token: above 64 rows the slot factors are applied with a
  one-hot instead of a gather per row; both must equal x · A[s] · B[s] row by row."""
  import jax.numpy as jnp

  from bitdelta_jax.models.layers import _lora_delta

  rng = np.random.default_rng(0)
  a = rng.standard_normal((4, 12, 3)).astype(np.float32)
  b = rng.standard_normal((4, 3, 7)).astype(np.float32)
  for rows in (5, 100):
    x = rng.standard_normal((rows, 1, 12)).astype(np.float32)
    slots = rng.integers(0, 4, rows).astype(np.int32)
    got = np.asarray(_lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b),
                                 jnp.asarray(slots)))
    want = np.stack([x[i] @ a[s] @ b[s] for i, s in enumerate(slots)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [5, 64, 65, 130])
def test_lora_delta_keeps_a_non_finite_slot_to_its_own_rows(rows):
  """Slot 2's A holds NaN and slot 3's B inf (and a NaN): the rows of slots 0 and 1 equal what
  they are with those slots' factors zeroed, exactly, below and above the 64-row switch."""
  from bitdelta_jax.models.layers import _LORA_GATHER_MAX_ROWS, _lora_delta

  assert _LORA_GATHER_MAX_ROWS == 64  # the parametrization straddles it
  rng = np.random.default_rng(1)
  a = rng.standard_normal((4, 12, 3)).astype(np.float32)
  b = rng.standard_normal((4, 3, 7)).astype(np.float32)
  a[0], b[0] = 0.0, 0.0  # slot 0 is the base
  x = rng.standard_normal((rows, 1, 12)).astype(np.float32)
  slots = np.arange(rows, dtype=np.int32) % 4
  bad_a, bad_b = a.copy(), b.copy()
  bad_a[2, 5, 1] = np.nan
  bad_b[3, 0, 2], bad_b[3, 1, 4] = np.inf, np.nan
  clean_a, clean_b = a.copy(), b.copy()
  clean_a[2:], clean_b[2:] = 0.0, 0.0

  def run(a, b):
    return np.asarray(_lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b),
                                  jnp.asarray(slots)))

  got, clean = run(bad_a, bad_b), run(clean_a, clean_b)
  tenant = slots < 2
  assert np.isfinite(got[tenant]).all()
  np.testing.assert_array_equal(got[tenant], clean[tenant])
  want = np.stack([x[i] @ a[s] @ b[s] for i, s in enumerate(slots)])
  np.testing.assert_allclose(got[tenant], want[tenant], rtol=1e-5, atol=1e-5)
  assert not np.isfinite(got[slots == 2]).all()  # the NaN stays in its own rows
