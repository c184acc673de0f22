"""`bitdelta_jax.delta.variant`: one reader says what a variant directory is (a delta or a
PEFT LoRA adapter), its bytes and rank, and what a slot load writes."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bitdelta_jax.delta.store import DeltaStoreError, _array_dir, load_delta, read_array
from bitdelta_jax.delta.variant import bank_options, open_variant
from bitdelta_jax.merge.lora import from_factors, load_adapter, save_adapter
from bitdelta_jax.models.slots import lora_entries
from serving.testing import TINY, synthetic_family


def _same(a, b) -> None:
  """Equal entries: the same type, every array field equal to the bit."""
  assert type(a) is type(b)
  if dataclasses.is_dataclass(a):
    for f in dataclasses.fields(a):
      _same(getattr(a, f.name), getattr(b, f.name))
  elif hasattr(a, "shape"):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  else:
    assert a == b


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  root = tmp_path_factory.mktemp("variants")
  base, deltas = synthetic_family(root, n=1)
  rng = np.random.default_rng(0)
  save_adapter(from_factors({
    "model.layers.0.self_attn.q_proj": (rng.standard_normal((4, TINY.hidden_size)).astype(
      np.float32), rng.standard_normal((TINY.hidden_size, 4)).astype(np.float32)),
    "model.layers.1.mlp.up_proj": (rng.standard_normal((6, TINY.hidden_size)).astype(
      np.float32), rng.standard_normal((TINY.intermediate_size, 6)).astype(np.float32))}),
    root / "lora")
  return base, deltas["v0"], root / "lora"


def test_a_delta(family):
  _, delta, _ = family
  v = open_variant(delta)
  assert v.kind == "delta" and v.lora_rank == 0 and v.added_tokens(TINY.vocab_size) == 0
  stored = [read_array(_array_dir(delta, n) / f, m)  # every array as stored, read back
            for n, t in v.manifest["tensors"].items() for f, m in t["arrays"].items()]
  assert v.nbytes == sum(a.nbytes for a in stored) > 0
  arrays, _ = load_delta(delta)
  payload = v.slot_payload()
  assert set(payload) == set(arrays)
  for name in arrays:
    _same(payload[name], arrays[name])
  assert v.slot_payload(by_shards=True) == str(delta)  # a mesh reads it slice by slice


def test_an_adapter(family):
  _, _, lora = family
  v = open_variant(lora)
  assert v.kind == "lora" and v.lora_rank == 6  # the largest of rank_pattern
  assert json.loads((lora / "adapter_config.json").read_text())["r"] <= 6
  want = lora_entries(load_adapter(lora))
  got = v.slot_payload(by_shards=True)  # small: read whole on every process
  assert set(got) == set(want)
  for name in want:
    _same(got[name], want[name])
  assert bank_options([lora], TINY.vocab_size)["lora_rank"] == 6


def test_neither_names_the_path(family, tmp_path):
  base, _, _ = family
  with pytest.raises(DeltaStoreError, match=str(base)):
    open_variant(base)  # a model, not a variant
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "adapter_config.json").write_text('{"r": "many"}')
  with pytest.raises(ValueError, match=f"{bad}.*not a PEFT adapter config"):
    open_variant(bad)
