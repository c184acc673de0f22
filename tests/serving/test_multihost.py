"""Multi-process serving (bitdelta_jax/engine/multihost/leader.py): `bitdelta serve` as 2 processes on loopback,
4 CPU devices each (gloo), one global data=2,model=4 mesh. Process 0's HTTP answers must
equal a single-process, single-device server's; a killed worker must turn into HTTP 503
``worker_lost`` within the step timeout, and /health must say ``degraded``.

Also: the plan bytes, the plan channel and the leader's replay against fake runners, the
distributed flags, and the single-process ``mesh`` path (a 1x1 mesh).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from bitdelta_jax.engine.multihost import leader as multihost
from bitdelta_jax.engine.multihost.runtime import WorkerLost
from serving.app import ServerThread
from serving.cli import add_demo_parser, add_serve_parsers, config_from_args
from serving.config import ConfigError, ServerConfig
from serving.testing import synthetic_family

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

STEP_TIMEOUT = 15
REQUESTS = [(m, p) for m in ("base", "v0", "v1", "v2", "emb1", "lora", "grown")
            for p in ("hello", "The quick brown fox")]


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
  assert c.engine_config().sharded and not c.multi_process
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


# -- the plan protocol ------------------------------------------------------------------------
def test_plans_round_trip_as_compact_bytes_and_malformed_ones_are_named():
  import numpy as np

  from bitdelta_jax.engine.controls import LogitControls
  from bitdelta_jax.engine.multihost import codec as step_plan

  rng = np.random.default_rng(0)
  empty = _shapes().empty(8)  # a ragged batch of 8 tokens, 4 lanes and outputs
  def arrays(obj):  # every array of a batch, by dotted name
    out = {}
    for f in dataclasses.fields(obj):
      a = getattr(obj, f.name)
      if dataclasses.is_dataclass(a):
        out.update({f"{f.name}.{k}": v for k, v in arrays(a).items()})
      elif isinstance(a, np.ndarray):
        out[f.name] = a
    return out

  def randomized(obj):
    new = {}
    for f in dataclasses.fields(obj):
      a = getattr(obj, f.name)
      if dataclasses.is_dataclass(a):
        new[f.name] = randomized(a)
      elif isinstance(a, np.ndarray):
        new[f.name] = (rng.random(a.shape) < 0.5 if a.dtype == bool else
                       rng.integers(0, 99, a.shape).astype(a.dtype))
    return dataclasses.replace(obj, **new)

  random = randomized(empty)
  assert len(arrays(random)) == 22 and "attention.lane_pages" in arrays(random)
  for controls in (None, LogitControls.neutral(4, 100, 16)):
    batch = dataclasses.replace(random, controls=controls)
    data = step_plan.encode("run", step_plan.batch_fields(batch, True))
    op, got = step_plan.decode(data)
    back, base_only = step_plan.batch_of(got)
    assert op == "run" and base_only is True
    assert back.attention.block_pages == batch.attention.block_pages
    want, have = arrays(batch), arrays(back)
    assert want.keys() == have.keys()
    for name, b in want.items():
      a = have[name]
      assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    if controls is None:
      assert back.controls is None
      raw = sum(v.nbytes for v in want.values())
      assert len(data) < raw + 40 * len(want)  # no padding, a few bytes of header per field
    else:
      assert all(np.array_equal(getattr(back.controls, k), getattr(controls, k))
                 for k in ("mask", "history", "repetition"))
  # a batch's padding (here all of it: a server's 32-token bucket) travels as a count and one
  # value per array
  from bitdelta_jax.engine.batch import StepShapes

  big = StepShapes(max_rows=32, max_step_tokens=544, max_pages_per_seq=128, page_size=16,
                   block_pages=8, vocab_size=49152, max_seq_len=2048).empty(32)
  data = step_plan.encode("run", step_plan.batch_fields(big, False))
  back, _ = step_plan.batch_of(step_plan.decode(data)[1])
  raw = 0
  for name, a in arrays(big).items():
    assert np.array_equal(arrays(back)[name], a), name
    raw += a.nbytes
  assert raw > 80_000 and len(data) < 1_500
  op, got = step_plan.decode(step_plan.encode("load", {"slot": 3, "path": "/d/v0", "adapter": 0,
                                                       "x": None}))
  assert (op, got) == ("load", {"slot": 3, "path": "/d/v0", "adapter": 0, "x": None})
  good = step_plan.encode("copy", {"src": np.arange(3, dtype=np.int32)})
  for bad, msg in [(b"JSON" + good[4:], "not a plan"), (good[:-2], "truncated in src"),
                   (good + b"\0", "1 bytes after"), (step_plan.encode("run", {}), "run plan without")]:
    with pytest.raises(step_plan.PlanError, match=msg):
      op, f = step_plan.decode(bad)
      step_plan.batch_of(f)


def test_plan_channel_delivers_in_order_and_refuses_a_wrong_token():
  import threading

  from bitdelta_jax.engine.multihost.channel import PlanReceiver, PlanSender

  sender = PlanSender(2, host="127.0.0.1")
  got: dict[int, list] = {1: [], 2: []}

  def follower(pid, token):
    try:
      r = PlanReceiver("127.0.0.1", sender.port, token, pid, timeout_s=10)
    except OSError:
      return
    try:
      while True:
        got[pid].append(r.recv())
    except ConnectionError:
      pass

  intruder = threading.Thread(target=follower, args=(1, b"x" * 32))  # refused: wrong token
  intruder.start()
  time.sleep(0.2)  # it connects first
  threads = [threading.Thread(target=follower, args=(i, sender.token)) for i in (1, 2)]
  for t in threads:
    t.start()
  sender.accept(timeout_s=10)
  intruder.join(10)
  assert not intruder.is_alive() and got[1] == []  # closed before it saw anything
  plans = [bytes([i]) * (i * 1000) for i in range(1, 6)]
  for p in plans:
    sender.send(p)
  sender.close()
  for t in threads:
    t.join(10)
  assert got == {1: plans, 2: plans}
  late = PlanSender(1, host="127.0.0.1")
  with pytest.raises(TimeoutError, match=r"processes \[1\] did not connect"):
    late.accept(timeout_s=0.3)
  late.close()


class FakeRunner:
  """Records calls; ``run`` returns its batch's token count."""

  def __init__(self):
    self.calls = []
    self.k_pool = 0

  def run(self, batch, base_only):
    self.calls.append(("run", batch.tokens.shape, base_only))
    return int(batch.tokens.size)

  def copy_pages(self, src, dst):
    self.calls.append(("copy", list(src), list(dst)))

  def load_variant(self, slot, delta):
    if delta == "/broken":
      raise ValueError("delta /broken is unreadable")  # deterministic: every process raises it
    self.calls.append(("load", slot, delta))

  def clear_slot(self, slot):
    self.calls.append(("clear", slot))

  def refresh(self):
    self.calls.append(("refresh",))

  def compile_all(self, forms, threads=2, progress=None):
    self.calls.append(("compile", tuple(forms), threads))
    return 0.0


