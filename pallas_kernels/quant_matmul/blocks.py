"""ggml's Q8_0, Q4_0 and Q4_1 weight blocks, held as a pytree the model's Linear layers use.

A block is 32 consecutive weights along K (a Linear's input dimension) with an f16 scale ``d``
(and for Q4_1 an f16 minimum ``m``):

* ``q8_0``: 32 int8 ``q``; ``w = d·q`` (1.0625 bytes per weight).
* ``q4_0``: 16 bytes, byte j holding weight j in its low nibble and weight j+16 in its high one;
  ``w = d·(q − 8)`` (0.5625 bytes per weight).
* ``q4_1``: the same nibbles; ``w = d·q + m`` (0.625 bytes per weight).

A GGUF file stores one ggml row per output column n (``[N, K/32 blocks]``, the blocks' fields
interleaved). `QuantizedKernel` keeps the same blocks, the same bytes, as column blocks: each
field an array whose last axis is N (``qs [K/32, 32|16, N]``, ``d``/``m`` ``[K/32, N]``). That is
the Flax ``[K, N]`` kernel's orientation: the CPU kernel streams K with 16 columns per vector,
as the f32 kernels do, and a mesh shards the blocks like the dense kernel (columns: the last
axis of every field; rows: axis 0, on block boundaries). `from_ggml_rows` / `to_ggml_rows`
convert exactly; `quantize_rows` is llama.cpp's reference quantizer, bit for bit (as the
``gguf`` package's numpy port computes it: f32 arithmetic, the same rounding).

Why not call ``gguf.quants.quantize``: `quantize` needs the column-block fields, which
`_quantize_fields` yields without a detour through row bytes, and two independent ports of
ggml's C rules checked byte-equal (``tests/kernels/test_quant_matmul.py``) catch a change in
either; the times are alike (576x1536: 11.5 / 4.1 / 7.3 ms here against gguf's 6.2 / 5.3 /
9.1 ms for Q8_0 / Q4_0 / Q4_1). Per-format facts (sizes, layout, decoding) are the table in
`formats`; the quantizers' rules stay code here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul.formats import BLOCK, block_format
from pallas_kernels.quant_matmul.formats import FORMATS as _TABLE

FORMATS = tuple(_TABLE)  # the names; each format's facts: `formats.block_format`


def block_bytes(fmt: str) -> int:
  """Bytes of one 32-weight block in the file."""
  return block_format(fmt).block_bytes


def bytes_per_weight(fmt: str) -> float:
  return block_format(fmt).bytes_per_weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKernel:
  """A ``[K, N]`` kernel in ggml blocks, as column blocks (see the module docstring).

  Attributes:
    qs: q8_0: int8 ``[K/32, 32, N]``; q4_0 / q4_1: uint8 ``[K/32, 16, N]`` (byte j: weights j
      and j + 16 of the block, low nibble first).
    d: float16 ``[K/32, N]``.
    m: float16 ``[K/32, N]`` for q4_1, else None.
    format: one of `FORMATS`.
    shape: ``(K, N)``.
  """

  qs: jax.Array | np.ndarray
  d: jax.Array | np.ndarray
  m: jax.Array | np.ndarray | None
  format: str = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Stored bytes (those of the file's blocks)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.qs, self.d, self.m)
               if a is not None)

  @property
  def ndim(self) -> int:
    return 2


def abstract(fmt: str, shape_KxN: tuple[int, int]) -> QuantizedKernel:
  """A `QuantizedKernel` of ``jax.ShapeDtypeStruct`` fields (tracing and lowering without data)."""
  f = block_format(fmt)
  k, n = (int(s) for s in shape_KxN)
  sds = jax.ShapeDtypeStruct
  qs = sds((k // BLOCK, f.qs_rows, n), jnp.uint8 if f.nibbles else jnp.int8)
  m = sds((k // BLOCK, n), jnp.float16) if f.has_min else None
  return QuantizedKernel(qs=qs, d=sds((k // BLOCK, n), jnp.float16), m=m, format=fmt,
                         shape=(k, n))


def _as_blocks(w_NxK: np.ndarray) -> np.ndarray:
  n, k = w_NxK.shape
  if k % BLOCK:
    raise ValueError(f"a {n}x{k} matrix does not split into blocks of {BLOCK} along K={k}")
  return np.asarray(w_NxK, np.float32).reshape(n, k // BLOCK, BLOCK)


def _roundf(x: np.ndarray) -> np.ndarray:
  """C's ``roundf`` (half away from zero), as ggml rounds Q8_0."""
  a = np.abs(x)
  f = np.floor(a)
  return np.sign(x) * (f + np.floor(2 * (a - f)))


def _nibbles(q: np.ndarray) -> np.ndarray:
  """``[..., 32]`` values 0..15 → ``[..., 16]`` bytes: low nibble j, high nibble j + 16."""
  q = q.astype(np.uint8)
  return q[..., :16] | (q[..., 16:] << np.uint8(4))


