"""Fidelity of real variants over a quantized base (issue 36, item 6) →
bench/results/fidelity/fidelity_quant.{json,md}.

The base is SmolLM2-135M-Instruct as imported (`bitdelta zoo real-base`: the wheel's Q4_1 GGUF
dequantized to f32), requantized to ggml Q8_0 and Q4_0 (`bitdelta_jax.hf.gguf_export.write_gguf`,
bit-identical to the `gguf` package's quantizer). For each real fine-tune
(`bitdelta_jax.zoo.real_family`) and format:

* ``base``: the quantized base itself (its own drop: NLL and KL against the fine-tune, beside the
  f32 base's);
* ``fine-tune quantized``: the fine-tune written to the same format (what a llama.cpp user
  would run: one quantized file per variant);
* ``bitdelta per-column``: the 1-bit delta taken against the quantized base
  (``Δ = W_ft − dequant(W_q)``, `compress_checkpoints` with the GGUF file as base), served over it;
* ``portable bitdelta per-column`` (issue 49 (a)): one delta per variant taken against the f32
  source (``Δ = W_ft − W_src``), served over every quantization (the file records its source);
* ``bitdelta per-column +distill`` (``--distill-steps`` > 0): its scales distilled against the quantized base
  (`distill_checkpoint` with the GGUF file as base).

Models are evaluated as dense f32 weights: dequant(W_q) (+ the delta): the server computes the
same products over the blocks (`pallas_kernels.quant_matmul`, tested equal to the dequantized
f32 product). The f32-base rows (fine-tune, per-column +distill over the f32 base) are read
from ``fidelity_real.json`` when present (same prompts, same recipe), else computed here.

    python -m bench fidelity_quant [--variants smol-math ...] [--formats q8_0 q4_0]

Variants an earlier run measured (in ``--out``'s fidelity_quant.json) and this one does not are
kept, each with the commit it was measured at: one variant takes ~40 min on 2 cores, so the
four are run one or two at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

from bench.common import report
from bench.common.machine import describe
from bench.common.paths import results_dir
from bench.fidelity.fidelity_real import evaluate, tensor_bytes
from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.store import load_delta, read_manifest
from bitdelta_jax.hf.checkpoints import open_checkpoint
from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint
from bitdelta_jax.hf.gguf_checkpoint import resolve_base
from bitdelta_jax.hf.gguf_export import write_gguf
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models.loading import from_tensors, load_config
from bitdelta_jax.models.tokenizer import Tokenizer
from bitdelta_jax.zoo import real_family as rf
from bitdelta_jax.zoo.real_base import import_real_base

GOAL_POINTS = 1.0  # issue 36 item 6: distilled variants within 1 point of their fine-tunes


def _tensors(path) -> dict:
  with open_checkpoint(resolve_base(path)) as r:
    return {n: r.read(n) for n in r.names()}


def portable_delta(name: str, base_dir: Path, work: Path) -> Path:
  """(a) the delta against the f32 source (per column, 1-bit embeddings: the same policy as
  (b)), made once per variant and served over every format."""
  from bitdelta_jax.delta.stream import compress_checkpoints

  d = work / f"{name}-portable"
  if not (d / "manifest.json").exists():
    compress_checkpoints(base_dir, rf.ensure_real_finetune(name, progress=False), d,
                         CompressPolicy(granularity="column"), embeddings="1bit",
                         overwrite=True, progress=False)
  return d


def run(name: str, fmt: str, base_dir: Path, base_q: Path, mc, tok, work: Path, args) -> dict:
  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.distill import DistillConfig, distill_checkpoint

  t0 = time.time()
  ft_dir = rf.ensure_real_finetune(name, progress=False)
  teacher = from_pretrained(ft_dir, jnp.float32)
  examples = rf.heldout(name, args.n_eval)
  rows: dict = {}

  def record(label, res, manifest=None):
    res.pop("hits", None)
    if manifest is not None:
      res["bytes"] = tensor_bytes(manifest)
    rows[label] = res
    print(f"  {name:12s} {fmt:5s} {label:30s} score {res['score']:5.1f}  nll {res['nll']:.3f}"
          + (f"  kl {res['kl']:.4f}" if res.get("kl") is not None else ""), flush=True)

  base_t = _tensors(base_q)
  record("base", rf.score(from_tensors(mc, base_t, jnp.float32), examples, tok,
                          reference=teacher))
  ft_q = work / f"{name}.{fmt}.gguf"
  write_gguf(ft_dir, ft_q, dtype=fmt)
  record("fine-tune quantized", rf.score(from_tensors(mc, _tensors(ft_q), jnp.float32), examples,
                                         tok, reference=teacher))
  d = work / f"{name}-{fmt}-column"
  m = compress_checkpoints(base_q, ft_dir, d, CompressPolicy(granularity="column"),
                           embeddings="1bit", overwrite=True, progress=False)
  formats = (m["base"].get("quantization") or {}).get("formats", {})
  if fmt not in formats:
    raise AssertionError(f"the delta's base fingerprint is not a {fmt} base: {formats}")
  record("bitdelta per-column", evaluate(mc, base_t, load_delta(d)[0], teacher, tok, examples), m)
  # (a) one delta against the f32 source, served over this quantization: the lineage the file
  # records (write_gguf) is what lets it load (check_base), and the variant is dequant + α·S
  pd = portable_delta(name, base_dir, work)
  portable, pm = load_delta(pd, base_fingerprint=fingerprint_checkpoint(resolve_base(base_q)))
  record("portable bitdelta per-column", evaluate(mc, base_t, portable, teacher, tok, examples),
         pm)
  # the same delta served as the server runs it: the file's blocks in the model, the delta in
  # slot 1, every product through the cpu_rows kernel with f32 and with int8 activations (the
  # default): the fidelity cost of int8 activations, in points
  from bitdelta_jax.models import slots as slots_lib

  served = from_pretrained(base_q, num_slots=2, variants=[pd])
  slots_lib.load_variant(served, 1, portable)
  before = os.environ.get("BITDELTA_QUANT_ACTIVATIONS")
  try:
    for act in ("f32", "int8"):
      os.environ["BITDELTA_QUANT_ACTIVATIONS"] = act  # read when each product is traced
      record(f"portable served ({act} activations)",
             rf.score(served, examples, tok, reference=teacher, slot=1))
      record(f"base served ({act} activations)",
             rf.score(served, examples, tok, reference=teacher, slot=0))
  finally:
    if before is None:
      os.environ.pop("BITDELTA_QUANT_ACTIVATIONS", None)
    else:
      os.environ["BITDELTA_QUANT_ACTIVATIONS"] = before
  del served
  if not args.distill_steps:
    shutil.rmtree(d, ignore_errors=True)
    ft_q.unlink(missing_ok=True)
    return {"rows": rows, "seconds": time.time() - t0}
  dd = work / f"{name}-{fmt}-column-distilled"
  shutil.rmtree(dd, ignore_errors=True)
  shutil.copytree(d, dd)
  info = distill_checkpoint(base_q, ft_dir, dd, rf.calibration_ids(tok, name),
                            DistillConfig(steps=args.distill_steps, seq=64, batch=4, lr=1e-4),
                            progress=False)
  record("bitdelta per-column +distill",
         evaluate(mc, base_t, load_delta(dd)[0], teacher, tok, examples), read_manifest(dd))
  rows["bitdelta per-column +distill"]["distill"] = {
    k: info.get(k) for k in ("steps", "held_mse_before", "held_mse_after", "seconds")}
  shutil.rmtree(d, ignore_errors=True)
  shutil.rmtree(dd, ignore_errors=True)
  ft_q.unlink(missing_ok=True)
  return {"rows": rows, "seconds": time.time() - t0}


def f32_rows(name: str, base_dir: Path, tok, args, previous: dict) -> dict:
  """The f32 base's rows: from fidelity_real.json (same prompts and recipe) or computed."""
  v = previous.get(name)
  keep = ("base", "fine-tune", "bitdelta per-column", "bitdelta per-column +distill")
  if v and v.get("n_eval") == args.n_eval:
    return {k: v["rows"][k] for k in keep if k in v["rows"]}
  ft_dir = rf.ensure_real_finetune(name, progress=False)
  teacher = from_pretrained(ft_dir, jnp.float32)
  examples = rf.heldout(name, args.n_eval)
  out = {"base": rf.score(from_pretrained(base_dir, jnp.float32), examples, tok,
                          reference=teacher),
         "fine-tune": rf.score(teacher, examples, tok, reference=teacher)}
  for r in out.values():
    r.pop("hits", None)
  return out


