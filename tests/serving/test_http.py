"""The real server on a loopback port, driven over HTTP (requests, aiohttp, the openai client).

One server for the module: a tiny base, 5 variants, one corrupt delta directory, 3 device
slots (one pinned), a host budget of two deltas, an API key and an admin key.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import aiohttp
import pytest
import requests

from serving.testing import corrupt_arrays, synthetic_family

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

KEY = "test-key"
ADMIN = "admin-key"
H = {"Authorization": f"Bearer {KEY}"}
AH = {"Authorization": f"Bearer {ADMIN}"}  # the admin routes (/v1/variants)
VARIANTS = ["v0", "v1", "v2", "v3", "v4"]
PROMPTS = ["hello", "The quick brown fox", "1 2 3 4"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  root = tmp_path_factory.mktemp("family")
  base, deltas = synthetic_family(root, n=len(VARIANTS))
  extra = synthetic_family(root, n=2, prefix="x", seed=0)[1]  # more cold variants, same base
  broken = shutil.copytree(deltas["v0"], root / "deltas" / "broken")  # corrupted once started
  return base, deltas, extra, broken


@pytest.fixture(scope="module")
def server(family, serve):
  base, deltas, _, broken = family
  with serve(base, {**deltas, "broken": broken}, api_key=KEY, admin_key=ADMIN, device_slots=3, pins=("v3",),
             host_cache_mb=2.5 * 9912 / (1 << 20), max_batch=4, max_seq_len=64,
             default_max_tokens=16, load_retry_s=0.5, max_body_bytes=64 * 1024,
             max_queued_requests=256) as h:  # its bursts queue (admission: test_admission)
    corrupt_arrays(broken)  # passed the start-up checks; its first load finds it corrupt
    yield h


def _key(path):
  return AH if path.startswith("/v1/variants") else H


def post(h, path, body, headers=None, **kw):
  return requests.post(h.url + path, json=body, headers=headers or _key(path), timeout=60, **kw)


def get(h, path, headers=None):
  return requests.get(h.url + path, headers=headers or _key(path), timeout=60)


def complete(h, model, prompt, **kw):
  r = post(h, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0, **kw})
  assert r.status_code == 200, r.text
  return r.json()


def is_error(r, status, code=None, param=None):
  assert r.status_code == status, (r.status_code, r.text)
  err = r.json()["error"]
  assert set(err) >= {"message", "type", "param", "code"} and err["message"]
  if code is not None:
    assert err["code"] == code, err
  if param is not None:
    assert err["param"] == param, err
  return err


def variants_info(h) -> dict:
  return {v["id"]: v for v in get(h, "/v1/variants").json()["data"]}


def sse_events(text: str) -> list:
  out = []
  for block in text.split("\n\n"):
    if block.strip():
      assert block.startswith("data: "), block
      data = block[len("data: "):]
      out.append(data if data == "[DONE]" else json.loads(data))
  return out


# -- basics -------------------------------------------------------------------------------------
def test_health_needs_no_key(server):
  r = requests.get(server.url + "/health", timeout=10)
  assert r.status_code == 200 and r.json()["status"] == "ok"


def test_health_names_the_ready_and_compiling_step_buckets(server):
  """Serving starts once the 1-token and max_batch-token programs are ready; the others
  compile in the background (`Generator.warmup(background=True)`) and /health says which."""
  cfg = server.cfg
  budget = cfg.max_batch + cfg.prefill_chunk
  want, b = [], 1
  while b < budget:
    want, b = want + [b], 2 * b
  want.append(budget)
  deadline = time.monotonic() + 300
  while True:
    h = requests.get(server.url + "/health", timeout=10).json()
    ready, compiling = h["buckets"]["ready"], h["buckets"]["compiling"]
    assert {1, 4} <= set(ready) and sorted(ready + compiling) == want, h  # max_batch 4
    if not compiling or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  assert ready == want and h["compiled_programs"] == len(want), h


@pytest.mark.parametrize("method,path", [
  ("get", "/v1/models"), ("get", "/metrics"), ("get", "/v1/variants"),
  ("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/v1/variants"),
  ("delete", "/v1/variants/v0"),
])
def test_api_key_enforced_everywhere_but_health(server, method, path):
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                  {"Authorization": ADMIN}):  # (no "Bearer ")
    r = getattr(requests, method)(server.url + path, headers=headers, json={}, timeout=10)
    is_error(r, 401, "invalid_api_key")


@pytest.mark.parametrize("method,path", [
  ("get", "/v1/variants"), ("post", "/v1/variants"), ("delete", "/v1/variants/v0"),
])
def test_the_inference_key_cannot_reach_admin_routes(server, method, path):
  r = getattr(requests, method)(server.url + path, headers=H, json={}, timeout=10)
  err = is_error(r, 403, "admin_key_required")
  assert "admin key" in err["message"]
  assert "v0" in variants_info(server)  # nothing was deleted


def test_the_admin_key_reaches_every_route(server):
  assert get(server, "/v1/variants", headers=AH).status_code == 200
  assert get(server, "/v1/models", headers=AH).status_code == 200
  r = post(server, "/v1/completions", {"model": "v1", "prompt": "hi", "max_tokens": 1},
           headers=AH)
  assert r.status_code == 200, r.text


def test_models_lists_base_and_variants(server):
  data = get(server, "/v1/models").json()["data"]
  by = {m["id"]: m for m in data}
  assert by["base"]["parent"] is None
  for n in VARIANTS + ["broken"]:
    assert by[n]["parent"] == "base" and by[n]["object"] == "model"
  assert get(server, "/v1/models/v1").json()["id"] == "v1"
  is_error(get(server, "/v1/models/nope"), 404, "model_not_found")


def test_completion_shape_usage_and_determinism(server):
  a = complete(server, "v1", "hello", max_tokens=8)
  b = complete(server, "v1", "hello", max_tokens=8)
  assert a["object"] == "text_completion" and a["model"] == "v1"
  ch = a["choices"][0]
  assert ch["finish_reason"] in ("length", "stop") and isinstance(ch["text"], str)
  assert a["usage"]["prompt_tokens"] == len(b"hello")  # byte-level tokenizer
  assert a["usage"]["total_tokens"] == 5 + a["usage"]["completion_tokens"]
  assert a["choices"][0]["text"] == b["choices"][0]["text"]
  # token-id prompts are accepted too
  c = complete(server, "v1", [ord(c) + 5 for c in "hello"], max_tokens=8)
  assert c["choices"][0]["text"] == a["choices"][0]["text"]


def test_variants_differ_from_base(server):
  outs = {m: complete(server, m, "The quick brown fox", max_tokens=12)["choices"][0]["text"]
          for m in ["base", "v0", "v1", "v2"]}
  assert len(set(outs.values())) >= 3, outs


def test_chat_completion(server):
  r = post(server, "/v1/chat/completions", {
    "model": "v2", "temperature": 0, "max_tokens": 6,
    "messages": [{"role": "system", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
  assert r.status_code == 200, r.text
  j = r.json()
  assert j["object"] == "chat.completion"
  assert j["choices"][0]["message"]["role"] == "assistant"
  assert j["usage"]["completion_tokens"] <= 6


def test_streaming_completion_matches_non_streaming(server):
  body = {"model": "v0", "prompt": "1 2 3 4", "temperature": 0, "max_tokens": 10}
  full = complete(server, "v0", "1 2 3 4", max_tokens=10)
  r = post(server, "/v1/completions", {**body, "stream": True,
                                        "stream_options": {"include_usage": True}})
  assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
  ev = sse_events(r.text)
  assert ev[-1] == "[DONE]"
  chunks = ev[:-1]
  text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
  assert text == full["choices"][0]["text"]
  finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
  assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == \
    full["choices"][0]["finish_reason"]
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_streaming_chat(server):
  r = post(server, "/v1/chat/completions", {
    "model": "v1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
    "max_tokens": 5, "stream": True})
  ev = sse_events(r.text)
  assert ev[-1] == "[DONE]"
  assert ev[0]["object"] == "chat.completion.chunk"
  assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
  assert ev[-2]["choices"][0]["finish_reason"] in ("length", "stop")
  assert all("usage" not in e for e in ev[:-1])


def test_stop_strings(server):
  full = complete(server, "v2", "hello", max_tokens=20)["choices"][0]["text"]
  clean = [i for i in range(2, len(full) - 2) if full[i:i + 2].isprintable()]
  if not clean:
    pytest.skip("no printable stop candidate in this output")
  stop = full[clean[0]:clean[0] + 2]
  got = complete(server, "v2", "hello", max_tokens=20, stop=[stop, "zzzz"])
  assert got["choices"][0]["text"] == full[:full.find(stop)]
  assert got["choices"][0]["finish_reason"] == "stop"


def test_seed_and_temperature(server):
  def sample(seed):
    return post(server, "/v1/completions", {"model": "v1", "prompt": "hello", "max_tokens": 12,
                                            "temperature": 1.0, "top_p": 0.95,
                                            "seed": seed}).json()["choices"][0]["text"]
  assert sample(7) == sample(7)
  assert len({sample(s) for s in range(4)}) > 1


def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(server):
  """As OpenAI and vLLM answer, instead of cutting max_tokens to the context silently."""
  r = post(server, "/v1/completions", {"model": "base", "prompt": "x" * 50, "max_tokens": 10_000})
  is_error(r, 400, "context_length_exceeded", "max_tokens")
  assert r.json()["error"]["message"].startswith(
    "This model's maximum context length is 64 tokens. However, you requested 10050 tokens (50 "
    "in the prompt, 10000 in the completion)."), r.text
  r = post(server, "/v1/completions", {"model": "v0", "prompt": "x" * 50,
                                       "max_completion_tokens": 15})
  is_error(r, 400, "context_length_exceeded", "max_completion_tokens")
  assert "you requested 65 tokens (50 in the prompt, 15 in the completion)" in r.text, r.text
  r = post(server, "/v1/chat/completions", {"model": "base", "max_tokens": 64,
                                            "messages": [{"role": "user", "content": "hi"}]})
  is_error(r, 400, "context_length_exceeded", "max_tokens")
  assert "in the messages, 64 in the completion" in r.text, r.text
  # exactly the room left is allowed; without max_tokens the default is cut to the room
  j = complete(server, "base", "x" * 50, max_tokens=14, ignore_eos=True)
  assert j["usage"]["completion_tokens"] == 14 and j["usage"]["total_tokens"] == 64, j["usage"]
  j = complete(server, "base", "x" * 60, ignore_eos=True)  # default_max_tokens 16 > 4 left
  assert j["usage"]["completion_tokens"] == 4 and j["usage"]["total_tokens"] == 64, j["usage"]


# -- errors -------------------------------------------------------------------------------------
def test_error_objects(server):
  is_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404,
           "model_not_found", "model")
  for bad in ("../v0", "v0/../../etc/passwd", "/tmp", str(server.cfg.base)):
    is_error(post(server, "/v1/completions", {"model": bad, "prompt": "x"}), 404, "model_not_found")
  r = requests.post(server.url + "/v1/completions", data=b"{not json", headers=H, timeout=10)
  is_error(r, 400, "invalid_json")
  is_error(post(server, "/v1/completions", [1, 2]), 400, "invalid_json")
  is_error(post(server, "/v1/completions", {"prompt": "x"}), 400, param="model")
  is_error(post(server, "/v1/completions", {"model": "v0"}), 400, param="prompt")
  cases = {
    "temperature": [-1, 3, "hot"], "top_p": [0, 1.5, "x"], "max_tokens": [0, "5", 1.5],
    "n": [0, 17, "2"], "stop": [5, ["a"] * 5], "seed": ["x"], "stream": ["yes"],
    "logprobs": [21, -1, True], "echo": ["yes"], "logit_bias": [[1], {"x": 1}, {"1": 200}],
  }
  for field, values in cases.items():
    for value in values:
      err = is_error(post(server, "/v1/completions", {"model": "v0", "prompt": "x",
                                                      field: value}), 400, param=field)
      assert field in err["message"]
  is_error(post(server, "/v1/chat/completions", {"model": "v0"}), 400, param="messages")
  is_error(post(server, "/v1/chat/completions", {"model": "v0", "messages": [{"role": "x"}]}),
           400, param="messages[0].role")
  is_error(post(server, "/v1/completions", {"model": "v0", "prompt": [999999]}), 400,
           param="prompt")


def test_prompt_longer_than_context(server):
  err = is_error(post(server, "/v1/completions", {"model": "v0", "prompt": "x" * 64}), 400,
                 "context_length_exceeded", "prompt")
  assert "64" in err["message"]
  is_error(post(server, "/v1/chat/completions", {
    "model": "v0", "messages": [{"role": "user", "content": "y" * 100}]}), 400,
    "context_length_exceeded", "messages")


def test_body_limit_and_unknown_routes(server):
  r = post(server, "/v1/completions", {"model": "v0", "prompt": "x" * 100_000})
  is_error(r, 413, "request_too_large")
  is_error(get(server, "/v1/nothing"), 404)
  r = requests.put(server.url + "/v1/completions", headers=H, timeout=10)
  is_error(r, 405)
  assert get(server, "/health").status_code == 200


# -- the openai client --------------------------------------------------------------------------
def test_openai_client(server):
  import openai

  client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
  ids = {m.id for m in client.models.list()}
  assert {"base", *VARIANTS} <= ids
  c = client.completions.create(model="v1", prompt="hello", max_tokens=8, temperature=0)
  assert c.choices[0].text == complete(server, "v1", "hello", max_tokens=8)["choices"][0]["text"]
  assert c.usage.prompt_tokens == 5
  chat = client.chat.completions.create(
    model="v2", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
  assert chat.choices[0].message.role == "assistant"
  stream = client.chat.completions.create(
    model="v2", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
    stream=True, stream_options={"include_usage": True})
  parts, usage = [], None
  for ev in stream:
    if ev.choices and ev.choices[0].delta.content:
      parts.append(ev.choices[0].delta.content)
    usage = ev.usage or usage
  assert "".join(parts) == chat.choices[0].message.content
  assert usage.completion_tokens == chat.usage.completion_tokens
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="missing", prompt="x")
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model="v1", prompt="x", temperature=5)
  bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()


# -- concurrency --------------------------------------------------------------------------------
async def _fire(url, bodies, path="/v1/completions"):
  async with aiohttp.ClientSession(headers=H) as s:
    async def one(b):
      async with s.post(url + path, json=b) as r:
        return r.status, await r.json()
    return await asyncio.gather(*(one(b) for b in bodies))


def test_concurrent_mixed_variants_match_sequential(server):
  models = ["base", "v0", "v1", "v2", "v3", "v4"]
  ref = {(m, p): complete(server, m, p, max_tokens=8)["choices"][0]["text"]
         for m in models for p in PROMPTS}
  bodies = [{"model": m, "prompt": p, "temperature": 0, "max_tokens": 8}
            for _ in range(2) for m in models for p in PROMPTS]
  t0 = time.time()
  res = asyncio.run(_fire(server.url, bodies))
  assert all(s == 200 for s, _ in res), [j for s, j in res if s != 200][:2]
  for b, (_, j) in zip(bodies, res):
    assert j["choices"][0]["text"] == ref[(b["model"], b["prompt"])], b
  assert time.time() - t0 < 60
  info = get(server, "/v1/variants").json()
  assert info["host_cache"]["used_bytes"] <= info["host_cache"]["budget_bytes"]
  assert info["device_slots"]["used"] <= 3
  assert sum(v["tier"] == "device" for v in info["data"]) <= 3
  assert variants_info(server)["v3"]["tier"] == "device"  # pinned


def test_single_flight_cold_variant(server, family):
  _, deltas, extra, _ = family
  r = post(server, "/v1/variants", {"name": "sf", "path": str(extra["x0"].resolve())})
  assert r.status_code == 201, r.text
  assert variants_info(server)["sf"]["tier"] == "disk"
  bodies = [{"model": "sf", "prompt": "hi", "temperature": 0, "max_tokens": 2}] * 100
  res = asyncio.run(_fire(server.url, bodies))
  assert [s for s, _ in res] == [200] * 100
  assert len({j["choices"][0]["text"] for _, j in res}) == 1
  info = variants_info(server)["sf"]
  assert info["loads"] == 1 and info["requests"] == 100 and info["last_load_source"] == "disk"
  assert info["last_load_time"] and info["last_load_seconds"] > 0
  assert metric(get(server, "/metrics").text, "bitdelta_variant_loads_total", model="sf",
                outcome="ok") == 1.0


def test_eviction_with_budgets_smaller_than_all_deltas(server):
  # 3 device slots (v3 pinned) and a host budget of 2.5 deltas, 5 variants cycled twice
  budget = get(server, "/v1/variants").json()["host_cache"]["budget_bytes"]
  for _ in range(2):
    for m in ["v0", "v1", "v2", "v4", "v3"]:
      complete(server, m, "hello", max_tokens=2)
      info = get(server, "/v1/variants").json()
      assert info["host_cache"]["used_bytes"] <= budget
      assert len(info["host_cache"]["variants"]) <= 2
      assert info["device_slots"]["used"] <= 3
  vi = variants_info(server)
  tiers = [vi[n]["tier"] for n in ["v0", "v1", "v2", "v4"]]
  assert tiers.count("device") <= 2 and tiers.count("disk") >= 1
  assert vi["v3"]["tier"] == "device"  # the pin survived all of it
  loads = sum(vi[n]["loads"] for n in ["v0", "v1", "v2", "v4"])
  assert loads >= 6  # evictions forced reloads
  m = get(server, "/metrics").text
  assert metric(m, "bitdelta_cache_misses_total", model="v0", tier="device") >= 2
  assert metric(m, "bitdelta_evictions_total", tier="device") >= 1
  assert metric(m, "bitdelta_evictions_total", tier="host") >= 1
  assert metric(m, "bitdelta_host_cache_bytes") <= budget


def test_corrupt_delta_fails_cleanly_and_others_keep_serving(server):
  bodies = ([{"model": "broken", "prompt": "hi", "max_tokens": 4}] * 5
            + [{"model": m, "prompt": "hi", "temperature": 0, "max_tokens": 4}
               for m in ["v0", "v1", "base"]])
  res = asyncio.run(_fire(server.url, bodies))
  for s, j in res[:5]:
    assert s == 503 and j["error"]["code"] == "variant_load_failed"
    assert "broken" in j["error"]["message"] and ("checksum" in j["error"]["message"]
                                                  or "corrupt" in j["error"]["message"])
  assert [s for s, _ in res[5:]] == [200, 200, 200]
  info = variants_info(server)["broken"]
  assert info["last_error"] and info["tier"] == "disk"
  assert get(server, "/health").json()["status"] == "ok"
  # a directory outside the variant roots cannot even be registered
  is_error(post(server, "/v1/variants", {"name": "nomanifest", "path": str(server.cfg.base)}),
           403, "path_not_allowed", param="path")


# -- admin --------------------------------------------------------------------------------------
def test_admin_register_validation(server, family):
  _, deltas, extra, _ = family
  path = str(extra["x1"].resolve())
  is_error(post(server, "/v1/variants", {"path": path}), 400, param="name")
  is_error(post(server, "/v1/variants", {"name": "ok1"}), 400, param="path")
  is_error(post(server, "/v1/variants", {"name": "../evil", "path": path}), 400, param="name")
  is_error(post(server, "/v1/variants", {"name": "a/b", "path": path}), 400, param="name")
  is_error(post(server, "/v1/variants", {"name": "rel", "path": "deltas/x1"}), 400, param="path")
  is_error(post(server, "/v1/variants", {"name": "bad", "path": str(deltas["v0"].parent)}), 400,
           "invalid_delta", param="path")  # inside the roots: the problem is named
  is_error(post(server, "/v1/variants", {"name": "v0", "path": path}), 409, "variant_exists")
  is_error(post(server, "/v1/variants", {"name": "base", "path": path}), 409, "variant_exists")
  r = requests.post(server.url + "/v1/variants", data=b"[", headers=AH, timeout=10)
  is_error(r, 400, "invalid_json")
  r = post(server, "/v1/variants", {"name": "late", "path": path})
  assert r.status_code == 201 and r.json()["tier"] == "disk" and r.json()["bytes"] > 0
  assert any(m["id"] == "late" and m["parent"] == "base"
             for m in get(server, "/v1/models").json()["data"])
  assert complete(server, "late", "hi", max_tokens=2)["model"] == "late"
  info = variants_info(server)["late"]
  assert info["requests"] == 1 and info["tier"] in ("device", "host") and info["loads"] == 1
  assert requests.delete(server.url + "/v1/variants/late", headers=AH, timeout=30).json()["deleted"]
  is_error(requests.delete(server.url + "/v1/variants/late", headers=AH, timeout=30), 404)
  is_error(requests.delete(server.url + "/v1/variants/base", headers=AH, timeout=30), 400)


def test_refused_paths_read_alike(server, family, tmp_path):
  """Outside the roots, missing, a file, a link out of the roots: one status, one message, so
  the admin route tells nothing about the server's disk."""
  base, deltas, _, _ = family
  root = deltas["v0"].parent
  link = root / "link-out"
  link.symlink_to(base.resolve(), target_is_directory=True)
  try:
    paths = [str(root / "missing"), "/etc", "/no/such/dir", str(deltas["v0"] / "manifest.json"),
             str(link), str(tmp_path)]
    msgs = set()
    for i, p in enumerate(paths):
      err = is_error(post(server, "/v1/variants", {"name": f"refused{i}", "path": p}), 403,
                     "path_not_allowed", param="path")
      msgs.add(err["message"])
    assert len(msgs) == 1 and not any(p in next(iter(msgs)) for p in paths), msgs
  finally:
    link.unlink()


