"""The paged engine's device side: the KV page pools, the model state and the jitted step.

    runner = PagedRunner(model, shapes=StepShapes(...), num_pages=1025, mesh=mesh)
    runner.compile_all((False,))                  # every token bucket, ahead of time
    runner.guard = True                           # from now on a step that would compile raises
    out = runner.run(batch, base_only=False)     # a PagedBatch of host arrays -> StepOutput
    tokens = runner.fetch(out.tokens)             # host values (on any number of processes)
    runner.copy_pages(src, dst)                   # forked choices' partly filled last pages
    runner.load_variant(slot, delta); runner.clear_slot(slot)

The scheduler (`bitdelta_jax.engine.generator.Generator`) decides everything on the host and
hands the runner one `PagedBatch` per call; the runner holds no scheduling state, so every
process of a multi-process server can replay process 0's calls on its own runner and dispatch
the same computations in the same order (`bitdelta_jax.engine.multihost.leader`). A batch whose ``controls`` is
None uses cached neutral control arrays (no mask, bias or penalty): plain batches then send and
transfer nothing for them.

Each step passes the model's parameters as a tuple of their arrays, read when the runner is
built and at every `refresh` (`load_variant` and `clear_slot` refresh): a change made to the
model any other way needs a `refresh` before the next step. Flattening the model state on every
call cost ~1.2 ms of host time before XLA started (SmolLM2-135M: ~750 variables), all of it
on the serial path of a decode step.

Programs: one per token bucket of `StepShapes` (``base_only``: the form of a model without
variant slots; with slots, batches of base rows skip the delta kernels inside the same program).
`compile_all` lowers and compiles them (or the buckets it is given) on a thread pool before
serving; a step of a bucket it compiled runs that executable. Buckets it left `pending` are
compiled by `compile_pending` on a background thread, from the argument shapes recorded by
`compile_all` (no device array is read there), and made ready by `promote` on the device
thread, which runs each once first (`ready_buckets`: what a scheduler may pad a step to). The decoder layers run unrolled on CPU and as one
``lax.scan`` over stacked layer states elsewhere (`scan_layers_default` says why).

On a mesh spanning several processes, host inputs become global arrays with
`jax.make_array_from_callback` (every process passes the same values), and `fetch` reads a
replicated output from this process's first shard.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.engine import heap, step_cache
from bitdelta_jax.engine.batch import PagedBatch, StepOutput, StepShapes
from bitdelta_jax.engine.controls import LogitControls, logprobs_of
from bitdelta_jax.engine.mesh_layout import MeshLayout
from bitdelta_jax.engine.pytrees import register_step_data
from bitdelta_jax.engine.sampling import row_keys, sample
from bitdelta_jax.models import slots as slots_lib
from bitdelta_jax.models.llama import stack_layers
from pallas_kernels import settings

register_step_data()
log = logging.getLogger("bitdelta_jax.paged_runner")


def run_impl(graphdef, state_def, layer_def, layers_def, params, stacked, k_pool, v_pool,
             batch: PagedBatch, base_only: bool, kv_sharding=None):
  """The step: the forward over the ragged batch, the sampler at the outputs, log probabilities;
  prompt positions are scored (a second logits pass over all N tokens) only when a step asks.
  ``params``: the model state's leaves (``state_def`` rebuilds the state); ``stacked``: the
  stacked decoder layer states' leaves (``layers_def``), run as one scan with ``layer_def``
  (`llama.stack_layers`), or None. Flat tuples, so that a call neither flattens the state nor
  parses its nodes (`PagedRunner.run`)."""
  model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
  layers = None if layer_def is None else (layer_def, jax.tree.unflatten(layers_def, stacked))
  h, k_pool, v_pool = model.forward_paged(batch, k_pool, v_pool, base_only=base_only,
                                          kv_sharding=kv_sharding, layers=layers)
  slots = None if base_only else batch.out_slot_ids
  out_logits = model.logits(h[batch.out_index], slots)
  keys = row_keys(batch.keys, batch.key_pos)
  tok = sample(out_logits, keys, batch.temperature, batch.top_p, batch.top_k, batch.controls)
  lp = logprobs_of(out_logits, tok, batch.want_logprobs)
  target = batch.score_target

  def scores(h):
    logits = model.logits(h, None if base_only else batch.slot_ids)
    return logprobs_of(logits, jnp.maximum(target, 0), target >= 0)

  n, top = target.shape[0], lp[1].shape[1]
  none = (jnp.zeros((n,), jnp.float32), jnp.zeros((n, top), jnp.int32),
          jnp.zeros((n, top), jnp.float32))
  sc = jax.lax.cond(jnp.any(target >= 0), scores, lambda h: none, h)
  return k_pool, v_pool, StepOutput(tok, *lp, *sc)


def copy_pages_impl(k_pool, v_pool, src, dst, *, implementation=None):
  """Copies whole pages ``src -> dst`` (a forked sequence's partly filled last page), in place
  (`write_kv`; ``implementation="reference"`` for pools sharded over a mesh)."""
  from pallas_kernels.paged_attention import write_kv

  layers = jnp.arange(k_pool.shape[0], dtype=jnp.int32)[:, None, None]
  offsets = jnp.arange(k_pool.shape[2], dtype=jnp.int32)[None, None, :]
  return tuple(
    write_kv(pool, layers, dst[None, :, None], offsets, pool[:, src], implementation=implementation)
    for pool in (k_pool, v_pool)
  )



def _register_native_kernels() -> None:
  """Registers every CPU kernel's FFI targets, which a program loaded from the step cache calls
  without having been traced (tracing is what registers them otherwise; a target left out here
  made its programs fail to load at every warm start)."""
  if jax.default_backend() != "cpu":
    return
  from pallas_kernels.native import registry

  registry.register_all()


def _is_layer_kernel(path) -> bool:
  """Whether a model-state leaf (by its key path) is a decoder layer's linear kernel (a dense
  array or a GGUF block field: ``model/layers/<i>/.../kernel[/qs|d|m]``)."""
  keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
  return len(keys) > 2 and keys[0] == "model" and keys[1] == "layers" and "kernel" in keys[3:]


def scan_layers_default() -> bool:
  """Scan the decoder layers off CPU; unroll them on CPU. A scan compiles one layer instead of
  L (about 2 s instead of 6 s a program for SmolLM2 on 2 cores) but XLA's CPU backend copies
  each layer's weights out of the stacked arrays every step (+14 ms a decode step here, +40%),
  so on CPU the warm-up pays the unrolled compiles once (and the persistent cache keeps them)."""
  return jax.default_backend() != "cpu"


def release_free_heap(clear_jax_caches: bool = False) -> None:
  """Returns the C heap's free pages to the OS (glibc ``malloc_trim``; elsewhere nothing). An
  XLA compile allocates and frees hundreds of MB, in the compiling thread's malloc arena;
  kept there, that memory stays resident, where the next phase (a weight, a program's
  temporaries) cannot reuse it and the peak grows by it. ``clear_jax_caches``: first drops
  JAX's tracing and lowering caches (`jax.clear_caches`), which keep 20-60 MB per step program
  (its jaxpr and MLIR module) that nothing reads again: the runner keeps each compiled
  program itself, and every token bucket is traced once anyway. Other jitted functions then
  trace and compile again on their next call."""
  if clear_jax_caches:
    jax.clear_caches()
  heap.trim()


class CompileAfterWarmup(RuntimeError):
  """A step needed a program the warm-up did not compile (the guard is on)."""


COPY_BATCH = 16  # page copies per copy call (padded; more copies take several calls)


class PagedRunner:
  """Device state of the paged engine and the calls that change it; see the module docstring."""

  def __init__(self, model, *, shapes: StepShapes, num_pages: int, mesh=None, rules=None,
               scan_layers: bool | None = None, step_cache_dir=None):
    cfg = model.config
    self.model = model
    self.shapes = shapes
    self.num_pages, self.page_size = int(num_pages), shapes.page_size
    self.max_seq_len = shapes.max_seq_len
    self.layout = MeshLayout.of(model, mesh, rules)
    self._pool_shape = (cfg.num_layers, self.num_pages, self.page_size, cfg.num_kv_heads,
                        cfg.head_dim)
    self.k_pool = self.v_pool = None
    self.reset_pools()
    if scan_layers is None:  # see `scan_layers_default`
      scan_layers = scan_layers_default()
    self.scan_layers = bool(scan_layers)
    self._stacked = self._layers = None
    self._stacked_shardings = None  # `_layer_shardings`, taken once
    self.graphdef, state = nnx.split(model)
    self._state_def = jax.tree.structure(state)
    self._set_state(state)
    self._restack()
    if self._stacked is not None:
      self._drop_layer_kernels()
    # the weights into huge pages on a thread of their own (1.7 s for a 1B Q4_0 model on 2
    # cores: not on the way to ready; steps read the same bytes meanwhile)
    self.huge_page_bytes = 0
    self.huge_pages_done = threading.Event()
    threading.Thread(target=self._huge_pages, name="huge-pages", daemon=True).start()
    layer_def, layers_def = None, None
    if self._stacked is not None:
      layer_def, layers_def = self._stacked[0], jax.tree.structure(self._stacked[1])
    self._run, self._copy_pages = self.layout.jit_step(
      functools.partial(run_impl, self.graphdef, self._state_def, layer_def, layers_def),
      functools.partial(copy_pages_impl,
                        implementation=None if self.layout.mesh is None else "reference"),
      self._layer_shardings())
    self.vocab_size = cfg.vocab_size + cfg.extra_vocab  # the width of the logits
    self._neutral: dict[int, LogitControls] = {}  # rows -> device arrays, reused every step
    self.local = self.layout.mesh is None or all(
      d.process_index == jax.process_index() for d in self.layout.mesh.devices.flat)
    self._compiled: dict[tuple, object] = {}  # (tokens, base_only) -> compiled step
    self._copy_compiled = None
    self.guard = False  # raise on a step the warm-up did not compile
    self.compiles_after_warmup = 0  # steps compiled lazily after `compile_all` (guard off)
    # several processes: `multihost.runtime.barrier`, met after compiling and before running a
    # new program (its collectives need every process there; compile times differ by minutes)
    self.sync: Callable[..., None] | None = None
    self.warm = False
    # compiled steps on disk (`step_cache`): one process only (see that module)
    self.step_cache_dir = step_cache_dir if jax.process_count() == 1 else None
    self.loaded_programs = 0  # programs `compile_all` took from the step cache
    self.probe_s = 0.0  # seconds `compile_all` spent running each program once
    self.probe_failures = 0  # programs that failed that first run (then recompiled)
    self.pending: list[tuple[int, bool]] = []  # (tokens, base_only) left to `compile_pending`
    self._arrived: queue.SimpleQueue = queue.SimpleQueue()  # compiled there, not yet promoted
    self._specs = None  # the step's array arguments as ShapeDtypeStructs (`_abstract_args`)

  @property
  def mesh(self):
    return self.layout.mesh

  @property
  def kv_bytes(self) -> int:
    return 2 * self.k_pool.size * self.k_pool.dtype.itemsize

  @property
  def compiles(self) -> int:
    """Step programs compiled so far (ahead of time and lazily)."""
    return len(self._compiled) + self._run._cache_size()

  @property
  def compiled_programs(self) -> int:
    """Step programs compiled ahead of time (`compile_all`, `promote`)."""
    return len(self._compiled)

  def ready_buckets(self, base_only: bool) -> tuple[int, ...]:
    """Token buckets of the form ``base_only`` whose program is compiled and has run once."""
    keys = tuple(self._compiled)  # one copy: `/health` reads this from another thread
    return tuple(sorted(n for n, f in keys if f == bool(base_only)))

  # -- the calls ------------------------------------------------------------------------------
  def run(self, batch: PagedBatch, base_only: bool) -> StepOutput:
    """One step over ``batch`` (host arrays); the pools are donated and replaced."""
    fn = self._compiled.get((batch.num_tokens, bool(base_only)))
    if fn is None:
      if self.warm:
        if self.guard:
          raise CompileAfterWarmup(
            f"a step of {batch.num_tokens} tokens (base_only={bool(base_only)}) needs a program "
            "the warm-up did not compile")
        self.compiles_after_warmup += 1
      if self.sync is not None:  # compile here, then run once every process has it
        key = (batch.num_tokens, bool(base_only))
        self._compiled[key] = fn = self._compile(*key)
        self.sync(f"compiled the step of {key[0]} tokens")
        out = fn(self._params, self._layers, self.k_pool, self.v_pool, self._inputs(batch))
      else:
        out = self._run(self._params, self._layers, self.k_pool, self.v_pool,
                        self._inputs(batch), bool(base_only))
    else:  # compiled ahead of time: the static base_only is part of the program
      out = fn(self._params, self._layers, self.k_pool, self.v_pool, self._inputs(batch))
    self.k_pool, self.v_pool, out = out
    return out

  def lower(self, batch: PagedBatch, base_only: bool, platform: str | None = None):
    """The step over ``batch``'s shapes, lowered (``.compile()`` it; nothing runs). With
    ``platform`` (e.g. "cuda"), lowered for that platform with its kernels selected
    (`pallas_kernels.platform.lowering_platform`), also from a process without it."""
    args = (self._params, self._layers, self.k_pool, self.v_pool, self._inputs(batch),
            bool(base_only))
    if platform is None:
      return self._run.lower(*args)
    from pallas_kernels.platform import lowering_platform

    with lowering_platform(platform):
      return self._run.trace(*args).lower(lowering_platforms=(platform,))

  def compile_all(self, forms: Sequence[bool] = (False,), threads: int = 2,
                  progress=None, buckets: Sequence[int] | None = None) -> float:
    """Compiles the step for every token bucket (or only ``buckets``) in each form of ``forms``
    (``base_only`` values; the engine asks for one) ahead of time, ``threads`` at a time, and
    the page copy; returns the seconds it took. Each program then runs once on a padding batch
    (`_probe`: SmolLM2's 11 programs take ~1 s on 2 cores), so one that cannot run is
    recompiled here rather than met by a request. The buckets not asked for are left in
    `pending` (`compile_pending`, `promote`). Every later step runs a program compiled here or
    promoted (with `guard` on, any other raises)."""
    t0 = time.perf_counter()
    self._specs = self._array_specs()
    wanted = self.shapes.buckets() if buckets is None else sorted(set(buckets))
    todo = [(n, f) for f in forms for n in wanted if (n, f) not in self._compiled]
    self.pending = [(n, f) for f in forms for n in self.shapes.buckets()
                    if (n, f) not in self._compiled and (n, f) not in todo]
    if self.step_cache_dir is not None:
      _register_native_kernels()

    with ThreadPoolExecutor(max(1, threads)) as ex:
      for key, compiled, loaded in ex.map(lambda k: self._build(k, progress), todo):
        self._compiled[key] = compiled
        self.loaded_programs += loaded
    if self.sync is not None:  # the probes below are the first collectives
      from bitdelta_jax.engine.multihost.runtime import fault_delay

      fault_delay("compile")
      self.sync("compiled the step programs", last=True)
    t = time.perf_counter()
    for key in todo:
      self._probe(*key, progress)
    self.probe_s += time.perf_counter() - t
    if self._copy_compiled is None:
      z = np.zeros((COPY_BATCH,), np.int32)
      self._copy_compiled = self._copy_pages.lower(self.k_pool, self.v_pool,
                                                   *self._replicated((z, z))).compile()
    self.warm = True
    release_free_heap()
    return time.perf_counter() - t0

  def compile_pending(self, progress=None, stop=None, on_compiled=None) -> None:
    """Compiles (or loads from the step cache) each program `compile_all` left pending, in
    bucket order, for a background thread: lowered from the argument shapes `compile_all`
    recorded, so no device array is read while the device thread steps. Each goes to the
    device thread's `promote` (``on_compiled()`` is called after each). ``stop`` (a
    `threading.Event`): checked between programs."""
    for key in list(self.pending):
      if stop is not None and stop.is_set():
        return
      self._arrived.put(self._build(key, progress, background=True))
      if on_compiled is not None:
        on_compiled()

  def promote(self, progress=None, limit: int | None = None) -> bool:
    """On the device thread, between steps: the programs `compile_pending` finished (at most
    ``limit`` of them), each run once (`_probe`: a whole step of padding, seconds for a large
    bucket of a large model) and from then on used by steps. True if any was promoted."""
    promoted = 0
    while limit is None or promoted < limit:
      try:
        key, compiled, loaded = self._arrived.get_nowait()
      except queue.Empty:
        return promoted
      if key not in self.pending:  # released meanwhile
        continue
      self._compiled[key] = compiled
      self.loaded_programs += loaded
      self.pending.remove(key)
      t = time.perf_counter()
      self._probe(*key, progress)
      self.probe_s += time.perf_counter() - t
      promoted += 1
    return promoted > 0

  @property
  def arrived(self) -> bool:
    """Programs `compile_pending` finished that `promote` has not taken yet."""
    return not self._arrived.empty()

  def _build(self, key: tuple[int, bool], progress=None, background: bool = False):
    """``(key, program, loaded)``: the step of ``key`` from the step cache, else compiled."""
    n, f = key
    t = time.perf_counter()
    cache = self.step_cache_dir
    compiled = None if cache is None else step_cache.load(cache, self._cache_key(n, f))
    loaded = compiled is not None
    if compiled is None:
      compiled = self._compile(n, f, clear_jax_caches=not background)
    if progress:
      where = " (in the background)" if background else ""
      progress(f"{'loaded' if loaded else 'compiled'} the {'base-only' if f else 'variant'} "
               f"step of {n} tokens{where} ({time.perf_counter() - t:.1f} s)")
    return key, compiled, loaded

  def _cache_key(self, n: int, base_only: bool) -> str:
    return step_cache.step_key(self._program_parts(n, base_only))

  def _compile(self, n: int, base_only: bool, clear_jax_caches: bool = True):
    """The step of ``n`` tokens, compiled from the recorded argument shapes (`_abstract_args`);
    with the step cache, really compiled here (not taken from JAX's persistent cache, whose
    programs cannot be re-serialized) and saved. The compile's freed memory goes back to the
    OS (`release_free_heap`; JAX's caches are kept while the device thread steps)."""
    if self.step_cache_dir is None:
      compiled = self.lower_bucket(n, base_only).compile()
    else:
      with step_cache.fresh_compile():
        compiled = self.lower_bucket(n, base_only).compile()
      step_cache.save(self.step_cache_dir, self._cache_key(n, base_only), compiled)
    release_free_heap(clear_jax_caches=clear_jax_caches)
    return compiled

  def lower_bucket(self, n: int, base_only: bool):
    """The step program of the bucket of ``n`` tokens, lowered from the recorded argument
    shapes (`_abstract_args`; what `compile_all` and the background compile build)."""
    return self._run.lower(*self._abstract_args(n), bool(base_only))

  def _array_specs(self) -> tuple:
    """The step's array arguments (parameters, stacked layers, pools) as ShapeDtypeStructs
    with their shardings: what lowering and the step cache's key read. Their shapes never
    change (a slot load writes into the banks), so they are taken once."""
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)  # noqa: E731
    return jax.tree.map(spec, (self._params, self._layers, self.k_pool, self.v_pool))

  def _abstract_args(self, n: int) -> tuple:
    """The step's arguments for a batch of ``n`` tokens as ShapeDtypeStructs (the batch with
    neutral controls, replicated like `_inputs`' arrays)."""
    if self._specs is None:
      self._specs = self._array_specs()
    rows = self.shapes.lanes(n)
    batch = dataclasses.replace(self.shapes.empty(n), controls=LogitControls.neutral(
      rows, self.vocab_size, self.max_seq_len))
    where = (self.layout.replicated if self.layout.mesh is not None
             else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
      np.shape(a), jax.dtypes.canonicalize_dtype(np.asarray(a).dtype), sharding=where), batch)
    return (*self._specs, batch)

  def _probe(self, n: int, base_only: bool, progress=None) -> None:
    """Runs the program of ``n`` tokens once on a padding batch (it writes only the reserved
    page 0), so a program that cannot run is found before serving: it is recompiled (its
    step-cache entry replaced) and run again; a second failure raises. Every process of a
    multi-process server probes the same programs in the same order."""
    key = (n, bool(base_only))
    try:
      self._run_padding(key)
      return
    except Exception as e:  # noqa: BLE001  a loaded program that cannot run: recompile it
      self.probe_failures += 1
      why = f"{type(e).__name__}: {str(e)[:300]}"
      log.warning("the step of %d tokens failed its first run (%s); recompiling it", n, why)
      if progress:
        progress(f"the step of {n} tokens failed its first run ({why}); recompiling it")
      self.reset_pools()  # the failed call may have consumed the donated pools (still empty)
    self._compiled[key] = self._compile(n, base_only)
    self._run_padding(key)

  def _run_padding(self, key: tuple) -> None:
    out = self._compiled[key](self._params, self._layers, self.k_pool, self.v_pool,
                              self._inputs(self.shapes.empty(key[0])))
    self.k_pool, self.v_pool, out = out
    jax.block_until_ready((self.k_pool, self.v_pool, out))

  def reset_pools(self) -> None:
    """Fresh zeroed KV pools. After a failed step: a call that fails may have consumed the
    pools donated to it, and every later step would then fail too. The caller has dropped every
    sequence and cached prefix that lived in the old pools."""
    self.k_pool = self.v_pool = None  # the old ones go before the new ones are allocated
    self.k_pool = self.layout.zeros(self._pool_shape, self.model.dtype, self.layout.kv)
    self.v_pool = self.layout.zeros(self._pool_shape, self.model.dtype, self.layout.kv)

  def release(self) -> None:
    """Drops the compiled programs (the engine calls it when its device thread ends). XLA's CPU
    backend maps each program's code into memory mappings of its own, and a process may hold
    65530: an engine object that outlives its server must not keep them."""
    self._compiled.clear()
    self._copy_compiled = None
    self.pending = []
    self.warm = False

  def _program_parts(self, n: int, base_only: bool) -> tuple:
    """What the step program of ``n`` tokens depends on, besides the code (`step_cache`):
    the model's config and every input's shape, dtype and sharding (the batch's follow from
    ``shapes`` and ``n``, replicated over ``mesh``)."""
    def avals(tree):
      return [(a.shape, str(a.dtype), str(getattr(a, "sharding", None)))
              for a in jax.tree.leaves(tree)]

    if self._specs is None:
      self._specs = self._array_specs()
    params, layers, k_pool, v_pool = self._specs  # (no device array: a background thread asks)
    return (repr(self.model.config), str(self.model.dtype), str(self._state_def),
            avals(params), avals(layers), avals((k_pool, v_pool)),
            repr(self.shapes), n, bool(base_only), self.scan_layers, str(self.mesh),
            os.environ.get("XLA_FLAGS", ""))  # e.g. the scheduler (`build.memory_scheduler`)

  def _inputs(self, batch: PagedBatch) -> PagedBatch:
    if batch.controls is None:
      batch = dataclasses.replace(batch, controls=self.neutral(batch.out_index.shape[0]))
    return self._replicated(batch)

  def _replicated(self, tree):
    return tree if self.local else self.layout.replicate(tree)

  def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
    """Copies pages ``src[i] -> dst[i]`` (in calls of `COPY_BATCH`, padded with page 0)."""
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    for i in range(0, len(src), COPY_BATCH):
      s = np.zeros((COPY_BATCH,), np.int32)
      d = np.zeros((COPY_BATCH,), np.int32)
      s[: len(src[i : i + COPY_BATCH])] = src[i : i + COPY_BATCH]
      d[: len(dst[i : i + COPY_BATCH])] = dst[i : i + COPY_BATCH]
      fn = self._copy_compiled or self._copy_pages
      self.k_pool, self.v_pool = fn(self.k_pool, self.v_pool, *self._replicated((s, d)))

  def load_variant(self, slot: int, delta) -> None:
    """``delta``: an in-memory delta dict, or (on a mesh) also a delta directory, written
    shard by shard."""
    if self.mesh is not None:
      from bitdelta_jax.sharding.restore import load_variant_sharded

      load_variant_sharded(self.model, slot, delta)
    else:
      slots_lib.load_variant(self.model, slot, delta)
    self.refresh()

  def clear_slot(self, slot: int) -> None:
    if self.mesh is not None:
      self.load_variant(slot, {})
      return
    slots_lib.clear_slot(self.model, slot)
    self.refresh()

  def refresh(self) -> None:
    """Re-reads the model's state. Steps pass the arrays read here, so call it after every
    change to the model's banks or parameters (`load_variant` and `clear_slot` do)."""
    self._set_state(self.layout.place_state(nnx.state(self.model)))
    self._restack()

  def _set_state(self, state) -> None:
    """Keeps ``state``'s leaves: the tuple every step passes (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(state)
    if treedef != self._state_def:  # the compiled steps unflatten with the first structure
      raise ValueError("the model's state changed structure since the runner was built")
    self._params = tuple(leaves)

  def _huge_pages(self) -> int:
    """The weights a step reads, on the host CPU, collapsed into 2 MiB pages where Linux allows
    (`heap.huge_pages`; ``BITDELTA_HUGE_PAGES=0`` leaves them): arrays of 4 MiB or more, base
    and banks, as the runner is built. Runs on its own thread while the device thread may
    step (the bytes do not change) or load a slot (a bank replaced meanwhile is held by the
    leaves taken here until the loop ends; a donated one has no pointer and is skipped; banks
    written later stay in 4 KiB pages). Returns the bytes collapsed."""
    try:
      if jax.default_backend() != "cpu" or not settings.get("BITDELTA_HUGE_PAGES"):
        return 0
      done, t0 = 0, time.perf_counter()
      for a in jax.tree.leaves((self._params, self._layers)):
        if not isinstance(a, jax.Array) or a.nbytes < (4 << 20) or len(a.devices()) != 1:
          continue
        try:
          done += heap.huge_pages(a.unsafe_buffer_pointer(), a.nbytes)
        except Exception:  # noqa: BLE001  a buffer without a host pointer: left as it is
          continue
        self.huge_page_bytes = done
      if done:
        log.info("weights in huge pages: %.0f MiB (%.2f s)", done / (1 << 20),
                 time.perf_counter() - t0)
      return done
    finally:
      self.huge_pages_done.set()

  # -- layers as one scan ---------------------------------------------------------------------
  def _restack(self) -> None:
    """The decoder layers' states stacked for the scan (leaves unchanged since the last call
    are reused: a slot load re-stacks only what it wrote)."""
    if not self.scan_layers:
      return
    stacked = stack_layers(self.model, self._stacked)
    if stacked is None:
      self.scan_layers = False
      return
    if self.mesh is not None:
      shard = self._layer_shardings()
      stacked = (stacked[0], jax.tree.map(lambda a, sh: jax.device_put(a, sh), stacked[1], shard),
                 stacked[2])
    self._stacked = stacked
    self._layers = tuple(jax.tree.leaves(stacked[1]))  # what steps pass, as `_params`

  def _drop_layer_kernels(self) -> None:
    """Scanning, the decoder layers' linear kernels (the bulk of the base) are held once: in
    the stacked copy the step scans over. Each layer's own becomes an empty array (one per
    dtype, replicated), in the model and in the step's arguments. Norms, biases and the slot
    banks stay per layer: a slot load writes the banks there and reads a norm's base value
    (`models.slots`), and `_restack` re-stacks only what changed."""
    from bitdelta_jax.models.llama import rekey_stacked

    empty = {}

    def gone(a):
      dt = np.dtype(a.dtype)
      if dt not in empty:
        empty[dt] = self.layout.replicate(np.zeros((0,), dt))
      return empty[dt]

    state = nnx.state(self.model)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    drop = [_is_layer_kernel(path) for path, _ in flat]
    if not any(drop):
      return
    nnx.update(self.model, jax.tree_util.tree_unflatten(
      treedef, [gone(a) if d else a for (_, a), d in zip(flat, drop, strict=True)]))
    if self.mesh is not None:  # the step's in_shardings: the empty arrays are replicated
      shardings, sdef = jax.tree.flatten(self.layout.params)
      self.layout = dataclasses.replace(self.layout, params=jax.tree.unflatten(
        sdef, [self.layout.replicated if d else s for s, d in zip(shardings, drop, strict=True)]))
    self._stacked = rekey_stacked(self.model, self._stacked)
    self._set_state(self.layout.place_state(nnx.state(self.model)))
    release_free_heap()

  def _layer_shardings(self):
    """The stacked states' shardings on a mesh: each layer leaf's, with the layer axis whole
    (taken once, before `_drop_layer_kernels` makes the layers' own kernels empty)."""
    if self.mesh is None or not self.scan_layers:
      return None
    if self._stacked_shardings is None:
      from jax.sharding import NamedSharding
      from jax.sharding import PartitionSpec as P

      per_layer = self.layout.params["model"]["layers"][0]
      self._stacked_shardings = jax.tree.map(
        lambda sh: NamedSharding(self.mesh, P(None, *sh.spec)), per_layer)
    return self._stacked_shardings

  # -- helpers --------------------------------------------------------------------------------
  def neutral(self, rows: int) -> LogitControls:
    """Controls that change nothing, for ``rows`` outputs, as cached device arrays."""
    if rows not in self._neutral:
      self._neutral[rows] = self.layout.replicate(
        LogitControls.neutral(rows, self.vocab_size, self.max_seq_len))
    return self._neutral[rows]

  def fetch(self, x) -> np.ndarray:
    """A replicated output as a host array (from this process's first shard off one host)."""
    if self.local:
      return np.asarray(x)
    return np.asarray(x.addressable_data(0))
