"""Streaming compression and materialisation of Hugging Face checkpoint directories.

One compressor for every mode (`compress_checkpoints`). In mode ``bitdelta`` peak memory is a
few row-chunks (≤ `CHUNK_BYTES` each) plus the packed output of the tensor in hand (1/16 of
it): a linear weight is read in blocks of output rows, each block is packed by one jitted
kernel that also returns per-column Σ|Δ| and ΣΔ², and α and the error come from those sums at
the end. The low-rank modes read one linear weight pair whole at a time (its SVD needs it).
Two whole models are never in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from bitdelta_jax.delta import pack_native
from bitdelta_jax.delta.compress import (
  CompressPolicy,
  DeltaMismatchError,
  Dense,
  apply_tensor,
  compress_tensor,
)
from bitdelta_jax.delta.format import PackedDelta, group_k_for
from bitdelta_jax.delta.report import Report, TensorReport
from bitdelta_jax.delta.store import (
  AtomicDir,
  DeltaStoreError,
  DeltaWriter,
  check_base,
  crc32,
  is_portable,
  load_entry,
  read_manifest,
  stored_embeddings,  # noqa: F401  (re-exported: its home was here)
)
from bitdelta_jax.hf.checkpoints import open_checkpoint
from bitdelta_jax.hf.fingerprint import Crc, fingerprint, with_source
from bitdelta_jax.hf.gguf_checkpoint import is_gguf_dir, quantization, resolve_base
from bitdelta_jax.hf.lineage_record import source_of
from bitdelta_jax.hf.safetensors_io import CheckpointReader, SafetensorsWriter

CHUNK_BYTES = 32 << 20
EMBEDDINGS_MODES = ("auto", "exact", "1bit")
# ``embeddings="auto"`` stores a changed embedding / LM head 1-bit (one α per token) when that
# reconstructs the fine-tuned matrix within this relative error, ‖W_ft − Ŵ_ft‖ / ‖W_base‖.
# Measured: the real SmolLM2 fine-tunes that trained their embeddings (bench/results/
# fidelity_real.md: ‖Δ‖/‖W‖ = 1.15e-3, 1-bit error 38% of ‖Δ‖) sit at 4.3e-4 and keep fidelity
# 1-bit; their linear layers, always 1-bit, at ~9e-4. The built-in nano family (‖Δ‖/‖W‖
# 0.11-0.22) would sit at 6-12% and stays exact.
AUTO_EMBEDDING_MAX_ERROR = 0.01
# Config fields that must agree between a base and a fine-tune (vocab_size may grow).
_ARCH_FIELDS = ("architectures", "model_type", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim")


def _rows_per_chunk(shape: tuple[int, ...], itemsize: int) -> int:
  row = max(1, int(np.prod(shape[1:])) * itemsize)
  return max(1, min(shape[0], CHUNK_BYTES // row))


@functools.partial(jax.jit, static_argnames=("group_k",))
def _linear_chunk(base_rows, ft_rows, *, group_k: int):
  """HF rows ``[R, K]`` (R output features) → bits ``[K_pad/8, R]``, Σ|Δ| [R], ΣΔ² [R], changed.

  Packs along the contiguous K axis of the HF rows and transposes only the packed result
  (1/16 of the data): transposing the f32 delta first costs ~1.6x more on CPU.
  """
  d = ft_rows.astype(jnp.float32) - base_rows.astype(jnp.float32)
  r, k = d.shape
  k_pad = -(-k // group_k) * group_k
  pos = d >= 0
  if k_pad != k:
    pos = jnp.pad(pos, ((0, 0), (0, k_pad - k)))
  planes = pos.astype(jnp.uint8).reshape(r, k_pad // group_k, 8, group_k // 8)
  weights = (jnp.uint8(1) << jnp.arange(8, dtype=jnp.uint8)).reshape(1, 1, 8, 1)
  packed = jnp.sum(planes * weights, axis=2, dtype=jnp.uint8).reshape(r, k_pad // 8)
  return (packed.T, jnp.sum(jnp.abs(d), axis=1), jnp.sum(d * d, axis=1),
          jnp.any(ft_rows != base_rows))


def _sample_norm_ratio(b: np.ndarray, f: np.ndarray) -> float:
  """‖Δ‖/‖W_base‖ on up to 64 evenly spaced rows of a block (a cheap plausibility check)."""
  step = max(1, b.shape[0] // 64)
  b32, f32 = b[::step].astype(np.float32), f[::step].astype(np.float32)
  w2 = float(np.sum(b32 * b32))
  d = f32 - b32
  d2 = float(np.sum(d * d))
  return math.sqrt(d2 / w2) if w2 > 0 else (0.0 if d2 == 0 else math.inf)


def _compress_linear_stream(name, base: CheckpointReader, ft: CheckpointReader, policy, base_crc,
                            norm_ratios: dict | None = None, stats: dict | None = None):
  """Packs one linear (or, by column, vocabulary) matrix block by block. ``stats`` (a dict)
  receives ``base_sq`` = Σ W_base² (read in the same pass) and ``err_sq`` = ‖Δ − α·sign(Δ)‖²:
  what the embeddings' ``auto`` choice weighs."""
  info = ft.info(name)
  n, k = info.shape
  g = group_k_for(k, policy.group_k)
  r = _rows_per_chunk(info.shape, 4)
  bits = np.empty((math.ceil(k / g) * g // 8, n), np.uint8)
  abs_sum = np.empty(n, np.float64)
  sq_sum = np.empty(n, np.float64)
  changed = False
  pending = None

  def collect(r0, rows, out):
    cb, ca, cs, cc = out
    bits[:, r0:r0 + rows] = np.asarray(cb)[:, :rows]
    abs_sum[r0:r0 + rows] = np.asarray(ca)[:rows]
    sq_sum[r0:r0 + rows] = np.asarray(cs)[:rows]
    return bool(cc)

  bufs = [(_buffer(base.info(name), r), _buffer(info, r)) for _ in range(2)]
  first = (base.read_rows(name, 0, r, bufs[0][0]), ft.read_rows(name, 0, r, bufs[0][1]))
  wsq = 0.0

  def norm(b):
    nonlocal wsq
    if stats is not None:
      b32 = b.astype(np.float32, copy=False)
      wsq += float(np.einsum("ij,ij->", b32, b32, dtype=np.float64))
  if norm_ratios is not None:
    norm_ratios[name] = _sample_norm_ratio(*first)
  if pack_native.unavailable_reason(*first) is None:
    # Native packer: the next block is read (and the base checksummed) on a thread while this
    # one is packed; both release the GIL. Two reused buffer pairs alternate.
    with ThreadPoolExecutor(1) as pool:
      def read(i, r0):
        bb, fb = bufs[i % 2]
        b = base.read_rows(name, r0, r0 + r, bb)
        base_crc.update(b)
        return b, ft.read_rows(name, r0, r0 + r, fb)

      base_crc.update(first[0])
      nxt = None
      blocks = list(range(0, n, r))
      cur = first
      for i, r0 in enumerate(blocks):
        if i + 1 < len(blocks):
          nxt = pool.submit(read, i + 1, blocks[i + 1])
        b, f = cur
        norm(b)
        cb, ca, cs, cc = pack_native.pack_rows(b, f, g)
        rows = b.shape[0]
        bits[:, r0:r0 + rows] = cb.T
        abs_sum[r0:r0 + rows], sq_sum[r0:r0 + rows] = ca, cs
        changed |= cc
        if i + 1 < len(blocks):
          cur = nxt.result()
  else:
    # XLA fallback. Dispatch is asynchronous: the next block is read and checksummed while XLA
    # packs this one.
    for r0 in range(0, n, r):
      b, f = first if r0 == 0 else (base.read_rows(name, r0, r0 + r), ft.read_rows(name, r0, r0 + r))
      base_crc.update(b)
      norm(b)
      rows = b.shape[0]
      if rows < r:  # pad the last block so every block compiles to one shape
        pad = ((0, r - rows), (0, 0))
        b, f = np.pad(b, pad), np.pad(f, pad)
      out = _linear_chunk(b, f, group_k=g)
      if pending is not None:
        changed |= collect(*pending)
      pending = (r0, rows, out)
    if pending is not None:
      changed |= collect(*pending)
  before = info.nbytes
  if stats is not None:
    stats["base_sq"] = wsq
  if not changed:
    return Dense("same"), TensorReport(name, "same", info.shape, info.dtype.name, before, 0, 0.0)
  if policy.granularity == "matrix":
    scale = np.array([abs_sum.sum() / (k * n)], np.float32)
    err2 = sq_sum.sum() - abs_sum.sum() ** 2 / (k * n)
  else:
    scale = (abs_sum / k).astype(np.float32)
    err2 = float(np.sum(sq_sum - abs_sum**2 / k))
  total = sq_sum.sum()
  rel = math.sqrt(max(err2, 0.0) / total) if total > 0 else 0.0
  if stats is not None:
    stats["err_sq"] = max(float(err2), 0.0)
  pd = PackedDelta(bits=bits, scale=scale, shape=(k, n), group_k=g, granularity=policy.granularity)
  return pd, TensorReport(name, "packed", info.shape, info.dtype.name, before, pd.nbytes, rel)


def _buffer(info, rows: int) -> np.ndarray:
  """A flat reusable read buffer for ``rows`` rows of a tensor."""
  return np.empty(rows * int(np.prod(info.shape[1:])), info.dtype)


def _same_stream(name: str, base: CheckpointReader, ft: CheckpointReader, base_crc) -> bool:
  """Whether a tensor is bit-identical in both checkpoints, compared in reused row blocks
  (the base's crc is accumulated on the way)."""
  info = base.info(name)
  if not info.shape:
    b, f = base.read(name), ft.read(name)
    base_crc.update(b)
    return b.tobytes() == f.tobytes()
  r = _rows_per_chunk(info.shape, info.dtype.itemsize)
  bb, fb = _buffer(info, r), _buffer(ft.info(name), r)
  same = True
  for r0 in range(0, info.shape[0], r):
    b = base.read_rows(name, r0, r0 + r, bb)
    base_crc.update(b)
    if same:
      same = np.array_equal(b.view(np.uint8), ft.read_rows(name, r0, r0 + r, fb).view(np.uint8))
  return same


def _read_config(d: Path) -> dict:
  p = Path(d) / "config.json"
  if not p.exists():
    return {}
  try:
    return json.loads(p.read_text())
  except json.JSONDecodeError as e:
    raise DeltaMismatchError(f"{p}: malformed config.json ({e})") from None


def check_pair(base: CheckpointReader, ft: CheckpointReader, policy: CompressPolicy):
  """Header-only checks, before any work: names, shapes and architecture agree."""
  bc, fc = _read_config(base.path), _read_config(ft.path)
  for key in _ARCH_FIELDS:
    if key in bc and key in fc and bc[key] != fc[key]:
      raise DeltaMismatchError(
        f"architecture mismatch: config.json field {key!r} is {bc[key]!r} in {base.path} "
        f"but {fc[key]!r} in {ft.path}"
      )
  missing = [n for n in base.names() if n not in ft]
  if missing:
    raise DeltaMismatchError(f"{ft.path}: fine-tune lacks base tensor(s) {missing[:5]}")
  grown_rows = {}
  for n in base.names():
    bs, fs = base.info(n).shape, ft.info(n).shape
    if bs != fs:
      grown = (policy.is_vocab(n) and len(bs) == len(fs) and bs[1:] == fs[1:] and fs[0] > bs[0])
      if not grown:
        raise DeltaMismatchError(
          f"shape mismatch for tensor {n!r}: {list(bs)} in {base.path}, {list(fs)} in {ft.path}"
        )
      grown_rows[n] = (bs[0], fs[0])
  return grown_rows


# Median ‖W_ft − W_base‖/‖W_base‖ of the linear layers above which the pair is unlikely to be a
# fine-tune of that base: fine-tunes move weights by a few percent (Vicuna/Llama-2: ~0.01-0.05),
# independently trained models by ~1.4.
IMPLAUSIBLE_DELTA_RATIO = 0.5


def pair_warnings(norm_ratios: dict[str, float], grown_rows: dict[str, tuple[int, int]]
                  ) -> tuple[list[str], list[str]]:
  """``(warnings, notes)`` for a compressed pair: a probable wrong base, a grown vocabulary."""
  warnings, notes = [], []
  if norm_ratios:
    med = float(np.median(list(norm_ratios.values())))
    if med > IMPLAUSIBLE_DELTA_RATIO:
      warnings.append(
        f"the linear-layer deltas are implausibly large for a fine-tune (median "
        f"|W_ft - W_base| / |W_base| = {med:.2f} over {len(norm_ratios)} matrices, "
        f"fine-tunes are typically < 0.1): is --base really the model this was fine-tuned from?")
  if grown_rows:
    old, new = max(grown_rows.values(), key=lambda v: v[1])
    names = ", ".join(sorted(grown_rows))
    notes.append(f"the fine-tune grew the vocabulary from {old} to {new} tokens ({new - old} new "
                 f"rows in {names}, stored exactly)")
  return warnings, notes


def compress_checkpoints(
  base_dir, ft_dir, out_dir, policy: CompressPolicy = CompressPolicy(), *, overwrite: bool = False,
  progress: bool = True, extra: dict | None = None, embeddings: str = "auto",
  base_source=None,
) -> dict:
  """Compresses an HF fine-tune against its HF base into a delta directory; returns the manifest.

  Every mode (``policy.mode``) runs this one loop over the fine-tune's tensors; the mode decides
  only what a linear weight becomes (`_compress_linear`): ``bitdelta`` streams it in row blocks
  into a `PackedDelta`, the low-rank modes (`residual.py`: ``dqrelo``, ``svd``, ``delta-come``)
  read it whole for its SVD (peak memory: two f32 copies of the largest linear weight plus its
  SVD) into a `ResidualEntry` / `LoraEntry`. Everything else (new tensors, embeddings, norms,
  the base fingerprint, the report, the warnings, the tokenizer) is the same for every mode.

  ``embeddings``: ``"exact"`` keeps changed embeddings / LM head as they are (f32 ``ft − base``,
  or the value); ``"1bit"`` stores them like linear weights, 1 bit per weight with one α per
  token (a `PackedDelta` in the ``[hidden, vocab]`` orientation), 1/16 of their bf16 bytes;
  served from packed slot banks (``ModelConfig.packed_embedding_slots``); ``"auto"`` (the
  default) stores each changed one 1-bit when that reconstructs the fine-tuned matrix within
  `AUTO_EMBEDDING_MAX_ERROR` (‖W_ft − (W_base + α·sign Δ)‖ / ‖W_base‖), exactly otherwise, and
  exactly in the low-rank modes (which still measure and record the 1-bit error). The
  manifest's ``embeddings`` is what was done ("1bit" when any vocabulary matrix is 1-bit),
  ``embeddings_choice`` says per tensor which and why. Added tokens' rows of a grown vocabulary
  are always kept exactly.

  A GGUF base (`bitdelta_jax.hf.lineage`): with ``base_source`` (the unquantized checkpoint the
  file was quantized from; checked once, `lineage.establish`) Δ is taken against the source,
  so the delta stores no rounding and serves over the source and every GGUF quantized from it.
  Without one, Δ is taken against the file's dequantized blocks, and a tensor of the fine-tune
  that quantizes to exactly the file's blocks (`GGUFCheckpoint.requantizes_same`) is kept as
  the base's ("same": an unchanged embedding costs nothing)."""
  base_dir = resolve_base(base_dir)  # FILE.gguf: Δ against its dequantized blocks
  pre_notes = []
  if base_source is not None:
    from bitdelta_jax.hf import lineage

    if not is_gguf_dir(base_dir):
      raise ValueError(f"--base-source applies to a GGUF --base; {base_dir} is a checkpoint "
                       "directory (compress against it directly)")
    rec = lineage.establish(base_dir, base_source)
    pre_notes.append(f"Δ taken against {rec['name']}, the checkpoint "
                     f"{quantization(base_dir)['file']} was quantized from ({rec['how']}): "
                     f"serves over it and over every GGUF quantized from it")
    base_dir = Path(base_source)
  elif is_gguf_dir(base_dir):
    rec = source_of(base_dir)
    if rec:
      pre_notes.append(f"{quantization(base_dir)['file']} was quantized from {rec['name']}: "
                       f"pass --base-source DIR (that checkpoint) to take Δ against it instead "
                       f"(the base's rounding not stored; serves over every quantization)")
  if embeddings not in EMBEDDINGS_MODES:
    raise ValueError(f"embeddings must be one of {', '.join(map(repr, EMBEDDINGS_MODES))}, "
                     f"got {embeddings!r}")
  if policy.mode != "bitdelta" and embeddings == "1bit":
    raise ValueError(f"embeddings={embeddings!r} is implemented for mode 'bitdelta' only")
  with open_checkpoint(base_dir) as base, open_checkpoint(ft_dir) as ft:
    grown_rows = check_pair(base, ft, policy)
    lines, fp, norm_ratios, choices = [], {}, {}, {}
    requantizes = getattr(base, "requantizes_same", None)  # a GGUF base without its source
    same_blocks: list[tuple[str, int]] = []
    with DeltaWriter(out_dir, overwrite=overwrite) as w:
      desc = "compress" if policy.mode == "bitdelta" else f"compress ({policy.mode})"
      with tqdm(ft.names(), desc=desc, unit="tensor", disable=not progress) as bar:
        for name in bar:
          info = ft.info(name)
          crc = Crc()
          if name not in base:
            entry = Dense("value", ft.read(name))
            line = TensorReport(name, "value", info.shape, info.dtype.name, info.nbytes,
                                entry.nbytes, 0.0, note="not in base")
          elif requantizes is not None and requantizes(name, ft):
            crc.update(base.read(name, copy=False))
            entry = Dense("same")
            fmt = base.formats[name]
            line = TensorReport(name, "same", info.shape, info.dtype.name, info.nbytes, 0, 0.0,
                                note=f"requantizes to the base's {fmt} blocks")
            same_blocks.append((name, info.nbytes))
          elif policy.is_linear(name, len(info.shape)) and base.info(name).shape == info.shape:
            entry, line = _compress_linear(name, base, ft, policy, crc, norm_ratios)
          elif (embeddings != "exact" and policy.is_vocab(name) and len(info.shape) == 2
                and base.info(name).shape == info.shape):
            entry, line = _compress_vocab(name, base, ft, policy, embeddings, crc, choices)
          elif base.info(name).shape == info.shape and base.info(name).dtype == info.dtype:
            # One streamed pass compares and checksums the base; a changed tensor kept as its
            # value needs no second read of the base.
            if _same_stream(name, base, ft, crc):
              entry = Dense("same")
            else:
              entry = _exact(name, base, ft, policy)
            line = TensorReport(name, entry.kind, info.shape, info.dtype.name, info.nbytes,
                                entry.nbytes, 0.0)
          else:
            b = base.read(name)
            crc.update(b)
            entry, line = compress_tensor(name, b, ft.read(name), policy, hf_layout=True)
            del b
          if name in base:
            bi = base.info(name)
            fp[name] = (bi.shape, bi.dtype.name, crc.value)
          _check_finite_entry(name, entry, base.path, ft.path)
          w.add(name, entry, hf_shape=info.shape)
          lines.append(line)
      warnings, notes = pair_warnings(norm_ratios, grown_rows)
      notes = pre_notes + notes
      if same_blocks:
        notes.append(
          f"{len(same_blocks)} tensor(s) of the fine-tune ({sum(b for _, b in same_blocks) / 1e6:.1f}"
          f" MB) quantize to exactly the base's own blocks (llama.cpp's reference quantizer): "
          f"kept as the base's, no bytes ({', '.join(n for n, _ in same_blocks[:3])}"
          f"{', ...' if len(same_blocks) > 3 else ''})")
      tok = keep_tokenizer(base_dir, ft_dir, w.tmp)
      if tok:
        notes.append(f"the fine-tune's tokenizer / chat template differ from the base's; kept "
                     f"in {TOKENIZER_DIR}/ ({', '.join(tok)})")
      # Directory names only: a manifest records no absolute paths of the machine it was built on.
      return w.finish(
        base_fingerprint=fingerprint(fp, quantization=quantization(base_dir)),
        report=Report(lines), policy=policy.to_dict(),
        source={"base": Path(base_dir).resolve().name, "finetuned": Path(ft_dir).resolve().name},
        finetuned_config=_read_config(ft.path), warnings=warnings, notes=notes,
        tokenizer=TOKENIZER_DIR if tok else None, embeddings_choice=choices, extra=extra)


def _check_finite_entry(name, entry, base_path, ft_path) -> None:
  """Refuses (`DeltaStoreError`, naming the tensor) an entry holding inf / NaN: a non-finite
  input tensor in either checkpoint makes a non-finite α, value or factor, which a delta must
  never hold (the loader would refuse it later, or one slot's rows would turn NaN). Nothing is
  written: the writer's temporary directory is discarded."""
  arrays = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)} \
    if dataclasses.is_dataclass(entry) else {}
  for field, a in arrays.items():
    if dataclasses.is_dataclass(a):  # a residual entry's 1-bit and low-rank parts
      _check_finite_entry(name, a, base_path, ft_path)
    elif isinstance(a, (np.ndarray, jax.Array)) and np.asarray(a).dtype.kind == "f":
      a = np.asarray(a)
      if not np.isfinite(a).all():
        raise DeltaStoreError(
          f"tensor {name!r}: its delta's {field} holds {int((~np.isfinite(a)).sum())} non-finite "
          f"value(s): {base_path} or {ft_path} holds inf / NaN in it; nothing written")


