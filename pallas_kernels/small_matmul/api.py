"""`small_matmul`: the plain product ``x · W`` of a Linear layer's base path, dispatch by shape.

Implementations (``implementation=``):

* ``"cpu"``: the f32 small-M kernel (`cpu.small_matmul`, ``MIN_ROWS..MAX_ROWS`` f32 rows; XLA's
  dot runs far below the bandwidth there).
* ``"cpu_bf16"``: bf16 x and W (`cpu_bf16.dense`): its kernel for a few rows, else XLA's dot with
  f32 sums (XLA's bf16-result dot ran 1.3-4.4x slower inside a model program).
* ``"xla"``: ``jnp.dot``, any backend.

``implementation=None`` takes the first of these that can run; `fallback_reasons` says why each
one before it could not. The kernels run on one CPU device only: their FFI calls do not
partition, so a multi-device program keeps XLA's dot (a sharded layer runs per-shard kernels,
`bitdelta_jax.sharding.ShardedDeltaMatmul`). A few rows with or without deltas go to the delta
kernel's few-rows path first (`pallas_kernels.delta_matmul.api`), which calls this for the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import settings
from pallas_kernels.platform import target_platform

from . import cpu, cpu_bf16

IMPLEMENTATIONS = ("cpu", "cpu_bf16", "xla")
__all__ = ["IMPLEMENTATIONS", "fallback_reasons", "one_cpu_device_reason", "small_matmul",
           "unavailable_reason"]


def one_cpu_device_reason(what: str) -> str | None:
  """None when the target platform is the CPU and the process has one device, else why ``what``
  (a CPU FFI kernel) cannot run."""
  if (platform := target_platform()) != "cpu":
    return f"{what} runs on the host CPU; the target platform is {platform!r}"
  if (n := jax.device_count()) != 1:
    return f"{what} runs on one device; this process has {n} (an FFI call does not partition)"
  return None


def unavailable_reason(name: str, rows: int, x_dtype, w_dtype) -> str | None:
  """None if implementation ``name`` takes ``rows`` rows of these dtypes here, else why not."""
  if name == "xla":
    return None
  x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
  if name == "cpu":
    if not settings.get("BITDELTA_SMALL_MATMUL"):
      return "turned off by BITDELTA_SMALL_MATMUL=0"
    if not cpu.MIN_ROWS <= rows <= cpu.MAX_ROWS:
      return f"{rows} rows: the f32 small-M kernel takes {cpu.MIN_ROWS} to {cpu.MAX_ROWS}"
    if x_dtype != jnp.float32 or w_dtype != jnp.float32:
      return f"x {x_dtype}, W {w_dtype}: the f32 small-M kernel takes f32 x and W"
    return one_cpu_device_reason("the f32 small-M kernel") or cpu._load()
  if name == "cpu_bf16":
    if x_dtype != jnp.bfloat16 or w_dtype != jnp.bfloat16:
      return f"x {x_dtype}, W {w_dtype}: the bf16 path takes bf16 x and W"
    return one_cpu_device_reason("the bf16 path")
  raise ValueError(f"unknown implementation {name!r}; choose from {IMPLEMENTATIONS} or None")


def fallback_reasons(rows: int, x_dtype, w_dtype) -> dict[str, str | None]:
  """Each implementation in preference order with why it cannot run (None: it can); the
  first None is what ``implementation=None`` runs."""
  return {name: unavailable_reason(name, rows, x_dtype, w_dtype) for name in IMPLEMENTATIONS}


def small_matmul(x_MxK: jax.Array, w_KxN: jax.Array, *,
                 implementation: str | None = None) -> jax.Array:
  """``x · W`` in ``x.dtype``: x ``[M, K]``, W ``[K, N]``. ``implementation``: one of
  `IMPLEMENTATIONS` (it raises if it cannot run), or None for the first that can."""
  m = x_MxK.shape[0]
  if implementation is None:
    reasons = fallback_reasons(m, x_MxK.dtype, w_KxN.dtype)
    implementation = next(name for name, why in reasons.items() if why is None)
  elif reason := unavailable_reason(implementation, m, x_MxK.dtype, w_KxN.dtype):
    raise RuntimeError(f"small_matmul implementation {implementation!r} cannot run: {reason}")
  if implementation == "cpu":
    y = cpu.small_matmul(x_MxK, w_KxN)
  elif implementation == "cpu_bf16":
    y = cpu_bf16.dense(x_MxK, w_KxN)
  else:
    y = jnp.dot(x_MxK, w_KxN)
  return y.astype(x_MxK.dtype)