def _shapes():
  from bitdelta_jax.engine.batch import StepShapes

  return StepShapes(max_rows=4, max_step_tokens=12, max_pages_per_seq=6, page_size=4,
                    block_pages=2, vocab_size=100, max_seq_len=24)


def _tiny_batch():
  return _shapes().empty(4)


def test_leader_plans_replay_identically_on_a_follower():
  from bitdelta_jax.engine.multihost import codec as step_plan

  sent = []
  lead = multihost.LeaderRunner(FakeRunner(), sent.append, timeout_s=5)
  lead.compile_all((True, False), threads=3)
  assert lead.run(_tiny_batch(), True) == 4
  lead.copy_pages([3], [7])
  lead.load_variant(2, multihost.VariantRef("/deltas/v0"))
  lead.clear_slot(2)
  lead.refresh()
  lead.ping()
  with pytest.raises(ValueError, match="unreadable"):  # re-raised as is, not "lost"
    lead.load_variant(1, multihost.VariantRef("/broken"))
  with pytest.raises(TypeError, match="by path"):
    lead.load_variant(1, {"w": 1})
  assert lead.lost is None and lead.k_pool == 0  # attributes come from the runner
  follower = FakeRunner()
  for data in sent:
    op, fields = step_plan.decode(data)
    try:
      multihost.apply(follower, op, fields)
    except ValueError:
      pass
  assert follower.calls == lead.runner.calls
  assert ("load", 2, "/deltas/v0") in follower.calls
  assert [step_plan.decode(d)[0] for d in sent] == ["compile", "run", "copy", "load", "clear",
                                                   "refresh", "ping", "load"]
  assert lead.plans == 8 and lead.plan_bytes == sum(map(len, sent))