def _compress_linear(name, base: CheckpointReader, ft: CheckpointReader, policy, crc,
                     norm_ratios: dict):
  """A linear weight's entry and report line under ``policy.mode``."""
  if policy.mode == "bitdelta":  # row blocks, never the whole matrix
    return _compress_linear_stream(name, base, ft, policy, crc, norm_ratios)
  b, f = base.read(name), ft.read(name)  # the low-rank modes' SVD needs the whole matrix
  crc.update(b)
  norm_ratios[name] = _sample_norm_ratio(b, f)
  return compress_tensor(name, b, f, policy, hf_layout=True)


def _exact(name, base: CheckpointReader, ft: CheckpointReader, policy) -> Dense:
  """A changed tensor kept exactly: its value, or ``ft − base`` (the base re-read only then)."""
  if policy.dense == "value":
    return Dense("value", ft.read(name))
  return compress_tensor(name, base.read(name), ft.read(name), policy, hf_layout=True)[0]


def embedding_choice(embeddings: str, mode: str, err: float | None) -> dict:
  """The one rule for a changed embedding / LM head (same shape as the base's), every mode:
  its ``embeddings_choice`` record. ``stored`` is "1bit" for ``embeddings="1bit"``, or for
  ``"auto"`` in mode ``bitdelta`` when the measured 1-bit error ``err`` (None: zero base) is
  within `AUTO_EMBEDDING_MAX_ERROR`; else "exact" (the low-rank modes always keep them exactly)."""
  one_bit = mode == "bitdelta" and (
    embeddings == "1bit" or (err is not None and err <= AUTO_EMBEDDING_MAX_ERROR))
  return {"stored": "1bit" if one_bit else "exact", "chosen_by": embeddings, "mode": mode,
          "rel_error_1bit": err, "limit": AUTO_EMBEDDING_MAX_ERROR}


