"""Paged attention on the host CPU (decode lanes, packed prompt chunks): C++ kernels called
through `jax.ffi`.

Why: on CPU the engine's attention was the jnp reference, whose decode pass gathers each lane's
pages out of the pools (a copy and a transpose per block) for as many blocks as the longest
lane needs. ``cpu_kernel.cc`` reads keys and values in place through each lane's page table,
bounded by the lane's own length (and window), one task per (lane, KV head) covering the query
heads of its group, tasks split over a persistent thread pool when there is enough work.

Numerics: the meaning of `reference.decode_lanes` (same masking, scale ``head_dim ** -0.5``,
f32 scores and online softmax, bf16 probabilities before p·v for bf16 pools, zeros for a lane of
length 0); sums in another order (per page, not per block), so results agree to rounding.
Backend: host CPU, pools f32 or bf16, any head_dim and group size; built on first use like
`pallas_kernels.small_matmul.cpu` (``g++ -O3 -march=native``); ``BITDELTA_PAGED_ATTENTION_CPU=0``
turns it off for ``implementation=None``.

`write` (the same library) stores a step's new K/V rows into a pool in place: XLA's CPU backend
computes a bf16 scatter in f32 (it converts the whole pool to f32 and back), so the engine's
``pool.at[layer, page, offset].set(new)`` cost a bf16 step time proportional to the pool's size.
`packed_prefill` (the same library) is `reference.packed_prefill`: each prompt token against its
own sequence's pages up to its position, a flash-attention loop over 16-key chunks, one task per
(tile of one sequence's tokens, KV head). The reference scores every packed token against every
page of the step and masks; at a 2k-token prompt that was half the time to first token.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import settings
from pallas_kernels.native import registry
from pallas_kernels.native.registry import NativeKernel

_SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "bitdelta_paged_decode"
_WRITE_TARGET = "bitdelta_paged_write"
_PREFILL_TARGET = "bitdelta_paged_prefill"
_BIG = 1 << 30  # "no window", as the reference


KERNELS = (NativeKernel("paged_attention", _SOURCE, (
  (_TARGET, "BitdeltaPagedDecode"), (_WRITE_TARGET, "BitdeltaPagedWrite"),
  (_PREFILL_TARGET, "BitdeltaPagedPrefill")), "the CPU paged-attention kernel"),)


def _load() -> str | None:
  return registry.load(KERNELS[0])[1]


def build_target(arch: tuple[str, ...], target: str) -> None:
  """Builds the kernel with target flags ``arch`` (``()``: the portable build, no AVX-512) and
  registers its decode entry as FFI target ``target`` (pass it to `decode_lanes`) and its
  packed-prefill entry as ``target + "_prefill"`` (for `packed_prefill`). For tests."""
  registry.build_variant(KERNELS[0], arch, target, others={_PREFILL_TARGET: target + "_prefill"})


def shapes_supported(*, num_heads: int, num_kv_heads: int, dtype, q_dtype) -> str | None:
  """None if the kernel takes these shapes and dtypes, else why not."""
  if num_heads % num_kv_heads:
    return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
  if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
    return f"the CPU kernel reads f32 or bf16 pools, not {jnp.dtype(dtype)}"
  if jnp.dtype(q_dtype) not in (jnp.float32, jnp.bfloat16):
    return f"the CPU kernel takes f32 or bf16 queries, not {jnp.dtype(q_dtype)}"
  return None


def build_reason() -> str | None:
  """None if the kernel is built (or can be) here, else why not."""
  return _load()


def enabled() -> bool:
  """Whether ``implementation=None`` may pick the kernel (``BITDELTA_PAGED_ATTENTION_CPU``)."""
  return settings.get("BITDELTA_PAGED_ATTENTION_CPU")


def decode_lanes(
  q_RxHxD, k_pool, v_pool, layer, *, lane_pages, lane_len, window=None, target: str = _TARGET
):
  """`reference.decode_lanes` through the kernel: ``[R, H, hd]`` in q's dtype for the first
  ``R = lane_pages.shape[0]`` tokens of ``q``; each lane reads ``lane_len[r]`` keys of its pages
  (no ``blocks``: the kernel bounds each lane by its own length). ``target``: another build
  (`build_target`). Raises NotImplementedError
  when the kernel cannot be built or does not take the shapes."""
  if reason := _load():
    raise NotImplementedError(reason)
  _, h, d = q_RxHxD.shape
  if reason := shapes_supported(
    num_heads=h, num_kv_heads=k_pool.shape[3], dtype=k_pool.dtype, q_dtype=q_RxHxD.dtype
  ):
    raise NotImplementedError(f"paged attention 'cpu': {reason}")
  r = lane_pages.shape[0]
  call = jax.ffi.ffi_call(
    target, jax.ShapeDtypeStruct((r, h, d), jnp.float32), vmap_method="sequential"
  )
  out = call(
    q_RxHxD[:r].astype(jnp.float32),
    k_pool,
    v_pool,
    jnp.asarray(layer, jnp.int32),
    jnp.asarray(lane_pages, jnp.int32),
    jnp.asarray(lane_len, jnp.int32),
    jnp.asarray(_BIG if window is None else window, jnp.int32),
    scale=np.float32(d**-0.5),
  )
  return out.astype(q_RxHxD.dtype)


def write(pool, layer, page, offset, new):
  """``pool.at[layer, page, offset].set(new)`` in place (the result is the pool's buffer, so
  the pool should be donated or dead after the call). ``pool``: ``[L, NP, PS, KV, hd]``;
  ``layer, page, offset``: ints or int arrays broadcast to ``new.shape[:-2]``; ``new``:
  ``[..., KV, hd]``, cast to the pool's dtype. Entries with an index out of range are dropped
  (jnp's default for a scatter; negative indices are out of range here). Raises
  NotImplementedError when the kernel cannot be built."""
  if reason := _load():
    raise NotImplementedError(reason)
  n_layers, n_pages, ps = pool.shape[:3]
  batch = new.shape[:-2]
  idx = [jnp.broadcast_to(jnp.asarray(a, jnp.int32), batch) for a in (layer, page, offset)]
  ok = (
    (idx[0] >= 0)
    & (idx[0] < n_layers)
    & (idx[1] >= 0)
    & (idx[1] < n_pages)
    & (idx[2] >= 0)
    & (idx[2] < ps)
  )
  rows = jnp.where(ok, (idx[0] * n_pages + idx[1]) * ps + idx[2], -1).reshape(-1)
  src = new.astype(pool.dtype).reshape(rows.shape[0], *new.shape[-2:])
  call = jax.ffi.ffi_call(
    _WRITE_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype), input_output_aliases={0: 0}
  )
  return call(pool, rows, src)


def packed_prefill(q_NxHxD, k_pool, v_pool, layer, inputs, *, window=None,
                   target: str = _PREFILL_TARGET):
  """`reference.packed_prefill` through the kernel: ``[N, H, hd]`` in q's dtype, every token of
  ``inputs.token_seq >= 0`` against the pages of ``inputs.pages`` labelled with its sequence,
  keys at positions ``<= its position`` (and ``> position - window``); zeros for a token with no
  key. ``inputs.blocks`` is not read: the kernel walks each sequence's own pages. ``target``:
  another build (`registry.build_variant`, for tests). Raises NotImplementedError when the
  kernel cannot be built or does not take the shapes."""
  if reason := _load():
    raise NotImplementedError(reason)
  n, h, d = q_NxHxD.shape
  if reason := shapes_supported(
    num_heads=h, num_kv_heads=k_pool.shape[3], dtype=k_pool.dtype, q_dtype=q_NxHxD.dtype
  ):
    raise NotImplementedError(f"paged attention 'cpu': {reason}")
  t = inputs
  i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((n, h, d), jnp.float32))
  out = call(
    q_NxHxD.astype(jnp.float32), k_pool, v_pool, i32(layer), i32(t.token_seq), i32(t.positions),
    i32(t.pages), i32(t.page_seq), i32(t.page_start), i32(t.page_fill),
    i32(_BIG if window is None else window), scale=np.float32(d**-0.5),
  )
  return out.astype(q_NxHxD.dtype)
