"""The delta store: one directory per variant, arrays in tensorstore (zarr), plus manifest.json.

    DELTA_DIR/
      manifest.json               format version, base fingerprint, per-tensor layout, report
      arrays/<tensor>/<field>/    zarr arrays (uncompressed, ≤64 MB chunks along axis 0)

Linear weights are ``packed`` (1-bit), or with the other delta modes (`residual.py`)
``residual`` (1-bit + low-rank factors) or ``lora`` (low-rank factors alone); the manifest's
``mode`` and ``lora_rank`` say which and how large a LoRA slot a model needs (docs/FORMAT.md).

Writes are atomic (`bitdelta_jax.outputs`): everything goes to a hidden sibling
``.bitdelta-tmp-NAME-<pid>-<id>`` that is fsynced and swapped into place only after the
manifest is written, so an interrupted write leaves nothing that loads as a variant; an
existing path is replaced only if it is a delta store. Every array's crc32 is in the manifest and checked on load.

We write arrays with tensorstore directly (Orbax's own storage layer) rather than through an
Orbax checkpointer because compression streams tensor by tensor and never holds the whole
tree; the zarr arrays can still be read into any sharding chunk by chunk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from bitdelta_jax.delta.entries import LAYOUT, DeltaMismatchError, Dense, Entry, PackedDelta
from bitdelta_jax.delta.report import Report
from bitdelta_jax.outputs import MARKER, OutputDir

FORMAT_NAME = "bitdelta-jax-delta"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHUNK_BYTES = 64 << 20
_SAFE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class DeltaStoreError(ValueError):
  """A delta directory is missing, corrupt, incompatible, or cannot be written."""


def crc32(a: np.ndarray) -> int:
  return zlib.crc32(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


def _ts_dtype(dtype: np.dtype) -> str:
  dtype = np.dtype(dtype)
  return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def _spec(path: Path, shape=None, dtype=None) -> dict:
  spec: dict[str, Any] = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}
  if shape is not None:
    row = max(1, int(np.prod(shape[1:])) * np.dtype(dtype).itemsize) if len(shape) else 1
    chunk0 = max(1, min(shape[0], CHUNK_BYTES // row)) if len(shape) else 1
    chunks = [chunk0, *shape[1:]] if len(shape) else []
    spec["metadata"] = {"shape": list(shape), "chunks": [max(1, c) for c in chunks],
                        "dtype": _ts_dtype(dtype), "compressor": None}
  return spec


def write_array(path: Path, a: np.ndarray) -> dict:
  a = np.ascontiguousarray(a)
  t = ts.open(_spec(path, a.shape, a.dtype), create=True, delete_existing=True).result()
  if a.size:
    t.write(a).result()
  return {"shape": list(a.shape), "dtype": a.dtype.name, "crc32": crc32(a)}


def check_finite(a: np.ndarray, where: str) -> None:
  """Raises `DeltaStoreError` if floating-point ``a`` holds inf or NaN. A variant's weights
  must be finite: in a shared batch one non-finite α or factor makes its own rows NaN, and no
  served variant has a use for one (``where`` names the tensor and the file)."""
  if a.dtype.kind in "biu":  # bits, codes, widths
    return
  bad = ~np.isfinite(a)
  if bad.any():
    first = np.unravel_index(int(np.argmax(bad)), a.shape)
    raise DeltaStoreError(
      f"{where}: {int(bad.sum())} non-finite value(s) (first {a[first]} at index "
      f"{[int(i) for i in first]}): a variant's weights must be finite")


def read_array(path: Path, meta: Mapping, *, verify: bool = True, index=None) -> np.ndarray:
  """Reads one stored array (or ``index``, a tuple of slices, of it) and checks it: shape,
  crc32 (``verify``, whole arrays) and, always, that its values are finite (`check_finite`)."""
  if not path.exists():
    raise DeltaStoreError(f"{path}: array file is missing")
  try:
    t = ts.open(_spec(path), open=True).result()
    if list(t.shape) != list(meta["shape"]):
      raise DeltaStoreError(f"{path}: stored shape {list(t.shape)} != manifest {meta['shape']}")
    a = (t if index is None else t[index]).read().result()
  except DeltaStoreError:
    raise
  except Exception as e:  # tensorstore raises ValueError with the low-level reason
    raise DeltaStoreError(f"{path}: corrupt or truncated array ({e})") from None
  if verify and index is None and crc32(a) != meta["crc32"]:
    raise DeltaStoreError(f"{path}: checksum mismatch: the array is corrupt")
  check_finite(a, f"{path}: tensor {path.parent.name!r}")  # arrays/<tensor>/<field>
  return a


class AtomicDir(OutputDir):
  """A directory written under a temporary name beside ``out`` and swapped in on `commit`.

  ``kind`` says what ``out`` may already hold to be replaced (see `bitdelta_jax.outputs`).
  """

  def __init__(self, out: str | os.PathLike, *, overwrite: bool = False,
               kind: str = "checkpoint"):
    super().__init__(out, kind=kind, overwrite=overwrite)


def _array_dir(root: Path, name: str) -> Path:
  if not _SAFE.match(name) or ".." in name:
    raise DeltaStoreError(f"tensor name {name!r} is not a safe file name")
  return root / "arrays" / name


def _packed_meta(d: Path, entry: PackedDelta) -> dict:
  return {"kind": "packed", "shape": list(entry.shape), "group_k": entry.group_k,
          "granularity": entry.granularity, "layout": entry.layout, "arrays": {
            "bits": write_array(d / "bits", np.asarray(entry.bits)),
            "scale": write_array(d / "scale", np.asarray(entry.scale, np.float32))}}


class DeltaWriter(AtomicDir):
  """Streams delta entries to a new delta directory; `finish` writes the manifest and commits."""

  def __init__(self, out, *, overwrite: bool = False):
    super().__init__(out, overwrite=overwrite, kind="delta")
    self.tensors: dict[str, dict] = {}

  def add(self, name: str, entry: Entry, hf_shape: Iterable[int] | None = None):
    d = _array_dir(self.tmp, name)
    from bitdelta_jax.delta import factors_io

    if isinstance(entry, PackedDelta):
      meta = _packed_meta(d, entry)
    elif factors_io.is_low_rank(entry):
      packed = getattr(entry, "packed", None)
      meta = factors_io.write_factors(d, getattr(entry, "lora", entry), write_array)
      if packed is not None:  # 1-bit + low rank: both parts' arrays under one tensor
        if tuple(packed.shape) != tuple(meta["shape"]):
          raise DeltaStoreError(f"tensor {name!r}: 1-bit part {list(packed.shape)} and low-rank "
                                f"part {meta['shape']} differ in shape")
        pm = _packed_meta(d, packed)
        meta = {**pm, **meta, "kind": "residual", "arrays": {**pm["arrays"], **meta["arrays"]}}
    else:
      arrays = {}
      for field in ("value", "extra_rows"):
        a = getattr(entry, field)
        if a is not None:
          arrays[field] = write_array(d / field, np.asarray(a))
      meta = {"kind": entry.kind, "arrays": arrays}
    if hf_shape is not None:
      meta["hf_shape"] = list(hf_shape)
    self.tensors[name] = meta

  def finish(self, *, base_fingerprint: dict, report: Report, policy: dict,
             extra: Mapping[str, Any] | None = None, **fields: Any) -> dict:
    """Writes manifest.json (`build_manifest` of the tensors added; ``fields`` are its
    keyword arguments) and commits."""
    manifest = build_manifest(self.tensors, base_fingerprint=base_fingerprint, report=report,
                              policy=policy, extra=extra, **fields)
    (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    self.commit()
    return manifest


def stored_embeddings(choices: Mapping[str, Mapping]) -> str:
  """The manifest's ``embeddings``: "1bit" when any vocabulary matrix is stored 1-bit."""
  return "1bit" if any(c["stored"] == "1bit" for c in choices.values()) else "exact"


