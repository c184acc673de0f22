"""Which unquantized checkpoint a GGUF base was quantized from: what makes a delta portable.

A delta compressed against a bf16 / f32 checkpoint S (its manifest's base fingerprint is S's)
serves over S and over any GGUF quantization Q of S: the variant is ``dequant(Q) + α·sign(Δ)``
with ``Δ = W_ft − W_S``, so the base's rounding is never stored and one delta file serves a
bf16 GPU deployment and a Q4_0 CPU one. A GGUF's *source* is established two ways:

* ``bitdelta quantize`` records S's content fingerprint in the file's metadata
  (`lineage_record.SOURCE_KEY`: the JSON of `bitdelta_jax.hf.fingerprint.fingerprint`,
  `lineage_record.SOURCE_NAME_KEY`: S's directory name); `lineage_record.record_from_file`
  copies it into the file's metadata directory when that is first made.
* For a GGUF made elsewhere, ``--base-source S`` (`establish`): every tensor of the file is
  checked to be a quantization of S's tensor within its format's error bound (`check_tensor`),
  and S's fingerprint is computed; both are kept in the metadata directory
  (`lineage_record.SOURCE_FILE`), which is keyed by the file's path, size and mtime, so the
  check runs once per file.

`bitdelta_jax.delta.store.check_base` accepts a delta whose base digest is the base's own or
its source's; anything else is refused, naming both and the fix.

Error bounds of `check_tensor` (round to nearest with the block's stored f16 scale ``d``, and
the scale's own f16 rounding): Q8_0 ``|W_S − dequant| ≤ 0.57·|d|``; Q4_0 ``≤ 1.01·|d|`` (the
code range −8..7 clamps one side of the block by up to a whole step); Q4_1 ``≤ 0.51·|d| +
2⁻¹⁰·|m|``; F32 tensors equal, F16 / BF16 within their rounding. A file quantized with an
importance matrix (llama.cpp's searched scales) may exceed them; it is then refused, and a delta
compressed against the file itself serves over it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from bitdelta_jax.hf.lineage_record import source_of, write_source

# max |W_S − dequant(W_q)| per block, in units of the block's |d| (module docstring)
BOUND_D = {"q8_0": 0.57, "q4_0": 1.01, "q4_1": 0.51}
_FLOAT_REL = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}


class LineageError(ValueError):
  """A GGUF base is not a quantization of the named source checkpoint."""


def check_tensor(name: str, fmt: str, source_NxK: np.ndarray, base) -> str | None:
  """None if ``base``'s tensor ``name`` (a `GGUFBase`, format ``fmt``) is a quantization of
  ``source`` within its format's error bound, else why not."""
  from pallas_kernels.quant_matmul import blocks

  src = np.asarray(source_NxK, np.float32)
  if fmt in _FLOAT_REL:
    deq = base.dequantized(name)
    if deq.shape != src.shape:
      return f"shape {list(deq.shape)} != the source's {list(src.shape)}"
    err = np.abs(deq - src)
    ok = err <= _FLOAT_REL[fmt] * np.abs(src)
    if ok.all():
      return None
    i = np.unravel_index(int(np.argmax(~ok)), src.shape)
    return (f"{fmt} value {deq[i]!r} at {[int(j) for j in i]} is not the source's {src[i]!r} "
            f"in {fmt}")
  if fmt not in BOUND_D:
    return f"ggml type {fmt.upper()}: lineage is checked for Q8_0, Q4_0, Q4_1, F32, F16, BF16"
  qk = base.read(name)  # [K, N] column blocks, q/k columns in HF order
  if tuple(qk.shape) != src.shape[::-1]:
    return f"shape {list(qk.shape[::-1])} != the source's {list(src.shape)}"
  deq = blocks.dequantize(qk)  # [K, N]
  k, n = qk.shape
  err = np.abs(deq - src.T).reshape(k // blocks.BLOCK, blocks.BLOCK, n).max(axis=1)
  d = np.abs(np.asarray(qk.d, np.float32))
  bound = BOUND_D[fmt] * d + 1e-7
  if qk.m is not None:
    bound = bound + np.abs(np.asarray(qk.m, np.float32)) * 2.0**-10
  bad = err > bound
  if not bad.any():
    return None
  b, c = np.unravel_index(int(np.argmax(err - bound)), bad.shape)
  return (f"{int(bad.sum())} of {bad.size} {fmt} blocks differ from the source by more than "
          f"the format's rounding (worst: column {int(c)}, block {int(b)}: "
          f"{float(err[b, c]):.3g} > {float(bound[b, c]):.3g})")


def establish(base_dir: str | os.PathLike, source_dir: str | os.PathLike, *,
              progress: bool = False) -> dict:
  """Checks that the GGUF base directory ``base_dir`` is a quantization of the HF checkpoint
  ``source_dir`` (`check_tensor`, every tensor) and records the source there; returns the
  record. A recorded source with the same fingerprint is accepted without reading the GGUF.

  Raises:
    LineageError: a tensor differs beyond its format's bound, or the names / shapes differ.
  """
  from bitdelta_jax.hf.checkpoints import open_checkpoint
  from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint
  from bitdelta_jax.hf.gguf_checkpoint import gguf_file, is_gguf_dir

  base_dir, source_dir = Path(base_dir), Path(source_dir)
  if not is_gguf_dir(base_dir):
    raise LineageError(f"--base-source applies to a GGUF base; {base_dir} is not one")
  if not (source_dir / "config.json").is_file():
    raise LineageError(f"--base-source {source_dir}: not an HF checkpoint directory")
  fp = fingerprint_checkpoint(source_dir)
  have = source_of(base_dir)
  if have and have["fingerprint"]["digest"] == fp["digest"]:
    return have
  from bitdelta_jax.hf.gguf_base import open_gguf_base

  gguf = gguf_file(base_dir)
  base = open_gguf_base(gguf)
  with open_checkpoint(source_dir) as src:
    names = base.names()
    tied_head = "lm_head.weight" in src and "lm_head.weight" not in names
    extra = sorted(set(src.names()) - set(names) - ({"lm_head.weight"} if tied_head else set()))
    missing = sorted(set(names) - set(src.names()))
    if missing or extra:
      raise LineageError(f"{gguf.name} is not a quantization of {source_dir}: tensors "
                         f"{(missing or extra)[:4]} are in only one of them")
    for name in names:
      why = check_tensor(name, base.format(name), src.read(name), base)
      if why:
        raise LineageError(f"{gguf.name} is not a quantization of {source_dir}: tensor "
                           f"{name!r}: {why}")
      if progress:
        print(f"lineage: {name} ok", flush=True)
  record = {"name": source_dir.resolve().name, "fingerprint": fp,
            "how": f"{gguf.name} checked against {source_dir.resolve().name} "
                   f"(every tensor within its format's rounding)"}
  write_source(base_dir, record)
  return record
