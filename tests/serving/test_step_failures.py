"""Issue 35: the engine survives a failed step.

A step that raises (injected here into the runner: the call consumes the KV pools donated to it,
as a failing XLA call does, then raises) ends the requests of that step with an error event;
the engine then rebuilds its pools, forgets its cached prefixes, re-queues the running
sequences that were not in the step, and serves the next request. `/health` says "degraded"
until a step succeeds, `bitdelta_step_failures_total` counts them, and after
``max_step_failures`` failures in a row the engine gives up (every request ends, `/health`
says "unavailable" and the server's ``engine_failed`` event is set: the CLI exits non-zero).

Before issue 35 the engine went on after a failed step with the pools gone: every later
request on every model failed ("Array has been deleted"), while `/health` said "ok".
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import requests
from model_fixtures import hf_greedy

from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.models import from_pretrained
from serving.testing import synthetic_family


class InjectedFailure(RuntimeError):
  pass


def failing(runner, times: int):
  """Makes ``runner.run`` fail its next ``times`` calls (-1: every call) the way a failing
  XLA call does: the donated KV pools are consumed, then it raises. Returns an undo."""
  real = runner.run
  left = [times]

  def run(batch, base_only):
    if left[0] != 0:
      left[0] -= 1
      runner.k_pool.delete()
      raise InjectedFailure("injected step failure")
    return real(batch, base_only)

  runner.run = run
  return lambda: setattr(runner, "run", real)


# -- the scheduler's side: which sequences fail, which are recomputed --------------------------
@pytest.fixture(scope="module")
def llama(hf_models):  # noqa: F811
  return hf_models("llama")


@pytest.mark.slow
def test_recover_fails_the_steps_sequences_and_recomputes_the_others(llama):
  hf, path = llama
  gen = Generator(from_pretrained(path, jnp.float32), max_rows=4, max_seq_len=64,
                       page_size=4, prefill_chunk=8)
  p = SamplingParams(max_new_tokens=6)
  long = [1] + list(range(20, 41))  # 22 tokens: its prefill takes 3 steps of 8
  short = [1, 7, 9]
  a = gen.add(long, 0, p, tag="a")
  gen.step()  # a's first chunk: pages written
  b = gen.add(short, 0, p, tag="b")
  c = gen.add([1, *range(50, 79)], 0, p, tag="c")  # 30 tokens
  # the prefill budget of 8 (`Scheduler._prefill_shares`): a (oldest) 2, then the fewest tokens
  # left first: b's 3, a 3 more; c, the longest, none
  gen.step()
  assert a.n_cached == 13 and b.n_cached == 3 and c.n_cached == 0 and c in gen.running
  undo = failing(gen.runner, 1)
  with pytest.raises(InjectedFailure):
    gen.step()  # b's first decode token, a's 8 (2, then 6 as it has fewer left than c): no c
  undo()
  failed = gen.recover()
  assert sorted(s.tag for s in failed) == ["a", "b"] and a.finished and b.finished
  # c was running (admitted, not in the failed step): re-queued, recomputed from its tokens
  assert not c.finished and c in gen.waiting and c.pages == [] and c.n_cached == 0
  assert gen.pool.used == 0 and not gen.pool.page_of  # every page free, no cached prefix
  done = {}
  while gen.has_work:
    for s, _ in gen.step().tokens:
      if len(s.generated) == 6:
        done[s.tag] = list(s.generated)
        gen.finish(s)
  assert done == {"c": hf_greedy(hf, c.prompt, 6)}
  again = gen.generate([long, short], params=p)  # the rebuilt pools serve new requests
  assert [g.tokens for g in again] == [hf_greedy(hf, long, 6), hf_greedy(hf, short, 6)]


# -- the server's side ---------------------------------------------------------------------------
def start(serve, root, **kw):
  base, deltas = synthetic_family(root, n=2)
  return serve(base, deltas, device_slots=2, max_batch=4, max_seq_len=96, default_max_tokens=6,
               warmup=False, **kw)


def post(h, model: str, prompt: str = "abc"):
  return requests.post(h.url + "/v1/completions", timeout=120, json={
    "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})


def health(h) -> tuple[int, dict]:
  r = requests.get(h.url + "/health", timeout=10)
  return r.status_code, r.json()


def inject(h, times: int):
  return h.server.engine.call(lambda gen: failing(gen.runner, times)).result(30)


@pytest.mark.slow
def test_a_failed_step_fails_its_request_and_the_next_is_served(tmp_path_factory, serve):
  with start(serve, tmp_path_factory.mktemp("fail-once")) as h:
    want = {m: post(h, m).json()["choices"][0]["text"] for m in ("base", "v0", "v1")}
    inject(h, 1)
    r = post(h, "v0")
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "step_failed" and "injected step failure" in err["message"]
    status, body = health(h)
    assert status == 200 and body["status"] == "degraded", body
    assert body["step_failures"]["in_a_row"] == 1
    assert "InjectedFailure" in body["step_failures"]["last_error"]
    metrics = requests.get(h.url + "/metrics", timeout=10).text
    assert "bitdelta_step_failures_total 1.0" in metrics
    for m in ("base", "v0", "v1"):  # every model, served from rebuilt pools
      r = post(h, m)
      assert r.status_code == 200, r.text
      assert r.json()["choices"][0]["text"] == want[m]
    status, body = health(h)
    assert status == 200 and body["status"] == "ok" and "step_failures" not in body, body


@pytest.mark.slow
def test_repeated_failures_stop_the_engine(tmp_path_factory, serve):
  with start(serve, tmp_path_factory.mktemp("fail-always"), max_step_failures=2) as h:
    assert post(h, "base").status_code == 200
    inject(h, -1)
    first = post(h, "v1")
    assert first.status_code == 500 and first.json()["error"]["code"] == "step_failed"
    assert not h.server.engine_failed.is_set()
    second = post(h, "base")
    assert second.status_code == 503, second.text
    assert second.json()["error"]["code"] == "engine_failed"
    assert "2 engine steps failed in a row" in second.json()["error"]["message"]
    assert h.call(h.server.engine_failed.is_set)
    status, body = health(h)
    assert status == 503 and body["status"] == "unavailable", body
    assert body["step_failures"]["fatal"].startswith("2 engine steps failed")
    r = post(h, "v0")  # nothing is accepted any more
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text


CLI_WORKER = r"""
import sys
from bitdelta_jax.engine.runner import PagedRunner