def _quantize_fields(w_NxK: np.ndarray, fmt: str):
  """(qs ``[N, K/32, 32|16]``, d ``[N, K/32]`` f16, m or None): llama.cpp's reference rules."""
  block_format(fmt)
  b = _as_blocks(w_NxK)
  with np.errstate(divide="ignore", invalid="ignore"):
    if fmt == "q8_0":
      d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
      inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
      return _roundf(b * inv).astype(np.int8), d[..., 0].astype(np.float16), None
    if fmt == "q4_0":
      imax = np.abs(b).argmax(axis=-1)[..., None]
      mx = np.take_along_axis(b, imax, axis=-1)
      d = mx / np.float32(-8)
      inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
      q = np.trunc(b * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
      return _nibbles(q), d[..., 0].astype(np.float16), None
    lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc((b - lo) * inv + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return _nibbles(q), d[..., 0].astype(np.float16), lo[..., 0].astype(np.float16)


def quantize(w_KxN: np.ndarray, fmt: str) -> QuantizedKernel:
  """A ``[K, N]`` kernel quantized as llama.cpp would quantize its ``[N, K]`` rows."""
  w = np.asarray(w_KxN, np.float32)
  qs, d, m = _quantize_fields(w.T, fmt)
  return _columns(qs, d, m, fmt, w.shape)


def _columns(qs, d, m, fmt, shape) -> QuantizedKernel:
  """Row-major fields (``[N, K/32, ...]``) → column blocks."""
  return QuantizedKernel(
    qs=np.ascontiguousarray(qs.transpose(1, 2, 0)), d=np.ascontiguousarray(d.T),
    m=None if m is None else np.ascontiguousarray(m.T), format=fmt,
    shape=(int(shape[0]), int(shape[1])))


def quantize_rows(w_NxK: np.ndarray, fmt: str) -> np.ndarray:
  """The bytes a GGUF file stores for ``w`` (``[N, K]``, HF layout): uint8
  ``[N, K/32 · block_bytes]``, equal to ``gguf.quants.quantize``'s."""
  qs, d, m = _quantize_fields(w_NxK, fmt)
  return _row_bytes(qs, d, m)


def _row_bytes(qs, d, m) -> np.ndarray:
  n, nb = d.shape
  parts = [d.view(np.uint8).reshape(n, nb, 2)]
  if m is not None:
    parts.append(m.view(np.uint8).reshape(n, nb, 2))
  parts.append(qs.view(np.uint8))
  return np.concatenate(parts, axis=-1).reshape(n, -1)


def from_ggml_rows(raw: np.ndarray, fmt: str, shape_KxN: tuple[int, int]) -> QuantizedKernel:
  """A GGUF tensor's bytes (uint8 ``[N, K/32 · block_bytes]``, one ggml row per column n) as
  column blocks of a ``[K, N]`` kernel."""
  k, n = (int(s) for s in shape_KxN)
  nb, size = k // BLOCK, block_bytes(fmt)
  if k % BLOCK or raw.size != n * nb * size:
    raise ValueError(f"{raw.size} bytes are not a {fmt} [{n}, {k}] tensor "
                     f"({n} rows of {nb} blocks of {size} bytes)")
  b = np.asarray(raw, np.uint8).reshape(n, nb, size)
  f = block_format(fmt)
  d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
  m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0] if f.has_min else None
  qs = b[..., f.header_bytes:]
  if not f.nibbles:
    qs = qs.view(np.int8)
  return _columns(qs, d, m, fmt, (k, n))


def to_ggml_rows(qk: QuantizedKernel) -> np.ndarray:
  """The inverse of `from_ggml_rows`: the file's bytes, ``[N, K/32 · block_bytes]``."""
  qs = np.asarray(qk.qs).transpose(2, 0, 1)
  d = np.ascontiguousarray(np.asarray(qk.d).T)
  m = None if qk.m is None else np.ascontiguousarray(np.asarray(qk.m).T)
  return _row_bytes(np.ascontiguousarray(qs), d, m)


def _values(qs, fmt, xp):
  """Block values ``[K/32, 32, ...]`` (int8 for q8_0, 0..15 for the nibbles) as f32."""
  if not block_format(fmt).nibbles:
    return qs.astype(xp.float32)
  lo = (qs & 0x0F).astype(xp.float32)
  hi = (qs >> 4).astype(xp.float32)
  return xp.concatenate([lo, hi], axis=1)


def _dequantize(qk: QuantizedKernel, xp):
  f = block_format(qk.format)
  d = qk.d.astype(xp.float32)[:, None]
  v = _values(qk.qs, qk.format, xp)
  w = d * (v - f.offset) if f.offset else d * v
  if f.has_min:
    w = w + qk.m.astype(xp.float32)[:, None]
  return w.reshape(qk.shape[0], *w.shape[2:])


def dequantize(qk: QuantizedKernel) -> np.ndarray:
  """f32 ``[K, N]`` (numpy), the values ggml's dequantization gives."""
  qk = jax.tree.map(np.asarray, qk)
  return _dequantize(qk, np).astype(np.float32)


def dequantize_jnp(qk: QuantizedKernel) -> jax.Array:
  """f32 ``[K, N]`` in jnp (equal to `dequantize`)."""
  return _dequantize(qk, jnp)


def take_columns(qk: QuantizedKernel, ids: jax.Array) -> jax.Array:
  """f32 ``[*ids.shape, K]``: the dequantized columns ``ids`` (for an embedding table held as
  ``[D, V]``, the embeddings of the tokens ``ids``); only those columns are read."""
  flat = ids.reshape(-1)
  sub = QuantizedKernel(
    qs=jnp.take(qk.qs, flat, axis=2), d=jnp.take(qk.d, flat, axis=1),
    m=None if qk.m is None else jnp.take(qk.m, flat, axis=1), format=qk.format,
    shape=(qk.shape[0], flat.shape[0]))
  return dequantize_jnp(sub).T.reshape(*ids.shape, qk.shape[0])


def permute_columns(qk: QuantizedKernel, perm) -> QuantizedKernel:
  """The kernel with its columns (the file's rows) in the order ``perm``."""
  perm = np.asarray(perm)
  return QuantizedKernel(
    qs=np.ascontiguousarray(np.asarray(qk.qs)[..., perm]),
    d=np.ascontiguousarray(np.asarray(qk.d)[:, perm]),
    m=None if qk.m is None else np.ascontiguousarray(np.asarray(qk.m)[:, perm]),
    format=qk.format, shape=qk.shape)
