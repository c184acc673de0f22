"""CI proves that the GPU path lowers for CUDA, without a GPU (`cuda_lowering` says how).

The one engine's whole serving step (SmolLM2-135M's config, three variant slots, the layers as
one scan as on a GPU) is lowered with the GPU kernels selected, on one device and over an
8-device mesh of forced host devices: the Mosaic GPU kernels (the fused 1-bit delta GEMM and
the paged decode attention) must be in the module, and no delta bits may be unpacked outside
them. The same check on a step whose delta matmuls run in XLA (``delta_implementation="xla"``,
which unpacks bit planes) must find the unpacking: the check can fail.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import cuda_lowering as cl
import pytest

pytestmark = pytest.mark.slow  # starts servers / subprocesses / the real model

MOSAIC = "mosaic_gpu_v2"  # the Mosaic GPU custom call (jax 0.10-0.11)


@pytest.fixture(scope="module")
def smollm2_runner():
  return cl.build_runner("smollm2")


@pytest.mark.parametrize("tokens,base_only", [(32, False), (544, False), (1, True)])
def test_whole_step_lowers_for_cuda_with_the_gpu_kernels(smollm2_runner, tokens, base_only):
  runner, cfg = smollm2_runner
  (row,) = cl.report(runner, cfg, [(tokens, base_only)])
  assert row["custom_calls"].get(MOSAIC, 0) >= 1, row["custom_calls"]
  if not base_only:  # the variant form: the delta GEMM is a kernel, its bits never unpacked
    assert "bitdelta_delta_matmul" in " ".join(row["kernels"]) or row["custom_calls"][MOSAIC] >= 2
    assert row["unpacked"] == [], row["unpacked"][:5]
  # no CPU kernel (jax.ffi custom calls of the CPU build) in a CUDA program
  assert not [c for c in row["custom_calls"] if c.startswith("bitdelta")], row["custom_calls"]


def test_the_unpacking_check_finds_bits_unpacked_by_xla():
  runner, cfg = cl.build_runner("smollm2", delta_implementation="xla")
  (row,) = cl.report(runner, cfg, [(32, False)])
  assert len(row["unpacked"]) >= cfg.num_layers  # every layer's q/k/v/o/gate/up/down planes


def _mesh_lowering(mesh: str, config: str) -> dict:
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  script = pathlib.Path(cl.__file__)
  proc = subprocess.run([sys.executable, str(script), mesh, config], capture_output=True,
                        text=True, timeout=600, env=env, cwd=script.parent.parent)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh,config", [("data=1,model=8", "smollm2"),
                                         ("data=1,model=8", "llama_heads"),
                                         ("data=2,model=4", "llama_heads")])
def test_whole_step_lowers_for_cuda_over_a_device_mesh(mesh, config):
  """SmolLM2's 3 KV heads do not split over 8 (the attention runs replicated, its matmuls
  column-parallel); 8 KV heads of 128 (Llama-8B's attention) split over ``model``, so the
  attention kernel runs per device under ``shard_map`` on its own heads' pages."""
  res = _mesh_lowering(mesh, config)
  assert res["devices"] == 8
  for row in res["rows"]:
    assert row["custom_calls"].get(MOSAIC, 0) >= 2, row
    assert row["unpacked"] == [], row["unpacked"][:5]