def write_md(out: Path, result: dict) -> None:
  L = ["# Real variants over a quantized base (SmolLM2-135M-Instruct, Q8_0 and Q4_0)", "",
       f"Machine: {result['machine']}. Commit {result['commit']}. Held-out prompts per variant: "
       f"{result['n_eval']}. Base: {result['base']}. Score: greedy exact match (%); NLL per "
       "answer token; KL(fine-tune ‖ model) per answer token. Rows per format: (c) `fine-tune "
       "quantized`: the fine-tune itself written in that format (one file per variant, what a "
       "llama.cpp user runs); (b) `bitdelta per-column`: the delta taken against the quantized "
       "weights (Δ = W_ft − dequant(W_q)) and served over them; (a) `portable bitdelta "
       "per-column`: ONE delta per variant taken against the f32 source (Δ = W_ft − W_src), "
       "served over every quantization of it (dequant(W_q) + α·sign Δ; it loads because the "
       "file records its source, `bitdelta_jax.hf.lineage`). `+distill` (earlier runs): scales "
       f"distilled against the quantized base ({result['distill_steps']} steps; 0: not run).", "",
       "Measured per variant: " + ", ".join(
         f"{n} at {v.get('commit', result['commit'])}" + (f" ({v['run_at']})" if v.get("run_at")
                                                          else "")
         for n, v in result["variants"].items()) + ".", "",
       "| variant | base format | method | score | Δ vs FT | NLL | KL |",
       "|---|---|---|---:|---:|---:|---:|"]
  for name, v in result["variants"].items():
    ft = v["f32"]["fine-tune"]["score"]
    for fmt, rows in [("f32", v["f32"]), *v["formats"].items()]:
      for label, r in rows.items():
        if fmt != "f32" or label in ("base", "fine-tune", "bitdelta per-column +distill"):
          kl = f"{r['kl']:.4f}" if r.get("kl") is not None else ""
          L.append(f"| {name} | {fmt} | {label} | {r['score']:.1f} | {r['score'] - ft:+.1f} | "
                   f"{r['nll']:.3f} | {kl} |")
  L += ["", "## Goals (issue 36 item 6; issue 49 items 4-5)", ""] + [f"- {g}" for g in result["goals"]]
  L += result.get("notes", [])
  (out / "fidelity_quant.md").write_text("\n".join(L) + "\n")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", nargs="*", default=list(rf.VARIANTS))
  p.add_argument("--formats", nargs="*", default=["q8_0", "q4_0"])
  p.add_argument("--n-eval", type=int, default=48)
  p.add_argument("--distill-steps", type=int, default=16)
  p.add_argument("--out", default=str(results_dir("fidelity")))
  p.add_argument("--assemble", action="store_true", help="write the results from the variants "
                 "already finished in an interrupted run (the per-variant files it leaves in "
                 "the temp dir), without running anything")
  args = p.parse_args()
  base_dir = import_real_base()
  tok = Tokenizer.from_dir(base_dir)
  mc = load_config(base_dir)
  out = Path(args.out)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
  previous = {}
  if (out / "fidelity_real.json").exists():
    old = json.loads((out / "fidelity_real.json").read_text())
    previous = {n: {**v, "n_eval": old.get("n_eval")} for n, v in old["variants"].items()}
  result = {"machine": describe(), "commit": commit, "n_eval": args.n_eval,
            "distill_steps": args.distill_steps,
            "base": "SmolLM2-135M-Instruct as imported (the wheel's Q4_1 GGUF dequantized to "
                    "f32), requantized by write_gguf", "variants": {}}
  if args.assemble:
    for name in args.variants:
      f = Path(tempfile.gettempdir()) / f"fidelity_quant_{name}.json"
      if f.exists():
        v = json.loads(f.read_text())
        if all(fmt in v["formats"] for fmt in args.formats):
          result["variants"][name] = v
    result["assembled_from_partial_run"] = True
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    bases = {}
    for fmt in [] if args.assemble else args.formats:
      bases[fmt] = write_gguf(base_dir, work / f"base.{fmt}.gguf", dtype=fmt)
    for name in [] if args.assemble else args.variants:
      v = {"f32": f32_rows(name, base_dir, tok, args, previous), "formats": {}, "seconds": {}}
      for fmt in args.formats:
        r = run(name, fmt, base_dir, bases[fmt], mc, tok, work, args)
        v["formats"][fmt], v["seconds"][fmt] = r["rows"], r["seconds"]
        (Path(tempfile.gettempdir()) / f"fidelity_quant_{name}.json").write_text(
          json.dumps(v, indent=1, default=float))
      v["commit"], v["run_at"] = commit, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
      result["variants"][name] = v
  if (out / "fidelity_quant.json").exists():  # variants measured by earlier runs stay
    earlier = json.loads((out / "fidelity_quant.json").read_text())
    result["notes"] = earlier.get("notes", [])
    for name, v in earlier.get("variants", {}).items():
      if name not in result["variants"]:
        v.setdefault("commit", earlier.get("commit"))
        result["variants"][name] = v
  goals = []
  for name, v in result["variants"].items():
    ft = v["f32"]["fine-tune"]["score"]
    for fmt, rows in v["formats"].items():
      dq = rows["fine-tune quantized"]["score"] - ft
      if "portable served (int8 activations)" in rows:  # issue 49 item 4: int8's cost
        i8, f32 = rows["portable served (int8 activations)"], rows["portable served (f32 activations)"]
        goals.append(
          f"{name} over {fmt}, served through the block kernel: int8 activations "
          f"{i8['score'] - ft:+.1f} points vs the f32 fine-tune, f32 activations "
          f"{f32['score'] - ft:+.1f} (int8 - f32: {i8['score'] - f32['score']:+.1f}); KL int8 "
          f"{i8['kl']:.4f} vs f32 {f32['kl']:.4f}")
      if "portable bitdelta per-column" in rows:  # issue 49: (a) within 1 point of (c)
        a = rows["portable bitdelta per-column"]["score"] - ft
        b = rows["bitdelta per-column"]["score"] - ft
        goals.append(
          f"{name} over {fmt}: (a) portable delta {a:+.1f} points vs the f32 fine-tune, (c) the "
          f"fine-tune quantized {dq:+.1f}, (b) delta against the {fmt} base {b:+.1f}: (a) vs (c) "
          f"{a - dq:+.1f} ({'met' if a - dq >= -GOAL_POINTS else 'missed'}, goal within "
          f"{GOAL_POINTS}); KL (a) {rows['portable bitdelta per-column']['kl']:.4f}, (c) "
          f"{rows['fine-tune quantized']['kl']:.4f}, (b) {rows['bitdelta per-column']['kl']:.4f}")
      if "bitdelta per-column +distill" in rows:
        d = rows["bitdelta per-column +distill"]["score"] - ft
        goals.append(f"{name} over {fmt}: distilled BitDelta {d:+.1f} points vs the f32 "
                     f"fine-tune ({'met' if d >= -GOAL_POINTS else 'missed'}, goal within "
                     f"{GOAL_POINTS}); the fine-tune itself quantized to {fmt}: {dq:+.1f}; the "
                     f"{fmt} base's NLL {rows['base']['nll']:.3f} vs f32 base "
                     f"{v['f32']['base']['nll']:.3f}")
  result["goals"] = goals
  out.mkdir(parents=True, exist_ok=True)
  report.write_json(out / "fidelity_quant.json", result, indent=1)
  write_md(out, result)
  print("\n".join(goals))


if __name__ == "__main__":
  main()
