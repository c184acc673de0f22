"""bitdelta_jax.distributed: two processes on loopback (4 CPU devices each, gloo collectives)
generate over one global 2x4 mesh and must match a single-process, single-device run; then one
worker dies and process 0 must get a clear `WorkerLost` within a bounded time."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from bitdelta_jax import distributed

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


def test_run_with_timeout():
  assert distributed.run_with_timeout(lambda x: x + 1, 1, timeout_s=5) == 2
  t0 = time.perf_counter()
  with pytest.raises(distributed.WorkerLost, match="did not finish within 0.3 s"):
    distributed.run_with_timeout(time.sleep, 5, timeout_s=0.3)
  assert time.perf_counter() - t0 < 2

  def boom():
    raise RuntimeError("Connection closed by peer")

  with pytest.raises(distributed.WorkerLost, match="failed: Connection closed by peer"):
    distributed.run_with_timeout(boom, timeout_s=5)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_single_process_and_survive_worker_death(tmp_path):
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", BITDELTA_CPU_THREADS="1")
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), "multihost", str(tmp_path / f"p{i}.json"), "--coordinator",
       f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), "--mesh",
       "data=2,model=4", "--kill", "--step-timeout", "20"],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for i in range(2)
  ]
  try:
    logs = [p.communicate(timeout=400)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  p0 = json.loads((tmp_path / "p0.json").read_text())
  assert (p0["processes"], p0["local_devices"], p0["devices"]) == (2, 4, 8)
  p1 = json.loads((tmp_path / "p1.json").read_text())
  assert p1["process"] == 1
  assert p0["tokens"] == p0["ref_tokens"]  # reference: one process, one device, unsharded
  assert p1["tokens"] == p0["ref_tokens"]
  assert p0["worker_lost"], "process 0 did not notice the dead worker"
  assert p0["detect_s"] < 20 + 5
