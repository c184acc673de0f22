"""Issue 35: `bitdelta demo` stopped and started again with the same cache answers as before.

Two real server processes, one after the other, with one ``BITDELTA_CACHE`` (JAX's
compilation cache and the step cache on, as users run it): the first compiles every step
program and saves it, the second loads every one of them (none recompiled: every native FFI
target is registered before loading) and answers every request exactly as the first did. The
requests reach every token bucket (prompts of 1 to 17 tokens with a prefill chunk of 16, and a
chunked 40-token prompt), and ask for ``n: 2`` on the 1-token prompt ``[42]``, ``logprobs`` and a
JSON schema, for the base and a variant. (The old failure: a program that JAX's cache returned,
saved again, loaded in the next process and failed its first run with a 500; that sequence is
replayed in tests/engine/test_step_cache_restarts.py.)
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
# every program before serving (not the larger ones in the background): the restart must load
# each, and both runs step through the same programs
ARGS = ["--max-batch", "2", "--prefill-chunk", "16", "--max-seq-len", "128", "--device-slots", "2",
        "--compile-all-first"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(cache, log) -> tuple[subprocess.Popen, str]:
  port = free_port()
  env = dict(os.environ, BITDELTA_CACHE=str(cache), BITDELTA_COMPILE_CACHE="1",
             JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.Popen([sys.executable, "-m", "bitdelta_jax.cli", "demo", "--port", str(port),
                        *ARGS], stdout=log, stderr=subprocess.STDOUT, env=env)
  url = f"http://127.0.0.1:{port}"
  t0 = time.time()
  while time.time() - t0 < 600:
    assert p.poll() is None, f"the demo exited with {p.returncode}"
    try:
      if requests.get(url + "/health", timeout=2).status_code == 200:
        return p, url
    except requests.RequestException:
      pass
    time.sleep(0.25)
  p.kill()
  raise AssertionError("the demo did not become healthy")


def answers(url: str) -> dict:
  def post(path, body):
    r = requests.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, (body, r.text)
    return r.json()["choices"]

  out = {}
  for m in ("nano", "nano-reverse"):
    out[m, "n2"] = [c["text"] for c in post("/v1/completions", {
      "model": m, "prompt": [42], "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 3})]
    c = post("/v1/completions", {"model": m, "prompt": "reverse abc", "max_tokens": 4,
                                 "temperature": 0, "logprobs": 2})[0]
    out[m, "logprobs"] = (c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"])
    out[m, "json"] = post("/v1/chat/completions", {
      "model": m, "max_tokens": 16, "temperature": 0,
      "messages": [{"role": "user", "content": "reverse abc"}],
      "response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA}}})[0]["message"]
    for n in (1, 2, 3, 5, 9, 17, 40):
      out[m, n] = post("/v1/completions", {"model": m, "prompt": [1] + [40 + i for i in
                                                                         range(n - 1)],
                                           "max_tokens": 3, "temperature": 0})[0]["text"]
  return out


def stop(p: subprocess.Popen) -> None:
  p.send_signal(signal.SIGINT)
  try:
    p.wait(60)
  except subprocess.TimeoutExpired:
    p.kill()
    p.wait()


def test_the_demo_started_again_loads_every_program_and_answers_the_same(tmp_path):
  logs = [tmp_path / "start1.log", tmp_path / "start2.log"]
  runs = []
  for log_path in logs:
    with open(log_path, "w") as log:
      p, url = start(tmp_path / "cache", log)
      try:
        runs.append(answers(url))
      finally:
        stop(p)
  warmups = [re.search(r"warm-up: (\d+) step programs in [\d.]+ s \((\d+) from the step cache; "
                       r"each run once in [\d.]+ s, (\d+) failed", p.read_text())
             for p in logs]
  assert all(warmups), [p.read_text()[-2000:] for p in logs]
  (programs, loaded0, _), (programs1, loaded1, failed1) = (
    tuple(int(x) for x in m.groups()) for m in warmups)
  assert programs == programs1 == 6  # buckets 1, 2, 4, 8, 16 and 18 (2 rows + a chunk of 16)
  assert loaded0 == 0 and loaded1 == programs and failed1 == 0
  assert len(list((tmp_path / "cache" / "steps").glob("step-*.bin"))) == programs
  assert runs[1] == runs[0]
