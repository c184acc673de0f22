"""`delta_matmul`: one entry point, several implementations, dispatch by backend.

    y[m] = x[m] · W_base + α[v] ⊙ (x[m] · S[v]),   v = slot_ids[m]; v == 0 means base only.

Implementations (``implementation=``):

* ``"reference"``: `reference.delta_matmul_reference`, readable jnp.
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
`NotImplementedError` (a shape a kernel cannot take); naming one that cannot run raises. The
target platform is the default backend, or the one `lowering_platform` (re-exported from
`pallas_kernels.platform`) sets: to lower CUDA programs in a CPU-only process, trace inside
``with lowering_platform("cuda"):`` and lower with ``lowering_platforms=("cuda",)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bitdelta_jax.delta.format import DEFAULT_GROUP_K, group_k_for, packed_rows
from pallas_kernels.platform import (
  hopper_reason,
  lowering_platform,
  override,
  target_platform,
)

from . import cpu, mosaic_gpu, pallas_gpu
from .config import Config, MosaicConfig
from .reference import delta_matmul_reference, with_reference_vjp

IMPLEMENTATIONS = ("reference", "xla", "cpu", "pallas_triton", "mosaic_gpu")
# The Pallas Triton lowering is deprecated from jax 0.11: only a fallback where it still lowers.
_TRITON_IN_PREFERENCE = jax.__version_info__ < (0, 11)
_GPU_PREFERENCE = ("mosaic_gpu", *(("pallas_triton",) if _TRITON_IN_PREFERENCE else ()), "xla")
_PREFERENCE = {
  "cpu": ("cpu", "xla"),
  "gpu": _GPU_PREFERENCE,
  "cuda": _GPU_PREFERENCE,
  "rocm": (*(("pallas_triton",) if _TRITON_IN_PREFERENCE else ()), "xla"),
}
_GPU_PLATFORMS = ("gpu", "cuda")
__all__ = [
  "IMPLEMENTATIONS",
  "delta_matmul",
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
  k, n = w_base.shape
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f"x must be [M, {k}] for w_base {w_base.shape}, got {x.shape}")
  want = (packed_rows(k, g), n)
  if bits.ndim not in (2, 3) or tuple(bits.shape[-2:]) != want:
    raise ValueError(f"bits must be [..., {want[0]}, {n}] (group_k={g}), got {bits.shape}")
  if scale.ndim != bits.ndim - 1 or scale.shape[-1] not in (1, n):
    raise ValueError(f"scale must be [{'S, ' if bits.ndim == 3 else ''}1|{n}], got {scale.shape}")
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


def delta_matmul(
  x: jax.Array,
  w_base: jax.Array,
  bits: jax.Array,
  scale: jax.Array,
  slot_ids: jax.Array | None = None,
  *,
  group_k: int = DEFAULT_GROUP_K,
  implementation: str | None = None,
  interpret: bool = False,
  config: Config | MosaicConfig | None = None,
) -> jax.Array:
  """``x·W_base + α ⊙ (x·S)`` for one variant, or per row's slot of a bank.

  Args:
    x: ``[M, K]`` activations (reshape leading dims away first).
    w_base: ``[K, N]`` base kernel (Flax layout).
    bits: uint8 ``[K_pad/8, N]`` (one variant) or ``[S, K_pad/8, N]`` (bank), layout of
      `bitdelta_jax.delta.format`.
    scale: float32 ``[1|N]`` or ``[S, 1|N]``.
    slot_ids: int ``[M]``, bank only: each row's slot; 0 means base only.
    group_k: the packing ``group_k`` (the group actually used is ``group_k_for(K, group_k)``).
    implementation: one of `IMPLEMENTATIONS`, or None for the best available.
    interpret: run Pallas kernels in interpret mode (tests, CPU).
    config: block sizes for the Pallas kernels: a `Config` for ``pallas_triton``, a
      `MosaicConfig` for ``mosaic_gpu`` (the other kernel then uses its own heuristic; default:
      `Config.heuristic` / `MosaicConfig.heuristic`).

  Returns:
    ``[M, N]`` in ``x.dtype``; accumulation in f32.
  """
  g = group_k_for(w_base.shape[0], group_k)
  _check(x, w_base, bits, scale, slot_ids, g)
  args = (x, w_base, bits, scale, slot_ids)
  if implementation is not None:
    reason = unavailable_reason(implementation, interpret=interpret)
    if reason:
      raise RuntimeError(f"delta_matmul implementation {implementation!r} cannot run: {reason}")
    return _run(implementation, *args, g=g, interpret=interpret, config=config)
  reasons = []
  for name in _PREFERENCE.get(target_platform(), ("xla",)):
    if unavailable_reason(name, interpret=interpret):
      reasons.append(f"{name}: {unavailable_reason(name, interpret=interpret)}")
      continue
    try:
      return _run(name, *args, g=g, interpret=interpret, config=config)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
  raise NotImplementedError("no delta_matmul implementation took this call:\n" + "\n".join(reasons))
