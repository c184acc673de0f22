"""Serving that tells the truth and gives no 5xx for a client's doing (issue 14, items 2, 6-8).

Start-up checks of configured variants (exit 2, or ``skip_bad_variants`` → left out and
``/health`` degraded), the port check before the model loads, refusal of
OpenAI parameters the server does not implement, checked numeric ranges, lone surrogates,
``/metrics`` (4xx by code, no ``_created``), a request accepted before ``DELETE`` that still
needs a slot, and a non-streaming client that disconnects.

One server for the module: a tiny base, 2 good variants and 4 bad ones (skipped), ONE device
slot (so loads contend), no API key.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time

import aiohttp
import pytest
import requests

from serving.app import BadVariantsError, ServerThread
from serving.config import ConfigError, ServerConfig
from serving.testing import corrupt_arrays, synthetic_family, wait_for

BAD = ("gone", "otherbase", "corrupt", "badmanifest")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  root = tmp_path_factory.mktemp("hardening")
  base, deltas = synthetic_family(root, n=2)
  extra = synthetic_family(root, n=1, prefix="x")[1]["x0"]  # a cold variant, same base
  other = synthetic_family(root / "other", n=1, seed=7)[1]["v0"]  # made for another base
  corrupt = corrupt_arrays(shutil.copytree(deltas["v0"], root / "deltas" / "corrupt"))
  badm = shutil.copytree(deltas["v0"], root / "deltas" / "badmanifest")
  (badm / "manifest.json").write_text('{"format": ')
  bad = {"gone": root / "deltas" / "missing", "otherbase": other, "corrupt": corrupt,
         "badmanifest": badm}
  return base, deltas, extra, bad


def config(family, **kw) -> ServerConfig:
  base, deltas, _, bad = family
  d = dict(base=str(base), base_name="base", port=0,
           variants=tuple((n, str(p)) for n, p in {**deltas, **bad}.items()),
           device_slots=1, max_batch=4, max_seq_len=256, default_max_tokens=8,
           load_retry_s=0.5, warmup=False)  # compile lazily: only the shapes the tests use
  d.update(kw)
  return ServerConfig(**d)


SLOW_S = 2.0  # the test server's header and body timeouts


@pytest.fixture(scope="module")
def server(family):
  with ServerThread(config(family, skip_bad_variants=True, header_timeout_s=SLOW_S,
                          body_timeout_s=SLOW_S)) as h:
    yield h


def post(h, path, body, **kw):
  return requests.post(h.url + path, json=body, timeout=60, **kw)


def get(h, path):
  return requests.get(h.url + path, timeout=60)


def is_error(r, status, param=None, code=None):
  assert r.status_code == status, (r.status_code, r.text)
  err = r.json()["error"]
  if param is not None:
    assert err["param"] == param and param in err["message"], err
  if code is not None:
    assert err["code"] == code, err
  assert "Retry-After" not in r.headers
  return err


def metric(text: str, name: str, **labels) -> float | None:
  from prometheus_client.parser import text_string_to_metric_families

  for fam in text_string_to_metric_families(text):
    for smp in fam.samples:
      if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
        return smp.value
  return None


# -- item 2: start-up checks, port, progress ------------------------------------------------------
def test_bad_variants_stop_the_start_naming_each_variant_and_reason(family):
  t0 = time.perf_counter()
  with pytest.raises(BadVariantsError) as ei:
    ServerThread(config(family)).start()
  msg = str(ei.value)
  assert set(ei.value.bad) == set(BAD), ei.value.bad
  reasons = {"gone": "no such delta directory", "otherbase": "made for a different base",
             "corrupt": "checksum", "badmanifest": "corrupt manifest"}
  for name, why in reasons.items():
    assert f"variant {name!r}" in msg and why in ei.value.bad[name], (name, ei.value.bad[name])
  assert "--skip-bad-variants" in msg
  assert "'v0'" not in msg and "'v1'" not in msg
  assert time.perf_counter() - t0 < 60  # failed before the model was built and compiled


def test_serve_cli_exits_2_on_a_bad_variant(family, capsys):
  from bitdelta_jax.cli import main

  base, deltas, _, bad = family
  code = main(["serve", "--base", str(base), "--port", "0", "--variant", f"v0={deltas['v0']}",
               "--variant", f"gone={bad['gone']}"])
  err = capsys.readouterr().err
  assert code == 2, err
  assert "gone" in err and "no such delta directory" in err and "--skip-bad-variants" in err


def test_serve_flags_for_the_checks():
  import argparse

  from serving.cli import add_serve_parsers, config_from_args

  sub = argparse.ArgumentParser().add_subparsers()
  p = add_serve_parsers(sub)
  args = p.parse_args(["--base", "b", "--skip-bad-variants", "--no-verify-variants", "--quiet"])
  cfg = config_from_args(args)
  assert cfg.skip_bad_variants and not cfg.verify_variants and args.quiet
  cfg = config_from_args(p.parse_args(["--base", "b"]))
  assert not cfg.skip_bad_variants and cfg.verify_variants


@pytest.mark.slow
def test_skipped_variants_are_not_served_and_health_is_degraded(server):
  ids = {m["id"] for m in get(server, "/v1/models").json()["data"]}
  assert ids == {"base", "v0", "v1"}
  r = get(server, "/health")
  assert r.status_code == 200
  j = r.json()
  assert j["status"] == "degraded" and set(j["skipped_variants"]) == set(BAD)
  assert "checksum" in j["skipped_variants"]["corrupt"]
  is_error(post(server, "/v1/completions", {"model": "corrupt", "prompt": "x"}), 404,
           "model", "model_not_found")
  assert post(server, "/v1/completions", {"model": "v0", "prompt": "hi", "temperature": 0,
                                          "max_tokens": 2}).status_code == 200


def test_banner_lists_served_and_skipped_variants_with_temperature_0(family):
  from serving.cli import banner

  cfg = config(family)
  text = banner(cfg, "http://127.0.0.1:1", served=["v0", "v1"],
                skipped={"corrupt": "checksum mismatch"})
  assert "variants: v0, v1" in text and "skipped:  corrupt (" in text
  assert '"model": "v0"' in text and '"temperature": 0' in text


def test_port_in_use_fails_before_the_model_loads(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    cfg = ServerConfig(base=str(tmp_path / "no-such-base"), port=port)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"port: cannot listen on 127\.0\.0\.1:{port}"):
      ServerThread(cfg).start()
    assert time.perf_counter() - t0 < 10


# -- item 6: an honest API ------------------------------------------------------------------------
UNSUPPORTED = {
  "functions": [{"name": "f"}], "function_call": {"name": "f"}, "best_of": 3, "suffix": "end", "min_p": 0.1, "use_beam_search": True,
  "guided_json": {"type": "object"}, "modalities": ["text", "audio"],
}
# implemented since issue 13 (tests/serving/test_openai_api.py checks what they do)
IMPLEMENTED = {
  "response_format": {"type": "json_object"}, "presence_penalty": 0.5,
  "frequency_penalty": -1, "logit_bias": {"5": 10}, "logprobs": True, "top_logprobs": 2,
  "n": 2, "echo": True, "repetition_penalty": 1.2, "min_tokens": 1, "stop_token_ids": [3],
}


@pytest.mark.slow
@pytest.mark.parametrize("field,value", list(IMPLEMENTED.items()))
@pytest.mark.parametrize("chat", [False, True])
def test_implemented_parameters_are_accepted(server, field, value, chat):
  if field == "echo" and chat:
    pytest.skip("echo is a completions parameter (a chat echo is refused, below)")
  body = {"model": "v0", field: value, "max_tokens": 2}
  if field == "top_logprobs":
    body["logprobs"] = True
  if not chat and field in ("logprobs", "top_logprobs"):
    body["logprobs"] = 2
    body.pop("top_logprobs", None)
  body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
  r = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
  assert r.status_code == 200, (field, r.text)
  assert len(r.json()["choices"]) == (2 if field == "n" else 1)


def test_tools_without_a_forced_tool_choice_are_refused(server):
  """tool_choice "auto" (the default) would need a per-model tool-call parser: a 400 naming
  tool_choice; tools on /v1/completions: a 400 naming tools."""
  tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
  for choice in (None, "auto"):
    body = {"model": "v0", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": choice}
    err = is_error(post(server, "/v1/chat/completions", body), 400, param="tool_choice")
    assert err["code"] == "unsupported_parameter" and "required" in err["message"]
  err = is_error(post(server, "/v1/completions", {"model": "v0", "prompt": "hi", "tools": tools}),
                 400, param="tools")
  assert err["code"] == "unsupported_parameter"
  is_error(post(server, "/v1/chat/completions", {
    "model": "v0", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    400, param="tool_choice")


def test_chat_echo_is_refused(server):
  body = {"model": "v0", "messages": [{"role": "user", "content": "hi"}], "echo": True}
  err = is_error(post(server, "/v1/chat/completions", body), 400, param="echo")
  assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("field,value", list(UNSUPPORTED.items()))
@pytest.mark.parametrize("chat", [False, True])
def test_unimplemented_parameters_are_refused(server, field, value, chat):
  body = {"model": "v0", field: value, "max_tokens": 2}
  body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
  err = is_error(post(server, "/v1/chat/completions" if chat else "/v1/completions", body), 400,
                 field)
  assert err["code"] == "unsupported_parameter"


@pytest.mark.slow
def test_neutral_values_and_unknown_extras_are_accepted(server):
  body = {"model": "v0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
          "temperature": 0, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
          "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False,
          "n": 1, "user": "me", "metadata": {"a": "b"}, "store": False, "some_extension": 1,
          "repetition_penalty": 1.0, "min_p": 0, "top_k": -1}
  r = post(server, "/v1/chat/completions", body)
  assert r.status_code == 200, r.text


# -- item 8: numeric ranges and unicode ---------------------------------------------------------
@pytest.mark.parametrize("field,value", [
  ("top_k", 2**31), ("top_k", 2**63), ("top_k", -2), ("max_tokens", 2**31), ("seed", 2**64),
  ("seed", -(2**64)), ("n", 2**40), ("temperature", 1e308), ("top_p", -0.0),
  ("presence_penalty", 5), ("frequency_penalty", "x"), ("best_of", 0),
  ("max_completion_tokens", 2**33),
])
def test_numeric_parameters_have_checked_ranges(server, field, value):
  chat = field == "max_completion_tokens"
  body = {"model": "v0", field: value}
  body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
  is_error(post(server, "/v1/chat/completions" if chat else "/v1/completions", body), 400, field)


def test_large_in_range_values_work(server):
  for extra in ({"top_k": 2**31 - 1}, {"top_k": 264}, {"seed": 2**63 - 1}, {"seed": -5}):
    r = post(server, "/v1/completions", {"model": "v0", "prompt": "hi", "temperature": 0.5,
                                         "ignore_eos": True, **extra})
    assert r.status_code == 200, (extra, r.text)
  prompt = r.json()["usage"]["prompt_tokens"]
  # in range, but past the context: a 400 naming the context and both numbers (not cut to fit)
  body = {"model": "v0", "prompt": "hi", "temperature": 0.5, "ignore_eos": True}
  err = is_error(post(server, "/v1/completions", {**body, "max_tokens": 2**31 - 1}), 400,
                 "max_tokens", "context_length_exceeded")
  assert (f"maximum context length is 256 tokens. However, you requested {prompt + 2**31 - 1} "
          f"tokens ({prompt} in the prompt, {2**31 - 1} in the completion)") in err["message"]
  r = post(server, "/v1/completions", {**body, "max_tokens": 256 - prompt})  # all the room
  assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 256, r.text


def raw_post(h, path, text: str):
  return requests.post(h.url + path, data=text.encode(), timeout=60,
                       headers={"Content-Type": "application/json"})


def test_lone_surrogates_are_400_naming_the_field(server):
  cases = [
    ("/v1/completions", '{"model": "v0", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "v0", "prompt": ["\\udfff"]}', "prompt"),
    ("/v1/completions", '{"model": "v0", "prompt": "hi", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", '{"model": "v\\ud800", "prompt": "hi"}', "model"),
    ("/v1/chat/completions",
     '{"model": "v0", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages[0].content"),
    ("/v1/variants", '{"name": "s", "path": "/tmp/\\ud800"}', "path"),
  ]
  for path, text, field in cases:
    is_error(raw_post(server, path, text), 400, field)
  assert get(server, "/health").json()["status"] == "degraded"  # (skipped variants), not down


# -- item 7: metrics ----------------------------------------------------------------------------
def test_metrics_count_errors_by_status_and_have_no_created_series(server):
  post(server, "/v1/completions", {"model": "v0", "prompt": "x", "top_k": "a"})
  post(server, "/v1/completions", {"model": "nope", "prompt": "x"})
  requests.get(server.url + "/v1/nowhere", timeout=10)
  text = get(server, "/metrics").text
  assert "_created" not in text
  n = "bitdelta_http_responses_total"
  assert metric(text, n, route="/v1/completions", status="400") >= 1
  assert metric(text, n, route="/v1/completions", status="404") >= 1
  assert metric(text, n, route="unmatched", status="404") >= 1
  before = metric(text, n, route="/v1/completions", status="400")
  post(server, "/v1/completions", {"model": "v0", "prompt": "x", "n": 30})
  after = metric(get(server, "/metrics").text, n, route="/v1/completions", status="400")
  assert after == before + 1


# -- item 8: DELETE while a request still needs a slot; client disconnects ----------------------
def test_request_accepted_before_delete_completes_even_when_it_waits_for_a_slot(server, family):
  _, _, extra, _ = family
  srv, engine = server.server, server.server.engine
  assert post(server, "/v1/completions", {"model": "v0", "prompt": "hi",
                                          "max_tokens": 1}).status_code == 200  # v0 resident
  r = post(server, "/v1/variants", {"name": "doomed", "path": str(extra.resolve())})
  assert r.status_code == 201, r.text
  results: dict = {}

  def run(key, fn):
    t = threading.Thread(target=lambda: results.__setitem__(key, fn()))
    t.start()
    return t

  # v0 holds the only slot: a long stream, its first token read
  stream = requests.post(server.url + "/v1/completions", stream=True, timeout=60, json={
    "model": "v0", "prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True})
  lines = stream.iter_lines()
  next(lines)
  engine.call(lambda gen: time.sleep(1.0))  # keep it in flight while the others queue up
  body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
  threads = [run("v1", lambda: post(server, "/v1/completions", {"model": "v1", **body}))]
  wait_for(lambda: len(srv.cache._slot_waiters) == 1, "v1 waits for the slot")
  threads.append(run("doomed", lambda: post(server, "/v1/completions",
                                             {"model": "doomed", **body})))
  wait_for(lambda: len(srv.cache._slot_waiters) == 2, "doomed waits for the slot")
  threads.append(run("delete", lambda: requests.delete(server.url + "/v1/variants/doomed",
                                                       timeout=60)))
  wait_for(lambda: srv.registry.get("doomed") is None, "doomed is being deleted")
  is_error(post(server, "/v1/completions", {"model": "doomed", "prompt": "x"}), 404, "model")
  for _ in lines:  # the stream ends, its slot frees: v1 loads first, then doomed
    pass
  for t in threads:
    t.join(60)
  assert results["v1"].status_code == 200, results["v1"].text
  assert results["doomed"].status_code == 200, results["doomed"].text
  assert results["doomed"].json()["model"] == "doomed"
  assert results["delete"].status_code == 200 and results["delete"].json()["deleted"]
  assert "doomed" not in {m["id"] for m in get(server, "/v1/models").json()["data"]}


def test_non_streaming_client_disconnect_stops_decoding(server):
  srv, engine = server.server, server.server.engine
  m = "bitdelta_generated_tokens_total"
  before = metric(get(server, "/metrics").text, m, model="v1") or 0.0

  hold = threading.Event()

  async def main():
    async with aiohttp.ClientSession() as s:
      req = asyncio.ensure_future(s.post(server.url + "/v1/completions", json={
        "model": "v1", "prompt": "hi", "max_tokens": 240, "ignore_eos": True}))
      t0 = time.time()
      while engine.active_rows == 0:
        assert time.time() - t0 < 30 and not req.done()
        await asyncio.sleep(0.005)
      engine.call(lambda gen: hold.wait(60))  # decoding pauses until the handler has noticed
      req.cancel()  # the client hangs up
    await asyncio.sleep(0)

  try:
    asyncio.run(main())
    live = srv.registry.get("v1").live
    t0 = time.time()
    while not (live and all(r.cancelled for r in live)):
      assert time.time() - t0 < 30, "the handler did not notice the disconnect"
      time.sleep(0.02)
  finally:
    hold.set()
  t0 = time.time()
  while srv.registry.get("v1").in_flight:
    assert time.time() - t0 < 30, "the request was not cancelled"
    time.sleep(0.02)
  text = get(server, "/metrics").text
  assert (metric(text, m, model="v1") or 0.0) - before < 240
  assert metric(text, "bitdelta_requests_total", model="v1", endpoint="completions",
                status="499") == 1
  assert engine.active_rows == 0


# -- issue 50 item 4: slow and oversized clients --------------------------------------------------
def _closed_after(sock: socket.socket, limit_s: float) -> float | None:
  """Seconds until the server closed ``sock`` (reads to EOF), None if open after ``limit_s``."""
  t0 = time.perf_counter()
  sock.settimeout(0.2)
  while time.perf_counter() - t0 < limit_s:
    try:
      if sock.recv(65536) == b"":
        return time.perf_counter() - t0
    except TimeoutError:
      continue
    except ConnectionResetError:
      return time.perf_counter() - t0
  return None


def _raw(h, head: bytes) -> socket.socket:
  s = socket.create_connection(("127.0.0.1", h.port), timeout=10)
  s.sendall(head)
  return s


def test_slow_header_clients_are_closed_within_the_timeout(server):
  import os

  fds = len(os.listdir("/proc/self/fd"))
  socks = [_raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(40)]
  t0 = time.perf_counter()
  for i in range(6):  # trickle one more header line on each, past the timeout
    time.sleep(0.5)
    for s in socks:
      try:
        s.sendall(b"X-Slow-%d: 1\r\n" % i)
      except OSError:
        pass  # already closed
  closed = [_closed_after(s, 3 * SLOW_S) for s in socks]
  assert None not in closed, closed
  assert time.perf_counter() - t0 < 3 * SLOW_S + 1
  for s in socks:
    s.close()
  wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds + 2, "the connections' fds are freed")
  assert get(server, "/health").json()["status"] in ("ok", "degraded")


def test_an_oversized_declared_body_is_a_413_before_reading(server):
  s = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                   b"\r\nContent-Length: 5000000000\r\n\r\n{")
  t0 = time.perf_counter()
  s.settimeout(SLOW_S / 2)  # well before the body timeout
  head = s.recv(65536)
  assert head.startswith(b"HTTP/1.1 413"), head[:200]
  assert time.perf_counter() - t0 < SLOW_S / 2
  body = json.loads(head.split(b"\r\n\r\n", 1)[1])
  assert body["error"]["code"] == "request_too_large" and "5000000000" in body["error"]["message"]
  s.close()


def test_a_slow_body_is_a_408(server):
  s = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                   b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
  t0 = time.perf_counter()
  s.settimeout(3 * SLOW_S)
  head = s.recv(65536)
  assert head.startswith(b"HTTP/1.1 408"), head[:200]
  assert SLOW_S * 0.9 < time.perf_counter() - t0 < 3 * SLOW_S
  assert b"request_timeout" in head
  s.close()


def test_malformed_requests_log_one_warning_line_not_tracebacks(server, caplog):
  from serving import malformed_log

  f = malformed_log.install()
  before = f.total
  bad = [b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
         b"GET /health HTTP/1.1\r\n" + b"".join(b"X%d: 1\r\n" % i for i in range(20000))
         + b"\r\n"]
  with caplog.at_level("INFO"):
    for head in bad * 3:
      s = _raw(server, head)
      s.settimeout(10)
      assert s.recv(200).startswith(b"HTTP/1.0 400"), head[:40]
      s.close()
    wait_for(lambda: f.total == before + len(bad) * 3, "every malformed request was seen")
  assert not [r for r in caplog.records if r.name.startswith("aiohttp") and r.exc_info]
  lines = [r for r in caplog.records if r.name == "serving.http"]
  assert len(lines) <= 1 and all("\n" not in r.getMessage() for r in lines), lines


def test_the_malformed_request_log_is_rate_limited():
  import logging

  from aiohttp.http_exceptions import LineTooLong

  from serving.malformed_log import MalformedRequestFilter

  now = [0.0]
  f = MalformedRequestFilter(interval_s=10, clock=lambda: now[0])
  out = []
  handler = logging.Handler()
  handler.emit = out.append
  logging.getLogger("serving.http").addHandler(handler)
  try:
    def record():
      try:
        raise LineTooLong("x" * 50, "8190")
      except LineTooLong as e:
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                                 "Error handling request from %s", ("10.0.0.7",),
                                 (type(e), e, e.__traceback__))

    assert [f.filter(record()) for _ in range(4)] == [False] * 4
    now[0] = 11
    assert f.filter(record()) is False
    plain = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "other", (), None)
    assert f.filter(plain) is True  # anything else passes
  finally:
    logging.getLogger("serving.http").removeHandler(handler)
  msgs = [r.getMessage() for r in out]
  assert len(msgs) == 2 and all(r.levelname == "WARNING" for r in out), msgs
  assert "from 10.0.0.7" in msgs[0] and "400" in msgs[0] and "since the last line" not in msgs[0]
  assert "(+3 more since the last line)" in msgs[1]
  assert f.total == 5


def test_server_still_healthy(server):
  j = get(server, "/health").json()
  assert j["status"] == "degraded" and j["active_rows"] == 0
  r = post(server, "/v1/completions", {"model": "v1", "prompt": "hi", "max_tokens": 2})
  assert r.status_code == 200
  assert json.loads(r.text)["choices"][0]["finish_reason"] in ("length", "stop")