def build_manifest(tensors: Mapping[str, dict], *, base_fingerprint: dict, report: Report,
                   policy: Mapping[str, Any], source: Mapping[str, str] | None = None,
                   finetuned_config: Mapping[str, Any] | None = None,
                   warnings: Iterable[str] = (), notes: Iterable[str] = (),
                   tokenizer: str | None = None,
                   embeddings_choice: Mapping[str, Mapping] | None = None,
                   extra: Mapping[str, Any] | None = None) -> dict:
  """The one manifest of a delta directory, whatever the mode wrote it: every key is always
  there (docs/FORMAT.md), so two modes' manifests differ in values only.

  ``tensors``: the per-tensor entries (`DeltaWriter.add`). ``mode`` (from the policy, else
  "bitdelta") and ``lora_rank`` (the largest factor rank of any tensor, 0 for none) are
  recorded so a server sizes its LoRA slots before loading any array. ``source``: the base and
  fine-tune directory names; ``finetuned_config``: the fine-tune's config.json; ``tokenizer``:
  the delta's own tokenizer directory (None: the base's); ``embeddings_choice``: per changed
  embedding / LM head, how it is stored and why (``embeddings`` summarises it). ``extra``:
  further keys (a caller's own), added last."""
  choices = {n: dict(c) for n, c in (embeddings_choice or {}).items()}
  ranks = [t.get("rank", 0) for t in tensors.values()]
  return {
    "format": FORMAT_NAME,
    "format_version": FORMAT_VERSION,
    "layout": LAYOUT,
    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "base": base_fingerprint,
    "policy": dict(policy),
    "scales": {"method": "mean_abs", "note": "alpha = mean|delta| (L2-optimal)"},
    "tensors": dict(tensors),
    "report": report.to_dict(),
    "mode": policy.get("mode", "bitdelta"),
    "lora_rank": max(ranks, default=0),
    "source": None if source is None else dict(source),
    "finetuned_config": dict(finetuned_config or {}),
    "warnings": list(warnings),
    "notes": list(notes),
    "tokenizer": tokenizer,
    "embeddings": stored_embeddings(choices),
    "embeddings_choice": choices,
    **(extra or {}),
  }