def test_leader_times_out_then_fails_fast():
  hung = threading.Event()  # set at the end: until then the send never returns
  sent = []

  def slow(data):
    sent.append(data)
    if data.startswith(b"BDP1\x03run"):
      hung.wait(120)  # a collective whose peer is gone

  lead = multihost.LeaderRunner(FakeRunner(), slow, timeout_s=0.3)
  assert lead.first_call_timeout_s == 300  # the first call of a shape compiles
  lead.first_call_timeout_s = 0.3
  try:
    with pytest.raises(WorkerLost, match="run did not finish within 0.3 s"):
      lead.run(_tiny_batch(), False)  # gives up while the send still hangs
    assert "worker process was lost" in lead.lost
    with pytest.raises(WorkerLost, match="worker process was lost"):
      lead.ping()  # at once: no other plan is sent (none could time out)
    assert len(sent) == 1
  finally:
    hung.set()

  def broken(data):
    raise ConnectionResetError("Connection reset by peer")

  lead = multihost.LeaderRunner(FakeRunner(), broken, timeout_s=5)
  with pytest.raises(WorkerLost, match="Connection reset by peer"):
    lead.ping()


# -- real servers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def family(tmp_path_factory):
  import numpy as np

  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.hf.safetensors_io import CheckpointReader
  from bitdelta_jax.merge.lora import from_factors, save_adapter
  from bitdelta_jax.synthetic import make_base, make_finetune, write_checkpoint
  from serving.testing import TINY

  root = tmp_path_factory.mktemp("mh")
  base, deltas = synthetic_family(root, n=3)
  # a variant with 1-bit embeddings (packed banks) and a PEFT LoRA adapter (LoRA banks)
  ft = write_checkpoint(make_finetune(make_base(TINY, 0), seed=7, rel=0.05), root / "ft_emb",
                        TINY.hf_config())
  compress_checkpoints(base, ft, root / "emb1", embeddings="1bit", progress=False)
  with CheckpointReader(base) as r:
    shapes = {n: r.read(n).shape for n in r.names()}
  rng = np.random.default_rng(3)
  factors = {}
  for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
    out_f, in_f = shapes[name + ".weight"]
    factors[name] = (rng.standard_normal((4, in_f)).astype(np.float32) * 0.3,
                     rng.standard_normal((out_f, 4)).astype(np.float32) * 0.3)
  save_adapter(from_factors(factors), root / "lora")
  # and a grown vocabulary: 2 added rows the LM head prefers, with the tokenizer that names them
  from tokenizers import Tokenizer as HFTokenizer

  grown = make_finetune(make_base(TINY, 0), seed=13, rel=0.3, extra_vocab=2)
  grown["lm_head.weight"][TINY.vocab_size:] *= 50
  gdir = write_checkpoint(grown, root / "ft_grown", TINY.hf_config(vocab_size=TINY.vocab_size + 2))
  tk = HFTokenizer.from_file(str(base / "tokenizer.json"))
  tk.add_tokens(["<g1>", "<g2>", "<g3>", "<g4>", "<g5>"])  # ids 261-265: rows 264, 265 added
  tk.save(str(gdir / "tokenizer.json"))
  for f in ("tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(base / f, gdir)
  compress_checkpoints(base, gdir, root / "grown", progress=False)
  variants = [(n, str(d)) for n, d in deltas.items()]
  variants += [("emb1", str(root / "emb1")), ("lora", str(root / "lora")),
               ("grown", str(root / "grown"))]
  cfg = ServerConfig(base=str(base), base_name="base", variants=tuple(variants), device_slots=2,
                     max_batch=4, max_seq_len=64, default_max_tokens=8, port=0, prefill_chunk=16)
  return root, cfg


@pytest.fixture(scope="module")
def reference(family):
  """Answers of a single-process, single-device server (no mesh)."""
  with ServerThread(family[1]) as ref:
    want = _answers(ref.url, parallel=False)
    rich = _rich(ref.url)
  assert len({w[0] for w in want}) > 4  # the variants differ from the base and each other
  grown = [w[0] for (m, _), w in zip(REQUESTS, want) if m == "grown"]
  assert any("<g4>" in t or "<g5>" in t for t in grown), grown  # it emits its added rows
  return want, rich


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["a"], "additionalProperties": False}
LONG = " ".join(["the quick brown fox"] * 2)  # 39 tokens: three prefill chunks of 16


