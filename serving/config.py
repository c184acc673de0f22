"""Server configuration: one frozen dataclass, built by the CLI or from a JSON file.

    cfg = ServerConfig(base="ckpt/base", variants=(("math", "deltas/math"),), device_slots=4)
    cfg = ServerConfig.from_file("serve.json", port=9000)      # file, then overrides
    cfg = cfg.replace(port=0)

A config file holds the same field names (``variants`` as an object ``{name: path}``; relative
paths are resolved against the file's directory). Every value is checked in ``__post_init__``;
an invalid one raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pallas_kernels import settings

# Variant / model names: what may appear in a request's ``model`` field. No slashes, no "..".
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
MESH_RE = re.compile(r"^\s*(data|model)\s*=\s*[1-9][0-9]*\s*(,\s*(data|model)\s*=\s*[1-9][0-9]*\s*)?$")


class ConfigError(ValueError):
  """An invalid server configuration value."""


def check_name(name: Any, what: str = "name") -> str:
  if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
    raise ConfigError(
      f"{what} {name!r} is not a valid model name (letters, digits, '_', '.', '-'; at most 128 "
      f"characters; starting with a letter or digit)"
    )
  return name


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Everything `serving.app` needs; see ``bitdelta serve --help`` for the meaning of each."""

  base: str
  variants: tuple[tuple[str, str], ...] = ()
  # a saved K-Merge pool (`bitdelta kmerge build`): each member is served from one LoRA slot
  # (as the variant named by its id), each task of its routing is a model answered by its member
  kmerge_pool: str | None = None
  # a GGUF base's unquantized source checkpoint (`bitdelta_jax.hf.lineage`): deltas compressed
  # against it serve over the file; checked once per file and recorded beside its metadata
  base_source: str | None = None
  base_name: str | None = None  # the base's model id; default: the base directory's name
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str | None = None  # inference routes (and /metrics) need it; /health never does
  # admin routes (/v1/variants) need it; with an api_key and no admin_key they are refused
  admin_key: str | None = None
  device_slots: int = 4  # variant slots on the device (the model gets device_slots + 1; 0 = base)
  host_cache_mb: float = 1024.0
  pins: tuple[str, ...] = ()
  top_n_pin: int = 0
  max_batch: int = 32  # most sequences decoding at once (a step runs only the live ones)
  # sequences admitted beyond max_batch (waiting for a row); past them a request gets a 429 with
  # Retry-After (None: 4 x max_batch)
  max_queued_requests: int | None = None
  max_seq_len: int = 2048  # prompt + generated tokens per sequence
  page_size: int = 16  # tokens per KV-cache page
  kv_cache_mb: float | None = None  # KV-cache pool, MiB; None: sized to fit (`build.kv_pages`)
  prefill_chunk: int = 512  # prompt tokens per engine iteration (longer prompts are chunked)
  prefix_caching: bool = True  # reuse the KV pages of shared prompt prefixes, per variant
  dtype: str = "float32"
  max_body_bytes: int = 1 << 20  # a larger declared Content-Length is a 413 before reading
  # a connection that has not sent a whole request head this long after opening (or after its
  # last response) is closed; a request body must arrive within body_timeout_s (else 408)
  header_timeout_s: float = 30.0
  body_timeout_s: float = 30.0
  default_max_tokens: int = 128
  rate_half_life_s: float = 60.0  # decay of the per-variant request-rate counter (eviction)
  load_retry_s: float = 5.0  # after a failed load, requests fail fast for this long
  # POST /v1/variants paths must lie under one of these; () means the directories holding the
  # configured variants plus the cache root (`variant_roots`); ("/",) allows any path
  admin_roots: tuple[str, ...] = ()
  verify_base: bool = True  # check each delta's base fingerprint (crc of every base tensor)
  verify_variants: bool = True  # at start, read each configured delta once and check its crc32s
  skip_bad_variants: bool = False  # serve without a variant that fails its start-up checks
  lora_rank: int | None = None  # LoRA slot rank; None: the largest rank of configured adapters
  extra_vocab: int | None = None  # added-token rows per slot; None: what configured variants add
  embedding_slots: bool | None = None  # per-slot embedding/LM-head banks; None: if a variant needs
  warmup: bool = True  # compile every step program (each token bucket and form) before serving
  # serve once the decode buckets are compiled; the prefill buckets compile in the background
  background_compile: bool = True
  # after the warm-up, a step that would compile raises instead (the request fails); otherwise
  # it compiles on the device thread and is counted (/health "compiles_after_warmup")
  forbid_compile_after_warmup: bool = dataclasses.field(
    default_factory=lambda: settings.get("BITDELTA_FORBID_COMPILE_AFTER_WARMUP"))
  io_threads: int = 2
  # scale-out (docs/SCALING.md): a device mesh, and several processes over one global mesh
  mesh: str | None = None  # "data=D,model=M"; None: one device (or all devices, multi-process)
  coordinator: str | None = None  # HOST:PORT of process 0's jax.distributed coordinator
  num_processes: int = 1
  process_id: int = 0  # 0 runs the HTTP front; the others follow its step plans
  step_timeout_s: float = 120.0  # a distributed step slower than this means a lost worker
  # every process must join, build its model and compile its steps within this long (several
  # processes; a straggler within it is waited for)
  start_timeout_s: float = 600.0
  # a sequence the scheduler neither computed nor deferred for this long is failed (its pages
  # and variant slot released); /health says "degraded" from half of it
  stall_timeout_s: float = 60.0
  delete_grace_s: float = 10.0  # DELETE /v1/variants/NAME: in-flight requests then get an error
  # SIGINT / SIGTERM: in-flight requests may finish for this long, then get an error (a second
  # signal exits at once)
  shutdown_grace_s: float = 10.0
  # engine steps that may fail in a row (each fails its requests, then the engine recovers)
  # before the server exits non-zero for its supervisor to restart it
  max_step_failures: int = 3

  def __post_init__(self):
    def need(cond: bool, field: str, msg: str):
      if not cond:
        raise ConfigError(f"{field}: {msg}")

    need(isinstance(self.base, str) and self.base != "", "base", "a base model directory is required")
    need(0 <= int(self.port) < 65536, "port", f"must be in [0, 65535], got {self.port}")
    need(self.host_cache_mb >= 0, "host_cache_mb", f"must be >= 0, got {self.host_cache_mb}")
    need(self.max_queued_requests is None or self.max_queued_requests >= 0,
         "max_queued_requests", f"must be >= 0, got {self.max_queued_requests}")
    need(self.top_n_pin >= 0, "top_n_pin", f"must be >= 0, got {self.top_n_pin}")
    for key in ("header_timeout_s", "body_timeout_s"):
      need(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
    for key in ("api_key", "admin_key"):
      k = getattr(self, key)
      need(k is None or (isinstance(k, str) and k.strip() == k and k != ""), key,
           "must be a non-empty string without surrounding spaces")
    need(self.admin_key is None or self.admin_key != self.api_key, "admin_key",
         "must differ from api_key (a client that may generate could otherwise administer)")
    need(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024")
    need(self.default_max_tokens >= 1, "default_max_tokens", "must be >= 1")
    need(self.rate_half_life_s > 0, "rate_half_life_s", "must be > 0")
    need(self.io_threads >= 1, "io_threads", "must be >= 1")
    need(self.extra_vocab is None or self.extra_vocab >= 0, "extra_vocab",
         f"must be >= 0, got {self.extra_vocab}")
    need(self.kmerge_pool is None or (isinstance(self.kmerge_pool, str) and self.kmerge_pool != ""),
         "kmerge_pool", f"expected a pool directory, got {self.kmerge_pool!r}")
    names = [check_name(n, "variant name") for n, _ in self.variants]
    need(len(set(names)) == len(names), "variants", "duplicate variant name")
    if self.base_name is not None:
      check_name(self.base_name, "base_name")
    need(self.model_id not in names, "variants", f"a variant is named like the base ({self.model_id!r})")
    for p in self.pins:
      need(p in names, "pins", f"pinned variant {p!r} is not among the configured variants")
    need(len(set(self.pins)) + self.top_n_pin <= self.device_slots, "pins",
         f"{len(set(self.pins))} explicit pins + top_n_pin {self.top_n_pin} exceed device_slots "
         f"{self.device_slots}")
    need(self.mesh is None or bool(MESH_RE.match(self.mesh)), "mesh",
         f"expected 'data=D,model=M' (either axis may be left out), got {self.mesh!r}")
    need(self.delete_grace_s >= 0, "delete_grace_s", f"must be >= 0, got {self.delete_grace_s}")
    need(self.shutdown_grace_s >= 0, "shutdown_grace_s",
         f"must be >= 0, got {self.shutdown_grace_s}")
    try:  # the engine's fields (rows, KV cache, dtype, processes, timeouts): its own checks
      self.engine_config()
    except ValueError as e:
      raise ConfigError(str(e)) from None

  # -- derived -------------------------------------------------------------------------------
  @property
  def admission_limit(self) -> int:
    """Sequences (prompts x n) admitted at once: max_batch running + max_queued_requests
    waiting (4 x max_batch when unset)."""
    queued = 4 * self.max_batch if self.max_queued_requests is None else self.max_queued_requests
    return self.max_batch + queued

  def variant_roots(self) -> tuple[Path, ...]:
    """The directories ``POST /v1/variants`` may load from: ``admin_roots`` when given, else
    the directories holding the configured variants (and the K-Merge pool) plus the cache root
    (`pallas_kernels.cache.cache_root`, where the zoo writes)."""
    from pallas_kernels.cache import cache_root

    if self.admin_roots:
      roots = [Path(r) for r in self.admin_roots]
    else:
      roots = [Path(p).parent for _, p in self.variants] + [cache_root()]
      if self.kmerge_pool is not None:
        roots.append(Path(self.kmerge_pool))
    return tuple(dict.fromkeys(Path(os.path.abspath(r)).resolve() for r in roots))

  @property
  def model_id(self) -> str:
    return self.base_name or Path(self.base).resolve().name or "base"

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  def engine_config(self):
    """The `bitdelta_jax.engine.config.EngineConfig` of these fields (what the engine, the
    generator builder and the multi-process runtime read)."""
    from bitdelta_jax.engine.config import EngineConfig

    return EngineConfig.of(self)

  @property
  def distributed(self):
    """The `bitdelta_jax.engine.multihost.runtime.DistributedConfig` of these fields."""
    return self.engine_config().distributed

  @property
  def host_cache_bytes(self) -> int:
    return int(self.host_cache_mb * (1 << 20))

  @property
  def max_prompt_tokens(self) -> int:
    """Longest prompt accepted: room for one generated token (long prompts are chunked)."""
    return self.max_seq_len - 1

  def replace(self, **kw) -> ServerConfig:
    return dataclasses.replace(self, **kw)

  # -- files ---------------------------------------------------------------------------------
  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, root: str | os.PathLike | None = None,
                **overrides) -> ServerConfig:
    """Builds a config from a JSON-like mapping; relative paths resolve against ``root``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if "buckets" in unknown:
      raise ConfigError("buckets: no longer used (the one engine chunks prompts of any length "
                        "up to max_seq_len); remove it")
    if unknown:
      raise ConfigError(f"{unknown[0]}: unknown config field (known: {', '.join(sorted(fields))})")
    kw = dict(d)

    def path(p: Any, field: str) -> str:
      if not isinstance(p, str) or not p:
        raise ConfigError(f"{field}: expected a path string, got {p!r}")
      return str(Path(root) / p) if root is not None and not os.path.isabs(p) else p

    if "base" in kw:
      kw["base"] = path(kw["base"], "base")
    if kw.get("kmerge_pool") is not None:
      kw["kmerge_pool"] = path(kw["kmerge_pool"], "kmerge_pool")
    if "variants" in kw:
      v = kw["variants"]
      items = v.items() if isinstance(v, Mapping) else v
      try:
        kw["variants"] = tuple((str(n), path(p, f"variants.{n}")) for n, p in items)
      except (TypeError, ValueError) as e:
        raise ConfigError(f"variants: expected {{name: path}} ({e})") from None
    for key in ("pins", "admin_roots"):
      if key in kw:
        if not isinstance(kw[key], list | tuple):
          raise ConfigError(f"{key}: expected a list, got {type(kw[key]).__name__}")
        kw[key] = tuple(kw[key])
    if "admin_roots" in kw:
      kw["admin_roots"] = tuple(path(p, "admin_roots") for p in kw["admin_roots"])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    try:
      return cls(**kw)
    except TypeError as e:
      raise ConfigError(str(e)) from None

  @classmethod
  def from_file(cls, path: str | os.PathLike, **overrides) -> ServerConfig:
    p = Path(path)
    try:
      d = json.loads(p.read_text())
    except OSError as e:
      raise ConfigError(f"{p}: cannot read config file ({e.strerror})") from None
    except json.JSONDecodeError as e:
      raise ConfigError(f"{p}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
      raise ConfigError(f"{p}: a config file holds a JSON object")
    return cls.from_dict(d, root=p.parent, **overrides)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["variants"] = dict(self.variants)
    d["api_key"] = None if self.api_key is None else "***"
    d["admin_key"] = None if self.admin_key is None else "***"
    return d
