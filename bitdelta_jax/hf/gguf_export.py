"""A Hugging Face Llama checkpoint directory → a llama-architecture GGUF file (f32, bf16, or
ggml's Q8_0 / Q4_0 / Q4_1 blocks).

The inverse of `bitdelta_jax.hf.gguf_import`, for running the same weights in llama.cpp (the
CPU bench compares against it). Tensors are renamed to llama.cpp's names and the rows of every
q_proj / k_proj head are permuted from HF's "rotate half" RoPE layout to the interleaved one
ggml's RoPE reads (llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``; k_proj per kv
head). In bf16 the 2-D weights are rounded to nearest even (``gguf.quants``, as ggml does) and
the 1-D norm weights stay f32, as llama.cpp's own converter writes them. In q8_0 / q4_0 / q4_1
every 2-D weight (the linear layers, ``token_embd`` and an untied ``output``) is quantized with
`pallas_kernels.quant_matmul.blocks.quantize_rows`, llama.cpp's reference quantizer bit for bit
(``gguf.quants.quantize`` gives the same bytes), on the permuted ``[N, K]`` rows; the norms stay
f32. (llama.cpp's ``llama-quantize`` keeps some tensors in other types by default, e.g. the
output in Q6_K; this writer uses one format for every 2-D weight.) A tied LM head is the
embedding: no ``output.weight`` is written.

Tensors are streamed: the tensor table is written first from the safetensors headers (shapes and
ggml types are known up front), then each tensor is read, permuted and converted in blocks of
rows (`CHUNK_ELEMENTS`) and appended, so memory stays a few blocks whatever the model's size.

The tokenizer metadata comes from ``tokenizer.json`` (byte-level BPE only: vocabulary, merges,
added tokens as control / user-defined tokens) and ``tokenizer_config.json`` (BOS/EOS/UNK/PAD,
``add_bos_token``, the chat template). The pre-tokenizer is named for llama.cpp from its
structure (``Digits`` then ``ByteLevel``: ``smollm``; ``ByteLevel`` alone: ``gpt-2``).

    path = write_gguf(hf_dir, "model-q4_0.gguf", dtype="q4_0")  # f32 | bf16 | q8_0 | q4_0 | q4_1
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bitdelta_jax.hf.gguf_names import GGUFExportError, gguf_tensor_name, permute_rows
from pallas_kernels.quant_matmul.blocks import block_bytes, quantize_rows

QUANTIZED = ("q8_0", "q4_0", "q4_1")
DTYPES = ("f32", "bf16", *QUANTIZED)
CHUNK_ELEMENTS = 1 << 20  # weights converted at once (4 MB in f32; the quantizer makes ~8 temporaries)
_BLOCK = 32  # weights per ggml block, along K
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types


def _check_config(cfg: dict[str, Any]) -> float:
  """Refuses what this writer does not export; returns the RoPE base frequency, read as the
  model loader reads it (`models.config`: transformers 5's ``rope_parameters``, 4's
  ``rope_theta`` + ``rope_scaling``)."""
  if cfg.get("model_type") != "llama":
    raise GGUFExportError(f"model_type {cfg.get('model_type')!r}: only 'llama' is exported")
  if cfg.get("attention_bias") or cfg.get("mlp_bias"):
    raise GGUFExportError("attention / MLP biases: not exported")
  return _rope_theta(cfg)


def _rope_theta(cfg: dict[str, Any]) -> float:
  """The RoPE base frequency as `models.config` reads it; scaled RoPE (in either spelling)
  is refused."""
  from bitdelta_jax.models.config import ConfigError, _rope_from_hf

  try:
    rope = _rope_from_hf(cfg)
  except ConfigError as e:
    raise GGUFExportError(f"config.json: {e}") from None
  scaling = cfg.get("rope_scaling") or {}
  kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) \
    else scaling
  if rope.rope_type != "default" or kind != "default":
    name = rope.rope_type if rope.rope_type != "default" else kind
    raise GGUFExportError(f"RoPE scaling {name!r} (rope_scaling / rope_parameters): not exported")
  return float(rope.theta)


def _pre_name(pre: dict | None) -> str:
  kinds = [p["type"] for p in (pre or {}).get("pretokenizers", [pre] if pre else [])]
  if kinds == ["ByteLevel"]:
    return "gpt-2"  # llama.cpp's name (it refuses "gpt2": "unknown pre-tokenizer type")
  if kinds == ["Digits", "ByteLevel"] and pre["pretokenizers"][0].get("individual_digits"):
    return "smollm"
  raise GGUFExportError(f"pre-tokenizer {kinds}: not exported (known: ByteLevel, Digits+ByteLevel)")


def gguf_writer(path: str, arch: str = "llama"):
  """gguf-py's writer, except that an empty array with a declared element type is written (a
  zero-length GGUF array, which the format allows and llama.cpp reads) instead of refused:
  a byte-level BPE without merges still needs its ``tokenizer.ggml.merges`` key, or llama.cpp
  refuses the file ("cannot find tokenizer merges in model file")."""
  import gguf

  class Writer(gguf.GGUFWriter):
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
      if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
        head = self._pack("I", vtype) if add_vtype else b""
        return head + self._pack("I", sub_type) + self._pack("Q", 0)
      return super()._pack_val(val, vtype, add_vtype, sub_type)

  return Writer(path, arch)


def tokenizer_metadata(hf_dir: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
  """tokens, token types, merges, pre-tokenizer name, special ids, flags, chat template."""
  d = Path(hf_dir)
  tj = json.loads((d / "tokenizer.json").read_text())
  tc_path = d / "tokenizer_config.json"
  tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
  model = tj["model"]
  if model.get("type") != "BPE" or (tj.get("decoder") or {}).get("type") != "ByteLevel":
    raise GGUFExportError("tokenizer: only byte-level BPE is exported")
  tokens: list[str | None] = [None] * vocab_size
  types = [_NORMAL] * vocab_size
  for t, i in model["vocab"].items():
    if i >= vocab_size:
      raise GGUFExportError(f"token id {i} >= the model's vocab_size {vocab_size}")
    tokens[i] = t
  for a in tj.get("added_tokens", []):
    if a["id"] >= vocab_size:
      raise GGUFExportError(f"added token id {a['id']} >= the model's vocab_size {vocab_size}")
    tokens[a["id"]] = a["content"]
    types[a["id"]] = _CONTROL if a.get("special") else _USER_DEFINED
  for i, t in enumerate(tokens):  # ids the tokenizer never produces (a padded embedding)
    if t is None:
      tokens[i], types[i] = f"[PAD{i}]", _UNUSED
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  ids = {t: i for i, t in enumerate(tokens)}

  def token_id(v) -> int | None:
    content = v.get("content") if isinstance(v, dict) else v
    return ids.get(content) if content is not None else None

  out: dict[str, Any] = {
    "tokens": tokens,
    "token_type": types,
    "merges": merges,
    "pre": _pre_name(tj.get("pre_tokenizer")),
    "add_bos_token": bool(tc.get("add_bos_token", False)),
    "add_eos_token": bool(tc.get("add_eos_token", False)),
    "chat_template": _chat_template(d),
  }
  special = _special_tokens(d, tc)
  for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
    tid = token_id(special.get(key))
    if tid is None and isinstance(special.get(f"{key}_id"), int):
      tid = special[f"{key}_id"]
    if tid is not None:
      out[f"{name}_token_id"] = tid
  return out


def _chat_template(d: Path) -> str | None:
  """The chat template wherever the tokenizer keeps it, as `models.tokenizer.Tokenizer` reads
  it: ``chat_template.jinja`` (transformers 5), else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or named templates: "default")."""
  from bitdelta_jax.models.tokenizer import Tokenizer

  return Tokenizer.from_dir(d).chat_template


def _special_tokens(d: Path, tc: dict) -> dict[str, Any]:
  """BOS / EOS / UNK / PAD: ``tokenizer_config.json``'s, else ``special_tokens_map.json``'s;
  EOS and BOS ids from ``generation_config.json`` / ``config.json`` where neither names them."""
  out: dict[str, Any] = {}
  stm = d / "special_tokens_map.json"
  smap = json.loads(stm.read_text()) if stm.is_file() else {}
  for key in ("bos", "eos", "unk", "pad"):
    v = tc.get(f"{key}_token") or smap.get(f"{key}_token")
    if v is not None:
      out[key] = v
  for fname in ("generation_config.json", "config.json"):
    f = d / fname
    cfg = json.loads(f.read_text()) if f.is_file() else {}
    for key in ("bos", "eos"):
      tid = cfg.get(f"{key}_token_id")
      if isinstance(tid, list) and tid:
        tid = tid[0]
      if isinstance(tid, int) and f"{key}_id" not in out:
        out[f"{key}_id"] = tid
  return out


def ggml_type(dtype: str):
  """The `gguf.GGMLQuantizationType` of a 2-D weight written in ``dtype``."""
  import gguf

  return getattr(gguf.GGMLQuantizationType, dtype.upper())


def file_type(dtype: str):
  """``general.file_type``: llama.cpp's ``LLAMA_FTYPE_*`` (ALL_F32 0, MOSTLY_BF16 32,
  MOSTLY_Q4_0 2, MOSTLY_Q4_1 3, MOSTLY_Q8_0 7)."""
  import gguf

  return gguf.LlamaFileType.ALL_F32 if dtype == "f32" else getattr(
    gguf.LlamaFileType, f"MOSTLY_{dtype.upper()}")


def _add_metadata(w, cfg: dict[str, Any], tok: dict[str, Any], dtype: str, name: str,
                  rope_theta: float | None = None, source: tuple[str, dict] | None = None
                  ) -> None:
  import gguf

  from bitdelta_jax.hf import lineage_record

  hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
  head_dim = cfg.get("head_dim") or hidden // heads
  w.add_name(name)
  w.add_context_length(cfg["max_position_embeddings"])
  w.add_embedding_length(hidden)
  w.add_block_count(cfg["num_hidden_layers"])
  w.add_feed_forward_length(cfg["intermediate_size"])
  w.add_head_count(heads)
  w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
  if head_dim != hidden // heads:
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
  w.add_rope_dimension_count(head_dim)
  w.add_rope_freq_base(_rope_theta(cfg) if rope_theta is None else rope_theta)
  w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
  w.add_vocab_size(cfg["vocab_size"])
  w.add_file_type(file_type(dtype))
  if dtype in QUANTIZED:
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(tok["pre"])
  w.add_token_list(tok["tokens"])
  w.add_token_types(tok["token_type"])
  # written even when empty (`_Writer`): gguf-py's add_token_merges drops an empty list
  w.add_key_value(gguf.Keys.Tokenizer.MERGES, tok["merges"], gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.STRING)
  w.add_add_space_prefix(False)
  w.add_add_bos_token(tok["add_bos_token"])
  w.add_add_eos_token(tok["add_eos_token"])
  for key, add in (
    ("bos_token_id", w.add_bos_token_id),
    ("eos_token_id", w.add_eos_token_id),
    ("unknown_token_id", w.add_unk_token_id),
    ("padding_token_id", w.add_pad_token_id),
  ):
    if key in tok:
      add(tok[key])
  if tok["chat_template"]:
    w.add_chat_template(tok["chat_template"])
  if source is not None:  # the checkpoint these weights came from (`bitdelta_jax.hf.lineage`)
    w.add_string(lineage_record.SOURCE_NAME_KEY, source[0])
    w.add_string(lineage_record.SOURCE_KEY, json.dumps(source[1], sort_keys=True))


@dataclasses.dataclass(frozen=True)
class _Planned:
  """One tensor of the file: where it comes from, what it becomes."""

  hf_name: str
  gguf_name: str
  shape: tuple[int, ...]  # HF layout
  dtype: str  # f32 | bf16 | q8_0 | q4_0 | q4_1
  heads: int  # q/k: heads whose rows are permuted; else 0

  @property
  def nbytes(self) -> int:
    n = int(np.prod(self.shape))
    if self.dtype in QUANTIZED:
      return n // _BLOCK * block_bytes(self.dtype)
    return n * (2 if self.dtype == "bf16" else 4)


def _plan(reader, cfg: dict[str, Any], dtype: str) -> list[_Planned]:
  """Every tensor's name, shape and type, checked before any byte is written."""
  heads = cfg["num_attention_heads"]
  kv_heads = cfg.get("num_key_value_heads", heads)
  names = reader.names()
  if cfg.get("tie_word_embeddings") and "lm_head.weight" in names:
    names.remove("lm_head.weight")  # the embedding is the head
  plan = []
  for hf_name in names:
    shape = tuple(reader.info(hf_name).shape)
    gg = gguf_tensor_name(hf_name)
    if len(shape) != 2:
      plan.append(_Planned(hf_name, gg, shape, "f32", 0))
      continue
    if dtype in QUANTIZED and shape[1] % _BLOCK:
      raise GGUFExportError(
        f"tensor {hf_name!r} ({gg}) is [{shape[0]}, {shape[1]}]: its input dimension "
        f"K={shape[1]} is not a multiple of {_BLOCK}, the {dtype} block size")
    n_heads = (heads if hf_name.endswith("q_proj.weight")
               else kv_heads if hf_name.endswith("k_proj.weight") else 0)
    if n_heads and shape[0] % (2 * n_heads):
      raise GGUFExportError(
        f"tensor {hf_name!r}: {shape[0]} rows do not split into {n_heads} heads of even size")
    plan.append(_Planned(hf_name, gg, shape, dtype, n_heads))
  return plan


