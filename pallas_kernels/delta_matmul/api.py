"""`delta_matmul`: one entry point, several implementations, dispatch by backend and shape.

    y[m] = x[m] · W_base + α[v] ⊙ (x[m] · S[v]),   v = slot_ids[m]; v == 0 means base only.

A Linear layer calls only this, with or without a bank of deltas (no bits: the plain ``x·W``).

Implementations (``implementation=``):

* ``"reference"``: `reference.delta_matmul_reference`, readable jnp.
* ``"cpu_rows"``: the few-rows CPU kernel (`cpu_rows.py`, 1 to `cpu_rows.MAX_ROWS` rows, one
  CPU device): W streamed once with every slot's delta blended in, base rows and the plain
  product included, so a decode step needs no ``lax.cond``. The CPU's first choice.
* ``"xla"``: pure XLA, any backend. Uses ``x·S = 2·x·B − rowsum(x)``; batch 1 looks up
  sums of 8 x values per packed byte (a gather, no unpacking), larger batches do 8 bit-plane
  dots. A fallback, not fast.
* ``"cpu"``: base GEMM by XLA + a C++ kernel through ``jax.ffi`` (`cpu.py`).
* ``"pallas_triton"``: Pallas Triton kernels for GPU (`pallas_gpu.py`); ``interpret=True`` runs
  the same kernel bodies on any backend (tests).
* ``"mosaic_gpu"``: Pallas Mosaic GPU kernels for Hopper (`mosaic_gpu.py`), the GPU default;
  ``interpret=True`` runs them in the Mosaic GPU interpreter on CPU (tests). The Triton
  lowering is deprecated in jax 0.11, so ``pallas_triton`` is only a GPU fallback before it.

``implementation=None`` tries the best for the target platform and falls through on
`NotImplementedError` (a shape a kernel cannot take); naming one that cannot run raises;
`fallback_reasons` says why each one before the choice could not run. With a bank and
``slot_ids``, every implementation but ``cpu_rows`` runs under a ``lax.cond``: a batch of base
rows only runs the base product (`pallas_kernels.small_matmul.api.small_matmul`) instead, so
one program serves batches with and without variants. ``implementation`` may also be a
callable with this function's signature (e.g. `bitdelta_jax.sharding.ShardedDeltaMatmul`):
it computes the products with deltas, XLA's dot the plain ones. The
target platform is the default backend, or the one `lowering_platform` (re-exported from
`pallas_kernels.platform`) sets: to lower CUDA programs in a CPU-only process, trace inside
``with lowering_platform("cuda"):`` and lower with ``lowering_platforms=("cuda",)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bits import DEFAULT_GROUP_K, group_k_for, packed_rows
from pallas_kernels.platform import (
  hopper_reason,
  lowering_platform,
  override,
  target_platform,
)
from pallas_kernels.small_matmul.api import small_matmul

from . import cpu, cpu_rows, mosaic_gpu, pallas_gpu
from .config import Config, MosaicConfig
from .reference import delta_matmul_reference, with_reference_vjp

IMPLEMENTATIONS = ("reference", "xla", "cpu_rows", "cpu", "pallas_triton", "mosaic_gpu")
# The Pallas Triton lowering is deprecated from jax 0.11: only a fallback where it still lowers.
_TRITON_IN_PREFERENCE = jax.__version_info__ < (0, 11)
_GPU_PREFERENCE = ("mosaic_gpu", *(("pallas_triton",) if _TRITON_IN_PREFERENCE else ()), "xla")
_PREFERENCE = {
  "cpu": ("cpu_rows", "cpu", "xla"),
  "gpu": _GPU_PREFERENCE,
  "cuda": _GPU_PREFERENCE,
  "rocm": (*(("pallas_triton",) if _TRITON_IN_PREFERENCE else ()), "xla"),
}
_GPU_PLATFORMS = ("gpu", "cuda")
__all__ = [
  "IMPLEMENTATIONS",
  "delta_matmul",
  "fallback_reasons",
  "lowering_platform",
  "target_platform",
  "unavailable_reason",
]

_XLA_LUT_MAX_ROWS = 1  # measured on a 2-core Xeon: the gather wins only at batch 1


def _xla_bits_product(x32, bits, g: int, k: int):
  """x·B (f32 [M, N]) for one packed matrix, B ∈ {0, 1}, pure XLA."""
  m = x32.shape[0]
  r, n = bits.shape
  p = g // 8
  x_p = jnp.pad(x32, ((0, 0), (0, r * 8 - k))).reshape(m, r // p, 8, p)  # [M, groups, j, p]
  hi = jax.lax.Precision.HIGHEST
  if m <= _XLA_LUT_MAX_ROWS:
    # Table of all 256 subset sums of the 8 x values behind each packed byte, then one gather.
    subsets = jnp.asarray(((np.arange(256)[None, :] >> np.arange(8)[:, None]) & 1), jnp.float32)
    x8 = x_p.transpose(0, 1, 3, 2).reshape(m, r, 8)  # byte row r = (group, p) holds j = 0..7
    table = jnp.einsum("mrj,jt->mrt", x8, subsets, precision=hi)  # [M, R, 256]
    idx = bits.astype(jnp.int32)
    return jnp.stack([jnp.take_along_axis(table[i], idx, axis=1).sum(0) for i in range(m)])
  out = jnp.zeros((m, n), jnp.float32)
  for j in range(8):  # plane j of every group is a contiguous [P, N] block of bits
    plane = ((bits >> j) & 1).astype(jnp.float32)
    out += jnp.dot(x_p[:, :, j, :].reshape(m, r), plane, precision=hi)
  return out


def _delta_matmul_xla(x, w_base, bits, scale, slot_ids, *, group_k: int):
  k = w_base.shape[0]
  x32 = x.astype(jnp.float32)
  rowsum = x32.sum(axis=1, keepdims=True)
  y = jnp.dot(x, w_base, preferred_element_type=jnp.float32)
  if slot_ids is None:
    y += scale.astype(jnp.float32) * (2 * _xla_bits_product(x32, bits, group_k, k) - rowsum)
  else:
    for s in range(1, bits.shape[0]):  # slot 0 = base only, never read
      rows = (slot_ids == s)[:, None]
      xs = jnp.where(rows, x32, 0.0)
      d = scale[s].astype(jnp.float32) * (2 * _xla_bits_product(xs, bits[s], group_k, k) - rowsum)
      y += jnp.where(rows, d, 0.0)
  return y.astype(x.dtype)


def _check(x, w_base, bits, scale, slot_ids, g: int):
  k, _ = w_base.shape
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f"x must be [M, {k}] for w_base {w_base.shape}, got {x.shape}")
  check_delta_operands(x, w_base.shape, bits, scale, slot_ids, g)


def check_delta_operands(x, shape_KxN, bits, scale, slot_ids, g: int) -> None:
  """The 1-bit delta operands of an ``[M, K] x [K, N]`` product (none; one variant; a bank and
  its slot_ids), checked for every base format (`quant_matmul` calls it too)."""
  k, n = shape_KxN
  if bits is None:
    if scale is not None or slot_ids is not None:
      raise ValueError("scale and slot_ids need bits")
    return
  want = (packed_rows(k, g), n)
  if bits.ndim not in (2, 3) or tuple(bits.shape[-2:]) != want:
    raise ValueError(f"bits must be [..., {want[0]}, {n}] (group_k={g}), got {bits.shape}")
  if scale is None or scale.ndim != bits.ndim - 1 or scale.shape[-1] not in (1, n):
    got = None if scale is None else scale.shape
    raise ValueError(f"scale must be [{'S, ' if bits.ndim == 3 else ''}1|{n}], got {got}")
  if bits.ndim == 3 and scale.shape[0] != bits.shape[0]:
    raise ValueError(f"bank of {bits.shape[0]} slots but scale has {scale.shape[0]}")
  if (slot_ids is None) != (bits.ndim == 2):
    raise ValueError(
      "a bank of deltas [S, K_pad/8, N] needs slot_ids [M], and slot_ids needs a bank"
    )
  if slot_ids is not None and slot_ids.shape != (x.shape[0],):
    raise ValueError(f"slot_ids must be [{x.shape[0]}], got {slot_ids.shape}")


def _run(
  name: str,
  x,
  w_base,
  bits,
  scale,
  slot_ids,
  *,
  g: int,
  interpret: bool,
  config: Config | MosaicConfig | None,
):
  if name == "cpu_rows":  # f32 result, differentiable (the reference's VJP)
    return cpu_rows.rows_call(x, w_base, bits, scale, slot_ids, group_k=g)
  if name in ("cpu", "pallas_triton", "mosaic_gpu"):  # kernels XLA cannot differentiate through
    kernel = lambda x, w, s, b, i: _run_impl(  # noqa: E731
      name, x, w, b, s, i, g=g, interpret=interpret, config=config)
    return with_reference_vjp(kernel, g)(x, w_base, scale, bits, slot_ids)
  return _run_impl(name, x, w_base, bits, scale, slot_ids, g=g, interpret=interpret, config=config)


def _run_impl(
  name: str,
  x,
  w_base,
  bits,
  scale,
  slot_ids,
  *,
  g: int,
  interpret: bool,
  config: Config | MosaicConfig | None,
):
  if name == "reference":
    return delta_matmul_reference(x, w_base, bits, scale, slot_ids, group_k=g)
  if name == "xla":
    return _delta_matmul_xla(x, w_base, bits, scale, slot_ids, group_k=g)
  if name == "cpu":
    return cpu.delta_matmul_cpu(x, w_base, bits, scale, slot_ids, group_k=g)
  if name == "pallas_triton":
    config = config if isinstance(config, Config) else None
    if slot_ids is None:
      return pallas_gpu.delta_matmul_single(
        x, w_base, bits, scale, group_k=g, config=config, interpret=interpret
      )
    return pallas_gpu.delta_matmul_bank(
      x, w_base, bits, scale, slot_ids, group_k=g, config=config, interpret=interpret
    )
  if name == "mosaic_gpu":
    config = config if isinstance(config, MosaicConfig) else None
    if slot_ids is None:
      return mosaic_gpu.delta_matmul_single(
        x, w_base, bits, scale, group_k=g, config=config, interpret=interpret
      )
    return mosaic_gpu.delta_matmul_bank(
      x, w_base, bits, scale, slot_ids, group_k=g, config=config, interpret=interpret
    )
  raise ValueError(f"unknown implementation {name!r}; choose from {IMPLEMENTATIONS} or None")


def unavailable_reason(name: str, *, interpret: bool = False) -> str | None:
  """None if implementation ``name`` can run on the target platform (this process's default
  backend, or the one set by `lowering_platform`), else why."""
  platform = target_platform()
  lowering_note = "" if override() is None else " (set by lowering_platform)"
  if name in ("reference", "xla"):
    return None
  if name == "cpu_rows":
    return cpu_rows.unavailable_reason()
  if name == "cpu":
    return cpu.unavailable_reason()
  if name == "pallas_triton":
    if interpret:
      return None
    if pallas_gpu.pltriton is None:
      return "this jax has no Pallas Triton lowering (jax.experimental.pallas.triton)"
    if platform not in (*_GPU_PLATFORMS, "rocm"):
      return (
        f"the Triton kernels need a GPU backend, the target platform is {platform!r}"
        f"{lowering_note} (pass interpret=True to run the kernel bodies on CPU)"
      )
    return None
  if name == "mosaic_gpu":
    reason = mosaic_gpu.unavailable_reason(interpret=interpret)
    if reason or interpret:
      return reason
    if platform not in _GPU_PLATFORMS:
      return (
        f"the Mosaic GPU kernels need a CUDA GPU backend (Hopper), the target platform is "
        f"{platform!r}{lowering_note} (pass interpret=True to run the kernel bodies on CPU, or "
        "trace inside lowering_platform('cuda') to lower them for a GPU from this process)"
      )
    return hopper_reason()
  raise ValueError(f"unknown implementation {name!r}; choose from {IMPLEMENTATIONS} or None")


def _shape_reason(name: str, x, w_base) -> str | None:
  """Why ``name`` would not take these operands, where that is known before running it."""
  if name == "cpu_rows":
    return cpu_rows.shapes_supported(x.shape[0], x.dtype, w_base.dtype)
  return None


def fallback_reasons(x, w_base, *, interpret: bool = False) -> dict[str, str | None]:
  """The target platform's implementations in preference order, each with why it cannot take
  ``x`` (``[M, K]``) and ``w_base`` (arrays or ``jax.ShapeDtypeStruct``); None: it can (a
  Pallas kernel may still refuse a shape when it runs, then the next one is tried)."""
  return {name: unavailable_reason(name, interpret=interpret) or _shape_reason(name, x, w_base)
          for name in _PREFERENCE.get(target_platform(), ("xla",))}


def _auto(x, w_base, bits, scale, slot_ids, *, g, interpret, config):
  reasons = []
  for name, reason in fallback_reasons(x, w_base, interpret=interpret).items():
    if name == "cpu_rows":
      continue  # taken before the delta/base split (`delta_matmul`)
    if reason:
      reasons.append(f"{name}: {reason}")
      continue
    try:
      return _run(name, x, w_base, bits, scale, slot_ids, g=g, interpret=interpret, config=config)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
  raise NotImplementedError("no delta_matmul implementation took this call:\n" + "\n".join(reasons))


def delta_matmul(
  x: jax.Array,
  w_base: jax.Array,
  bits: jax.Array | None = None,
  scale: jax.Array | None = None,
  slot_ids: jax.Array | None = None,
  *,
  group_k: int = DEFAULT_GROUP_K,
  implementation=None,
  interpret: bool = False,
  config: Config | MosaicConfig | None = None,
  preferred_element_type=None,
) -> jax.Array:
  """``x·W_base + α ⊙ (x·S)`` for one variant, or per row's slot of a bank, or ``x·W_base``.

  Args:
    x: ``[M, K]`` activations (reshape leading dims away first).
    w_base: ``[K, N]`` base kernel (Flax layout).
    bits: uint8 ``[K_pad/8, N]`` (one variant) or ``[S, K_pad/8, N]`` (bank), layout of
      `pallas_kernels.bits`; None: the plain product ``x·W_base`` (no scale, no slot_ids).
    scale: float32 ``[1|N]`` or ``[S, 1|N]``.
    slot_ids: int ``[M]``, bank only: each row's slot; 0 means base only.
    group_k: the packing ``group_k`` (the group actually used is ``group_k_for(K, group_k)``).
    implementation: one of `IMPLEMENTATIONS`, None for the best available, or a callable with
      this signature (a sharded matmul) for the products with deltas.
    interpret: run Pallas kernels in interpret mode (tests, CPU).
    config: block sizes for the Pallas kernels: a `Config` for ``pallas_triton``, a
      `MosaicConfig` for ``mosaic_gpu`` (the other kernel then uses its own heuristic; default:
      `Config.heuristic` / `MosaicConfig.heuristic`).
    preferred_element_type: the result's dtype (default ``x.dtype``). ``jnp.float32``: the
      few-rows kernel's f32 sums as they are, the other implementations' ``x.dtype`` result
      widened (so a LoRA term added in f32 sees what it saw before this API chose kernels).

  Returns:
    ``[M, N]`` in ``preferred_element_type`` or ``x.dtype``; accumulation in f32.
  """
  out = jnp.dtype(preferred_element_type or x.dtype)
  if callable(implementation):
    delta_fn = functools.partial(implementation, group_k=group_k)
    return _with_base_rows(delta_fn, x, w_base, bits, scale, slot_ids, "xla").astype(out)
  g = group_k_for(w_base.shape[0], group_k)
  _check(x, w_base, bits, scale, slot_ids, g)
  args = (x, w_base, bits, scale, slot_ids)
  run = functools.partial(_run, g=g, interpret=interpret, config=config)
  if implementation is None:
    if fallback_reasons(x, w_base, interpret=interpret).get("cpu_rows", "") is None:
      return run("cpu_rows", *args).astype(out)  # base rows and deltas in one pass, no cond
    delta_fn = functools.partial(_auto, g=g, interpret=interpret, config=config)
  else:
    reason = unavailable_reason(implementation, interpret=interpret)
    if reason:
      raise RuntimeError(f"delta_matmul implementation {implementation!r} cannot run: {reason}")
    if implementation == "cpu_rows":
      if reason := _shape_reason("cpu_rows", x, w_base):
        raise NotImplementedError(f"delta_matmul 'cpu_rows': {reason}")
      return run("cpu_rows", *args).astype(out)
    delta_fn = functools.partial(run, implementation)
  return _with_base_rows(delta_fn, *args, None).astype(out)


def _with_base_rows(delta_fn, x, w_base, bits, scale, slot_ids, base_implementation):
  """``delta_fn(x, w_base, bits, scale, slot_ids)`` in ``x.dtype``; with a bank under a
  ``lax.cond`` that runs only the base product when no row has a slot > 0; without bits the
  base product alone."""
  base = lambda x: small_matmul(x, w_base, implementation=base_implementation)  # noqa: E731
  if bits is None:
    return base(x)
  product = lambda x: delta_fn(x, w_base, bits, scale, slot_ids).astype(x.dtype)  # noqa: E731
  if slot_ids is None:
    return product(x)
  # Inside shard_map both branches must vary over the same mesh axes: a Pallas call's result
  # carries none, the base product those of its operands.
  axes = frozenset().union(*(_varying_axes(a) for a in (x, w_base, bits, scale, slot_ids)))
  return jax.lax.cond(
    jnp.any(slot_ids > 0), _varying(product, axes), _varying(base, axes), x)


def _varying_axes(a):
  """The shard_map axes ``a`` varies over (``aval.vma`` in newer JAX)."""
  aval = jax.typeof(a)
  if (vma := getattr(aval, "vma", None)) is not None:
    return frozenset(vma)
  return frozenset(aval.manual_axis_type.varying)


def _varying(fn, axes):
  """``fn`` with its result marked as varying over ``axes`` (a no-op outside shard_map)."""

  def wrapped(x):
    y = fn(x)
    missing = tuple(sorted(axes - _varying_axes(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y

  return wrapped
