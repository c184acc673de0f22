"""Restarts as users make them: the same server stopped and started again with the same cache.

    python -m bench restarts                    # the demo and the real model, 10 starts each
    python -m bench restarts --which demo --starts 4

Each start is a new `bitdelta demo` (or `bitdelta demo --real`) process with one cache
directory (``BITDELTA_CACHE``: JAX's compilation cache and the step cache both on, as users
run it). Start 1 is cold (an empty cache); before start 3 the step files are removed (as an
upgrade does: the step key hashes the code, JAX's own cache key does not), so start 3 meets
only JAX's cache and start 4 onwards load what start 3 saved: the sequence that answered 500
to everything before issue 35. Every start answers, for every model it serves: a chat message
(greedy), ``n: 2`` on the 1-token prompt ``[42]`` (seeded sampling), ``logprobs`` and a JSON
schema; and for the base, prompts of 1 to 511 tokens reaching every token bucket. Each answer
must be a 200 and equal the cold start's (text, and log probabilities within 1e-5).

Then the server gets SIGINT and its exit is timed. Writes bench/results/serving/restarts.{json,md}.
Timings share the machine with whatever else runs: run it alone.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import report, server
from bench.common.machine import describe
from bench.common.paths import results_dir
from bench.common.server import free_port

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
BUCKET_LENGTHS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 511)


def start(which: str, cache: pathlib.Path, log) -> tuple[subprocess.Popen, str, float]:
  port = free_port()
  cmd = [sys.executable, "-m", "bitdelta_jax.cli", "demo", "--port", str(port)]
  if which == "real":
    cmd.append("--real")
  env = dict(BITDELTA_CACHE=str(cache), BITDELTA_COMPILE_CACHE="1", JAX_PLATFORMS="cpu")
  proc, url, seconds, _ = server.start(cmd, port, log, env=env, poll_s=0.25)
  return proc, url, seconds


def battery(url: str) -> dict:
  """Every request of one start: name -> (status, what must not change between starts)."""
  import requests

  def post(path, body):
    r = requests.post(url + path, json=body, timeout=600)
    try:
      data = r.json()
    except ValueError:
      data = r.text
    return r.status_code, data

  out = {}
  models = [m["id"] for m in requests.get(url + "/v1/models", timeout=30).json()["data"]]
  base = models[0]
  for m in models:
    s, d = post("/v1/chat/completions", {"model": m, "temperature": 0, "max_tokens": 16,
                                         "messages": [{"role": "user", "content": "add 12+7"}]})
    out[f"{m}/chat"] = (s, d["choices"][0]["message"]["content"] if s == 200 else d)
    s, d = post("/v1/completions", {"model": m, "prompt": [42], "n": 2, "max_tokens": 8,
                                    "temperature": 0.8, "seed": 7})
    out[f"{m}/n2"] = (s, [c["text"] for c in d["choices"]] if s == 200 else d)
    s, d = post("/v1/completions", {"model": m, "prompt": "reverse abc", "max_tokens": 4,
                                    "temperature": 0, "logprobs": 3})
    out[f"{m}/logprobs"] = (s, (d["choices"][0]["text"], d["choices"][0]["logprobs"][
      "token_logprobs"]) if s == 200 else d)
    s, d = post("/v1/chat/completions", {
      "model": m, "temperature": 0, "max_tokens": 24,
      "messages": [{"role": "user", "content": "json please"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    out[f"{m}/json_schema"] = (s, d["choices"][0]["message"]["content"] if s == 200 else d)
  for n in BUCKET_LENGTHS:
    s, d = post("/v1/completions", {"model": base, "prompt": [1] + [200 + i % 50
                                                                    for i in range(n - 1)],
                                    "max_tokens": 1, "temperature": 0})
    out[f"{base}/prompt{n}"] = (s, d["choices"][0]["text"] if s == 200 else d)
  return out


def same(a, b) -> bool:
  if isinstance(a, float) and isinstance(b, float):
    return abs(a - b) <= 1e-5
  if isinstance(a, list | tuple) and isinstance(b, list | tuple):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
  return a == b


def run(which: str, starts: int, tmp: pathlib.Path) -> dict:
  cache = tmp / f"cache-{which}"
  rows, cold = [], None
  for i in range(1, starts + 1):
    if i == 3:  # as after an upgrade: the step files go, JAX's cache stays
      for p in (cache / "steps").glob("step-*.bin"):
        p.unlink()
    log_path = tmp / f"{which}-{i}.log"
    with open(log_path, "w") as log:
      proc, url, ready = start(which, cache, log)
      try:
        answers = battery(url)
      finally:
        t = time.time()
        proc.send_signal(signal.SIGINT)
        try:
          proc.wait(120)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
        exit_s = time.time() - t
    text = log_path.read_text()
    m = re.search(r"warm-up: (\d+) step programs in ([\d.]+) s \((\d+) from the step cache; "
                  r"each run once in ([\d.]+) s, (\d+) failed", text)
    cold = cold or answers
    row = {"start": i, "ready_s": round(ready, 1), "exit_after_sigint_s": round(exit_s, 1),
           "exit_code": proc.returncode,
           "programs": int(m.group(1)) if m else None,
           "warmup_s": float(m.group(2)) if m else None,
           "from_step_cache": int(m.group(3)) if m else None,
           "first_runs_s": float(m.group(4)) if m else None,
           "probe_failures": int(m.group(5)) if m else None,
           "requests": len(answers),
           "non_200": {k: v[0] for k, v in answers.items() if v[0] != 200},
           "differ_from_cold": sorted(k for k in answers
                                      if not same(answers[k], cold.get(k)))}
    print(which, json.dumps(row), flush=True)
    rows.append(row)
  shutil.rmtree(cache, ignore_errors=True)
  return {"starts": rows}


def render(res: dict) -> str:
  m = res["machine"]
  lines = ["# Restarts: the same server started again and again with one cache", "",
           f"`python -m bench restarts` on {m['cpu']}, {m['cores']} cores, jax "
           f"{m.get('jax')}. Before start 3 the step files are removed (as an upgrade does); "
           "start 1 is cold. Every start answers a chat message, `n: 2` on the prompt `[42]`, "
           "`logprobs` and a JSON schema for every model, and prompts of "
           f"{', '.join(map(str, BUCKET_LENGTHS))} tokens for the base; each answer must be a "
           "200 equal to the cold start's. Then SIGINT.", ""]
  for which in ("demo", "real"):
    if which not in res:
      continue
    lines += [f"## {res[which]['label']}", "",
              "| start | ready, s | warm-up, s | programs (from step cache) | first runs, s "
              "(failed) | requests | non-200 | differ from cold | exit after SIGINT, s (code) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in res[which]["starts"]:
      lines.append(
        f"| {r['start']} | {r['ready_s']} | {r['warmup_s']} | {r['programs']} "
        f"({r['from_step_cache']}) | {r['first_runs_s']} ({r['probe_failures']}) | "
        f"{r['requests']} | "
        f"{len(r['non_200'])} | {len(r['differ_from_cold'])} | {r['exit_after_sigint_s']} "
        f"({r['exit_code']}) |")
    lines.append("")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--which", choices=("demo", "real", "both"), default="both")
  ap.add_argument("--starts", type=int, default=10)
  ap.add_argument("--out", default=str(results_dir("serving")))
  args = ap.parse_args(argv)
  res: dict = {"machine": describe()}
  labels = {"demo": "`bitdelta demo` (nano and its 6 variants)",
            "real": "`bitdelta demo --real` (SmolLM2-135M-Instruct, dequantized Q4_1, and its "
                    "real variants)"}
  with tempfile.TemporaryDirectory() as tmp:
    for which in (("demo", "real") if args.which == "both" else (args.which,)):
      res[which] = {"label": labels[which], **run(which, args.starts, pathlib.Path(tmp))}
  out = pathlib.Path(args.out)
  report.write_json(out / "restarts.json", res, indent=1)
  (out / "restarts.md").write_text(render(res))
  print(render(res))
  bad = [r for w in ("demo", "real") if w in res for r in res[w]["starts"]
         if r["non_200"] or r["differ_from_cold"]]
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
