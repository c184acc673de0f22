"""What the engine is configured with: `EngineConfig`, and the `Metrics` it records into.

    cfg = EngineConfig(base="ckpt/base", max_batch=8, max_seq_len=512)
    engine = Engine(cfg)                                   # a library user: no server needed
    cfg = server_config.engine_config()                    # what `serving` hands the engine

The engine, the generator builder and the multi-process runtime read only these fields; the
server's own options (ports, keys, caches, variants) stay in `serving.config.ServerConfig`,
which builds this from its fields of the same names. Values are checked once, in
``__post_init__``, as `ValueError`s naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from pallas_kernels import settings


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  base: str  # an HF checkpoint directory, or a GGUF base's metadata directory
  dtype: str = "float32"  # of the base weights and activations on the device
  device_slots: int = 4  # variant slots (the model gets device_slots + 1; slot 0 = the base)
  max_batch: int = 32  # most sequences decoding at once (a step runs only the live ones)
  max_seq_len: int = 2048  # prompt + generated tokens per sequence
  page_size: int = 16  # tokens per KV-cache page
  # KV-cache pool, MiB (pages are shared by all sequences); None: sized to fit
  # (`build.kv_pages`: 4096 tokens or two sequences, at most 1024 MiB)
  kv_cache_mb: float | None = None
  prefill_chunk: int = 512  # prompt tokens per engine iteration (longer prompts are chunked)
  prefix_caching: bool = True  # reuse the KV pages of shared prompt prefixes, per variant
  warmup: bool = True  # compile every step program before serving
  # with warmup, one process: ready once the decode buckets' programs are (up to max_batch
  # tokens a step); the larger prefill buckets compile in the background meanwhile
  background_compile: bool = True
  # a step that would compile then raises (default: $BITDELTA_FORBID_COMPILE_AFTER_WARMUP)
  forbid_compile_after_warmup: bool = dataclasses.field(
    default_factory=lambda: settings.get("BITDELTA_FORBID_COMPILE_AFTER_WARMUP"))
  # a sequence the scheduler neither computed nor deferred for this long is failed
  stall_timeout_s: float = 60.0
  max_step_failures: int = 3  # steps that may fail in a row before the engine gives up
  # scale-out (docs/SCALING.md)
  mesh: str | None = None  # "data=D,model=M"; None: one device (or all devices, multi-process)
  coordinator: str | None = None  # HOST:PORT of process 0's jax.distributed coordinator
  num_processes: int = 1
  process_id: int = 0  # 0 schedules; the others follow its step plans
  step_timeout_s: float = 120.0  # a distributed step slower than this means a lost worker
  start_timeout_s: float = 600.0  # every process joins, builds and compiles within this long

  def __post_init__(self):
    def need(cond: bool, field: str, msg: str):
      if not cond:
        raise ValueError(f"{field}: {msg}")

    need(isinstance(self.base, str) and self.base != "", "base", "a base model is required")
    need(self.dtype in ("float32", "bfloat16", "float16"), "dtype",
         f"must be float32, bfloat16 or float16, got {self.dtype!r}")
    for field, lo in (("device_slots", 1), ("max_batch", 1), ("max_seq_len", 8),
                      ("page_size", 1), ("prefill_chunk", 1), ("max_step_failures", 1),
                      ("num_processes", 1)):
      need(getattr(self, field) >= lo, field, f"must be >= {lo}, got {getattr(self, field)}")
    for field in ("kv_cache_mb", "stall_timeout_s", "step_timeout_s", "start_timeout_s"):
      value = getattr(self, field)
      need((value is None and field == "kv_cache_mb") or (value is not None and value > 0),
           field, f"must be > 0, got {value}")
    need(0 <= self.process_id < self.num_processes, "process_id",
         f"must be in [0, {self.num_processes}), got {self.process_id}")
    need(self.num_processes == 1 or bool(self.coordinator), "coordinator",
         "num_processes > 1 needs a coordinator HOST:PORT")

  @classmethod
  def of(cls, obj: Any) -> EngineConfig:
    """This config's fields read from ``obj`` (any object with attributes of the same names,
    e.g. `serving.config.ServerConfig`)."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})

  def replace(self, **kw) -> EngineConfig:
    return dataclasses.replace(self, **kw)

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  @property
  def sharded(self) -> bool:
    """Built through `bitdelta_jax.sharding` (a mesh was given, or several processes)."""
    return self.mesh is not None or self.multi_process

  @property
  def distributed(self):
    """The `bitdelta_jax.engine.multihost.runtime.DistributedConfig` of these fields."""
    from bitdelta_jax.engine.multihost.runtime import DistributedConfig

    return DistributedConfig(self.coordinator, self.num_processes, self.process_id, self.mesh,
                             step_timeout_s=self.step_timeout_s,
                             start_timeout_s=self.start_timeout_s)


class Metrics(Protocol):
  """What the engine records into (`serving.metrics.Metrics` is one; the engine alone records
  nothing). Each is a prometheus_client-style metric:"""

  ttft: Any  # .labels(model).observe(seconds): time to a request's first token
  itl: Any  # .labels(model).observe(seconds): time between its tokens
  generated_tokens: Any  # .labels(model).inc()
  queue_depth: Any  # .set(n): requests waiting for a row
  batch_rows: Any  # .set(n): rows in the step
  batch_occupancy: Any  # .set(fraction of max_batch)
  step_failures: Any  # .inc(): a step that raised
  stalled: Any  # .inc(n): sequences failed for making no progress
