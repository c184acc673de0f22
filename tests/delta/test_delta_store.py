"""The delta store (`bitdelta_jax.delta.store`) refuses what no variant may hold: arrays whose
crc32 is right but whose values are not finite (issue 35), for every kind of stored tensor."""

from __future__ import annotations

import numpy as np
import pytest

from bitdelta_jax.delta.compress import CompressPolicy, compress
from bitdelta_jax.delta.store import (
  DeltaStoreError,
  load_delta,
  read_array,
  read_manifest,
  save_delta,
)
from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune
from serving.testing import poison_array

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.layers.1.input_layernorm.weight"
POLICIES = {
  "bitdelta": CompressPolicy(),
  "dqrelo": CompressPolicy(mode="dqrelo", rank=3, granularity="column"),  # 1-bit + bf16 factors
  "svd": CompressPolicy(mode="svd", rank=4, factor_dtype="float16"),
  "delta-come": CompressPolicy(mode="delta-come", budget=1 / 15),  # coded factors + steps
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
  root = tmp_path_factory.mktemp("stores")
  c = SyntheticConfig(hidden_size=32, intermediate_size=64, vocab_size=64)
  base = make_base(c)
  ft = make_finetune(base)
  out = {}
  for mode, policy in POLICIES.items():
    delta, report = compress(base, ft, policy, hf_layout=True)
    out[mode] = root / mode
    save_delta(
      out[mode],
      delta,
      base_fingerprint={"tensors": {}, "digest": "x"},
      report=report,
      policy=policy.to_dict(),
    )
  return out


def poison(src, dst, tensor: str, field: str, value: float):
  """A copy of the store ``src`` at ``dst`` whose ``tensor/field`` holds ``value`` at one
  element, its crc32 valid."""
  import shutil

  return poison_array(shutil.copytree(src, dst), tensor, field, value)


def _float_fields(store, tensor):
  arrays = read_manifest(store)["tensors"][tensor]["arrays"]
  return sorted(f for f, meta in arrays.items() if meta["dtype"] not in ("uint8", "int32"))


def test_every_mode_stores_float_arrays_to_check(stores):
  fields = {mode: _float_fields(d, Q) for mode, d in stores.items()}
  assert fields["bitdelta"] == ["scale"]
  assert {"a16", "b16", "scale"} <= set(fields["dqrelo"])
  assert {"a16", "b16"} <= set(fields["svd"])
  assert any(f.endswith("_step") for f in fields["delta-come"])
  assert _float_fields(stores["bitdelta"], NORM) == ["value"]


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_load_refuses_non_finite_values_naming_tensor_and_file(stores, tmp_path, mode, value):
  for i, field in enumerate(_float_fields(stores[mode], Q)):
    bad = poison(stores[mode], tmp_path / f"{mode}{i}", Q, field, value)
    with pytest.raises(DeltaStoreError, match="non-finite") as ei:
      load_delta(bad)
    msg = str(ei.value)
    assert f"tensor {Q!r}" in msg and f"{Q}/{field}" in msg, msg


def test_load_refuses_a_non_finite_dense_tensor(stores, tmp_path):
  bad = poison(stores["bitdelta"], tmp_path / "norm", NORM, "value", np.nan)
  with pytest.raises(DeltaStoreError, match=f"{NORM}/value: tensor {NORM!r}: 1 non-finite"):
    load_delta(bad)


def test_a_sliced_read_is_checked_too(stores, tmp_path):
  """Sharded restores read slices (`read_array(..., index=...)`): each is checked."""
  bad = poison(stores["bitdelta"], tmp_path / "slice", Q, "scale", np.inf)
  meta = read_manifest(bad)["tensors"][Q]["arrays"]["scale"]
  with pytest.raises(DeltaStoreError, match="non-finite"):
    read_array(bad / "arrays" / Q / "scale", meta, index=(slice(0, meta["shape"][0]),))


def test_large_finite_values_still_load(stores, tmp_path):
  """Only inf and NaN are refused: a huge α is a finite number (its rows overflow in a batch,
  which the engine keeps to that variant's own rows)."""
  big = poison(stores["bitdelta"], tmp_path / "big", Q, "scale", 1e30)
  delta, _ = load_delta(big)
  assert np.max(delta[Q].scale) == np.float32(1e30)
