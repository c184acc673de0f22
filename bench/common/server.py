"""A server under test as a subprocess: `bitdelta serve` (or `bitdelta demo`, or llama.cpp's
llama-server) started, waited for until its /health answers 200, stopped.

    proc, url, seconds, health = start(serve_command(base, variants, port), port, log)
    ...
    stop_server(proc)

`start` is the one way a bench starts a server and waits for it; `launch_server` +
`wait_healthy` split the two for benches that start several servers at once.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

from bench.common.paths import ROOT


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_all_buckets(url: str, timeout_s: float = 1800, poll_s: float = 0.2) -> float:
  """Seconds until ``url``'s /health lists no step bucket still compiling in the background
  (0 for a server without the background compile); TimeoutError after ``timeout_s``."""
  t0 = time.perf_counter()
  while (health(url) or {}).get("buckets", {}).get("compiling"):
    if time.perf_counter() - t0 > timeout_s:
      raise TimeoutError(f"buckets still compiling after {timeout_s} s")
    time.sleep(poll_s)
  return time.perf_counter() - t0


def url_of(port_or_url) -> str:
  return port_or_url if isinstance(port_or_url, str) else f"http://127.0.0.1:{port_or_url}"


def health(url: str, timeout_s: float = 2) -> dict | None:
  """The JSON body of a 200 from ``url``/health (``{"raw": ...}`` if not JSON), else None."""
  try:
    with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
      if r.status != 200:
        return None
      body = r.read()
  except Exception:  # noqa: BLE001 - not up yet (refused, 503 while loading, timeout)
    return None
  try:
    return json.loads(body)
  except ValueError:
    return {"raw": body[:200].decode(errors="replace")}


def serve_command(base, variants: dict, port: int, *, device_slots: int = 4, extra: tuple = (),
                  max_batch: int = 32, max_seq_len: int = 2048) -> list[str]:
  """`bitdelta serve` on ``base`` (named "base") with ``variants`` ({name: delta dir});
  ``extra``: more CLI arguments (e.g. ``("--dtype", "bfloat16")``)."""
  cmd = [sys.executable, "-m", "bitdelta_jax.cli", "serve", "--base", str(base), "--port",
         str(port), "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len),
         "--device-slots", str(device_slots), "--base-name", "base", *extra]
  for n, d in variants.items():
    cmd += ["--variant", f"{n}={d}"]
  return cmd


def launch(cmd: list[str], log, *, env: dict | None = None,
           cwd: pathlib.Path = ROOT) -> subprocess.Popen:
  """``cmd`` as a subprocess, output to ``log``; ``env``: variables set over this process's."""
  return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(cwd),
                          env=None if env is None else {**os.environ, **env})


def launch_server(base, variants, port, log, *, device_slots: int = 4, extra: tuple = (),
                  env: dict | None = None) -> subprocess.Popen:
  """`bitdelta serve` (`serve_command`) as a subprocess, not waited for (`wait_healthy`)."""
  return launch(serve_command(base, variants, port, device_slots=device_slots, extra=extra),
                log, env=env)


def _poll(proc, url: str, log, t0: float, timeout_s: float, poll_s: float) -> tuple[float, dict]:
  while time.time() - t0 < timeout_s:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode}; see {getattr(log, 'name', log)}")
    h = health(url)
    if h is not None:
      return time.time() - t0, h
    time.sleep(poll_s)
  proc.kill()
  raise TimeoutError("server did not become healthy")


def wait_healthy(proc, port_or_url, log, t0: float | None = None, timeout_s: float = 1800,
                 poll_s: float = 1.0) -> float:
  """Seconds from ``t0`` (default: now) until the server's /health answers 200; raises if the
  process exits first, kills it and raises after ``timeout_s``."""
  t0 = time.time() if t0 is None else t0
  return _poll(proc, url_of(port_or_url), log, t0, timeout_s, poll_s)[0]


def start(cmd: list[str], port: int, log, *, env: dict | None = None, cwd: pathlib.Path = ROOT,
          timeout_s: float = 1800, poll_s: float = 1.0):
  """Starts ``cmd`` (a server listening on ``port``) and waits for its /health:
  ``(proc, url, seconds from launch to healthy, the /health JSON)``."""
  t0 = time.time()
  proc = launch(cmd, log, env=env, cwd=cwd)
  url = url_of(port)
  seconds, h = _poll(proc, url, log, t0, timeout_s, poll_s)
  return proc, url, seconds, h


def start_server(base, variants, port, log, **kw):
  """`bitdelta serve` (`launch_server`'s options) started and healthy: ``(proc, seconds)``."""
  t0 = time.time()
  proc = launch_server(base, variants, port, log, **kw)
  return proc, wait_healthy(proc, port, log, t0)


def stop_server(proc, timeout_s: float = 60) -> None:
  proc.terminate()
  try:
    proc.wait(timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()


def process_mb(pid: int) -> dict:
  """{"peak": VmHWM, "now": VmRSS} of process ``pid`` in MiB."""
  out = {}
  for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
    if line.startswith(("VmHWM:", "VmRSS:")):
      out[line.split(":")[0]] = int(line.split()[1]) / 1024
  return {"peak": out.get("VmHWM", float("nan")), "now": out.get("VmRSS", float("nan"))}