def test_delete_waits_for_in_flight_requests(server, family):
  _, _, extra, _ = family
  assert post(server, "/v1/variants", {"name": "doomed",
                                       "path": str(extra["x1"].resolve())}).status_code == 201
  engine = server.server.engine
  result, times = {}, {}

  def stream():
    r = post(server, "/v1/completions", {"model": "doomed", "prompt": "hi", "max_tokens": 40,
                                         "temperature": 0, "stream": True}, stream=True)
    lines = []
    for line in r.iter_lines():
      lines.append(line)
      if len(lines) == 1:
        times["first"] = time.time()
    times["stream_done"] = time.time()
    result["events"] = sse_events("\n\n".join(x.decode() for x in lines if x))

  def delete():
    r = requests.delete(server.url + "/v1/variants/doomed", headers=AH, timeout=60)
    times["delete_done"] = time.time()
    result["delete"] = r

  ts = threading.Thread(target=stream)
  ts.start()
  while "first" not in times:
    time.sleep(0.005)
  # hold the device thread until the checks below are done: the request stays in flight
  hold = threading.Event()
  engine.call(lambda gen: hold.wait(30))
  td = threading.Thread(target=delete)
  td.start()
  try:
    time.sleep(0.3)  # a DELETE that did not wait would be done by now (on a quiet machine)
    assert "delete_done" not in times  # still waiting for the stream (it cannot end: held)
    assert "doomed" not in {m["id"] for m in get(server, "/v1/models").json()["data"]}
    is_error(post(server, "/v1/completions", {"model": "doomed", "prompt": "x"}), 404)
  finally:
    hold.set()
  ts.join(30)
  td.join(30)
  assert result["delete"].status_code == 200 and result["delete"].json()["deleted"]
  assert times["delete_done"] >= times["stream_done"] - 0.05
  ev = result["events"]
  assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] in ("length", "stop")
  assert "doomed" not in variants_info(server)