def read_manifest(path: str | os.PathLike) -> dict:
  path = Path(path)
  mf = path / MANIFEST
  if not path.is_dir():
    raise DeltaStoreError(f"{path}: no such delta directory")
  if not mf.exists():
    raise DeltaStoreError(f"{path}: not a delta directory ({MANIFEST} is missing)")
  try:
    m = json.loads(mf.read_text())
  except json.JSONDecodeError as e:
    raise DeltaStoreError(f"{mf}: corrupt manifest ({e})") from None
  if m.get("format") != FORMAT_NAME:
    raise DeltaStoreError(f"{mf}: not a bitdelta-jax delta manifest")
  v = m.get("format_version")
  if not isinstance(v, int) or v > FORMAT_VERSION:
    raise DeltaStoreError(
      f"{mf}: format version {v} is newer than this bitdelta-jax reads ({FORMAT_VERSION}); "
      "upgrade bitdelta-jax"
    )
  if m.get("layout") != LAYOUT:
    raise DeltaStoreError(f"{mf}: bit layout {m.get('layout')!r}, this version reads {LAYOUT!r}")
  return m


def load_entry(path: Path, name: str, meta: Mapping, *, verify: bool = True) -> Entry:
  d = _array_dir(Path(path), name)
  arrays = meta["arrays"]
  for field in arrays:
    if not (d / field).exists():
      raise DeltaStoreError(f"{d / field}: array for tensor {name!r} is missing")
  if meta["kind"] in ("residual", "lora"):
    from bitdelta_jax.delta import factors_io

    return factors_io.read_entry(d, meta, lambda f: read_array(d / f, arrays[f], verify=verify))
  if meta["kind"] == "packed":
    return PackedDelta(
      bits=read_array(d / "bits", arrays["bits"], verify=verify),
      scale=read_array(d / "scale", arrays["scale"], verify=verify),
      shape=tuple(meta["shape"]), group_k=meta["group_k"], granularity=meta["granularity"],
      layout=meta["layout"],
    )
  got = {f: read_array(d / f, m, verify=verify) for f, m in arrays.items()}
  return Dense(meta["kind"], got.get("value"), got.get("extra_rows"))


