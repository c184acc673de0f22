"""Test models for the benches: random-weight Llamas (HF bf16 dirs, GGUF files) and random 1-bit
variants of them, for the speed and memory rows of `bench.serving.quant` and `bench.engine.memory`
(issue 36 item 7: "1B-shaped and 7B-shaped Llamas with random weights, speed and memory only"),
and synthetic full fine-tunes of a real base, compressed (`make_variants`).

    python -m bench.common.random_models --shape 1b --formats q8_0,q4_0 --variants 3
    python -m bench.common.random_models --shape 7b --formats q4_0 --variants 14

A shape's bf16 HF directory is written tensor by tensor (`write_random_llama`),
quantized with `bitdelta quantize` (ggml's reference rounding) and deleted. A variant here is a
delta directory whose 1-bit banks hold random bits and a small α on every linear weight (norms,
embedding and LM head "same"), made against the GGUF file's own fingerprint, so the server
loads and checks it as it would a compressed fine-tune: it costs the same bytes, the same slot
load and the same kernel work per token as a real one (what a speed / memory row measures) and
says nothing about quality. Compressing a real 7B fine-tune pair would take a 13.5 GB bf16 copy
per variant and ~10 minutes each on 2 cores. Everything is cached under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from bench.common.paths import ROOT

SHAPES = {
  # Llama-3.2-1B-like widths with a Llama-2 vocabulary
  "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8),
  # Llama-2-7B
  "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32),
}
DEFAULT_WORK = pathlib.Path(tempfile.gettempdir()) / "bitdelta_quant_models"
# server options for the 7B shape (bench.serving.quant, bench.engine.memory): prompt chunks of 64 tokens (the
# warm-up runs every step program once; 544-token steps of a 7B take minutes on 2 cores),
# deltas not kept twice (slots + host cache), sequences of 256 tokens (a 7B's f32 KV: 1 MiB a
# token); with more than 3 variants a 1 GiB KV pool, else 512 MiB
SEVEN_B_SERVER = {"host_cache_mb": 512, "prefill_chunk": 64, "max_seq_len": 256}


def seven_b_server(n_variants: int) -> dict:
  return SEVEN_B_SERVER | {"kv_cache_mb": 1024 if n_variants > 3 else 512}


def write_random_variant(base, out: pathlib.Path, seed: int, alpha: float = 1e-3) -> pathlib.Path:
  """A delta directory against ``base`` (an HF dir or GGUF file) whose every linear weight is a
  1-bit delta of random signs with per-matrix scale ``alpha``; other tensors are "same"."""
  import numpy as np

  from bitdelta_jax.delta.compress import CompressPolicy
  from bitdelta_jax.delta.entries import Dense
  from bitdelta_jax.delta.format import PackedDelta, group_k_for
  from bitdelta_jax.delta.report import Report, TensorReport
  from bitdelta_jax.delta.store import DeltaWriter
  from bitdelta_jax.hf.checkpoints import open_checkpoint
  from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base

  if out.exists():
    return out
  policy = CompressPolicy()
  fp = fingerprint_checkpoint(base)
  rng = np.random.default_rng(seed)
  lines = []
  with open_checkpoint(resolve_base(base)) as r, DeltaWriter(out) as w:
    for name in r.names():
      info = r.info(name)
      if policy.is_linear(name, len(info.shape)):
        n, k = info.shape
        g = group_k_for(k, policy.group_k)
        bits = rng.integers(0, 256, ((-(-k // g) * g) // 8, n), np.uint8)
        entry = PackedDelta(bits=bits, scale=np.array([alpha], np.float32), shape=(k, n),
                            group_k=g, granularity=policy.granularity)
        line = TensorReport(name, "packed", info.shape, info.dtype.name, info.nbytes,
                            entry.nbytes, 0.0, note="random bits (bench)")
      else:
        entry = Dense("same")
        line = TensorReport(name, "same", info.shape, info.dtype.name, info.nbytes, 0, 0.0)
      w.add(name, entry, hf_shape=info.shape)
      lines.append(line)
    w.finish(base_fingerprint=fp, report=Report(lines), policy=policy.to_dict(),
             source={"base": pathlib.Path(base).name, "finetuned": f"random-{seed}"},
             notes=["random 1-bit variant for speed / memory benches (bench/common/random_models.py)"])
  return out


def llama_specs(c) -> tuple[dict, dict]:
  """``({HF name: shape}, {linear name: shape})`` of a `SyntheticConfig`'s Llama, in file order
  (an ``lm_head.weight`` unless its embeddings are tied)."""
  from bitdelta_jax.synthetic import linear_shapes

  specs = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
  lin = linear_shapes(c)
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}."
    specs |= {n: s for n, s in lin.items() if n.startswith(p)}
    specs[p + "input_layernorm.weight"] = (c.hidden_size,)
    specs[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
  specs["model.norm.weight"] = (c.hidden_size,)
  if not c.tie_word_embeddings:
    specs["lm_head.weight"] = (c.vocab_size, c.hidden_size)
  return specs, lin


def write_random_llama(out: pathlib.Path, shape: dict, seed: int, base: pathlib.Path | None = None):
  """An HF bf16 Llama dir with random weights, written tensor by tensor (a fine-tune: ``base``'s
  tensors plus 3% noise on the linear layers)."""
  import ml_dtypes
  import numpy as np

  from bitdelta_jax.hf.safetensors_io import CheckpointReader, SafetensorsWriter
  from bitdelta_jax.synthetic import SyntheticConfig
  from bitdelta_jax.zoo.tokenizer_build import write_tokenizer

  c = SyntheticConfig(**shape)
  specs, lin = llama_specs(c)
  specs["lm_head.weight"] = (c.vocab_size, c.hidden_size)  # always written here (untied files)
  bf16 = np.dtype(ml_dtypes.bfloat16)
  r = np.random.default_rng(seed)
  src = CheckpointReader(base) if base else None
  tmp = out.with_name(out.name + ".partial")
  tmp.mkdir(parents=True, exist_ok=True)
  with SafetensorsWriter(tmp / "model.safetensors", {n: (s, bf16) for n, s in specs.items()},
                         {"format": "pt"}) as w:
    for name, s in specs.items():
      if src is not None:
        v = src.read(name).astype(np.float32)
        if name in lin:
          v += 0.03 * np.abs(v).mean() * r.standard_normal(s, np.float32)
      elif len(s) == 1:
        v = np.ones(s, np.float32)
      elif name in lin:
        v = r.standard_normal(s, np.float32) / np.sqrt(s[1])
      else:
        v = 0.02 * r.standard_normal(s, np.float32)
      w.write(name, v.astype(bf16))
      del v
  (tmp / "config.json").write_text(json.dumps(c.hf_config(), indent=2))
  write_tokenizer(tmp)
  os.rename(tmp, out)


def cli(*args) -> None:
  """`bitdelta ARGS` (the CLI of this checkout), checked."""
  subprocess.run([sys.executable, "-m", "bitdelta_jax.cli", *args], check=True, cwd=ROOT)


def make_variants(base: pathlib.Path, root: pathlib.Path, names=("v1", "v2", "v3emb")) -> dict:
  """Compressed synthetic full fine-tunes (cached); the last one also changes the embedding."""
  import numpy as np
  from safetensors.numpy import load_file, save_file

  from bitdelta_jax.delta.compress import CompressPolicy
  from bitdelta_jax.delta.stream import compress_checkpoints

  out = {}
  tensors = None
  for i, name in enumerate(names):
    d = root / name
    out[name] = d
    if (d / "manifest.json").exists():
      continue
    if tensors is None:
      tensors = load_file(str(base / "model.safetensors"))
    rng = np.random.default_rng(100 + i)
    ft = {}
    for k, a in tensors.items():
      change = a.ndim == 2 and ("embed" not in k or name.endswith("emb")) or "norm" in k
      if change:
        rms = float(np.sqrt(np.mean(a.astype(np.float64) ** 2)))
        a = (a + rng.normal(0, 0.002 * rms, a.shape)).astype(a.dtype)
      ft[k] = a
    ftdir = root / f"{name}-ft"
    ftdir.mkdir(parents=True, exist_ok=True)
    save_file(ft, str(ftdir / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json",):
      (ftdir / f).write_bytes((base / f).read_bytes())
    compress_checkpoints(base, ftdir, d, CompressPolicy(), progress=False)
    for f in ftdir.iterdir():
      f.unlink()
    ftdir.rmdir()
  return out


def make(shape: str, formats: list[str], n_variants: int, work: pathlib.Path = DEFAULT_WORK,
         keep_bf16: bool = False) -> dict:
  """``{fmt: (gguf_path, [variant dirs])}`` for one shape, built once under ``work``."""
  work.mkdir(parents=True, exist_ok=True)
  bf16 = work / f"llama{shape}-bf16"
  ggufs = {f: work / f"llama{shape}.{f.upper()}.gguf" for f in formats}
  if not all(g.exists() for g in ggufs.values()) and not bf16.exists():
    print(f"writing {bf16}", flush=True)
    write_random_llama(bf16, SHAPES[shape], 0)
  out = {}
  for fmt, g in ggufs.items():
    if not g.exists():
      print(f"quantizing {g.name}", flush=True)
      cli("quantize", "--base", str(bf16), "--format", fmt, "--out", str(g), "--quiet")
    vs = []
    for i in range(n_variants):
      print(f"variant {i} of {g.name}", flush=True)
      vs.append(write_random_variant(g, work / f"llama{shape}-{fmt}-v{i}", seed=100 + i))
    out[fmt] = (g, vs)
  if bf16.exists() and not keep_bf16:
    subprocess.run(["rm", "-rf", str(bf16)], check=True)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", choices=sorted(SHAPES), required=True)
  p.add_argument("--formats", default="q8_0,q4_0")
  p.add_argument("--variants", type=int, default=3)
  p.add_argument("--work", default=str(DEFAULT_WORK))
  a = p.parse_args(argv)
  for fmt, (g, vs) in make(a.shape, a.formats.split(","), a.variants, pathlib.Path(a.work)).items():
    print(fmt, g, len(vs), "variants")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