def test_client_disconnect_frees_the_row(server):
  async def main():
    async with aiohttp.ClientSession(headers=H) as s:
      async with s.post(server.url + "/v1/completions", json={
          "model": "v1", "prompt": "hi", "max_tokens": 60, "stream": True}) as r:
        await r.content.readline()  # first event, then hang up
    for _ in range(200):
      await asyncio.sleep(0.02)
      if variants_info(server)["v1"]["in_flight"] == 0:
        return True
    return False

  assert asyncio.run(main())
  assert get(server, "/health").json()["active_rows"] == 0
  assert complete(server, "v1", "hi", max_tokens=2)["model"] == "v1"


def test_health_is_prompt_while_engine_busy(server):
  engine = server.server.engine
  bodies = [{"model": m, "prompt": "hi", "max_tokens": 30} for m in ["base", "v1"] * 6]

  hold = threading.Event()

  async def main():
    fire = asyncio.ensure_future(_fire(server.url, bodies))
    await asyncio.sleep(0.05)
    held = engine.call(lambda gen: hold.wait(60))  # the device thread is busy until released
    while not held.running():
      await asyncio.sleep(0.01)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
      for _ in range(5):  # answered while the device thread is still held, however slowly
        async with s.get(server.url + "/health") as r:
          assert r.status == 200 and not hold.is_set()
    hold.set()
    return await fire

  try:
    res = asyncio.run(main())
  finally:
    hold.set()
  assert all(s == 200 for s, _ in res)