def load_delta(path: str | os.PathLike, *, base_fingerprint: dict | None = None,
               verify: bool = True) -> tuple[dict[str, Entry], dict]:
  """Loads a whole delta directory into host memory: ``({name: entry}, manifest)``.

  ``base_fingerprint`` (from `fingerprint`) checks the delta was made for that base.
  """
  m = read_manifest(path)
  if base_fingerprint is not None:
    check_base(m, base_fingerprint, where=str(path))
  return {n: load_entry(Path(path), n, meta, verify=verify) for n, meta in m["tensors"].items()}, m


def save_delta(out: str | os.PathLike, delta: Mapping[str, Entry], *, base_fingerprint: dict,
               report: Report, policy: dict, overwrite: bool = False,
               extra: Mapping[str, Any] | None = None) -> dict:
  """Writes an in-memory delta (a flat dict) atomically."""
  with DeltaWriter(out, overwrite=overwrite) as w:
    for name, entry in delta.items():
      w.add(name, entry)
    return w.finish(base_fingerprint=base_fingerprint, report=report, policy=policy, extra=extra)


def describe_base(base_fp: dict) -> str:
  """``"a GGUF base (FILE: q4_1 ×210, ...)"`` or ``"an unquantized checkpoint"``."""
  q = base_fp.get("quantization")
  if not q:
    return "an unquantized checkpoint"
  formats = ", ".join(f"{f} ×{n}" for f, n in q.get("formats", {}).items())
  return f"a GGUF base ({q.get('file')}: {formats})"


def is_portable(manifest: dict, base_fp: dict) -> bool:
  """Whether the delta was made against the base's source checkpoint (a GGUF quantized from
  it, `bitdelta_jax.hf.lineage`) rather than the base's own values: its base tensors' CRCs are
  the source's, checked when the lineage was established, not those of this base."""
  src = base_fp.get("source")
  return bool(src) and manifest["base"].get("digest") == src.get("digest") and \
    manifest["base"].get("digest") != base_fp.get("digest")


def check_base(manifest: dict, base_fp: dict, *, where: str = "delta"):
  """Raises `DeltaMismatchError` naming the first tensor where the base differs, and the fix.
  A delta made against the base itself, or against the checkpoint a GGUF base was quantized
  from (`is_portable`), passes."""
  want = manifest["base"]
  if want.get("digest") == base_fp.get("digest") or is_portable(manifest, base_fp):
    return
  fix = _base_fix(want, base_fp)
  wt, bt = want["tensors"], base_fp["tensors"]
  for n in wt:
    if n not in bt:
      raise DeltaMismatchError(f"{where} was made for a different base: tensor {n!r} is "
                               f"missing{fix}")
    for key in ("shape", "dtype", "crc32"):
      a, b = wt[n][key], bt[n][key]
      if a is not None and b is not None and a != b:
        raise DeltaMismatchError(
          f"{where} was made for a different base: tensor {n!r} {key} is {b} in this base, "
          f"{a} in the delta's base (the delta's: {describe_base(want)}; this one: "
          f"{describe_base(base_fp)}){fix}"
        )
  extra = sorted(set(bt) - set(wt))
  if extra:
    raise DeltaMismatchError(f"{where} was made for a different base: base has extra tensors "
                             f"{extra[:5]}{fix}")


def _base_fix(want: dict, base_fp: dict) -> str:
  """How to make a delta and a base agree, for `check_base`'s message."""
  if want.get("quantization"):
    return (f". The delta was compressed against {describe_base(want)}: serve it over that "
            f"file, or compress the fine-tune against the unquantized checkpoint that file was "
            f"made from (such a delta serves over it and over every GGUF quantized from it)")
  src = base_fp.get("source")
  if base_fp.get("quantization") and src:
    return (f". This GGUF was quantized from {src['name']} ({src['how']}), not from the "
            f"delta's base: compress the fine-tune against {src['name']} or against this file")
  if base_fp.get("quantization"):
    return (". If this GGUF was quantized from the delta's base, say so with --base-source "
            "DIR (the unquantized checkpoint; it is checked and recorded once); otherwise "
            "compress the fine-tune against this file or its source")
  return ". Compress the fine-tune against this base, or serve the delta over its own base"


