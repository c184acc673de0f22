"""Runner calls as compact bytes: what process 0 sends the other processes of a server.

    data = encode("run", batch_fields(batch, base_only))    # bytes, a few KB for a decode step
    op, fields = decode(data)
    batch, base_only = batch_of(fields)

A plan is an operation name and named fields, each None, an int, a str or a numpy array (its
dtype, shape and raw bytes; no padding to a fixed size, no JSON). `PagedBatch` travels as its
fields; its ``attention`` as ``attention.<field>``, its ``controls`` as ``controls.<field>``, or
not at all when the batch uses the runner's neutral controls. Layout (little-endian)::

    b"BDP1" | u8 len(op) | op | u16 entries | entries
    entry: u8 len(name) | name | u8 kind | payload
      kind 0 None; 1 int: i64; 2 str: u32 len | utf-8
      kind 3 array: u8 dtype code | u8 ndim | u32 dims... | raw bytes (C order)
      kind 4 padded array: as 3, then u32 n | the first n elements | one element repeated to
        the end (a batch's padding: page tables, lanes and tokens past the live ones)

`decode` checks every length against the buffer and names what is wrong.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping

import numpy as np

MAGIC = b"BDP1"
_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(np.bool_),
           np.dtype(np.uint8), np.dtype(np.int64), np.dtype(np.float64), np.dtype(np.int8))
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_WIRE = tuple(d.newbyteorder("<") for d in _DTYPES)  # as sent: little-endian
_NONE, _INT, _STR, _ARRAY, _PADDED = range(5)
_MIN_TAIL = 16  # elements of repeated padding worth sending as one


class PlanError(ValueError):
  """Bytes that are not a well-formed plan."""


def encode(op: str, fields: Mapping[str, object] | None = None) -> bytes:
  """``op`` and ``fields`` as bytes (see the module docstring)."""
  out = [MAGIC, _name(op)]
  fields = fields or {}
  out.append(struct.pack("<H", len(fields)))
  for name, v in fields.items():
    out.append(_name(name))
    if v is None:
      out.append(bytes([_NONE]))
    elif isinstance(v, bool | int | np.integer):
      out.append(struct.pack("<Bq", _INT, int(v)))
    elif isinstance(v, str):
      raw = v.encode()
      out.append(struct.pack("<BI", _STR, len(raw)) + raw)
    else:
      a = np.ascontiguousarray(v)
      if a.dtype not in _CODE:
        raise TypeError(f"plan field {name!r}: dtype {a.dtype} cannot be sent")
      wire = a.astype(_WIRE[_CODE[a.dtype]], copy=False).reshape(-1)
      n = _live(wire)
      kind = _PADDED if wire.size - n >= _MIN_TAIL else _ARRAY
      out.append(struct.pack(f"<BBB{a.ndim}I", kind, _CODE[a.dtype], a.ndim, *a.shape))
      if kind == _PADDED:
        out.append(struct.pack("<I", n) + wire[: n + 1].tobytes())
      else:
        out.append(wire.tobytes())
  return b"".join(out)


def decode(data: bytes) -> tuple[str, dict[str, object]]:
  """The (op, fields) of ``encode``; `PlanError` on malformed bytes. Arrays are read-only
  views of ``data``."""
  buf = bytes(data)
  if buf[:4] != MAGIC:
    raise PlanError(f"not a plan (starts with {buf[:4]!r}, expected {MAGIC!r})")
  pos = 4

  def take(n: int, what: str) -> bytes:
    nonlocal pos
    if pos + n > len(buf):
      raise PlanError(f"plan truncated in {what} (needs {pos + n} bytes, has {len(buf)})")
    pos += n
    return buf[pos - n : pos]

  def name(what: str) -> str:
    return take(take(1, what)[0], what).decode()

  op = name("the op")
  fields: dict[str, object] = {}
  for _ in range(struct.unpack("<H", take(2, "the entry count"))[0]):
    key = name("a field name")
    kind = take(1, key)[0]
    if kind == _NONE:
      fields[key] = None
    elif kind == _INT:
      fields[key] = struct.unpack("<q", take(8, key))[0]
    elif kind == _STR:
      fields[key] = take(struct.unpack("<I", take(4, key))[0], key).decode()
    elif kind in (_ARRAY, _PADDED):
      code, ndim = take(2, key)
      if code >= len(_DTYPES):
        raise PlanError(f"field {key!r}: unknown dtype code {code}")
      shape = struct.unpack(f"<{ndim}I", take(4 * ndim, key))
      count = 1
      for d in shape:
        count *= d
      size = _WIRE[code].itemsize
      if kind == _PADDED:
        n = struct.unpack("<I", take(4, key))[0]
        if n >= count:
          raise PlanError(f"field {key!r}: {n} live elements of {count}")
        at = pos
        take((n + 1) * size, key)
        head = np.frombuffer(buf, _WIRE[code], n + 1, at)
        a = np.empty(count, _DTYPES[code])
        a[:n] = head[:n]
        a[n:] = head[n]
        fields[key] = a.reshape(shape)
        continue
      at = pos
      take(count * size, key)  # bounds check
      # read-only views of the message (native order on little-endian hosts; else converted)
      a = np.frombuffer(buf, _WIRE[code], count, at).reshape(shape)
      fields[key] = a if a.dtype.isnative else a.astype(_DTYPES[code])
    else:
      raise PlanError(f"field {key!r}: unknown kind {kind}")
  if pos != len(buf):
    raise PlanError(f"{len(buf) - pos} bytes after the last field")
  return op, fields


def _live(flat: np.ndarray) -> int:
  """Elements before the run of the last value that ends ``flat``."""
  if flat.size == 0:
    return 0
  same = flat == flat[-1]
  if flat.dtype.kind == "f":
    same |= np.isnan(flat) & np.isnan(flat[-1])
  diff = np.flatnonzero(~same)
  return int(diff[-1]) + 1 if diff.size else 0


def _name(s: str) -> bytes:
  raw = s.encode()
  if len(raw) > 255:
    raise ValueError(f"plan name {s[:40]!r}... is longer than 255 bytes")
  return bytes([len(raw)]) + raw


# -- the paged engine's batches -------------------------------------------------------------------
def batch_fields(batch, base_only: bool) -> dict[str, object]:
  """A `PagedBatch` of host arrays (controls None or host arrays) as plan fields: its arrays by
  name, its `AttentionInputs` and controls as ``attention.<field>`` and ``controls.<field>``."""
  out: dict[str, object] = {"base_only": int(bool(base_only))}
  for f in dataclasses.fields(batch):
    v = getattr(batch, f.name)
    if f.name in _NESTED:
      if v is not None:
        out.update({f"{f.name}.{c.name}": _field(getattr(v, c.name))
                    for c in dataclasses.fields(v)})
    else:
      out[f.name] = np.asarray(v)
  return out


_NESTED = ("attention", "controls")


def _field(v):
  return v if isinstance(v, int) else np.asarray(v)


def batch_of(fields: Mapping[str, object]):
  """(`PagedBatch`, base_only) from `batch_fields`' output."""
  from bitdelta_jax.engine.batch import PagedBatch
  from bitdelta_jax.engine.controls import LogitControls
  from pallas_kernels.attention_inputs import AttentionInputs

  nested = {p: {k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith(p + ".")}
            for p in _NESTED}
  names = [f.name for f in dataclasses.fields(PagedBatch) if f.name not in _NESTED]
  missing = [n for n in names if n not in fields] + [
    f"attention.{f.name}" for f in dataclasses.fields(AttentionInputs)
    if f.name not in nested["attention"]]
  if missing:
    raise PlanError(f"run plan without {', '.join(missing)}")
  controls = LogitControls(**nested["controls"]) if nested["controls"] else None
  return PagedBatch(**{n: fields[n] for n in names}, attention=AttentionInputs(
    **nested["attention"]), controls=controls), bool(fields["base_only"])