def metric(text: str, name: str, **labels) -> float | None:
  from prometheus_client.parser import text_string_to_metric_families

  for fam in text_string_to_metric_families(text):
    for smp in fam.samples:
      if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
        return smp.value
  return None


def test_bench_serve_counts_what_the_server_generated(server, tmp_path, capsys):
  """`bitdelta bench serve` against this server: its token counts are the server's own
  (/metrics), every request is timed, and a JSON report is written."""
  from bitdelta_jax.cli import main

  def generated():
    return metric(get(server, "/metrics").text, "bitdelta_generated_tokens_total",
                  model="v2") or 0.0

  before = generated()
  out = tmp_path / "bench.json"
  code = main(["bench", "serve", "--url", server.url, "--model", "v2", "--concurrency", "1,3",
               "--requests", "4", "--prompt-words", "6", "--output-tokens", "5", "--api-key",
               KEY, "--seed", "7", "--out", str(out)])
  assert code == 0, capsys.readouterr().err
  levels = json.loads(out.read_text())["levels"]
  assert [(r["concurrency"], r["requests"], r["ok"], r["errors"]) for r in levels] == [
    (1, 4, 4, 0), (3, 4, 4, 0)]
  assert all(r["output_tokens"] == 4 * 5 for r in levels)  # EOS ignored: 5 tokens each
  assert generated() - before == 2 * 4 * 5
  for r in levels:
    assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
    assert r["output_tok_s"] > 0 and r["prompt_tokens_mean"] > 6
  assert "| 3 | 4 (4) |" in capsys.readouterr().out
  assert main(["bench", "serve", "--url", server.url, "--model", "v2", "--concurrency",
               "0"]) == 2
  # a wrong key: every request fails, counted, exit 1
  assert main(["bench", "serve", "--url", server.url, "--model", "v2", "--concurrency", "1",
               "--requests", "2", "--output-tokens", "2", "--prompt-words", "2"]) == 1
  assert "HTTP 401" in capsys.readouterr().err


