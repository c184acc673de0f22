"""What the serving tests share: one server factory.

    def test_x(serve, tmp_path):
      base, deltas = synthetic_family(tmp_path, n=2)
      with serve(base, deltas, device_slots=2, max_batch=4) as h:   # a real server
        requests.post(h.url + "/v1/completions", json=...)

``serve`` starts `serving.app.ServerThread`: the whole server (HTTP on a free port, the
registry, the delta cache, the engine's device thread) in this process, stopped when the
``with`` ends. ``base_name`` is "base"; any `serving.config.ServerConfig` field may be given.
``serve(...).start()`` without ``with`` is for a start that must fail (e.g. refused variants).
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from serving.app import ServerThread
from serving.config import ServerConfig


def server_config(base, variants=(), **fields) -> ServerConfig:
  """A `ServerConfig` over ``base`` with ``variants`` (``{name: path}`` or ``((name, path),
  ...)``) on a free port; ``fields`` override the rest."""
  items = variants.items() if isinstance(variants, Mapping) else variants
  kw = dict(base=str(base), base_name="base", port=0,
            variants=tuple((str(n), str(p)) for n, p in items))
  kw.update(fields)
  return ServerConfig(**kw)


@pytest.fixture(scope="session")
def serve():
  """``serve(base, variants=(), **fields)`` → a `ServerThread` (a context manager)."""

  def start(base, variants=(), **fields) -> ServerThread:
    return ServerThread(server_config(base, variants, **fields))

  return start
