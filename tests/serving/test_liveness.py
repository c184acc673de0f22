"""Issue 24: no request can hang or hold its variant slot without progress.

A real server on loopback (the synthetic family: a tiny Llama base and 4 variants over 2
device slots, pages of 16 tokens, prefix caching on):

* n > 1 whose leader has one prompt token left to compute (a 1-token prompt; a prompt whose
  full pages are prefix-cache hits) answers, streamed and not, every choice equal to the same
  request made alone;
* a sequence the scheduler never moves (a scheduler fault injected here) is failed after
  ``stall_timeout_s`` with a 500 naming the stall, ``/health`` says ``degraded`` meanwhile, and
  its slot is free again for other variants;
* ``DELETE`` returns within its grace period even while a request of the variant generates;
* a client that disconnects releases a queued group of n choices;
* a bounded load mixing n > 1, prefix-cache hits and more variants than slots completes every
  request with its lone output.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from serving.testing import synthetic_family, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

VARIANTS = ("v0", "v1", "v2", "v3")
HEADER = [7 + (i * 37) % 250 for i in range(33)]  # token ids; prompts share its pages


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve):
  base, deltas = synthetic_family(tmp_path_factory.mktemp("liveness"), n=len(VARIANTS))
  with serve(base, deltas, device_slots=2, max_batch=8, max_seq_len=96, default_max_tokens=6,
             warmup=False, stall_timeout_s=1.5, delete_grace_s=0.5) as h:
    yield h


def post(h, body, path="/v1/completions", **kw):
  return requests.post(h.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def choices_of(r) -> list[tuple[str, str]]:
  assert r.status_code == 200, r.text
  return [(c["text"], c["finish_reason"]) for c in r.json()["choices"]]


def streamed_choices(h, body) -> list[tuple[str, str]]:
  r = post(h, {**body, "stream": True}, stream=True)
  assert r.status_code == 200, r.text
  texts: dict[int, list[str]] = {}
  finish: dict[int, str] = {}
  for line in r.iter_lines():
    if not line or line == b"data: [DONE]":
      continue
    chunk = json.loads(line[len(b"data: "):])
    assert "error" not in chunk, chunk
    for c in chunk["choices"]:
      texts.setdefault(c["index"], []).append(c["text"])
      if c["finish_reason"]:
        finish[c["index"]] = c["finish_reason"]
  return [("".join(texts[i]), finish[i]) for i in sorted(texts)]


def slots_in_use(h) -> list[int]:
  return [s["in_use"] for s in requests.get(h.url + "/v1/variants", timeout=10).json()[
    "device_slots"]["slots"]]



# prompt lengths 1, page_size - 1, page_size + 1, 2 page_size + 1 (HEADER's pages are cached
# after the first request), n = 2..16
CASES = [(1, 2), (1, 16), (15, 3), (17, 2), (17, 16), (33, 4)]


@pytest.mark.parametrize("length,n", CASES)
def test_n_choices_answer_whatever_is_cached(server, length, n):
  body = {"model": "v1", "prompt": HEADER[:length], "n": n, "max_tokens": 4,
          "temperature": 1.0, "seed": 5, "ignore_eos": True}
  alone = [choices_of(post(server, {**body, "n": 1, "seed": 5}))[0]]
  first = choices_of(post(server, body))  # uncached (or cached by an earlier case)
  again = choices_of(post(server, body))  # the prompt's full pages now come from the cache
  streamed = streamed_choices(server, body)
  assert len(first) == n and first == again == streamed
  assert first[0] == alone[0]  # choice 0 is the single answer
  assert all(f == "length" for _, f in first)
  wait_for(lambda: slots_in_use(server) == [0, 0], "every slot released")


def test_a_sequence_without_progress_is_failed_and_frees_its_slot(server):
  srv = server.server
  engine = srv.engine

  def freeze(gen):  # a scheduler fault: v2's sequences are never planned
    plan = gen.scheduler._plan

    def without_v2():
      decode, prefill, errors = plan()
      keep = lambda work: [(s, n) for s, n in work if s.model != "v2"]  # noqa: E731
      return keep(decode), keep(prefill), errors

    gen.scheduler._plan = without_v2
    return plan

  original = engine.call(freeze).result(10)
  health: list[dict] = []
  try:
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", post(server, {
      "model": "v2", "prompt": HEADER[:5], "n": 3, "max_tokens": 4})))
    t0 = time.time()
    t.start()
    wait_for(lambda: engine.stuck > 0, "the watchdog sees the stuck sequence", 10)
    health.append(requests.get(server.url + "/health", timeout=10).json())
    t.join(30)
    took = time.time() - t0
    r = done["r"]
    assert r.status_code == 500 and r.json()["error"]["code"] == "stalled", r.text
    assert "no progress" in r.json()["error"]["message"]
    assert 1.5 <= took < 10, took
  finally:
    engine.call(lambda gen: setattr(gen.scheduler, "_plan", original)).result(10)
  assert health[0]["status"] == "degraded"
  assert health[0]["stalled"]["sequences_without_progress"] == 3, health
  # the handler releases its variant after the 500 reached the client (as on line ~208)
  wait_for(lambda: srv.registry.get("v2").in_flight == 0, "the stalled request released v2", 10)
  wait_for(lambda: slots_in_use(server) == [0, 0], "the stuck variant's slot is released")
  assert engine.gen.pool.used == 0  # and its pages
  # both slots serve other variants again
  for m in ("v0", "v3", "v2"):
    assert choices_of(post(server, {"model": m, "prompt": "hi", "max_tokens": 2}))
  later = requests.get(server.url + "/health", timeout=10).json()
  assert later["stalled"]["failed_recently"] == 3  # an operator polling later still sees it
  wait_for(lambda: requests.get(server.url + "/health", timeout=10).json()["status"] == "ok",
           "healthy again after one stall timeout", 10)
  metrics = requests.get(server.url + "/metrics", timeout=10).text
  assert "bitdelta_stalled_sequences_total 3.0" in metrics


def test_delete_returns_within_its_grace_and_ends_the_variants_requests(server):
  srv = server.server
  path = srv.registry.get("v3").path
  r = requests.post(server.url + "/v1/variants", json={"name": "doomed", "path": str(path)},
                    timeout=30)
  assert r.status_code == 201, r.text
  got = {}
  stream = post(server, {"model": "doomed", "prompt": "hi", "max_tokens": 80,
                         "ignore_eos": True, "stream": True}, stream=True)
  lines = stream.iter_lines()
  next(lines)  # generating
  doomed = srv.registry.get("doomed")
  hold = threading.Event()  # released once the grace ran out: it cannot finish within it

  def release():
    try:
      wait_for(lambda: doomed.ended_by is not None, "the DELETE ended its requests")
    finally:
      hold.set()

  slow = srv.engine.call(lambda gen: hold.wait(60))
  threading.Thread(target=release, daemon=True).start()
  t = threading.Thread(target=lambda: got.setdefault("r", post(server, {
    "model": "doomed", "prompt": "x", "n": 2, "max_tokens": 80, "ignore_eos": True})))
  t.start()
  wait_for(lambda: srv.registry.get("doomed").in_flight == 2, "both requests in flight")
  t0 = time.time()
  d = requests.delete(server.url + "/v1/variants/doomed", timeout=30)
  assert time.time() - t0 < 0.5 + 10 + 1
  assert d.status_code == 200 and d.json()["deleted"], d.text
  slow.result(10)
  t.join(30)
  assert got["r"].status_code == 410 and got["r"].json()["error"]["code"] == "variant_deleted"
  tail = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
  assert tail and tail[-1]["error"]["code"] == "variant_deleted", tail[-3:]
  wait_for(lambda: "doomed" not in {v["id"] for v in requests.get(
    server.url + "/v1/variants", timeout=10).json()["data"]}, "doomed is gone")
  wait_for(lambda: slots_in_use(server) == [0, 0], "its slot is released")


def test_a_disconnect_releases_a_queued_group(server):
  srv = server.server
  # the device thread is held until the client has gone: the request waits (for its variant's
  # load, then in the inbox) and cannot finish first
  release = threading.Event()
  hold = srv.engine.call(lambda gen: release.wait(60))
  body = json.dumps({"model": "v0", "prompt": HEADER[:17], "n": 4, "max_tokens": 60,
                     "ignore_eos": True}).encode()
  sock = socket.create_connection((server.cfg.host, server.port))
  try:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: srv.registry.get("v0").in_flight == 1, "the request is in flight")
    sock.close()
  finally:
    release.set()
  hold.result(10)
  wait_for(lambda: srv.registry.get("v0").in_flight == 0, "the disconnect released it", 10)
  wait_for(lambda: srv.engine.active_rows == 0 and not srv.engine.gen.has_work, "no rows left")


def test_mixed_load_completes_every_request_with_its_lone_output(server):
  """More variants than slots, n > 1, prefix-cache hits, streaming and not, all at once."""
  bodies = []
  for i in range(36):
    model = ("base", *VARIANTS)[i % 5]
    length = (1, 15, 17, 33, 20, 3)[i % 6]
    prompt = HEADER[:length] if i % 2 else HEADER[:length][::-1]
    n = (1, 2, 4, 1, 3)[i % 5]
    sampled = i % 3 == 0
    bodies.append(({"model": model, "prompt": prompt, "n": n, "max_tokens": 5,
                    "temperature": 1.0 if sampled else 0.0, "seed": i, "ignore_eos": True},
                   i % 4 == 0))

  def run(case):
    body, stream = case
    return streamed_choices(server, body) if stream else choices_of(post(server, body))

  alone = [run(c) for c in bodies]
  with ThreadPoolExecutor(12) as pool:
    together = list(pool.map(run, bodies, timeout=300))
  assert together == alone
  wait_for(lambda: slots_in_use(server) == [0, 0], "every slot released")
  health = lambda: requests.get(server.url + "/health", timeout=10).json()  # noqa: E731
  # the engine's gauges are set once per loop, after a client may have read its last token
  wait_for(lambda: health()["active_rows"] == 0, "no active rows", 10)
  h = health()
  assert h["active_rows"] == 0 and h["queue_depth"] == 0, h