def test_metrics_exposition(server):
  complete(server, "v1", "hello", max_tokens=4)
  post(server, "/v1/completions", {"model": "v1", "prompt": "hi", "max_tokens": 4,
                                   "stream": True})
  m = get(server, "/metrics").text
  assert metric(m, "bitdelta_requests_total", model="v1", endpoint="completions",
                status="200") >= 2
  assert metric(m, "bitdelta_generated_tokens_total", model="v1") >= 2
  assert metric(m, "bitdelta_prompt_tokens_total", model="v1") >= 7
  assert metric(m, "bitdelta_time_to_first_token_seconds_count", model="v1") >= 2
  assert metric(m, "bitdelta_time_to_first_token_seconds_bucket", model="v1", le="+Inf") >= 2
  assert metric(m, "bitdelta_inter_token_latency_seconds_count", model="v1") >= 1
  assert metric(m, "bitdelta_cache_hits_total", model="v1", tier="device") >= 1
  assert metric(m, "bitdelta_cache_misses_total", model="v1", tier="device") >= 1
  assert metric(m, "bitdelta_variant_load_seconds_count", model="v1", source="disk") >= 1
  assert metric(m, "bitdelta_variant_tier", model="v3", tier="device") == 1.0
  assert metric(m, "bitdelta_variant_tier", model="v3", tier="disk") == 0.0
  assert metric(m, "bitdelta_device_slots") == 3.0
  for name in ("bitdelta_batch_occupancy", "bitdelta_queue_depth", "bitdelta_batch_rows_active",
               "bitdelta_host_cache_bytes", "bitdelta_device_slots_used"):
    assert metric(m, name) is not None, name
