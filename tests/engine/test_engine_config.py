"""The engine's own config: built from a server's, checked once, and the library below the
server never imports it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from bitdelta_jax.engine.config import EngineConfig
from serving.config import ServerConfig


def test_a_server_config_hands_the_engine_its_fields():
  s = ServerConfig(base="/m/b", max_batch=3, max_seq_len=64, page_size=8, mesh="model=2",
                   stall_timeout_s=9.0, start_timeout_s=30.0, api_key="k", port=0)
  e = s.engine_config()
  for f in dataclasses.fields(EngineConfig):
    assert getattr(e, f.name) == getattr(s, f.name), f.name
  assert e.sharded and not e.multi_process
  assert e.distributed == s.distributed and e.distributed.start_timeout_s == 30.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    e.max_batch = 4


@pytest.mark.parametrize("kw,msg", [
  (dict(max_batch=0), "max_batch: must be >= 1"), (dict(dtype="int8"), "dtype: must be"),
  (dict(kv_cache_mb=0), "kv_cache_mb: must be > 0"),
  (dict(num_processes=2), "coordinator: num_processes > 1 needs"),
  (dict(process_id=1), r"process_id: must be in \[0, 1\)"),
])
def test_invalid_values_name_the_field(kw, msg):
  with pytest.raises(ValueError, match=msg):
    EngineConfig(base="/m/b", **kw)


def test_the_engine_refuses_a_server_config():
  from bitdelta_jax.engine import Engine

  with pytest.raises(TypeError, match="EngineConfig.*ServerConfig.engine_config"):
    Engine(ServerConfig(base="/m/b"))


def test_the_layers_import_downward_only():
  """In one fresh process: nothing under bitdelta_jax imports the server, and the model, the
  delta formats, hf, sharding and the kernels do not import the engine either."""
  code = ("import sys\n"
          "def loaded(p): return sorted(m for m in sys.modules if m == p or m.startswith(p + '.'))\n"
          "import bitdelta_jax.models.llama, bitdelta_jax.models.loading, bitdelta_jax.models.banks"
          ", bitdelta_jax.delta.variant, bitdelta_jax.delta.stream, bitdelta_jax.hf.gguf_base, "
          "bitdelta_jax.sharding, pallas_kernels.quant_matmul\n"
          "print(loaded('bitdelta_jax.engine') + loaded('serving'))\n"
          "import bitdelta_jax.engine.engine, bitdelta_jax.engine.build, "
          "bitdelta_jax.engine.multihost.leader, bitdelta_jax.merge.cli, bitdelta_jax.distill\n"
          "print(loaded('serving'))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
