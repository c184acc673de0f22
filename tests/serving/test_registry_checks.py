"""Registration checks that need no running server: a low-rank delta whose rank exceeds the
server's LoRA slots, and a compress call in a low-rank mode through `stream`."""

import pytest

from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.models.banks import Banks
from bitdelta_jax.synthetic import make_base, make_finetune, write_checkpoint
from serving.registry import Registry, RegistryError
from serving.testing import TINY


@pytest.fixture(scope="module")
def dqrelo_delta(tmp_path_factory):
  root = tmp_path_factory.mktemp("reg")
  base = make_base(TINY, 0)
  b = write_checkpoint(base, root / "base", TINY.hf_config())
  f = write_checkpoint(make_finetune(base, seed=2, rel=0.2), root / "ft", TINY.hf_config())
  m = compress_checkpoints(b, f, root / "delta", CompressPolicy(mode="dqrelo", rank=3),
                           progress=False)
  return root / "delta", m


def test_stream_compress_runs_low_rank_modes(dqrelo_delta):
  _, m = dqrelo_delta
  assert m["mode"] == "dqrelo" and m["lora_rank"] == 3
  assert any(t["kind"] == "residual" for t in m["tensors"].values())


def test_a_delta_whose_rank_exceeds_the_lora_slots_is_refused_at_registration(dqrelo_delta):
  path, _ = dqrelo_delta
  small = Registry("base", banks=Banks(lora_rank=2), vocab_size=TINY.vocab_size)
  with pytest.raises(RegistryError, match="rank 3.*LoRA slots have rank 2.*--lora-rank 3"):
    small.inspect(path, None)
  assert Registry("base", banks=Banks(lora_rank=3), vocab_size=TINY.vocab_size).inspect(path, None).nbytes > 0


def test_one_bit_embeddings_only_in_bitdelta_mode(dqrelo_delta, tmp_path):
  path, _ = dqrelo_delta
  root = path.parent
  with pytest.raises(ValueError, match="implemented for mode 'bitdelta' only"):
    compress_checkpoints(root / "base", root / "ft", tmp_path / "x",
                         CompressPolicy(mode="svd", rank=2), embeddings="1bit", progress=False)