def _compress_vocab(name, base: CheckpointReader, ft: CheckpointReader, policy, embeddings: str,
                    crc, choices: dict):
  """A vocabulary matrix (``embeddings`` "auto" or "1bit"): packed with one α per token, which
  also measures its 1-bit error (Σ W_base² read in the same pass); kept 1-bit or re-read as
  `_exact` by `embedding_choice`, recorded in ``choices``."""
  info = ft.info(name)
  stats: dict = {}
  column = dataclasses.replace(policy, granularity="column")
  entry, line = _compress_linear_stream(name, base, ft, column, crc, stats=stats)
  if not isinstance(entry, PackedDelta):  # unchanged: "same"
    return entry, line
  # relative to a zero base matrix the error is undefined (None): kept exactly
  err = math.sqrt(stats["err_sq"] / stats["base_sq"]) if stats["base_sq"] else None
  choices[name] = choice = embedding_choice(embeddings, policy.mode, err)
  if choice["stored"] == "1bit":
    return entry, line
  entry = _exact(name, base, ft, policy)  # the base was read (and summed) once
  why = ("(zero base)" if err is None else f"{err:.2%}")
  note = (f"auto: 1-bit would err {why}" if policy.mode == "bitdelta" else
          f"{policy.mode}: kept exactly (1-bit would err {why})")
  return entry, TensorReport(name, entry.kind, info.shape, info.dtype.name, info.nbytes,
                             entry.nbytes, 0.0, note=note)


TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "added_tokens.json",
                   "generation_config.json")


def keep_tokenizer(base_dir, ft_dir, out_dir) -> list[str]:
  """Copies the fine-tune's tokenizer files (and chat template, generation config) that differ
  from the base's (or that the base lacks) into ``out_dir/tokenizer/``; returns them ([] when
  all equal the base's). A file left out is the base's (`Tokenizer.from_dir`'s ``fallback``):
  a variant that only changed its chat template stores a few KB, not the vocabulary."""
  base_dir, ft_dir = Path(base_dir), Path(ft_dir)
  kept = [f for f in TOKENIZER_FILES if (ft_dir / f).is_file() and (
    not (base_dir / f).is_file() or (ft_dir / f).read_bytes() != (base_dir / f).read_bytes())]
  if kept and same_tokenizer(base_dir, ft_dir):
    return []  # other bytes, same tokenizer (e.g. a GGUF base's files, written from its metadata)
  if kept:
    (Path(out_dir) / TOKENIZER_DIR).mkdir(parents=True, exist_ok=True)
  for f in kept:
    shutil.copy2(ft_dir / f, Path(out_dir) / TOKENIZER_DIR / f)
  return kept


_PROBE = ("Hello, world! The capital of France is Paris. 12345 + 678 = 13023.\n"
          "def f(x):\n\treturn x ** 2  # çà 日本語 🙂 <|im_start|>user\n")


