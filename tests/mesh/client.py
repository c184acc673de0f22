"""The pytest side of `tests/mesh/worker.py`: starts the 8-device worker once and sends it jobs.

    def test_x(mesh_worker):                        # the session fixture (tests/conftest.py)
      rep = mesh_worker.call("sharding/sharding_worker.py:equivalence", ["1x8", "2x4"])

A job's exception is raised here with the worker's traceback and the tail of its log.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

WORKER = pathlib.Path(__file__).with_name("worker.py")


class MeshWorkerError(RuntimeError):
  pass


class MeshWorker:
  def __init__(self, log: pathlib.Path, timeout_s: float = 900):
    self.log_path, self.timeout_s = log, timeout_s
    self._lock = threading.Lock()
    self._log = open(log, "w")  # noqa: SIM115  closed by `close`
    self._proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._log, text=True)
    self._ready = None

  def _read(self) -> dict:
    result: list = []
    reader = threading.Thread(target=lambda: result.append(self._proc.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(self.timeout_s)
    if not result or not result[0]:
      self._proc.kill()
      raise MeshWorkerError(f"mesh worker {'timed out' if not result else 'died'}"
                            f" (exit {self._proc.poll()}); log:\n{self.tail()}")
    return json.loads(result[0])

  def tail(self, chars: int = 4000) -> str:
    self._log.flush()
    return self.log_path.read_text()[-chars:]

  def call(self, fn: str, *args, **kwargs):
    """``fn`` ("path/under/tests.py:function") run in the worker with JSON ``args``."""
    with self._lock:
      if self._ready is None:
        self._ready = self._read()
      self._proc.stdin.write(json.dumps({"fn": fn, "args": args, "kwargs": kwargs}) + "\n")
      self._proc.stdin.flush()
      answer = self._read()
    if "error" in answer:
      raise MeshWorkerError(f"{fn} failed in the mesh worker:\n{answer['error']}")
    return answer["ok"]

  def close(self) -> None:
    if self._proc.poll() is None:
      self._proc.stdin.close()
      try:
        self._proc.wait(30)
      except subprocess.TimeoutExpired:
        self._proc.kill()
    self._log.close()
