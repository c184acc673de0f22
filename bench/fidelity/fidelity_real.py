"""Fidelity of compressed *real* variants: full fine-tunes of SmolLM2-135M-Instruct
(`bitdelta_jax.zoo.real_family`) → bench/results/fidelity/fidelity_real.{json,md,png}.

Per variant: the base, the full fine-tune, BitDelta per-matrix / per-column (1-bit embeddings
with a per-token α where the fine-tune changed them, norms exact), per-column with scale
distillation, and D-QRELO (1-bit + compensated low-rank residual, `delta.residual`) at 1/15 of
the bf16 bytes of each linear weight, as compressed and with α and the low-rank factors
distilled together (`distill`, the factors re-quantised to bf16 as stored, bytes unchanged). For each: task score (greedy exact match on held-out
prompts, %), NLL per answer token, mean KL(fine-tune ‖ variant) per answer token, and the
whole-variant bytes against the bf16 fine-tune (``2 × parameters``) and against the bf16 linear
layers alone.

    python -m bench fidelity_real [--variants smol-math ...] [--n-eval 48] [--keep-previous]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench.common import report
from bench.common.machine import describe
from bench.common.paths import results_dir
from bitdelta_jax.delta.compress import CompressPolicy, apply_delta
from bitdelta_jax.delta.report import Report
from bitdelta_jax.delta.store import load_delta, read_manifest, save_delta
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models.loading import from_tensors, load_config
from bitdelta_jax.models.tokenizer import Tokenizer
from bitdelta_jax.zoo import real_family as rf
from bitdelta_jax.zoo.real_base import import_real_base

GOAL_POINTS = 1.0  # distilled BitDelta within 1 point of the fine-tune (issue 12, item 4)
EMB = ("embed_tokens", "lm_head")
NOTES = "## Reading the table"


def tensor_bytes(manifest: dict, names=None) -> int:
  total = 0
  for n, meta in manifest["tensors"].items():
    if names is not None and n not in names:
      continue
    for a in meta["arrays"].values():
      total += int(np.prod(a["shape"])) * np.dtype(a["dtype"].replace("bfloat16", "float16")).itemsize
  return total


def evaluate(mc, base_t, delta, teacher, tok, examples) -> dict:
  model = from_tensors(mc, apply_delta(base_t, delta, hf_layout=True), jnp.float32)
  return rf.score(model, examples, tok, reference=teacher)


def run_variant(name, base_dir, base_t, mc, tok, work: Path, args) -> dict:
  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.distill import DistillConfig, distill_checkpoint

  t0 = time.time()
  ft_dir = rf.ensure_real_finetune(name, progress=False)
  teacher = from_pretrained(ft_dir, jnp.float32)
  examples = rf.heldout(name, args.n_eval)
  with CheckpointReader(ft_dir) as r:
    n_params = sum(int(np.prod(r.info(n).shape)) for n in r.names())
    linear = [n for n in r.names() if len(r.info(n).shape) == 2 and not any(e in n for e in EMB)]
    n_linear = sum(int(np.prod(r.info(n).shape)) for n in linear)
  rows = {}

  def record(label, res, manifest=None, nbytes=None):
    if manifest is not None or nbytes is not None:
      nb = tensor_bytes(manifest) if nbytes is None else nbytes
      res.update(bytes=nb, whole_ratio=2 * n_params / nb,
                 linear_ratio=2 * n_linear / tensor_bytes(manifest, set(linear))
                 if manifest is not None else None)
    rows[label] = res
    print(f"  {name:12s} {label:24s} score {res['score']:5.1f}  nll {res['nll']:.3f}"
          + (f"  kl {res['kl']:.4f}" if res.get("kl") is not None else "")
          + (f"  1/{res['whole_ratio']:.1f} of bf16" if "whole_ratio" in res else ""), flush=True)

  record("base", rf.score(from_pretrained(base_dir, jnp.float32), examples, tok,
                          reference=teacher))
  record("fine-tune", rf.score(teacher, examples, tok, reference=teacher))
  for gran in ("matrix", "column"):
    d = work / f"{name}-{gran}"
    m = compress_checkpoints(base_dir, ft_dir, d, CompressPolicy(granularity=gran),
                             embeddings="1bit", overwrite=True, progress=False)
    record(f"bitdelta per-{gran}", evaluate(mc, base_t, load_delta(d)[0], teacher, tok,
                                            examples), m)
  d = work / f"{name}-column"
  shipped = Path(args.family) / "deltas" / name if args.family else None
  if shipped is not None and (shipped / "manifest.json").exists():
    dd = shipped  # built by `bitdelta zoo build --real` (the same compress + distill)
    info = read_manifest(dd).get("scales", {})
  else:
    dd = work / f"{name}-column-distilled"
    shutil.rmtree(dd, ignore_errors=True)
    shutil.copytree(d, dd)
    info = distill_checkpoint(base_dir, ft_dir, dd, rf.calibration_ids(tok, name),
                              DistillConfig(steps=args.distill_steps, seq=64, batch=4, lr=1e-4),
                              progress=False)
  record("bitdelta per-column +distill", evaluate(mc, base_t, load_delta(dd)[0], teacher, tok,
                                                  examples), read_manifest(dd))
  rows["bitdelta per-column +distill"]["distill"] = {
    k: info.get(k) for k in ("steps", "held_mse_before", "held_mse_after", "seconds")}
  # D-QRELO on the linear layers; embeddings as the 1-bit per-column delta above.
  q = work / f"{name}-dqrelo"
  # per-matrix α and 64-row groups: at 1/15 the 1-bit part must leave room for the factors
  # (128-row groups pad K=576 to 640, and a per-column α costs 4 bytes per column)
  mq = compress_checkpoints(base_dir, ft_dir, q,
                            CompressPolicy(granularity="matrix", mode="dqrelo",
                                           budget=args.budget, iters=1, group_k=64),
                            overwrite=True, progress=False)
  delta_q = load_delta(q)[0]
  mc_col = read_manifest(d)
  emb_names = [n for n in mc_col["tensors"] if any(e in n for e in EMB)]
  col = load_delta(d)[0]
  for n in emb_names:
    delta_q[n] = col[n]
  nbytes = tensor_bytes(mq) - tensor_bytes(mq, set(emb_names)) + tensor_bytes(mc_col, set(emb_names))
  res = evaluate(mc, base_t, delta_q, teacher, tok, examples)
  res["lora_rank"] = mq.get("lora_rank")
  record(f"dqrelo {args.budget_text} (+1-bit emb)", res, nbytes=nbytes)
  rows[f"dqrelo {args.budget_text} (+1-bit emb)"]["linear_ratio"] = (
    2 * n_linear / tensor_bytes(mq, set(linear)))
  # The same delta as one directory (1-bit embeddings included), then α and the low-rank
  # factors distilled together (`distill`, factors re-quantised to bf16 as stored).
  qd = work / f"{name}-dqrelo-distilled"
  mqd = save_delta(qd, delta_q, base_fingerprint=mq["base"], report=Report([]),
                   policy=mq["policy"], overwrite=True)
  if tensor_bytes(mqd) != nbytes:
    raise AssertionError(f"merged dqrelo delta: {tensor_bytes(mqd)} bytes, expected {nbytes}")
  info_q = distill_checkpoint(base_dir, ft_dir, qd, rf.calibration_ids(tok, name),
                              DistillConfig(steps=args.distill_steps, seq=64, batch=4, lr=1e-4),
                              progress=False)
  mqd = read_manifest(qd)
  if tensor_bytes(mqd) != nbytes:
    raise AssertionError(f"distillation changed the delta's bytes: {tensor_bytes(mqd)} != {nbytes}")
  res = evaluate(mc, base_t, load_delta(qd)[0], teacher, tok, examples)
  res["lora_rank"] = mqd.get("lora_rank")
  label = f"dqrelo {args.budget_text} +distill"
  record(label, res, mqd)
  rows[label]["distill"] = {k: info_q.get(k) for k in (
    "steps", "held_mse_before", "held_mse_after", "seconds", "factors_distilled")}
  ft_rec = json.loads((ft_dir / "recipe.json").read_text())
  return {"rows": rows, "norm_ratios": rf.norm_ratios(base_dir, ft_dir),
          "train_embeddings": rf.VARIANTS[name].train_embeddings,
          "finetune_seconds": ft_rec["seconds"], "finetune_loss_first_last": [
            ft_rec["losses"][0], float(np.mean(ft_rec["losses"][-8:]))],
          "params": n_params, "linear_params": n_linear, "seconds": time.time() - t0}


def write_md(out: Path, result: dict) -> None:
  lines = ["# Fidelity on real fine-tunes of SmolLM2-135M-Instruct", "",
           f"Machine: {result['machine']}. Held-out prompts per variant: {result['n_eval']}. "
           "Score: greedy exact match (%); NLL per answer token; KL(fine-tune ‖ variant) per "
           "answer token; size: whole variant vs the bf16 fine-tune (2 bytes × parameters), and "
           "its linear layers vs their bf16 bytes.", "",
           "| variant | method | score | Δ vs FT | NLL | KL | whole size | linear size |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for name, v in result["variants"].items():
    ft = v["rows"]["fine-tune"]["score"]
    for label, r in v["rows"].items():
      r.pop("hits", None)
      size = f"1/{r['whole_ratio']:.1f}" if r.get("whole_ratio") else ""
      lin = f"1/{r['linear_ratio']:.1f}" if r.get("linear_ratio") else ""
      kl = f"{r['kl']:.4f}" if r.get("kl") is not None else ""
      lines.append(f"| {name} | {label} | {r['score']:.1f} | {r['score'] - ft:+.1f} | "
                   f"{r['nll']:.3f} | {kl} | {size} | {lin} |")
  runs: dict[str, list[str]] = {}
  for name, v in result["variants"].items():
    runs.setdefault(v.get("run", "this run"), []).append(name)
  if len(runs) > 1:
    lines += ["", "Rows by run (variants not re-run are kept from the earlier run; "
              "`--keep-previous`):", ""]
    lines += [f"- {run}: {', '.join(names)}" for run, names in runs.items()]
  lines += ["", "## Goals", ""]
  for g in result["goals"]:
    lines.append(f"- {g}")
  lines += ["", "## ‖Δ‖/‖W‖ per layer type (full fine-tunes)", "",
            "| variant | embeddings train | " + " | ".join(result["layer_types"]) + " |",
            "|---|---|" + "---:|" * len(result["layer_types"])]
  for name, v in result["variants"].items():
    lines.append(f"| {name} | {'yes' if v['train_embeddings'] else 'no'} | " + " | ".join(
      f"{v['norm_ratios'].get(t, 0.0):.2e}" for t in result["layer_types"]) + " |")
  notes = ""
  old = out / "fidelity_real.md"
  if old.exists() and NOTES in old.read_text():  # hand-written reading notes are kept
    notes = "\n" + NOTES + old.read_text().split(NOTES, 1)[1].rstrip() + "\n"
  (out / "fidelity_real.md").write_text("\n".join(lines) + "\n" + notes)


def plot(out: Path, result: dict) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(result["variants"])
  labels = list(dict.fromkeys(k for v in result["variants"].values() for k in v["rows"]))
  fig, ax = plt.subplots(figsize=(10, 4))
  w = 0.8 / len(labels)
  for i, label in enumerate(labels):
    ax.bar(np.arange(len(names)) + i * w, [
      result["variants"][n]["rows"].get(label, {}).get("score", np.nan) for n in names],
      w, label=label)
  ax.set_xticks(np.arange(len(names)) + 0.4 - w / 2, names)
  ax.set_ylabel("held-out exact match (%)")
  ax.set_title("Real SmolLM2-135M fine-tunes: task score by compression method")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(out / "fidelity_real.png", dpi=120)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", nargs="*", default=list(rf.VARIANTS))
  p.add_argument("--n-eval", type=int, default=48)
  p.add_argument("--distill-steps", type=int, default=16)
  p.add_argument("--budget", default="1/15")
  p.add_argument("--family", help="a real family built by `bitdelta zoo build --real`: its "
                 "distilled deltas are the +distill rows (else distilled here)")
  p.add_argument("--out", default=str(results_dir("fidelity")))
  p.add_argument("--keep-previous", action="store_true", help="keep the variants of the "
                 "existing fidelity_real.json that are not re-run (marked with their run)")
  args = p.parse_args()
  num, den = args.budget.split("/")
  args.budget_text, args.budget = args.budget, float(num) / float(den)
  base_dir = import_real_base()
  tok = Tokenizer.from_dir(base_dir)
  mc = load_config(base_dir)
  with CheckpointReader(base_dir) as r:
    base_t = {n: r.read(n) for n in r.names()}
  out = Path(args.out)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip() or "unknown"
  run = f"commit {commit}, {time.strftime('%Y-%m-%d')}"
  result = {"machine": describe(), "n_eval": args.n_eval, "budget": args.budget_text,
            "recipe": json.loads(rf.RealRecipe().key()), "commit": commit, "variants": {}}
  previous = {}
  if args.keep_previous and (out / "fidelity_real.json").exists():
    old = json.loads((out / "fidelity_real.json").read_text())
    old_run = old.get("run_label") or f"commit {old.get('commit', '2fe616b')} (earlier run)"
    previous = {n: {**v, "run": v.get("run", old_run)} for n, v in old["variants"].items()}
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.variants:
      result["variants"][name] = run_variant(name, base_dir, base_t, mc, tok, Path(tmp), args)
      result["variants"][name]["run"] = run
      # each variant's rows as soon as they exist (a later failure keeps them)
      (Path(tempfile.gettempdir()) / f"fidelity_real_{name}.json").write_text(
        json.dumps(result["variants"][name], indent=1, default=float))
  order = list(dict.fromkeys([*rf.VARIANTS, *previous, *result["variants"]]))
  merged = {**previous, **result["variants"]}
  result["variants"] = {n: merged[n] for n in order if n in merged}
  types = sorted({t for v in result["variants"].values() for t in v["norm_ratios"]})
  result["layer_types"] = types
  goals = []
  for name, v in result["variants"].items():
    r = v["rows"]
    ft = r["fine-tune"]["score"]
    d = r["bitdelta per-column +distill"]["score"] - ft
    goals.append(f"{name}: distilled BitDelta {d:+.1f} points vs the fine-tune "
                 f"({'met' if d >= -GOAL_POINTS else 'missed'}, goal within {GOAL_POINTS})")
    for q in [k for k in r if k.startswith("dqrelo")]:
      dq, rq = r[q]["score"] - ft, r[q]
      goals.append(f"{name}: {q} {dq:+.1f} points, KL {rq['kl']:.4f}, NLL {rq['nll']:.3f} "
                   f"(fine-tune NLL {r['fine-tune']['nll']:.3f}), linear layers "
                   f"1/{rq['linear_ratio']:.1f} of bf16 "
                   f"({'met' if dq >= -0.3 and rq['linear_ratio'] >= 15 else 'missed'}, goal "
                   f"within 0.3 at <= 1/15)")
    wr = r["bitdelta per-column"]["whole_ratio"]
    goals.append(f"{name}: whole variant 1/{wr:.1f} of the bf16 fine-tune "
                 f"({'met' if wr >= 14 else 'missed'}, goal <= 1/14)")
  result["goals"] = goals
  out.mkdir(parents=True, exist_ok=True)
  report.write_json(out / "fidelity_real.json", result, indent=1)
  write_md(out, result)
  plot(out, result)
  print("\n".join(goals))


if __name__ == "__main__":
  main()
