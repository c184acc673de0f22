"""The engine's `Generator` from a configuration: the model on one device, a mesh or several
processes, its per-slot banks, its KV pages. Each is decided here once; the server's start-up
checks (`serving.app`) and the engine ask the same functions.

    banks = banks_for(manifests, vocab_size)   # which banks the variants need (`models.banks`)
    pages = kv_pages(cfg, model_config)                     # KV pages of each data group
    gen = build_generator(cfg, banks, tokenizer=tok)

``cfg`` is an `bitdelta_jax.engine.config.EngineConfig` (`kv_pages` and `data_size` read
only its fields: a server's `serving.config.ServerConfig` answers them too).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Callable

from bitdelta_jax.models.banks import Banks
from pallas_kernels import settings
from pallas_kernels.cache import cache_root

log = logging.getLogger("bitdelta_jax.engine")


def compile_cache_root() -> pathlib.Path | None:
  """Where compiled programs are kept between processes, by ``BITDELTA_COMPILE_CACHE``: unset or
  ``1`` the cache root (`pallas_kernels.cache.cache_root`), ``0`` nowhere (every start
  compiles), any other value a directory of its own (the test suite points it at one fresh
  directory per run, so a run shares its compiles and never touches the user's cache). Built
  native kernels stay in the cache root either way."""
  value = settings.get("BITDELTA_COMPILE_CACHE")
  if value == "0":
    return None
  return cache_root() if value == "1" else pathlib.Path(value)


def step_cache_dir() -> str | None:
  """Where compiled step programs are kept whole (`bitdelta_jax.engine.step_cache`):
  ``<compile cache>/steps``, or None (`compile_cache_root`)."""
  root = compile_cache_root()
  return None if root is None else str(root / "steps")


def enable_compile_cache() -> None:
  """Keeps compiled executables on disk (``<compile cache>/xla``, `compile_cache_root`) so a
  restarted process skips most of its compiles: programs that took 1 s or more to compile, or
  ``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` (JAX's own knob) when it is set. Does nothing
  when the cache is off or JAX's cache directory is already set."""
  import jax

  root = compile_cache_root()
  if root is None or jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def blocks_only(base) -> bool:
  """Whether ``base`` is a GGUF base whose every decoder linear weight is in ggml blocks: its
  steps derive nothing from the weights outside the block kernel (`quant_matmul`, any number of
  rows, each slot's delta fused), so XLA's default CPU scheduler keeps nothing large alive and
  `memory_scheduler` is not needed. Measured (bench/results/engine/memory.md): SmolLM2 Q4_1 peaks at
  2670 vs 2652 MiB and a 7B-shaped Q4_0 at ~the same with either scheduler once steps past 512
  rows took the kernel, and the default decodes SmolLM2 Q4_1 ~7-9% faster."""
  from bitdelta_jax.hf.gguf_checkpoint import GGUF_BASE_FILE, is_gguf_dir

  if base is None or not is_gguf_dir(base):
    return False
  import json

  from pallas_kernels.quant_matmul.blocks import FORMATS

  formats = json.loads((pathlib.Path(base) / GGUF_BASE_FILE).read_text()).get("formats") or {}
  linear = [f for name, f in formats.items()
            if ".layers." in name and name.endswith("proj.weight")]
  return bool(linear) and all(f in FORMATS for f in linear)


def memory_scheduler() -> bool:
  """Has XLA's CPU compiler order each program to minimize its memory (``XLA_FLAGS`` gets
  ``--xla_cpu_enable_concurrency_optimized_scheduler=false``) unless the flags name that option
  already; True when it is (or was) in effect. XLA reads its flags when the backend starts, so
  this works only before the first JAX computation of the process (`build_generator` calls it
  first); later it changes nothing and returns whether the flags say so.

  Why: the default CPU scheduler (concurrency-optimized) runs what each layer derives from its
  weights alone (dequantized GGUF blocks, W + α⊙S expansions) for every unrolled layer up front
  and keeps them all alive: SmolLM2 Q4_1's 544-token step needed 2485 MB of temporaries (1.5 GB
  of dequantized weights) instead of 307 MB, 2x its weights and KV pool together
  (`bench/results/engine/memory.md`). The per-compile option (``compile(compiler_options)``) is
  accepted but does not reach the scheduler in jax 0.10's CPU client, hence the flag."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _SCHEDULER_FLAG not in flags:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
      return False
    os.environ["XLA_FLAGS"] = f"{flags} {_SCHEDULER_FLAG}=false".strip()
    return True
  return f"{_SCHEDULER_FLAG}=false" in flags or f"{_SCHEDULER_FLAG}=0" in flags


def data_size(cfg) -> int:
  """The ``data`` size of ``cfg.mesh`` (a checked ``"data=D,model=M"`` spec; 1 without)."""
  for part in (getattr(cfg, "mesh", None) or "").split(","):
    name, _, value = part.partition("=")
    if name.strip() == "data":
      return int(value)
  return 1


def kv_token_bytes(model_config, itemsize: int) -> int:
  """Bytes of K and V of one token over every layer and KV head."""
  mc = model_config
  return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize


# the default KV pool (``kv_cache_mb=None``) of each data group: this many tokens or two
# sequences of ``max_seq_len``, whichever is more (llama-server's default context is 4096),
# at most ``AUTO_KV_MAX_MB`` (but always one sequence) and at most what the rows need
AUTO_KV_TOKENS = 4096
AUTO_KV_MAX_MB = 1024


def kv_pages(cfg, model_config, itemsize: int | None = None) -> int:
  """KV pages of each data group's pool (the reserved page 0 included): ``kv_cache_mb`` split
  over the data groups, at most what its rows need at ``max_seq_len``; ``kv_cache_mb=None``
  sizes it to fit (``AUTO_KV_TOKENS``: SmolLM2-135M's pool is then 180 MiB in f32, not the
  1 GiB it used to take by default). Raises ValueError when a group's share of an explicit
  ``kv_cache_mb`` cannot hold one sequence of ``max_seq_len``."""
  if itemsize is None:
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype]
  groups = data_size(cfg) if not getattr(cfg, "multi_process", False) else 1
  token_bytes = kv_token_bytes(model_config, itemsize)
  page_bytes = token_bytes * cfg.page_size
  per_seq = -(-cfg.max_seq_len // cfg.page_size)
  rows = max(1, cfg.max_batch // groups)
  if cfg.kv_cache_mb is None:
    want = -(-max(AUTO_KV_TOKENS, 2 * cfg.max_seq_len) // cfg.page_size)
    budget = max(per_seq, min(want, AUTO_KV_MAX_MB * (1 << 20) // page_bytes))
    return max(2, min(rows * per_seq, budget) + 1)
  budget = int(cfg.kv_cache_mb * (1 << 20)) // groups // page_bytes
  if budget < per_seq:
    need_mb = per_seq * page_bytes * groups / (1 << 20)
    raise ValueError(
      f"kv_cache_mb: {cfg.kv_cache_mb:g} MiB holds {budget * cfg.page_size} tokens of this "
      f"model's KV cache{f' per data group ({groups})' if groups > 1 else ''}, less than one "
      f"sequence of max_seq_len {cfg.max_seq_len}; raise --kv-cache-mb to at least "
      f"{need_mb:.1f} or lower --max-seq-len")
  return max(2, min(rows * per_seq, budget) + 1)


def build_generator(cfg, banks: Banks = Banks(), *, tokenizer=None,
                    model_factory: Callable | None = None):
  """The engine's `Generator`, on one device or, with ``--mesh`` or several processes, over a
  device mesh (the base restored straight into its shardings; ``data > 1`` splits it into
  data groups). Every process of a multi-process server builds it with the same arguments (the
  same JAX computations in the same order); only process 0's scheduler is used."""
  import jax.numpy as jnp

  from bitdelta_jax.engine.generator import Generator

  if blocks_only(cfg.base):
    log.info("a GGUF base in blocks: XLA's default CPU scheduler (nothing is derived from the "
             "weights outside the block kernel)")
  elif not memory_scheduler():
    log.info("XLA's memory-minimizing CPU scheduler could not be chosen (JAX started before "
             "the engine was built): long prompt steps may need more memory")
  dtype = getattr(jnp, cfg.dtype)
  mesh = None
  kw = banks.model_kwargs()
  if cfg.sharded:
    from bitdelta_jax import sharding

    mesh = sharding.make_mesh(cfg.mesh)
    log.info("sharded over mesh %s (%d processes)", sharding.mesh_spec(mesh), cfg.num_processes)
  if model_factory is not None:
    model = model_factory()
  elif mesh is not None:
    model = sharding.restore_base(cfg.base, mesh, dtype, num_slots=cfg.device_slots + 1, **kw)
  else:
    from bitdelta_jax.models import from_pretrained

    model = from_pretrained(cfg.base, dtype, num_slots=cfg.device_slots + 1, **kw)
  from bitdelta_jax.engine.runner import release_free_heap

  release_free_heap()  # the host copies the load freed (a heap of ≤32 MB arrays) go back now
  gen = Generator(model, max_rows=cfg.max_batch, max_seq_len=cfg.max_seq_len,
                  page_size=cfg.page_size,
                  num_pages=kv_pages(cfg, model.config, model.dtype.itemsize),
                  prefill_chunk=cfg.prefill_chunk, prefix_caching=cfg.prefix_caching,
                  tokenizer=tokenizer, mesh=mesh, step_cache_dir=step_cache_dir())
  if cfg.num_processes > 1:  # hosts finish loading minutes apart: meet before any collective
    from bitdelta_jax.engine.multihost import runtime

    runtime.barrier("built the model", last=not cfg.warmup)
    for r in gen.runners:
      r.sync = runtime.barrier
  return gen
