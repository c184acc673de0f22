"""bitdelta_jax.engine.multihost.runtime: its flags. The step watchdog (`LeaderRunner`) and two real processes over one
global mesh (the same answers as one device; a dead worker gives 503s) are tested through the
server in tests/serving/test_multihost.py."""

from __future__ import annotations

import pathlib

import pytest

from bitdelta_jax.engine.multihost import runtime as distributed

pytestmark = pytest.mark.slow  # starts servers / subprocesses / the real model

WORKER = pathlib.Path(__file__).with_name("sharding_worker.py")


def test_config_validation():
  assert not distributed.DistributedConfig().multi_process
  with pytest.raises(ValueError, match="--coordinator"):
    distributed.DistributedConfig(num_processes=2)
  with pytest.raises(ValueError, match="process id 2"):
    distributed.DistributedConfig("h:1", num_processes=2, process_id=2)
  import argparse

  ap = argparse.ArgumentParser()
  distributed.add_arguments(ap)
  args = ap.parse_args(["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1",
                        "--mesh", "data=2,model=4"])
  cfg = distributed.DistributedConfig.from_args(args)
  assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.mesh) == (
    "h:1", 2, 1, "data=2,model=4")
  assert distributed.initialize(distributed.DistributedConfig()) is False