def run(self, batch, base_only):  # every step after the warm-up fails
  raise RuntimeError("injected step failure")

PagedRunner.run = run
from bitdelta_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_cli_exits_non_zero_when_the_engine_gives_up(tmp_path_factory):
  import os
  import socket
  import subprocess
  import sys
  import time

  base, _ = synthetic_family(tmp_path_factory.mktemp("cli-fail"), n=1)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen([sys.executable, "-c", CLI_WORKER, "serve", "--base", str(base),
                        "--base-name", "base", "--port", str(port), "--max-batch", "2",
                        "--max-seq-len", "64", "--prefill-chunk", "8",
                        "--max-step-failures", "2"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  url = f"http://127.0.0.1:{port}"
  try:
    t0 = time.time()
    while True:
      assert p.poll() is None and time.time() - t0 < 300, "the server did not start"
      try:
        if requests.get(url + "/health", timeout=2).status_code == 200:
          break
      except requests.RequestException:
        time.sleep(0.25)
    codes = []
    for _ in range(2):
      codes.append(requests.post(url + "/v1/completions", timeout=60, json={
        "model": "base", "prompt": "abc", "max_tokens": 2}).status_code)
    assert codes == [500, 503]
    assert p.wait(60) == 3
    err = p.stderr.read()
    assert "2 engine steps failed in a row" in err, err[-2000:]
  finally:
    if p.poll() is None:
      p.kill()
