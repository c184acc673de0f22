"""The aiohttp application: OpenAI-compatible routes, admin routes, health and metrics.

    app, server = build_app(cfg)            # startup loads the model on the device thread
    handle = ServerThread(cfg).start()      # a real server on a loopback port (tests, bench)
    handle.url, handle.server, handle.stop()

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` → SSE ending in
``data: [DONE]``), ``GET /v1/models`` (+ ``/v1/models/{id}``), ``GET /health``,
``GET /metrics``, and admin ``GET|POST /v1/variants``, ``DELETE /v1/variants/{name}``.
With ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer <key>``; the
admin routes need ``admin_key`` instead (`_auth`).
Every failure is an OpenAI error object; an unexpected exception is a 500, never a crash.
The generation routes' request path (prompts, options, n choices, log probabilities, controls,
structured output, streaming) is `serving.generation`.

Start-up checks the port, then every configured variant (directory, manifest, base, array
crc32s) before the model loads: a failure is a `BadVariantsError`, or with
``skip_bad_variants`` the variant is left out and ``/health`` says ``degraded`` with the reasons.
A non-streaming request whose client disconnects is cancelled (the engine frees its row).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import os
import socket
import threading
import time
from pathlib import Path

from aiohttp import web

from bitdelta_jax.delta.entries import DeltaMismatchError
from bitdelta_jax.delta.store import DeltaStoreError, check_base
from bitdelta_jax.delta.variant import open_variant
from bitdelta_jax.engine.build import kv_pages
from bitdelta_jax.engine.engine import Engine
from bitdelta_jax.models.banks import banks_for
from serving import malformed_log
from serving import protocol as P
from serving.cache import DeltaCache, LoadError
from serving.config import ConfigError, ServerConfig
from serving.generation import generate, unknown
from serving.metrics import CONTENT_TYPE_LATEST, Metrics
from serving.registry import Registry, RegistryError, read_pool
from serving.router import Router

log = logging.getLogger("serving.app")
SERVER_KEY = web.AppKey("server", object)
MAX_BODY = web.AppKey("max_body", int)
# Stopping (`Server.drain`): after the grace, requests that were ended get this long to send
# their error (the engine ends them at its next iteration); aiohttp then waits this long for
# any handler left before cancelling it; and the device thread this long to end its loop, or
# 1 s when it did not even end those requests (inside a long step, e.g. a compile: the CLI
# then exits without it).
CUTOFF_S = 3.0
CLEANUP_TIMEOUT_S = 1.0
ENGINE_STOP_S = 5.0


def _base_vocab(base_dir) -> int:
  """The base's vocabulary size (rows of its embedding), from its config.json."""
  from bitdelta_jax.models.loading import load_config

  return load_config(base_dir).vocab_size


class BadVariantsError(ConfigError):
  """Configured variants that fail their start-up checks (``bitdelta serve`` exits 2)."""

  def __init__(self, bad: dict[str, str]):
    lines = "\n".join(f"  variant {n!r}: {why}" for n, why in bad.items())
    super().__init__(f"{len(bad)} configured variant(s) fail their start-up checks:\n{lines}\n"
                     "fix or remove them, or start with --skip-bad-variants to serve the rest")
    self.bad = dict(bad)


