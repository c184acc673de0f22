"""`compress_checkpoints` for every delta mode: HF base + fine-tune directories → delta directory.

``mode="bitdelta"`` is `stream.compress_checkpoints` itself (row-block streaming, native
packing). The other modes (`residual.py`) need a whole matrix for its SVD, so each linear
weight pair is read whole, one tensor at a time (peak memory: two f32 copies of the largest
linear weight plus its SVD); every other tensor is handled exactly as `stream` does.
"""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from bitdelta_jax.delta import stream
from bitdelta_jax.delta.compress import CompressPolicy, Dense, compress_tensor
from bitdelta_jax.delta.report import Report, TensorReport
from bitdelta_jax.delta.store import DeltaWriter, crc32, fingerprint
from bitdelta_jax.hf.safetensors_io import CheckpointReader


def compress_checkpoints(base_dir, ft_dir, out_dir, policy: CompressPolicy = CompressPolicy(), *,
                         overwrite: bool = False, progress: bool = True,
                         extra: dict | None = None) -> dict:
  """Compresses an HF fine-tune against its base with ``policy.mode``; returns the manifest
  (which records ``mode`` and ``lora_rank``)."""
  if policy.mode == "bitdelta":
    return stream.compress_checkpoints(base_dir, ft_dir, out_dir, policy, overwrite=overwrite,
                                       progress=progress, extra=extra)
  with CheckpointReader(base_dir) as base, CheckpointReader(ft_dir) as ft:
    grown_rows = stream.check_pair(base, ft, policy)
    lines, fp, norm_ratios = [], {}, {}
    with DeltaWriter(out_dir, overwrite=overwrite) as w:
      for name in tqdm(ft.names(), desc=f"compress ({policy.mode})", unit="tensor",
                       disable=not progress):
        info = ft.info(name)
        f = ft.read(name)
        if name not in base:
          entry = Dense("value", f)
          line = TensorReport(name, "value", info.shape, info.dtype.name, info.nbytes,
                              entry.nbytes, 0.0, note="not in base")
        else:
          b = base.read(name)
          bi = base.info(name)
          fp[name] = (bi.shape, bi.dtype.name, crc32(b))
          entry, line = compress_tensor(name, b, f, policy, hf_layout=True)
          if line.kind == "packed":
            nb = float((b.astype("float64") ** 2).sum()) ** 0.5
            nd = float(((f.astype("float64") - b) ** 2).sum()) ** 0.5
            norm_ratios[name] = nd / nb if nb else 0.0
          del b
        w.add(name, entry, hf_shape=info.shape)
        lines.append(line)
      src = {"base": Path(base_dir).resolve().name, "finetuned": Path(ft_dir).resolve().name}
      warnings, notes = stream.pair_warnings(norm_ratios, grown_rows)
      tok_extra = {}
      keep = getattr(stream, "keep_tokenizer", None)  # the fine-tune's own tokenizer, if kept
      if keep is not None:
        tok = keep(base_dir, ft_dir, w.tmp)
        tok_extra = {"tokenizer": stream.TOKENIZER_DIR if tok else None}
        if tok:
          notes.append(f"the fine-tune's tokenizer / chat template differ from the base's; kept "
                       f"in {stream.TOKENIZER_DIR}/ ({', '.join(tok)})")
      return w.finish(base_fingerprint=fingerprint(fp), report=Report(lines),
                      policy=policy.to_dict(),
                      extra={"source": src, "finetuned_config": stream._read_config(ft.path),
                             "warnings": warnings, "notes": notes, **tok_extra, **(extra or {})})
