"""Multi-process serving (serving/multihost.py): `bitdelta serve` as 2 processes on loopback,
4 CPU devices each (gloo), one global data=2,model=4 mesh. Process 0's HTTP answers must
equal a single-process, single-device server's; a killed worker must turn into HTTP 503
``worker_lost`` within the step timeout, and /health must say ``degraded``.

Also: the plan protocol against fake generators (no JAX), the distributed flags, and the
single-process ``mesh`` path (ShardedGenerator on this process's one device).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from bitdelta_jax.distributed import WorkerLost
from serving import multihost
from serving.app import ServerThread
from serving.cli import add_demo_parser, add_serve_parsers, config_from_args
from serving.config import ConfigError, ServerConfig
from serving.testing import synthetic_family

STEP_TIMEOUT = 15
REQUESTS = [(m, p) for m in ("base", "v0", "v1", "v2") for p in ("hello", "The quick brown fox")]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# -- flags and config -------------------------------------------------------------------------
def test_distributed_flags_and_config(tmp_path):
  p = argparse.ArgumentParser()
  sub = p.add_subparsers()
  add_serve_parsers(sub)
  add_demo_parser(sub)
  f = tmp_path / "c.json"
  f.write_text(json.dumps({"base": "/m/b", "mesh": "model=8", "step_timeout_s": 7.0}))
  c = config_from_args(p.parse_args(["serve", "--config", str(f)]))
  assert (c.mesh, c.num_processes, c.process_id, c.step_timeout_s) == ("model=8", 1, 0, 7.0)
  assert c.sharded and not c.multi_process
  c = config_from_args(p.parse_args(
    ["serve", "--config", str(f), "--coordinator", "h:1", "--num-processes", "2",
     "--process-id", "1", "--mesh", "data=2,model=4", "--step-timeout", "5"]))
  assert (c.coordinator, c.num_processes, c.process_id, c.mesh, c.step_timeout_s) == (
    "h:1", 2, 1, "data=2,model=4", 5.0)
  d = c.distributed
  assert (d.coordinator, d.num_processes, d.process_id, d.mesh) == ("h:1", 2, 1, "data=2,model=4")
  a = p.parse_args(["demo", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0",
                    "--mesh", "data=1,model=8"])
  assert (a.coordinator, a.num_processes, a.mesh) == ("h:1", 2, "data=1,model=8")
  for kw, field in [({"num_processes": 2}, "coordinator"), ({"mesh": "rows=2"}, "mesh"),
                    ({"num_processes": 2, "coordinator": "h:1", "process_id": 2}, "process_id"),
                    ({"step_timeout_s": 0}, "step_timeout_s")]:
    with pytest.raises(ConfigError, match=field):
      ServerConfig(base="/m/b", **kw)


# -- the plan protocol, without JAX ---------------------------------------------------------------
class FakeGen:
  """Records calls; ``step`` returns the row count so far as tokens."""

  def __init__(self):
    self.calls, self.max_rows = [], 2

  class model:  # noqa: N801
    class config:  # noqa: N801
      num_slots = 3

  def bucket_for(self, n):
    if n > 16:
      raise ValueError(f"prompt of {n} tokens exceeds the largest bucket 16")
    return 16

  def init_state(self):
    self.calls.append("init")
    return 0

  def prefill(self, prompt, slot, params):
    self.calls.append(("prefill", tuple(prompt), slot, params.temperature, params.seed))
    if slot == 2:
      raise ValueError("slot 2 is broken")  # deterministic: every process raises it

    class P:
      token = [len(prompt)]
    return P()

  def insert(self, state, prefix, row):
    self.calls.append(("insert", row))
    return state + 1

  def step(self, state):
    self.calls.append("step")
    return state, [state, state]

  def load_variant(self, slot, delta):
    self.calls.append(("load", slot, delta))

  def clear_slot(self, slot):
    self.calls.append(("clear", slot))


def test_leader_plans_replay_identically_on_a_follower():
  from bitdelta_jax.models.sampling import SamplingParams

  sent = []
  lead = multihost.LeaderGenerator(multihost.Replica(FakeGen()), timeout_s=5,
                                   max_plan_bytes=4096,
                                   broadcast=lambda plan, max_bytes: sent.append(
                                     json.loads(json.dumps(plan))))
  st = lead.init_state()
  pre = lead.prefill([5, 6, 7], 1, SamplingParams(temperature=0.5, seed=3, max_new_tokens=4))
  assert int(pre.token[0]) == 3
  st = lead.insert(st, pre, 1)
  _, toks = lead.step(st)
  assert list(toks) == [1, 1]
  lead.load_variant(2, multihost.VariantRef("/deltas/v0"))
  lead.clear_slot(2)
  lead.ping()
  with pytest.raises(ValueError, match="slot 2 is broken"):  # re-raised as is, not "lost"
    lead.prefill([1], 2)
  with pytest.raises(ValueError, match="largest bucket"):  # checked before broadcasting
    lead.prefill(list(range(20)), 1)
  with pytest.raises(ValueError, match="exceeds 4096 bytes"):  # refused before broadcasting
    lead.load_variant(1, multihost.VariantRef("/" + "d" * 5000))
  with pytest.raises(TypeError, match="by path"):
    lead.load_variant(1, {"w": 1})
  assert lead.lost is None and lead.max_rows == 2
  follower = multihost.Replica(FakeGen())
  for plan in sent:
    try:
      follower.apply(plan)
    except ValueError:
      pass
  assert follower.gen.calls == lead.replica.gen.calls
  assert ("load", 2, "/deltas/v0") in follower.gen.calls
  assert [p["op"] for p in sent] == ["init", "prefill", "insert", "step", "load", "clear", "ping",
                                     "prefill"]


def test_leader_times_out_then_fails_fast():
  def slow(plan, max_bytes):
    if plan["op"] == "step":
      time.sleep(5)  # a collective whose peer is gone

  lead = multihost.LeaderGenerator(multihost.Replica(FakeGen()), timeout_s=0.3,
                                   max_plan_bytes=4096, broadcast=slow)
  assert lead.first_call_timeout_s == 300  # the first call of a kind compiles
  lead.first_call_timeout_s = 0.3
  st = lead.init_state()
  t0 = time.perf_counter()
  with pytest.raises(WorkerLost, match="step did not finish within 0.3 s"):
    lead.step(st)
  assert time.perf_counter() - t0 < 2
  assert "worker process was lost" in lead.lost
  t0 = time.perf_counter()
  with pytest.raises(WorkerLost, match="worker process was lost"):
    lead.init_state()  # at once, without another collective
  assert time.perf_counter() - t0 < 0.1

  def broken(plan, max_bytes):
    raise RuntimeError("Gloo all-reduce failed: Connection closed by peer")

  lead = multihost.LeaderGenerator(multihost.Replica(FakeGen()), timeout_s=5,
                                   max_plan_bytes=4096, broadcast=broken)
  with pytest.raises(WorkerLost, match="Connection closed by peer"):
    lead.init_state()


# -- real servers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def family(tmp_path_factory):
  root = tmp_path_factory.mktemp("mh")
  base, deltas = synthetic_family(root, n=3)
  cfg = ServerConfig(base=str(base), base_name="base", variants=tuple(
    (n, str(d)) for n, d in deltas.items()), device_slots=2, max_batch=4, max_seq_len=64,
    buckets=(32,), default_max_tokens=8, port=0)
  return root, cfg


@pytest.fixture(scope="module")
def reference(family):
  """Answers of a single-process, single-device server (no mesh)."""
  with ServerThread(family[1]) as ref:
    want = _answers(ref.url, parallel=False)
  assert len({w[0] for w in want}) > 4  # the variants differ from the base and each other
  return want


def _complete(url, model, prompt, **kw):
  r = requests.post(url + "/v1/completions", json={
    "model": model, "prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": True,
    **kw}, timeout=120)
  assert r.status_code == 200, r.text
  c = r.json()["choices"][0]
  return c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]


def _answers(url, parallel: bool) -> list:
  if not parallel:
    return [_complete(url, m, p) for m, p in REQUESTS]
  with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as ex:  # mixed-variant batches
    return list(ex.map(lambda mp: _complete(url, *mp), REQUESTS))


def _start_pair(root, cfg: ServerConfig, http_port: int):
  f = root / "serve.json"
  d = cfg.to_dict()
  d.pop("api_key")
  f.write_text(json.dumps(d))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", BITDELTA_CPU_THREADS="1")
  coord = _free_port()
  procs, logs = [], []
  for i in range(2):
    log = open(root / f"p{i}.log", "w")
    logs.append(root / f"p{i}.log")
    procs.append(subprocess.Popen(
      [sys.executable, "-m", "bitdelta_jax.cli", "serve", "--config", str(f), "--port",
       str(http_port), "--coordinator", f"127.0.0.1:{coord}", "--num-processes", "2",
       "--process-id", str(i), "--mesh", "data=2,model=4", "--step-timeout", str(STEP_TIMEOUT)],
      env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def _wait_healthy(url, procs, logs, timeout=150):
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < timeout:
    for p, log in zip(procs, logs):
      if p.poll() is not None:
        pytest.fail(f"a server process exited ({p.returncode}):\n{log.read_text()[-4000:]}")
    try:
      if requests.get(url + "/health", timeout=2).status_code == 200:
        return
    except requests.ConnectionError:
      pass
    time.sleep(0.5)
  pytest.fail("multi-process server did not become healthy:\n" + logs[0].read_text()[-4000:])


def test_two_processes_serve_like_one_and_survive_a_dead_worker(family, request):
  root, cfg = family
  http_port = _free_port()
  url = f"http://127.0.0.1:{http_port}"
  procs, logs = _start_pair(root, cfg, http_port)
  try:
    want = request.getfixturevalue("reference")  # computed here while the pair starts
    _wait_healthy(url, procs, logs)
    assert requests.get(url + "/health").json()["processes"] == 2
    assert _answers(url, parallel=True) == want
    variants = requests.get(url + "/v1/variants").json()
    assert sum(v["loads"] for v in variants["data"]) >= 3  # 3 variants through 2 slots

    # a request in flight when the worker dies fails with a clear 503-class error
    r = requests.post(url + "/v1/completions", json={
      "model": "v0", "prompt": "x", "max_tokens": 60, "ignore_eos": True, "stream": True},
      stream=True, timeout=60)
    lines = r.iter_lines()
    first = next(ln for ln in lines if ln)
    assert first.startswith(b"data: {"), first
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.perf_counter()
    rest = [ln for ln in lines if ln]
    detect_s = time.perf_counter() - t0
    assert rest[-1] == b"data: [DONE]", rest[-2:]
    err = json.loads(rest[-2][len(b"data: "):])["error"]
    assert err["code"] == "worker_lost" and "a worker process was lost" in err["message"], err
    assert detect_s < STEP_TIMEOUT + 5
    # the server stays up, says why it is degraded, and refuses new work at once
    h = requests.get(url + "/health", timeout=5)
    assert h.status_code == 503 and h.json()["status"] == "degraded"
    assert "worker process was lost" in h.json()["error"]
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/completions", json={"model": "base", "prompt": "hi"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_lost", r.text
    assert time.perf_counter() - t0 < 2
  finally:
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    for p in procs:
      try:
        p.wait(20)
      except subprocess.TimeoutExpired:
        p.kill()
  assert procs[0].returncode == 0, logs[0].read_text()[-4000:]


def test_single_process_mesh_serves_like_one_device(family, reference):
  """``mesh`` in one process: the paged engine, base restored into its shardings, variants
  loaded from in-memory deltas (this process has one device: a 1x1 mesh), and what the
  fixed-row engine refused (n, logprobs) is served."""
  with ServerThread(family[1].replace(mesh="data=1,model=1")) as one:
    assert _answers(one.url, parallel=True) == reference
    assert requests.get(one.url + "/health").json()["status"] == "ok"
    m, p = REQUESTS[1]
    r = requests.post(one.url + "/v1/completions", json={
      "model": m, "prompt": p, "temperature": 0, "max_tokens": 8, "ignore_eos": True, "n": 2,
      "logprobs": 2}, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [reference[1][0]] * 2  # greedy: both the same text
    assert all(len(c["logprobs"]["tokens"]) == 8 for c in choices)