def same_tokenizer(base_dir, ft_dir) -> bool:
  """Whether two directories hold the same tokenizer by content: vocabulary with added tokens
  (ids and special flags), the encoding of a probe text, special tokens, chat template and
  generation stop ids (files may differ in bytes: key order, a template moved to
  ``chat_template.jinja``, a GGUF base's files written from its metadata)."""
  from bitdelta_jax.models.tokenizer import Tokenizer, TokenizerError

  try:
    a, b = Tokenizer.from_dir(base_dir), Tokenizer.from_dir(ft_dir)
  except (TokenizerError, OSError, ValueError):
    return False

  def vocab(t):  # without the placeholders a GGUF names the embedding's unused rows
    return {k: v for k, v in t.tok.get_vocab(with_added_tokens=True).items()
            if not re.fullmatch(r"\[PAD\d+\]", k)}

  def added(t):
    return sorted((i, x.content, x.special) for i, x in t.tok.get_added_tokens_decoder().items()
                  if not re.fullmatch(r"\[PAD\d+\]", x.content))

  return (vocab(a) == vocab(b) and added(a) == added(b)
          and a.encode(_PROBE, add_special_tokens=True) == b.encode(_PROBE, add_special_tokens=True)
          and a.special_tokens == b.special_tokens and a.chat_template == b.chat_template
          and a.stop_token_ids == b.stop_token_ids)