def _converted_chunks(reader, t: _Planned):
  """The tensor's bytes in the file, a block of rows at a time (q/k blocks hold whole heads)."""
  import gguf

  rows = t.shape[0] if t.shape else 1
  row_elems = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
  step = max(1, CHUNK_ELEMENTS // max(row_elems, 1))
  if t.heads:
    head_rows = rows // t.heads
    step = max(head_rows, step // head_rows * head_rows)
  for r0 in range(0, rows, step):
    a = np.asarray(reader.read_rows(t.hf_name, r0, r0 + step), np.float32)
    if not np.isfinite(a).all():
      raise GGUFExportError(f"tensor {t.hf_name!r} holds {int((~np.isfinite(a)).sum())} "
                            f"non-finite value(s) in rows {r0}-{r0 + len(a) - 1}: not written")
    if t.heads:
      a = permute_rows(a, a.shape[0] // (rows // t.heads))
    if t.dtype in QUANTIZED:
      yield quantize_rows(a, t.dtype)
    elif t.dtype == "bf16":
      yield gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.BF16)
    else:
      yield np.ascontiguousarray(a)


def write_gguf(
  hf_dir: str | os.PathLike,
  out_path: str | os.PathLike,
  *,
  dtype: str = "f32",
  name: str | None = None,
  overwrite: bool = True,
  record_source: bool = True,
) -> Path:
  """Writes ``hf_dir``'s model (safetensors, one file or sharded) as a GGUF at ``out_path``;
  returns the path.

  Args:
    dtype: the 2-D weights' type, one of `DTYPES` (norms are always f32).
    name: ``general.name`` (default: the directory's name).
    overwrite: replace an existing ``out_path``; False refuses one (`FileExistsError`), also
      one that appears while writing.
    record_source: write ``hf_dir``'s content fingerprint into the file's metadata
      (`bitdelta_jax.hf.lineage`: deltas compressed against ``hf_dir`` then serve over the
      file). Costs one extra read of the checkpoint.

  The file is written beside ``out_path`` under a temporary name and renamed into place when
  complete: a failed or interrupted write leaves no partial file at ``out_path``.

  Raises:
    GGUFExportError: an architecture or tensor this writer does not export (names it), e.g. a
      2-D weight whose input dimension is not a multiple of 32 for q8_0 / q4_0 / q4_1.
  """
  import gguf

  from bitdelta_jax.hf.checkpoints import open_checkpoint

  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  d, out = Path(hf_dir), Path(out_path)
  if not d.is_dir():
    raise GGUFExportError(f"{d}: not a checkpoint directory")
  if not (d / "config.json").is_file():
    raise GGUFExportError(f"{d}: no config.json")
  if out.is_dir():
    raise GGUFExportError(f"{out}: is a directory, not a file to write")
  if not overwrite and out.exists():
    raise FileExistsError(f"{out} exists (not replaced)")
  cfg = json.loads((d / "config.json").read_text())
  rope_theta = _check_config(cfg)
  tok = tokenizer_metadata(d, cfg["vocab_size"])
  source = None
  if record_source:
    from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint

    fp = fingerprint_checkpoint(d)
    source = (d.resolve().name, {"tensors": fp["tensors"], "digest": fp["digest"]})
  with open_checkpoint(d) as reader:
    plan = _plan(reader, cfg, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.partial")  # mode from the umask
    w = gguf_writer(str(tmp))
    try:
      _add_metadata(w, cfg, tok, dtype, name or d.name, rope_theta, source)
      for t in plan:  # the tensor table first: every size is known without reading a tensor
        if t.dtype == "f32":
          w.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes)
        elif t.dtype == "bf16":
          w.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.uint16), t.nbytes,
                            raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
          byte_shape = (t.shape[0], t.nbytes // t.shape[0])
          w.add_tensor_info(t.gguf_name, byte_shape, np.dtype(np.uint8), t.nbytes,
                            raw_dtype=ggml_type(t.dtype))
      w.write_header_to_file()
      w.write_kv_data_to_file()
      w.write_ti_data_to_file()
      # The data section, tensor by tensor in table order, each block of rows as it is made
      # (GGUFWriter.write_tensor_data takes whole tensors only): each tensor starts on the
      # file's alignment, as write_tensors_to_file places them.
      fout = w.fout[0]
      for t in plan:
        w.write_padding(fout, fout.tell())
        written = 0
        for chunk in _converted_chunks(reader, t):
          chunk.tofile(fout)
          written += chunk.nbytes
        if written != t.nbytes:
          raise AssertionError(f"{t.hf_name}: wrote {written} bytes, planned {t.nbytes}")
      w.write_padding(fout, fout.tell())
      w.close()
      if overwrite:
        os.replace(tmp, out)
      else:
        os.link(tmp, out)  # no-clobber: fails if out_path appeared meanwhile
        tmp.unlink()
    except BaseException:
      w.close()
      tmp.unlink(missing_ok=True)
      raise
  return out
