"""Process 0 → every other process of a server: length-prefixed plan bytes over TCP.

    sender = PlanSender(followers=3)              # process 0: listens on an ephemeral port
    # ... sender.port and sender.token reach the followers once (a collective at start-up)
    sender.accept(timeout_s=120)                  # every follower connected and authenticated
    sender.send(data)                             # each plan to each follower, in order

    receiver = PlanReceiver(host, port, token, process_id, timeout_s=120)   # a follower
    data = receiver.recv()                        # ConnectionError once process 0 is gone

A follower proves it belongs to this server with the token (random, 32 bytes) that process 0
handed out through the distributed runtime; a connection without it is closed and never sees a
plan. TCP keeps the plans in order; ``TCP_NODELAY`` sends each one at once.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import time

log = logging.getLogger("bitdelta_jax.engine.multihost.channel")

_HELLO = struct.Struct("<4sI32s")  # b"BDF1", process id, token
MAX_PLAN_BYTES = 1 << 30


class PlanSender:
  """Process 0's end: one TCP connection per follower."""

  def __init__(self, followers: int, *, host: str = "0.0.0.0"):
    self.followers = int(followers)
    self.token = secrets.token_bytes(32)
    self._listener = socket.create_server((host, 0))
    self.port = self._listener.getsockname()[1]
    self._conns: dict[int, socket.socket] = {}
    self.sent_bytes = 0

  def accept(self, timeout_s: float) -> None:
    """Waits until every follower (process ids 1..followers) has connected."""
    deadline = time.monotonic() + timeout_s
    while len(self._conns) < self.followers:
      left = deadline - time.monotonic()
      if left <= 0:
        missing = sorted(set(range(1, self.followers + 1)) - set(self._conns))
        raise TimeoutError(f"processes {missing} did not connect to the plan channel on port "
                           f"{self.port} within {timeout_s:g} s")
      self._listener.settimeout(left)
      try:
        conn, addr = self._listener.accept()
      except TimeoutError:
        continue
      conn.settimeout(10.0)
      try:
        magic, pid, token = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
      except (OSError, ConnectionError, struct.error):
        conn.close()
        continue
      if magic != b"BDF1" or not hmac.compare_digest(token, self.token) or not (
          1 <= pid <= self.followers) or pid in self._conns:
        log.warning("plan channel: refused a connection from %s", addr)
        conn.close()
        continue
      conn.settimeout(None)
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      self._conns[pid] = conn
    self._listener.close()

  def send(self, data: bytes) -> None:
    """``data`` to every follower; OSError when one is gone."""
    frame = struct.pack("<I", len(data)) + data
    for conn in self._conns.values():
      conn.sendall(frame)
    self.sent_bytes += len(frame)

  def close(self) -> None:
    for conn in self._conns.values():
      try:
        conn.close()
      except OSError:
        pass
    self._conns.clear()
    try:
      self._listener.close()
    except OSError:
      pass


class PlanReceiver:
  """A follower's end."""

  def __init__(self, host: str, port: int, token: bytes, process_id: int, *,
               timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        self._conn = socket.create_connection((host, port), timeout=10.0)
        break
      except OSError:
        if time.monotonic() > deadline:
          raise
        time.sleep(0.2)
    self._conn.sendall(_HELLO.pack(b"BDF1", int(process_id), token))
    self._conn.settimeout(None)
    self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

  def recv(self) -> bytes:
    """The next plan; ConnectionError when process 0 closed the connection."""
    (n,) = struct.unpack("<I", _recv_exact(self._conn, 4))
    if n > MAX_PLAN_BYTES:
      raise ConnectionError(f"a plan of {n} bytes (more than {MAX_PLAN_BYTES})")
    return _recv_exact(self._conn, n)

  def close(self) -> None:
    self._conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
  parts, got = [], 0
  while got < n:
    chunk = conn.recv(min(n - got, 1 << 20))
    if not chunk:
      raise ConnectionError("the plan channel was closed")
    parts.append(chunk)
    got += len(chunk)
  return b"".join(parts)
