"""Malformed HTTP requests are logged as one rate-limited WARNING line, not a traceback each.

aiohttp logs a request it cannot parse (a 100 KB header line, 20,000 headers, a broken request
line) at ERROR with a full traceback on the ``aiohttp.server`` logger: an unauthenticated client
could flood the log. `install` puts a filter on that logger which turns each such record into
one line naming the peer and the parser's reason, at most one per ``interval_s`` (with a count
of those left out); every other record passes unchanged.
"""

from __future__ import annotations

import logging
import threading
import time

from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger("serving.http")


class MalformedRequestFilter(logging.Filter):
  def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
    super().__init__()
    self.interval_s = interval_s
    self.clock = clock
    self.suppressed = 0  # malformed requests not logged since the last line
    self.total = 0
    self._next = float("-inf")
    self._lock = threading.Lock()

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, HttpProcessingError):
      return True
    with self._lock:
      self.total += 1
      now = self.clock()
      if now < self._next:
        self.suppressed += 1
        return False
      self._next = now + self.interval_s
      more, self.suppressed = self.suppressed, 0
    reason = " ".join(str(exc.message).split())[:160]
    peer = record.getMessage().removeprefix("Error handling request").strip() or "a client"
    log.warning("malformed request %s: %s %s%s", peer, exc.code, reason,
                f" (+{more} more since the last line)" if more else "")
    return False


def install(interval_s: float = 10.0) -> MalformedRequestFilter:
  """The filter on ``aiohttp.server`` (one per process: a second call returns the first)."""
  target = logging.getLogger("aiohttp.server")
  for f in target.filters:
    if isinstance(f, MalformedRequestFilter):
      return f
  f = MalformedRequestFilter(interval_s)
  target.addFilter(f)
  return f
