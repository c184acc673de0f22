"""Bounded admission (issue 50 item 5): past ``max_batch + max_queued_requests`` sequences a
generation request is a 429 with Retry-After, counted in /metrics; admitted requests finish.
The server has test_liveness's shape (2 slots, max_batch 8, 96-token context), so its step
programs come from the run's step cache."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from serving.testing import synthetic_family, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.server]

TOKENS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve):
  base, deltas = synthetic_family(tmp_path_factory.mktemp("admission"), n=2)
  with serve(base, deltas, device_slots=2, max_batch=8, max_seq_len=96, default_max_tokens=6,
             max_queued_requests=0) as h:
    yield h


def _complete(url, i, n=1):
  return requests.post(url + "/v1/completions", json={
    "model": ["base", "v0", "v1"][i % 3], "prompt": f"request {i} says", "max_tokens": TOKENS,
    "temperature": 0, "ignore_eos": True, "n": n}, timeout=300)


def test_a_burst_past_the_limit_gets_429_while_admitted_requests_finish(server):
  health = requests.get(server.url + "/health", timeout=30).json()
  assert health["admission_limit"] == 8 and health["admitted_sequences"] == 0
  with ThreadPoolExecutor(32) as pool:
    rs = list(pool.map(lambda i: _complete(server.url, i), range(32)))
  ok = [r for r in rs if r.status_code == 200]
  refused = [r for r in rs if r.status_code == 429]
  assert len(ok) + len(refused) == len(rs), [r.status_code for r in rs]
  assert ok and refused
  for r in ok:  # admitted requests complete in full
    assert r.json()["usage"]["completion_tokens"] == TOKENS
  for r in refused:
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
  metrics = requests.get(server.url + "/metrics", timeout=30).text
  line = next(x for x in metrics.splitlines()
              if x.startswith('bitdelta_requests_rejected_total{reason="queue_full"}'))
  assert float(line.split()[-1]) >= len(refused)
  wait_for(lambda: requests.get(server.url + "/health", timeout=30).json()[
    "admitted_sequences"] == 0, "admitted sequences back to 0")


def test_a_request_alone_is_admitted_even_past_the_limit(server):
  wait_for(lambda: requests.get(server.url + "/health", timeout=30).json()[
    "admitted_sequences"] == 0, "an idle server")
  r = _complete(server.url, 0, n=12)  # 12 sequences > 8: alone on the server, so admitted
  assert r.status_code == 200, r.text
  assert len(r.json()["choices"]) == 12