def _rich(url) -> list:
  """What the fixed-row engine refused: n choices with log probabilities (sampled, seeded),
  echo, penalties and bias, a JSON schema, and a prompt longer than one prefill chunk."""
  bodies = [
    {"model": "v0", "prompt": "hello", "n": 2, "logprobs": 2, "temperature": 0.8, "seed": 5},
    {"model": "v1", "prompt": "The quick", "echo": True, "logprobs": 1, "max_tokens": 3,
     "temperature": 0},
    {"model": "v2", "prompt": LONG, "temperature": 0, "presence_penalty": 0.5,
     "logit_bias": {"5": -100}},
    {"model": "base", "prompt": "x", "temperature": 0, "max_tokens": 24,
     "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
  ]
  with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:  # in one batch
    rs = list(ex.map(lambda b: requests.post(url + "/v1/completions", json={
      "max_tokens": 8, "ignore_eos": True, **b}, timeout=120), bodies))
  out = []
  for r in rs:
    assert r.status_code == 200, r.text
    out.append([(c["text"], c["finish_reason"], (c.get("logprobs") or {}).get("token_logprobs"))
                for c in r.json()["choices"]])
  return out


def _same_rich(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert [c[:2] for c in g] == [c[:2] for c in w]
    for cg, cw in zip(g, w):
      if cw[2] is not None:
        assert len(cg[2]) == len(cw[2])
        for a, b in zip(cg[2], cw[2]):
          assert (a is None and b is None) or abs(a - b) < 1e-3, (cg, cw)


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


def _start_pair(root, cfg: ServerConfig, http_port: int, *, straggle_s: float = 0.0,
                processes=(0, 1), extra=()):
  """The two processes of one server (``processes``: which of them to start); process 1
  sleeps ``straggle_s`` between compiling and its first collective."""
  f = root / "serve.json"
  d = cfg.to_dict()
  d.pop("api_key"), d.pop("admin_key")
  f.write_text(json.dumps(d))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu", BITDELTA_CPU_THREADS="1")
  coord = _free_port()
  procs, logs = [], []
  for i in processes:
    log = open(root / f"p{i}.log", "w")
    logs.append(root / f"p{i}.log")
    fault = {"BITDELTA_FAULT_STAGE": "compile", "BITDELTA_FAULT_START_DELAY_S": str(straggle_s)}
    procs.append(subprocess.Popen(
      [sys.executable, "-m", "bitdelta_jax.cli", "serve", "--config", str(f), "--port",
       str(http_port), "--coordinator", f"127.0.0.1:{coord}", "--num-processes", "2",
       "--process-id", str(i), "--mesh", "data=2,model=4", "--step-timeout", str(STEP_TIMEOUT),
       *extra], env={**env, **fault} if i == 1 and straggle_s else env, stdout=log,
      stderr=subprocess.STDOUT))
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


STRAGGLE_S = 32.0  # past gloo's 30 s to create a communicator (issue 50's start-up failure)


def test_two_processes_serve_like_one_and_survive_a_dead_worker(family, request):
  """One process reaches its first collective 32 s after the other (the straggler of a fleet
  with warm and cold step caches): the start waits for it, then both serve like one."""
  root, cfg = family
  http_port = _free_port()
  url = f"http://127.0.0.1:{http_port}"
  procs, logs = _start_pair(root, cfg, http_port, straggle_s=STRAGGLE_S)
  try:
    want, rich = request.getfixturevalue("reference")  # computed here while the pair starts
    _wait_healthy(url, procs, logs, timeout=150 + STRAGGLE_S)
    waited = re.search(r"waited ([0-9.]+) s for every process to have compiled the step programs",
                       logs[0].read_text())
    assert waited and float(waited.group(1)) > STRAGGLE_S - 5, logs[0].read_text()[-3000:]
    assert requests.get(url + "/health").json()["processes"] == 2
    assert _answers(url, parallel=True) == want
    _same_rich(_rich(url), rich)
    plans = requests.get(url + "/health").json()["plans"]
    assert plans["sent"] > 20 and plans["bytes"] > 1000 * plans["sent"] / 10, plans
    assert 0 < plans["send_ms_mean"] < 50, plans  # encoding + sending, not the step
    assert json.loads(rich[3][0][0])["a"] in range(100)  # the schema held
    variants = requests.get(url + "/v1/variants").json()
    assert sum(v["loads"] for v in variants["data"]) >= 6  # 6 variants through 2 slots

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


def test_a_peer_that_never_arrives_is_one_line_and_exit_1(family, tmp_path):
  root, cfg = family
  procs, logs = _start_pair(root, cfg, _free_port(), processes=(0,),
                            extra=("--start-timeout", "4"))
  try:
    assert procs[0].wait(60) == 1
  finally:
    if procs[0].poll() is None:
      procs[0].kill()
  out = logs[0].read_text()
  err = [ln for ln in out.splitlines() if ln.startswith("error:")]
  assert len(err) == 1 and "start-up did not finish within 4 s (--start-timeout)" in err[0], out
  assert "joining the 2 processes" in err[0], out
  assert "Traceback" not in out and "Check failure" not in out, out


def test_single_process_mesh_serves_like_one_device(family, reference):
  """``mesh`` in one process: the paged engine, base restored into its shardings, variants
  loaded from in-memory deltas (this process has one device: a 1x1 mesh)."""
  reference, _ = reference  # (the richer requests run on the 2-process mesh above)
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
