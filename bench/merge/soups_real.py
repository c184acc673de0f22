"""Checkpoint soups during a real full fine-tune of SmolLM2-135M-Instruct (issue 21 item 4).

For each task the base fails, four runs of the same fine-tune (the real recipe's AdamW,
warm-up + cosine, clip 1.0; every linear layer and norm trained, the tied embedding frozen; the
same initial point, seed and batch stream) that differ only in what happens every ``every``
steps (`bitdelta_jax.merge.soup_training`):

    none      plain training
    average   params ← mean of the last ``window`` checkpoints (one every every/window steps)
    svd       params ← svd_soup(start, [params, best], rank): the seed's rank-r SVD average with
              the best checkpoint so far (best by the validation loss at the checks)
    monosoup  params ← monosoup(start, params): the paper's single-checkpoint rule

Measured per run: smoothness of the training loss (mean |Δ| and std of Δ between consecutive
steps; the batches are the same across runs, so the differences are paired) and of the
validation loss (``n_val`` training-distribution examples off the training stream, evaluated at
every check, i.e. every every/window steps, before any merge at that step); final validation
loss and held-out exact match / NLL (``n_eval`` held-out prompts, teacher-forced greedy,
`real_family.score`) after the last merge; wall time.

    python -m bench soups_real                 # bench/results/merge/soups_real.{json,md,png}
    python -m bench soups_real --quick --out-dir /tmp/soups   # smoke run: minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

from bench.common import report
from bench.common.paths import results_dir

# LAPACK (the SVD merges) on one thread: on a loaded 2-core machine OpenBLAS's threads made a
# 576x1536 SVD take 10-25 s instead of 1 s (XLA's own dots do not use OpenBLAS)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.merge.soup_training import (
  METHODS,
  SoupSchedule,
  copy_tree,
  model_step_fns,
  soup_train,
)
from bitdelta_jax.zoo.lora_tasks import LORA_TASKS
from bitdelta_jax.zoo.real_family import RealRecipe, encode, optimizer, score
from bitdelta_jax.zoo.tasks import TASKS

RESULTS = results_dir("merge")

ALL_TASKS = {**TASKS, **LORA_TASKS}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  # one task keeps the default run near 15-20 min on a quiet 2-core machine (an SVD merge of the
  # 210 linear matrices took ~55 s in the loaded smoke run, compile included; 3 merges per SVD
  # run); --tasks nano-upper lora-add doubles it. Plain training reaches a middle score in 48
  # steps: held-out EM 57.8% (nano-upper), 70.3% (lora-add), both 0% for the base
  tasks: tuple[str, ...] = ("nano-upper",)
  steps: int = 48
  every: int = 16  # merge period N (a merge also lands on the last step)
  window: int = 4  # checks per period: checkpoints averaged / validation checks
  rank: int = 8  # svd soup
  batch: int = 4
  seq: int = 40  # nano-upper and lora-add fit in 34 tokens; encode() refuses longer
  lr: float = 5e-5  # the real recipe's; at 1e-4 nano-upper reached 16% held-out after 4 steps
  warmup: int = 6
  n_val: int = 8
  n_eval: int = 64
  seed: int = 0

  @classmethod
  def quick(cls) -> BenchConfig:
    return cls(tasks=("nano-upper",), steps=4, every=4, window=2, rank=2, batch=2, warmup=1,
               n_val=4, n_eval=8)

  def recipe(self) -> RealRecipe:
    return RealRecipe(steps=self.steps, batch=self.batch, seq=self.seq, lr=self.lr,
                      warmup=self.warmup, seed=self.seed)

  def schedule(self, method: str) -> SoupSchedule:
    return SoupSchedule(method, every=self.every, window=self.window, rank=self.rank)


def batches(task, tokenizer, cfg: BenchConfig):
  import random

  rng = random.Random(f"{task.name}:soups-real:{cfg.seed}")  # the same stream for every run
  while True:
    yield encode(tokenizer, [task.example(rng) for _ in range(cfg.batch)], cfg.seq)


def validation(task, tokenizer, cfg: BenchConfig):
  import random

  rng = random.Random(f"{task.name}:soups-real-val:{cfg.seed}")
  return encode(tokenizer, [task.example(rng) for _ in range(cfg.n_val)], cfg.seq)


def smoothness(xs) -> tuple[float, float]:
  """(mean |Δ|, std Δ) of consecutive values."""
  d = np.diff(np.asarray(xs, np.float64))
  return (float(np.mean(np.abs(d))), float(np.std(d))) if len(d) else (float("nan"),) * 2


def run(cfg: BenchConfig, base_dir=None) -> dict:
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.models.tokenizer import Tokenizer
  from bitdelta_jax.zoo.real_base import import_real_base

  base_dir = pathlib.Path(base_dir) if base_dir else import_real_base()
  tok = Tokenizer.from_dir(base_dir)
  graphdef, start, rest = nnx.split(from_pretrained(base_dir, jnp.float32), nnx.Param, ...)
  opt = optimizer(cfg.recipe(), train_embeddings=False)
  step_fn, loss_fn = model_step_fns(graphdef, rest, opt)  # one compile for every run

  def evaluate(params, examples):
    r = score(nnx.merge(graphdef, params, rest), examples, tok, seq=cfg.seq)
    return r["score"], r["nll"]

  rows, bases = [], {}
  for name in cfg.tasks:
    task = ALL_TASKS[name]
    held = task.heldout(cfg.n_eval, cfg.seed)
    vt, vm = (jnp.asarray(x) for x in validation(task, tok, cfg))
    em0, nll0 = evaluate(start, held)
    bases[name] = {"exact_match": em0, "nll": nll0, "val_loss": float(loss_fn(start, vt, vm))}
    print(f"{name}: base EM {em0:.1f}% NLL {nll0:.3f}", flush=True)
    for method in METHODS:
      params = copy_tree(start)
      t0 = time.perf_counter()
      r = soup_train(step_fn, params, opt.init(params), batches(task, tok, cfg), cfg.steps,
                     cfg.schedule(method), start=start,
                     val_loss=lambda p, vt=vt, vm=vm: loss_fn(p, vt, vm))
      train_s = time.perf_counter() - t0
      final_val = float(loss_fn(r.params, vt, vm))  # after the last merge
      em, nll = evaluate(r.params, held)
      vals = [v for _, v in r.val]
      step_abs, step_std = smoothness(r.losses)
      val_abs, val_std = smoothness(vals + [final_val])
      rows.append({
        "task": name, "method": method,
        "loss_step_mean_abs_diff": step_abs, "loss_step_diff_std": step_std,
        "val_mean_abs_diff": val_abs, "val_diff_std": val_std,
        "final_train_loss": float(np.mean(r.losses[-max(1, cfg.steps // 8):])),
        "final_val_loss": final_val, "exact_match": em, "nll": nll,
        "merge_steps": r.merges, "train_seconds": train_s, "merge_seconds": r.merge_seconds,
        "seconds": time.perf_counter() - t0,
        "losses": [round(x, 5) for x in r.losses], "val": r.val,
      })
      print(f"  {method:9s} |Δloss| {step_abs:.4f}  |Δval| {val_abs:.4f}  val {final_val:.4f}  "
            f"EM {em:5.1f}%  NLL {nll:.3f}  ({train_s:.0f}s train, {r.merge_seconds:.0f}s merging)",
            flush=True)
      del r, params
  return {"config": dataclasses.asdict(cfg), "base": bases, "rows": rows,
          "winner": winner(rows)}


def winner(rows) -> dict:
  """Per criterion, the method with the best mean over tasks."""
  means = {m: {k: float(np.mean([r[k] for r in rows if r["method"] == m]))
               for k in ("exact_match", "nll", "final_val_loss", "loss_step_mean_abs_diff",
                         "val_mean_abs_diff")} for m in METHODS}
  return {
    "exact_match": max(METHODS, key=lambda m: (means[m]["exact_match"], -means[m]["nll"])),
    "nll": min(METHODS, key=lambda m: means[m]["nll"]),
    "final_val_loss": min(METHODS, key=lambda m: means[m]["final_val_loss"]),
    "smoothest_steps": min(METHODS, key=lambda m: means[m]["loss_step_mean_abs_diff"]),
    "smoothest_val": min(METHODS, key=lambda m: means[m]["val_mean_abs_diff"]),
    "means": means,
  }


def markdown(data: dict) -> str:
  cfg, meta = data["config"], data["meta"]
  m = meta["machine"]
  out = [
    "# Checkpoint soups in a real fine-tune of SmolLM2-135M-Instruct (issue 21 item 4)",
    "",
    f"Base `{meta['base']}`{' (**quick smoke run**)' if meta['quick'] else ''}. Machine: "
    f"{m.get('cpu')} ({m.get('cores')} cores), jax {m.get('jax')} {m.get('backend')}; load "
    f"average at start {meta['load_start']}, at end {meta['load_end']}; {meta['seconds']:.0f} s "
    "wall.",
    "",
    f"Full fine-tune (all linear layers and norms, tied embedding frozen; AdamW peak lr "
    f"{cfg['lr']}, warm-up {cfg['warmup']} + cosine, clip 1.0), batch {cfg['batch']}, seq "
    f"{cfg['seq']}, {cfg['steps']} steps, the same start, seed and batch stream for every "
    f"method. Merge every {cfg['every']} steps (and at the last): average = mean of the last "
    f"{cfg['window']} checkpoints (one every {max(1, cfg['every'] // cfg['window'])} steps); "
    f"svd = `svd_soup(start, [params, best], rank {cfg['rank']})`, best by the validation loss; "
    "monosoup = `monosoup(start, params)` (freevariance). Validation loss: "
    f"{cfg['n_val']} training-distribution examples off the training stream, at every check "
    "and after the last merge. Held-out: "
    f"{cfg['n_eval']} prompts, teacher-forced greedy exact match (%) and NLL per answer token. "
    "Smoothness: mean |Δ| and std of Δ between consecutive training steps (paired: same "
    "batches) and between consecutive validation evaluations (lower = smoother); a merge's "
    "jump shows in the next check, the last merge's in the final evaluation (0 for none).",
    "",
    "| task | method | mean abs Δloss (steps) | std Δloss | mean abs Δval (evals) | std Δval | "
    "final train loss | final val loss | held-out EM % | held-out NLL | train s (merging) |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for t in cfg["tasks"]:
    b = data["base"][t]
    out.append(f"| {t} | base | | | | | | {b['val_loss']:.4f} | {b['exact_match']:.1f} | "
               f"{b['nll']:.4f} | |")
    for r in (r for r in data["rows"] if r["task"] == t):
      out.append(
        f"| {t} | {r['method']} | {r['loss_step_mean_abs_diff']:.4f} | "
        f"{r['loss_step_diff_std']:.4f} | {r['val_mean_abs_diff']:.4f} | {r['val_diff_std']:.4f} "
        f"| {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} | {r['exact_match']:.1f} | "
        f"{r['nll']:.4f} | {r['train_seconds']:.0f} ({r.get('merge_seconds', 0):.0f}) |")
  w = data["winner"]
  out += ["", "Mean over tasks:", "",
          "| method | mean abs Δloss | mean abs Δval | final val loss | held-out EM % | NLL |",
          "|---|---:|---:|---:|---:|---:|"]
  for mth, v in w["means"].items():
    out.append(f"| {mth} | {v['loss_step_mean_abs_diff']:.4f} | {v['val_mean_abs_diff']:.4f} | "
               f"{v['final_val_loss']:.4f} | {v['exact_match']:.1f} | {v['nll']:.4f} |")
  out += ["",
          f"Best held-out EM: **{w['exact_match']}**; best NLL: **{w['nll']}**; best final "
          f"validation loss: **{w['final_val_loss']}**; smoothest training loss: "
          f"**{w['smoothest_steps']}**; smoothest validation loss: **{w['smoothest_val']}**."]
  return "\n".join(out) + "\n"


def plot(data: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = data["config"]["tasks"]
  fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for i, r in enumerate(r for r in data["rows"] if r["task"] == task):
      c = f"C{i}"
      ax.plot(np.arange(1, len(r["losses"]) + 1), r["losses"], lw=0.7, alpha=0.6, color=c)
      if r["val"]:  # the checks (before a merge at that step), then the value after the last merge
        s, v = zip(*r["val"], (len(r["losses"]) + 0.5, r["final_val_loss"]))
        ax.plot(s, v, "o-", ms=3, lw=1.4, color=c,
                label=f"{r['method']} (EM {r['exact_match']:.0f}%, val {r['final_val_loss']:.3f})")
      for s in r["merge_steps"]:
        ax.axvline(s, color="grey", lw=0.4, ls=":")
    ax.set_title(f"{task}: training loss (thin), validation loss (dots)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
  ap.add_argument("--base", default=None, help="base HF directory (default: the real base)")
  ap.add_argument("--tasks", nargs="+", default=None, help=f"from {sorted(ALL_TASKS)}")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--every", type=int, default=None)
  ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (lora-json: 48)")
  ap.add_argument("--out-dir", default=str(RESULTS))
  ap.add_argument("--render", action="store_true", help="re-render md/png from the JSON")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out_dir) / "soups_real"
  if args.render:
    data = json.loads(out.with_suffix(".json").read_text())
    out.with_suffix(".md").write_text(markdown(data))
    plot(data, out.with_suffix(".png"))
    return
  cfg = BenchConfig.quick() if args.quick else BenchConfig()
  cfg = dataclasses.replace(cfg, **{k: v for k, v in (
    ("tasks", tuple(args.tasks or ())), ("steps", args.steps), ("every", args.every),
    ("seq", args.seq)) if v})
  if cfg.steps % cfg.every:
    raise SystemExit("--steps must be a multiple of --every (the last step merges)")
  from bench.common import machine

  load_start = [round(x, 2) for x in os.getloadavg()]
  t0 = time.perf_counter()
  data = run(cfg, args.base)
  data["meta"] = {"machine": machine.describe(), "base": args.base or "real SmolLM2-135M-Instruct"
                  " (import_real_base)", "quick": args.quick, "seconds": time.perf_counter() - t0,
                  "load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()],
                  "jax_devices": str(jax.devices())}
  out.parent.mkdir(parents=True, exist_ok=True)
  report.write_json(out.with_suffix(".json"), data, indent=1)
  out.with_suffix(".md").write_text(markdown(data))
  plot(data, out.with_suffix(".png"))
  print(f"{data['meta']['seconds']:.0f} s → {out}.{{json,md,png}}", flush=True)


if __name__ == "__main__":
  main()