def update_scales(path: str | os.PathLike, scales: Mapping[str, np.ndarray],
                  scales_meta: Mapping[str, Any]) -> dict:
  """Replaces α of packed (or 1-bit + low-rank) tensors in a delta directory, atomically
  (`update_entries` without factors)."""
  return update_entries(path, scales, {}, scales_meta)


def update_entries(path: str | os.PathLike, scales: Mapping[str, np.ndarray],
                   factors: Mapping[str, Any], scales_meta: Mapping[str, Any],
                   factors_meta: Mapping[str, Any] | None = None) -> dict:
  """Replaces α of 1-bit tensors and low-rank factors of ``residual`` / ``lora`` tensors in a
  delta directory, atomically.

  ``scales``: ``{name: α}`` in the stored scale shape, for ``packed`` and ``residual`` tensors.
  ``factors``: ``{name: CodedLora}`` with the stored rank and widths (`residual.recode`), so
  the directory's bytes do not change. The new directory is assembled beside the old one
  (every other array is hard-linked, not copied), then swapped in; the manifest records how
  the scales (``scales``) and factors (``factors``) were obtained.
  """
  from bitdelta_jax.delta import factors_io

  path = Path(path)
  m = read_manifest(path)
  for name, a in scales.items():
    meta = m["tensors"].get(name)
    if meta is None or meta["kind"] not in ("packed", "residual"):
      raise DeltaStoreError(f"{path}: {name!r} is not a 1-bit (packed or residual) tensor of "
                            f"this delta")
    if list(np.shape(a)) != meta["arrays"]["scale"]["shape"]:
      raise DeltaStoreError(f"{path}: new scale for {name!r} has shape {list(np.shape(a))}, "
                            f"expected {meta['arrays']['scale']['shape']}")
    check_finite(np.asarray(a), f"{path}: new scale for {name!r} (nothing written)")
  for name, e in factors.items():
    meta = m["tensors"].get(name)
    if meta is None or meta["kind"] not in ("residual", "lora"):
      raise DeltaStoreError(f"{path}: {name!r} is not a low-rank (residual or lora) tensor of "
                            f"this delta")
    for field in ("a", "b", "a_step", "b_step"):
      if getattr(e, field, None) is not None:
        check_finite(np.asarray(getattr(e, field), np.float32),
                     f"{path}: new factor {field} for {name!r} (nothing written)")
    k, n = meta["shape"]
    widths = [int(w) for w in getattr(e, "widths", ())]
    if (tuple(np.shape(e.a)) != (k, meta["rank"]) or tuple(np.shape(e.b)) != (meta["rank"], n)
            or len(widths) != meta["rank"] or e.float_dtype != meta.get("float_dtype")):
      raise DeltaStoreError(
        f"{path}: new factors for {name!r} ({list(np.shape(e.a))} / {list(np.shape(e.b))}, "
        f"{len(widths)} widths, {getattr(e, 'float_dtype', None)}) are not stored like the old "
        f"ones ([{k}, {meta['rank']}] / [{meta['rank']}, {n}], {meta.get('float_dtype')})")
  with AtomicDir(path, overwrite=True, kind="delta") as out:
    for src in path.rglob("*"):
      rel = src.relative_to(path)
      dst = out.tmp / rel
      if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
      elif rel.name not in (MANIFEST, MARKER):
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
    for name, a in scales.items():
      d = _array_dir(out.tmp, name) / "scale"
      shutil.rmtree(d)
      m["tensors"][name]["arrays"]["scale"] = write_array(d, np.asarray(a, np.float32))
    for name, e in factors.items():
      meta, d = m["tensors"][name], _array_dir(out.tmp, name)
      for field in list(meta["arrays"]):
        if field not in ("bits", "scale"):  # the factor arrays (1-bit part kept)
          shutil.rmtree(d / field)
          del meta["arrays"][field]
      fm = factors_io.write_factors(d, e, write_array)
      meta["arrays"].update(fm["arrays"])
    m["scales"] = dict(scales_meta)
    if factors_meta is not None:
      m["factors"] = dict(factors_meta)
    (out.tmp / MANIFEST).write_text(json.dumps(m, indent=1))
    out.commit()
  return m