def tokenizer_dir(delta_dir, manifest: dict | None = None) -> Path | None:
  """The delta's own tokenizer directory (kept by `compress`), or None: the base's applies."""
  manifest = read_manifest(delta_dir) if manifest is None else manifest
  rel = manifest.get("tokenizer")
  if not rel:
    return None
  d = Path(delta_dir) / rel
  if not any((d / f).is_file() for f in TOKENIZER_FILES):
    raise DeltaStoreError(f"{d}: the manifest names a tokenizer directory, but it holds no "
                          f"tokenizer files")
  return d


_COPY_FILES = ("config.json", *TOKENIZER_FILES)


def apply_checkpoint(base_dir, delta_dir, out_dir, *, overwrite: bool = False,
                     progress: bool = True, max_shard_bytes: int = 4 << 30,
                     on_tensor: Callable[[str], None] | None = None) -> Path:
  """Writes ``W_base + α·S`` (and the kept tensors) as an HF checkpoint transformers can load.

  The base is verified tensor by tensor against the delta's fingerprint as it is read.
  """
  manifest = read_manifest(delta_dir)
  delta_dir = Path(delta_dir)
  base_dir = resolve_base(base_dir)
  with open_checkpoint(base_dir) as base:
    # Cheap structural check first (names, shapes, dtypes); content crc is checked per tensor.
    structural = with_source(fingerprint({n: (base.info(n).shape, base.info(n).dtype.name, None)
                                          for n in base.names()}), base_dir)
    check_base(manifest, structural, where=str(delta_dir))
    # a delta made against a GGUF base's source: its CRCs are the source's (checked when the
    # lineage was established), the values applied to are the file's
    portable = is_portable(manifest, structural)
    tensors = manifest["tensors"]
    for n, meta in tensors.items():  # fail before writing anything if an array is missing
      for field in meta["arrays"]:
        if not (delta_dir / "arrays" / n / field).exists():
          raise DeltaStoreError(f"{delta_dir / 'arrays' / n / field}: array for tensor {n!r} is missing")
    out_specs = {}
    for n, meta in tensors.items():
      shape = tuple(meta.get("hf_shape") or base.info(n).shape)
      dtype = base.info(n).dtype if n in base else None
      if meta["kind"] in ("value",) or dtype is None:
        dtype = np.dtype(_np_dtype(meta["arrays"]["value"]["dtype"]))
      out_specs[n] = (shape, dtype)
    shards, size = [[]], 0
    for n, (shape, dtype) in out_specs.items():
      nb = int(np.prod(shape)) * np.dtype(dtype).itemsize
      if shards[-1] and size + nb > max_shard_bytes:
        shards.append([])
        size = 0
      shards[-1].append(n)
      size += nb
    with AtomicDir(out_dir, overwrite=overwrite, kind="checkpoint") as out, \
        contextlib.ExitStack() as stack:
      bar = tqdm(total=len(out_specs), desc="apply", unit="tensor", disable=not progress)
      stack.callback(bar.close)
      weight_map = {}
      for i, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        with SafetensorsWriter(out.tmp / fname, {n: out_specs[n] for n in names},
                               {"format": "pt"}) as sw:
          for n in names:
            entry = load_entry(delta_dir, n, tensors[n])
            if n in base:
              b = base.read(n)
              want = manifest["base"]["tensors"][n]["crc32"]
              if want is not None and not portable and crc32(b) != want:
                raise DeltaMismatchError(
                  f"{delta_dir} was made for a different base: tensor {n!r} content differs "
                  f"(crc32 {crc32(b)} vs {want})"
                )
              w = apply_tensor(n, b, entry, hf_layout=True)
              if np.asarray(w).dtype.kind == "f" and not np.isfinite(w).all():
                raise DeltaMismatchError(
                  f"tensor {n!r}: base + delta holds {int((~np.isfinite(w)).sum())} non-finite "
                  f"value(s) ({base_dir} or {delta_dir}); nothing written")
            elif isinstance(entry, Dense) and entry.kind == "value":
              w = entry.value
            else:
              raise DeltaStoreError(f"{delta_dir}: tensor {n!r} needs a base tensor")
            sw.write(n, w)
            weight_map[n] = fname
            bar.update(1)
            if on_tensor:
              on_tensor(n)
      if len(shards) > 1:
        total = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in out_specs.values())
        (out.tmp / "model.safetensors.index.json").write_text(
          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
      cfg = manifest.get("finetuned_config") or {}
      own = tokenizer_dir(delta_dir, manifest)
      for f in _COPY_FILES:
        src = Path(base_dir) / f
        if own is not None and (own / f).is_file():
          src = own / f  # the fine-tune's own tokenizer, chat template, stop tokens
        if f == "config.json" and cfg:
          (out.tmp / f).write_text(json.dumps(cfg, indent=2))
        elif src.exists():
          shutil.copy2(src, out.tmp / f)
      out.commit()
  return Path(out_dir)


def _np_dtype(name: str):
  if name == "bfloat16":
    import ml_dtypes

    return ml_dtypes.bfloat16
  return np.dtype(name)
