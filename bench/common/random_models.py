"""Random-weight Llamas as GGUF files, and random 1-bit variants of them, for the speed and memory
rows of `quant_bench.py` (issue 36 item 7: "1B-shaped and 7B-shaped Llamas with random weights,
speed and memory only").

    python bench/quant_models.py --shape 1b --formats q8_0,q4_0 --variants 3
    python bench/quant_models.py --shape 7b --formats q4_0 --variants 14

A shape's bf16 HF directory is written tensor by tensor (`memory_bench._write_random_llama`),
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
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = {
  # Llama-3.2-1B-like widths with a Llama-2 vocabulary (memory_bench.ONE_B)
  "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8),
  # Llama-2-7B
  "7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32),
}
DEFAULT_WORK = pathlib.Path(tempfile.gettempdir()) / "bitdelta_quant_models"
# server options for the 7B shape (quant_bench, memory_bench): prompt chunks of 64 tokens (the
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
  from bitdelta_jax.delta.stream import fingerprint_checkpoint
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base
  from bitdelta_jax.hf.safetensors_io import CheckpointReader

  if out.exists():
    return out
  policy = CompressPolicy()
  fp = fingerprint_checkpoint(base)
  rng = np.random.default_rng(seed)
  lines = []
  with CheckpointReader(resolve_base(base)) as r, DeltaWriter(out) as w:
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
             notes=["random 1-bit variant for speed / memory benches (bench/quant_models.py)"])
  return out


def make(shape: str, formats: list[str], n_variants: int, work: pathlib.Path = DEFAULT_WORK,
         keep_bf16: bool = False) -> dict:
  """``{fmt: (gguf_path, [variant dirs])}`` for one shape, built once under ``work``."""
  from memory_bench import _cli, _write_random_llama

  work.mkdir(parents=True, exist_ok=True)
  bf16 = work / f"llama{shape}-bf16"
  ggufs = {f: work / f"llama{shape}.{f.upper()}.gguf" for f in formats}
  if not all(g.exists() for g in ggufs.values()) and not bf16.exists():
    print(f"writing {bf16}", flush=True)
    _write_random_llama(bf16, SHAPES[shape], 0)
  out = {}
  for fmt, g in ggufs.items():
    if not g.exists():
      print(f"quantizing {g.name}", flush=True)
      _cli("quantize", "--base", str(bf16), "--format", fmt, "--out", str(g), "--quiet")
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
