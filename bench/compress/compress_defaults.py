"""What `bitdelta compress` writes with default flags, now and at an earlier commit, on a
fine-tune-shaped change of the real SmolLM2-135M base.

    python -m bench compress_defaults [--rounds 3] [--before REF]

The "fine-tune" is the real base (`bitdelta zoo real-base`, dequantized Q4_1) plus Gaussian
noise whose ‖Δ‖/‖W‖ per layer type is the one the shipped real fine-tune smol-math measured
(`bitdelta_jax/zoo/shipped_real/family.json`: 1.15e-3 on the tied embedding, ~1.6e-3 on the
linear layers, 1e-3 / 2e-4 on the norms), so every tensor changes as in a full fine-tune that
trained its embeddings. It is not a trained model: the bytes and the embedding decision depend
only on ‖Δ‖/‖W‖ and the shapes, which it matches; fidelity is measured in fidelity_real.md.
Each round compresses it with default flags and with ``--embeddings 1bit``, with this checkout
and (``--before``) with REF, interleaved; wall seconds include ~4 s of start-up.
Writes bench/results/compress/compress_defaults.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

import numpy as np

from bench.common import (
  machine,
  report,
)
from bench.common.checkouts import ROOT, checkouts, copy_side_files, run_cli
from bench.common.paths import results_dir

OUT = results_dir("compress")
FAMILY = ROOT / "bitdelta_jax" / "zoo" / "shipped_real" / "family.json"


def make_finetune(base: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  from safetensors.numpy import load_file, save_file

  ratios = json.loads(FAMILY.read_text())["variants"]["smol-math"]["norm_ratios"]
  dst.mkdir(parents=True, exist_ok=True)
  copy_side_files(base, dst)
  rng = np.random.default_rng(0)
  for f in base.glob("*.safetensors"):
    out = {}
    for name, w in load_file(f).items():
      kind = name.split(".")[-2]
      rel = ratios[kind]
      w32 = w.astype(np.float32)
      rms = float(np.sqrt(np.mean(w32 * w32)))
      out[name] = (w32 + rel * rms * rng.standard_normal(w.shape)).astype(w.dtype)
    save_file(out, dst / f.name, metadata={"format": "pt"})
  return dst


def dir_bytes(d: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--before", help="a git ref to compare with")
  args = ap.parse_args()
  from bitdelta_jax.zoo.real_base import import_real_base  # noqa: PLC0415

  base = import_real_base()
  cfg = json.loads((base / "config.json").read_text())
  n_params = sum(int(np.prod(a.shape)) for a in _shapes(base))
  bf16 = 2 * n_params
  with tempfile.TemporaryDirectory(prefix="compress_defaults_") as tmp:
    work = pathlib.Path(tmp)
    ft = make_finetune(base, work / "ft")
    flags = {"default flags": [], "--embeddings 1bit": ["--embeddings", "1bit"]}
    res: dict = {}
    with checkouts(args.before, work) as srcs:
      for r in range(args.rounds):
        for label, extra in flags.items():
          for src_label, src in srcs.items():
            out = work / f"d_{src_label}_{len(extra)}"
            argv = ["compress", "--base", str(base), "--finetuned", str(ft), "--out", str(out),
                    "--overwrite", "--quiet", *extra]
            wall, rss = run_cli(src, argv)
            m = json.loads((out / "manifest.json").read_text())
            emb = m["tensors"]["model.embed_tokens.weight"]["kind"]
            res.setdefault(label, {}).setdefault(src_label, []).append(
              {"wall_s": wall, "rss_gib": rss, "bytes": dir_bytes(out), "embed": emb})
            print(f"round {r} {label} [{src_label}]: {wall:.1f} s, {dir_bytes(out) / 1e6:.2f} MB, "
                  f"embeddings {emb}", flush=True)
  summary = {label: {s: {"wall_s": round(statistics.median(x["wall_s"] for x in xs), 2),
                         "bytes": xs[-1]["bytes"], "x_smaller_than_bf16": round(bf16 / xs[-1]["bytes"], 2),
                         "embeddings": xs[-1]["embed"]}
                     for s, xs in by.items()}
             for label, by in res.items()}
  doc = {"machine": machine.describe(), "rounds": args.rounds, "before": args.before,
         "model": f"SmolLM2-135M-Instruct (dequantized Q4_1), {n_params} parameters, "
                  f"hidden {cfg.get('hidden_size')}", "bf16_bytes": bf16, "results": summary}
  OUT.mkdir(exist_ok=True)
  report.write_json(OUT / "compress_defaults.json", doc, indent=2)
  mm = doc["machine"]
  lines = ["# `bitdelta compress` with default flags: size against the bf16 checkpoint", "",
           f"Machine: {mm['cpu']}, {mm['cores']} cores, jax {mm.get('jax')}. {doc['model']}; bf16 "
           f"checkpoint {bf16 / 1e6:.1f} MB. Fine-tune: the base plus noise at smol-math's "
           "measured ‖Δ‖/‖W‖ per layer type (every tensor changed, embeddings included; see the "
           f"script's docstring). Delta = the whole directory. Medians of {args.rounds} "
           "interleaved rounds. Script: `bench/compress/compress_defaults.py"
           + (f" --before {args.before}`." if args.before else "`."), "",
           "| flags | code | delta (MB) | × smaller than bf16 | embeddings stored | wall (s) |",
           "|---|---|---:|---:|---|---:|"]
  for label, by in summary.items():
    for s, v in by.items():
      code = args.before if s == "before" else "this commit"
      lines.append(f"| {label} | {code} | {v['bytes'] / 1e6:.2f} | {v['x_smaller_than_bf16']}x | "
                   f"{v['embeddings']} | {v['wall_s']} |")
  (OUT / "compress_defaults.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


def _shapes(base: pathlib.Path):
  from bitdelta_jax.hf.safetensors_io import CheckpointReader

  with CheckpointReader(base) as r:
    return [r.info(n) for n in r.names()]


if __name__ == "__main__":
  main()