class Server:
  """Owns the engine, registry, cache and router of one running server."""

  def __init__(self, cfg: ServerConfig):
    self.cfg = cfg
    self.metrics = Metrics()
    self.io = concurrent.futures.ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="bitdelta-io")
    self.tokenizer = None
    self.engine: Engine | None = None
    self.registry: Registry | None = None
    self.cache: DeltaCache | None = None
    self.router: Router | None = None
    self.base_fp: dict | None = None
    self.bad_variants: dict[str, str] = {}  # configured but left out: name -> why
    self.pool_members = ()  # `serving.registry.PoolMember`s of cfg.kmerge_pool
    self.started = time.time()
    self.stopping = False  # `drain` began: new requests get a 503
    self.in_flight = 0  # handlers running (every route)
    self.admitted_rows = 0  # sequences of the generation requests admitted and not yet answered
    self._idle: asyncio.Event | None = None  # set when in_flight drops to 0 (drain waits on it)
    self.engine_stop_s = 30.0  # how long cleanup waits for the device thread
    # set on the event loop when the engine gives up (`Engine.fatal`): the CLI exits non-zero
    self.engine_failed = asyncio.Event()

  # -- lifecycle -------------------------------------------------------------------------------
  async def startup(self, _app=None) -> None:
    from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint
    from bitdelta_jax.models.tokenizer import Tokenizer

    cfg, loop = self.cfg, asyncio.get_running_loop()
    self.tokenizer = await loop.run_in_executor(self.io, Tokenizer.from_dir, cfg.base)
    if cfg.kmerge_pool is not None:
      self.pool_members = await loop.run_in_executor(self.io, self._read_pool)
    manifests = await loop.run_in_executor(self.io, _read_manifests, self.configured)
    self.base_fp = await loop.run_in_executor(
      self.io, lambda: fingerprint_checkpoint(cfg.base, content=cfg.verify_base))
    shapes = {n: tuple(t["shape"]) for n, t in self.base_fp["tensors"].items()}
    vocab = _base_vocab(cfg.base)
    # the banks every configured variant needs, unless the configuration says (1-bit embedding
    # deltas: packed per-slot banks, 1/32 of the dense ones)
    banks = banks_for([m for m in manifests.values() if isinstance(m, dict)], vocab,
                      embedding_slots=cfg.embedding_slots, lora_rank=cfg.lora_rank,
                      extra_vocab=cfg.extra_vocab)
    self.registry = Registry(cfg.model_id, admin_roots=cfg.variant_roots(), banks=banks,
                             base_tensors=set(self.base_fp["tensors"]), vocab_size=vocab,
                             base_dir=cfg.base, base_shapes=shapes)
    await self._add_config_variants()
    self._add_pool_tasks()
    self.engine = Engine(cfg.engine_config(), self.metrics, self.tokenizer, banks=banks)
    self.engine.on_fatal = lambda why: loop.call_soon_threadsafe(self.engine_failed.set)
    await asyncio.wrap_future(self.engine.start())
    self.cache = DeltaCache(cfg, self.metrics, read_delta=self._read_delta,
                            write_slot=self._write_slot, io_pool=self.io)
    self.router = Router(self.registry, self.cache, self.metrics)
    for v in self.registry.all():
      v.pinned = v.name in cfg.pins
      self.metrics.set_tier(v.name, "disk")
    for name in cfg.pins:
      if name in self.bad_variants:
        continue
      try:
        await self.cache.preload(self.registry.get(name))
      except LoadError as e:  # serve the rest; requests for it get the error
        log.warning("pinned %s", e)

  @property
  def configured(self) -> tuple[tuple[str, str], ...]:
    """The configured variants, then the K-Merge pool's members (named by their ids)."""
    return self.cfg.variants + tuple((m.id, str(m.path)) for m in self.pool_members)

  def _read_pool(self):  # IO thread
    """The pool's members; a `ConfigError` for a pool that cannot be read or whose member
    names clash with the base or a configured variant."""
    cfg = self.cfg
    try:
      members = read_pool(cfg.kmerge_pool)
    except RegistryError as e:
      raise ConfigError(f"kmerge_pool: {e}") from None
    taken = {n: "a configured variant" for n, _ in cfg.variants}
    taken[cfg.model_id] = "the base model"
    for m in members:
      if m.id in taken:
        raise ConfigError(f"kmerge_pool: member {m.id!r} of {cfg.kmerge_pool} has the name of "
                          f"{taken[m.id]}; rename that variant")
    return members

  def _add_pool_tasks(self) -> None:
    """Each task of the pool's routing becomes a model name answered by its member (a
    registry alias). A task named like the base, a variant or a member is a `ConfigError`."""
    for m in self.pool_members:
      if m.id in self.bad_variants:  # left out with --skip-bad-variants: so are its tasks
        for t in m.tasks:
          self.bad_variants[t] = f"its K-Merge member {m.id!r} fails its start-up checks"
        continue
      for t in m.tasks:
        try:
          self.registry.add_alias(t, m.id)
        except RegistryError as e:
          raise ConfigError(f"kmerge_pool: task {t!r} of {self.cfg.kmerge_pool} cannot be "
                            f"served: {e}") from None

  async def _add_config_variants(self) -> None:
    """Checks every configured variant (directory, manifest, base, arrays) before the model
    loads. A failure is a `BadVariantsError` naming each variant and why, unless
    ``skip_bad_variants``: then the variant is left out and `/health` reports it."""
    loop, cfg = asyncio.get_running_loop(), self.cfg

    def check(name, path):  # IO thread
      name, p = self.registry.check(name, path, source="config")
      return p, self.registry.inspect(p, self._base_check, verify=cfg.verify_variants)

    members = {m.id for m in self.pool_members}
    futs = [loop.run_in_executor(self.io, check, n, p) for n, p in self.configured]
    results = await asyncio.gather(*futs, return_exceptions=True)
    for (name, _), res in zip(self.configured, results, strict=True):
      if isinstance(res, BaseException):
        if not isinstance(res, RegistryError | DeltaStoreError | DeltaMismatchError | OSError
                          | ValueError):
          raise res
        where = f"member of the K-Merge pool {cfg.kmerge_pool}: " if name in members else ""
        self.bad_variants[name] = where + str(res)
        continue
      p, info = res
      self.registry.add(name, p, info, source="kmerge" if name in members else "config")
    if self.bad_variants:
      if not cfg.skip_bad_variants:
        raise BadVariantsError(self.bad_variants)
      for name, why in self.bad_variants.items():
        log.warning("variant %s left out (it fails its start-up checks): %s", name, why)

  async def cleanup(self, _app=None) -> None:
    if self.engine is not None:
      await asyncio.get_running_loop().run_in_executor(None, self.engine.stop,
                                                       self.engine_stop_s)
    self.io.shutdown(wait=False, cancel_futures=True)

  async def drain(self, runner: web.AppRunner, grace_s: float, say=log.warning) -> None:
    """Stops serving in about ``grace_s`` seconds (SIGINT / SIGTERM; `runner.cleanup` follows).

    The port closes, and a request that still arrives on an open connection gets a 503
    (``server_shutting_down``). Requests in flight may finish for ``grace_s``; then every
    engine request still running is ended with an error (a stream gets an error event and
    ``[DONE]``, a non-streamed request a 503), and the handlers get `CUTOFF_S` to send it.
    ``say`` reports each stage (how many requests it waits for)."""
    loop = asyncio.get_running_loop()
    self.stopping = True
    self.engine_stop_s = ENGINE_STOP_S
    for site in list(runner.sites):
      await site.stop()
    if not self.in_flight:
      say("stopping: no requests in flight")
      return
    t0 = loop.time()
    say(f"stopping: no new requests; waiting up to {grace_s:g} s for {self.in_flight} "
        "in-flight request(s) to finish (signal again to exit now)")
    if await self._wait_idle(grace_s):
      say(f"stopping: the requests in flight finished in {loop.time() - t0:.1f} s")
      return
    left = self.in_flight
    ended = self.router.end_all("server shutting down", "server_shutting_down")
    say(f"stopping: {left} request(s) still running after {grace_s:g} s; ending them with an "
        f"error ({ended} engine sequence(s))")
    if not await self._wait_idle(CUTOFF_S):
      self.engine_stop_s = 1.0
      say(f"stopping: {self.in_flight} request(s) did not end within {CUTOFF_S:g} s; closing "
          "their connections")

  async def _wait_idle(self, timeout: float) -> bool:
    """True once no handler runs (at most ``timeout`` seconds)."""
    if not self.in_flight:
      return True
    self._idle = asyncio.Event()
    try:
      await asyncio.wait_for(self._idle.wait(), timeout)
    except TimeoutError:
      return False
    return True

  def admit(self, rows: int, model: str, endpoint: str) -> None:
    """Admits a generation request of ``rows`` sequences, or refuses it with a 429 (Retry-After)
    when the sequences already admitted plus these pass `ServerConfig.admission_limit`. A
    request alone on the server is always admitted (its size is bounded by the body checks)."""
    limit = self.cfg.admission_limit
    if self.admitted_rows and self.admitted_rows + rows > limit:
      self.metrics.rejected.labels("queue_full").inc()
      self.metrics.requests.labels(model, endpoint, "429").inc()
      raise P.ApiError(429, f"the server is at capacity ({self.admitted_rows} sequences admitted, "
                       f"at most {limit}: --max-batch + --max-queued-requests); retry later",
                       code="queue_full", headers={"Retry-After": "1"})
    self.admitted_rows += rows

  def _enter(self) -> None:
    self.in_flight += 1

  def _leave(self) -> None:
    self.in_flight -= 1
    if not self.in_flight and self._idle is not None:
      self._idle.set()

  def _base_check(self, manifest: dict, where: str) -> None:
    check_base(manifest, self.base_fp, where=where)

  def _read_delta(self, v):  # IO thread
    """What the variant's slot load writes (`bitdelta_jax.delta.variant`): its arrays or LoRA
    entries; with several processes a reference each process reads its own slices from."""
    var = open_variant(v.path)
    if self.cfg.multi_process:  # (bitdelta_jax/engine/multihost/leader.py)
      from bitdelta_jax.engine.multihost.leader import VariantRef

      if var.kind == "delta":
        self._base_check(var.manifest, str(v.path))
      return VariantRef(str(v.path), adapter=var.kind == "lora")
    return var.slot_payload(base_fingerprint=self.base_fp)

  def _write_slot(self, slot: int, delta) -> concurrent.futures.Future:
    return self.engine.call(lambda gen: gen.load_variant(slot, delta))

  # -- generation ------------------------------------------------------------------------------
  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await generate(self, request, chat=False)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await generate(self, request, chat=True)

  # -- models ----------------------------------------------------------------------------------
  def _model_obj(self, name: str, created: float, parent: str | None) -> dict:
    obj = {"id": name, "object": "model", "created": int(created), "owned_by": "bitdelta-jax",
           "root": self.cfg.model_id, "parent": parent}
    if parent is None:
      return obj
    a = self.registry.alias_of(name)
    if a is not None:  # a K-Merge task: answered by its member's adapter
      obj["kmerge_member"] = a.target
      obj["kmerge_tasks"] = self.registry.tasks_of(a.target)
    elif tasks := self.registry.tasks_of(name):  # a K-Merge member
      obj["kmerge_tasks"] = tasks
    return obj

  async def models(self, request: web.Request) -> web.Response:
    base = self.cfg.model_id
    data = [self._model_obj(base, self.started, None)]
    data += [self._model_obj(v.name, v.registered_at, base) for v in self.registry.all()]
    data += [self._model_obj(a.name, a.registered_at, base) for a in self.registry.aliases()]
    return web.json_response({"object": "list", "data": data})

  async def model(self, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == self.cfg.model_id:
      return web.json_response(self._model_obj(name, self.started, None))
    v = self.registry.get(name)
    if v is None:
      raise unknown(name)
    a = self.registry.alias_of(name)
    created = a.registered_at if a is not None else v.registered_at
    return web.json_response(self._model_obj(name, created, self.cfg.model_id))

  # -- admin -----------------------------------------------------------------------------------
  def _variant_info(self, v) -> dict:
    top = self.cache.top_n()
    return {
      "id": v.name, "object": "variant", "parent": self.cfg.model_id, "path": str(v.path),
      "source": v.source, "tier": self.cache.tier(v), "bytes": v.nbytes,
      "host_bytes": v.host_bytes, "device_slot": v.slot if self.cache.tier(v) == "device" else None,
      "loading": v.name in self.cache.loading, "loads": v.loads,
      "last_load_time": v.last_load_time, "last_load_seconds": v.last_load_seconds,
      "last_load_source": v.last_load_source, "requests": v.requests, "in_flight": v.in_flight,
      "pinned": "explicit" if v.name in self.cache.explicit_pins else (
        "top_n" if v.name in top else None),
      "request_rate": round(v.decayed_rate(self.cache.clock(), self.cfg.rate_half_life_s), 4),
      "last_error": v.load_error, "created": int(v.registered_at),
    }

  async def list_variants(self, request: web.Request) -> web.Response:
    return web.json_response({"object": "list",
                              "data": [self._variant_info(v) for v in self.registry.all()],
                              **self.cache.snapshot()})

  async def add_variant(self, request: web.Request) -> web.Response:
    body = await P.read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
    name, path = body.get("name"), body.get("path")
    if name is None:
      raise P.invalid("name", "is required")
    if path is None:
      raise P.invalid("path", "is required")
    try:
      name, p = self.registry.check(name, path, source="admin")
      info = await asyncio.get_running_loop().run_in_executor(
        self.io, lambda: self.registry.inspect(p, self._base_check,
                                               verify=self.cfg.verify_variants))
      v = self.registry.add(name, p, info, source="admin")
    except RegistryError as e:
      raise P.ApiError(e.status, str(e), param=e.param, code=e.code) from None
    except (DeltaStoreError, DeltaMismatchError, OSError) as e:  # OSError: e.g. unreadable
      raise P.ApiError(400, f"path: {e}", param="path", code="invalid_delta") from None
    self.metrics.set_tier(v.name, "disk")
    log.info("registered variant %s -> %s", v.name, v.path)
    return web.json_response(self._variant_info(v), status=201)

  async def delete_variant(self, request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == self.cfg.model_id:
      raise P.ApiError(400, "the base model cannot be deleted", param="name")
    try:
      v = await self.registry.remove(name, self.cache.drop, grace_s=self.cfg.delete_grace_s)
    except KeyError:
      raise unknown(name) from None
    log.info("deleted variant %s", name)
    return web.json_response({"id": v.name, "object": "model", "deleted": True})

  # -- health / metrics ------------------------------------------------------------------------
  async def health(self, request: web.Request) -> web.Response:
    e = self.engine
    lost = e.lost if e is not None else None
    ok = e is not None and e.alive and not lost
    extra = {"error": lost} if lost else {}
    if self.bad_variants:  # serving, but without these (--skip-bad-variants)
      extra["skipped_variants"] = dict(self.bad_variants)
    if self.cfg.multi_process:
      extra["processes"] = self.cfg.num_processes
      r = getattr(getattr(e, "gen", None), "runner", None)
      if r is not None and hasattr(r, "plans"):  # what the followers were sent (plain ints)
        extra["plans"] = {"sent": r.plans, "bytes": r.plan_bytes,
                          "send_ms_mean": round(1e3 * r.send_s / max(r.plans, 1), 3)}
    r = getattr(getattr(e, "gen", None), "runner", None)
    if r is not None and getattr(r, "warm", False):  # plain ints, read without the device
      extra["compiled_programs"] = r.compiled_programs
      extra["compiles_after_warmup"] = r.compiles_after_warmup
      if hasattr(r, "ready_buckets"):  # token buckets a step may use; the rest compiling
        extra["buckets"] = {"ready": list(r.ready_buckets(e.gen.base_only)),
                            "compiling": e.gen.pending_buckets}
    stalled = e.stall_report() if e is not None else None
    if stalled:
      extra["stalled"] = stalled
    failed = e.failure_report() if e is not None else None
    if failed:
      extra["step_failures"] = failed
    status = "unavailable" if not ok and not lost else "degraded" if (
      lost or self.bad_variants or stalled or failed) else "ok"
    return web.json_response({
      "status": status, **extra,
      "model": self.cfg.model_id,
      "variants": len(self.registry.all()) if self.registry else 0,
      "active_rows": e.active_rows if e else 0, "queue_depth": e.queue_depth if e else 0,
      "admitted_sequences": self.admitted_rows, "admission_limit": self.cfg.admission_limit,
      "uptime_s": round(time.time() - self.started, 3),
    }, status=200 if ok else 503)

  async def metrics_route(self, request: web.Request) -> web.Response:
    return web.Response(body=self.metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def _read_manifests(variants) -> dict:
  """Each configured variant's manifest (`bitdelta_jax.delta.variant.open_variant`), or the
  error reading it."""
  out = {}
  for name, path in variants:
    try:
      out[name] = open_variant(path).manifest
    except (DeltaStoreError, OSError, ValueError) as e:
      out[name] = e
  return out


# -- middleware -------------------------------------------------------------------------------
def _count(request: web.Request, status: int) -> None:
  resource = request.match_info.route.resource
  route = resource.canonical if resource is not None else "unmatched"
  request.app[SERVER_KEY].metrics.responses.labels(route, str(status)).inc()


@web.middleware
async def _errors(request: web.Request, handler):
  status = 500
  try:
    limit = request.app[MAX_BODY]
    if (request.content_length or 0) > limit:  # refused before a byte of it is read
      raise P.ApiError(413, f"the request body ({request.content_length} bytes declared) is "
                       f"larger than the limit ({limit} bytes)", code="request_too_large",
                       headers={"Connection": "close"})
    resp = await handler(request)
    status = resp.status
    return resp
  except P.ApiError as e:
    status = e.status
    return web.json_response(e.body(), status=e.status, headers=e.headers)
  except web.HTTPException as e:
    status = e.status
    if e.status < 400:
      raise
    msg = {413: f"the request body is larger than the limit ({request.app[MAX_BODY]} bytes)"}
    body = P.error_body(msg.get(e.status, e.reason), "invalid_request_error",
                        code={404: "not_found", 405: "method_not_allowed",
                              413: "request_too_large"}.get(e.status))
    headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
    return web.json_response(body, status=e.status, headers=headers)
  except (ConnectionError, asyncio.CancelledError):
    status = 499  # client closed the request (nginx's code); nothing is sent
    raise
  except Exception as e:  # noqa: BLE001  nothing crashes the server
    log.exception("unhandled error in %s %s", request.method, request.path)
    return web.json_response(
      P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status=500)
  finally:
    _count(request, status)


@web.middleware
async def _track(request: web.Request, handler):
  """Counts the handlers in flight (`Server.drain` waits for them); once the server is
  stopping, a new request is a 503."""
  server = request.app[SERVER_KEY]
  if server.stopping:
    raise P.ApiError(503, "the server is shutting down", code="server_shutting_down")
  server._enter()
  try:
    return await handler(request)
  finally:
    server._leave()


def _bearer(request: web.Request) -> str | None:
  header = request.headers.get("Authorization", "")
  return (header[7:].strip() or None) if header[:7].lower() == "bearer " else None


def _is(token: str | None, key: str | None) -> bool:
  return token is not None and key is not None and hmac.compare_digest(token.encode(),
                                                                       key.encode())


def _auth(api_key: str | None, admin_key: str | None):
  """``/health`` is open. The admin routes (``/v1/variants``) take the admin key; the inference
  key there is a 403, and with an inference key but no admin key they are off (403). Every
  other route takes either key when an inference key is set, and is open when none is (an
  admin key alone guards only the admin routes)."""

  def refuse(status: int, msg: str, code: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return web.json_response(P.error_body(msg, "invalid_request_error", code=code),
                             status=status, headers=headers)

  @web.middleware
  async def auth(request: web.Request, handler):
    if request.path == "/health":
      return await handler(request)
    admin = request.path == "/v1/variants" or request.path.startswith("/v1/variants/")
    if admin:  # the keys a route takes; None: open
      keys = (admin_key,) if admin_key is not None else () if api_key is not None else None
    else:
      keys = (api_key, admin_key) if api_key is not None else None
    token = _bearer(request)
    if keys is None or any(_is(token, k) for k in keys):
      return await handler(request)
    if admin and _is(token, api_key):
      why = ("the admin routes need the admin key, not the API key" if admin_key is not None
             else "the admin routes are off: this server has an API key and no admin key (start "
             "it with --admin-key)")
      return refuse(403, why, "admin_key_required")
    if admin and admin_key is not None:
      return refuse(401, "missing or incorrect admin key (send 'Authorization: Bearer <admin "
                    "key>')", "invalid_api_key")
    return refuse(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                  "invalid_api_key")

  return auth


def build_app(cfg: ServerConfig) -> tuple[web.Application, Server]:
  server = Server(cfg)
  app = web.Application(client_max_size=cfg.max_body_bytes,
                        middlewares=[_errors, _track, _auth(cfg.api_key, cfg.admin_key)])
  app[MAX_BODY] = cfg.max_body_bytes
  app[SERVER_KEY] = server
  app.on_startup.append(server.startup)
  app.on_cleanup.append(server.cleanup)
  r = app.router
  r.add_post("/v1/completions", server.completions)
  r.add_post("/v1/chat/completions", server.chat_completions)
  r.add_get("/v1/models", server.models)
  r.add_get("/v1/models/{name}", server.model)
  r.add_get("/v1/variants", server.list_variants)
  r.add_post("/v1/variants", server.add_variant)
  r.add_delete("/v1/variants/{name}", server.delete_variant)
  r.add_get("/health", server.health)
  r.add_get("/metrics", server.metrics_route)
  return app, server


# -- running ----------------------------------------------------------------------------------
def check_port(host: str, port: int) -> None:
  """Binds (and releases) ``host:port`` as the server will, so that a port in use fails in a
  second, before the model loads; a `ConfigError` names the address. Port 0 always works."""
  if port == 0:
    return
  try:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
  except (OSError, UnicodeError) as e:
    raise ConfigError(f"host: cannot resolve {host!r} ({e})") from None
  for family, kind, proto, _, addr in infos:
    with socket.socket(family, kind, proto) as sock:
      if os.name == "posix":  # as asyncio's create_server: TIME_WAIT does not block a restart
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
      try:
        sock.bind(addr)
      except OSError as e:
        raise ConfigError(f"port: cannot listen on {host}:{port} ({e.strerror or e}); is another "
                          "server running there? Choose another with --port") from None


def with_gguf_base(cfg: ServerConfig) -> ServerConfig:
  """``cfg`` with a ``.gguf`` base replaced by its metadata directory (config, tokenizer and a
  pointer to the file: `bitdelta_jax.hf.gguf_checkpoint.resolve_base`); others as they are."""
  from bitdelta_jax.hf.gguf_checkpoint import is_gguf_dir, resolve_base

  if str(cfg.base).endswith(".gguf"):
    if Path(cfg.base).is_dir() and not (Path(cfg.base) / "config.json").is_file():
      raise ConfigError(f"base: {cfg.base} is a directory, not a GGUF file")
    if not Path(cfg.base).exists():
      raise ConfigError(f"base: {cfg.base} does not exist")
    if Path(cfg.base).is_file():
      cfg = dataclasses.replace(cfg, base=str(resolve_base(cfg.base)))
  if cfg.base_source is not None:
    from bitdelta_jax.hf.lineage import LineageError, establish

    if not is_gguf_dir(cfg.base):
      raise ConfigError(f"base_source: applies to a GGUF base; {cfg.base} is a checkpoint "
                        "directory")
    try:
      rec = establish(cfg.base, cfg.base_source)
    except LineageError as e:
      raise ConfigError(f"base_source: {e}") from None
    log.info("base source: %s", rec["how"])
  return cfg


def check_base_dir(cfg: ServerConfig) -> None:
  """What can be checked of ``cfg.base`` before the model loads, as `ConfigError`s naming
  the option: it is an HF model directory (not a delta, a file, nothing), its context holds
  ``max_seq_len``, and the KV cache holds one sequence of ``max_seq_len`` tokens."""
  from bitdelta_jax.models.loading import load_config
  from bitdelta_jax.outputs import describe, output_kind

  base = Path(cfg.base)
  if output_kind(base) == "delta":
    raise ConfigError(f"base: {base} is a bitdelta delta store; --base takes the base model the "
                      "deltas were compressed against (serve the delta with --variant "
                      "NAME=DIR)")
  if not base.is_dir() or not (base / "config.json").is_file():
    what = describe(base) if not base.is_dir() else "a directory without config.json"
    raise ConfigError(f"base: {base} is {what}; expected an HF model directory (config.json, "
                      "*.safetensors, tokenizer.json)")
  mc = load_config(base)
  if cfg.max_seq_len > mc.max_position_embeddings:
    raise ConfigError(f"max_seq_len: {cfg.max_seq_len} is longer than the base's context "
                      f"(max_position_embeddings {mc.max_position_embeddings} in "
                      f"{base / 'config.json'}); lower --max-seq-len")
  try:
    kv_pages(cfg, mc)
  except ValueError as e:
    raise ConfigError(str(e)) from None


async def start_site(cfg: ServerConfig, *, shutdown_timeout: float = 60.0,
                     ) -> tuple[web.AppRunner, Server, int]:
  """Checks, builds and starts the server; ``shutdown_timeout``: how long ``runner.cleanup``
  waits for handlers in flight before cancelling them (the CLI drains them first)."""
  check_port(cfg.host, cfg.port)
  cfg = with_gguf_base(cfg)
  check_base_dir(cfg)
  app, server = build_app(cfg)
  # request bodies are decoded by serving.protocol.decode_body (JSON errors, bounded size)
  # keepalive_timeout: a connection is closed once it has been this long without a whole
  # request head, from its opening or its last response (a slow-header client included)
  runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False,
                         shutdown_timeout=shutdown_timeout, keepalive_timeout=cfg.header_timeout_s)
  malformed_log.install()
  try:
    await runner.setup()  # runs startup: model load + compile on the device thread
  except BaseException:
    await runner.cleanup()
    raise
  site = web.TCPSite(runner, cfg.host, cfg.port)
  await site.start()
  port = site._server.sockets[0].getsockname()[1]  # the real port when cfg.port == 0
  return runner, server, port


class ServerThread:
  """A real server on its own event loop in a background thread (tests, benchmarks)."""

  def __init__(self, cfg: ServerConfig):
    self.cfg = cfg
    self.loop: asyncio.AbstractEventLoop | None = None
    self.server: Server | None = None
    self.port: int | None = None
    self._ready = threading.Event()
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None

  @property
  def url(self) -> str:
    return f"http://{self.cfg.host}:{self.port}"

  def start(self, timeout: float = 600) -> ServerThread:
    self._thread = threading.Thread(target=self._run, name="bitdelta-http", daemon=True)
    self._thread.start()
    if not self._ready.wait(timeout):
      raise TimeoutError("server did not start")
    if self._error is not None:
      raise self._error
    return self

  def _run(self) -> None:
    loop = self.loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
      runner, self.server, self.port = loop.run_until_complete(start_site(self.cfg))
    except BaseException as e:  # noqa: BLE001
      self._error = e
      self._ready.set()
      loop.close()
      return
    self._ready.set()
    try:
      loop.run_forever()
    finally:
      loop.run_until_complete(runner.cleanup())
      loop.close()

  def call(self, fn, timeout: float = 60):
    """Runs ``fn()`` (a coroutine function or plain function) on the server's loop."""
    async def wrap():
      r = fn()
      return await r if asyncio.iscoroutine(r) else r
    return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

  def stop(self) -> None:
    if self.loop is not None and self._thread is not None and self._thread.is_alive():
      self.loop.call_soon_threadsafe(self.loop.stop)
      self._thread.join(60)

  def __enter__(self) -> ServerThread:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


__all__ = ["BadVariantsError", "ConfigError", "Server", "ServerThread", "build_app", "start_site"]
