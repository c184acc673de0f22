"""``bitdelta kmerge build``: a K-Merge pool (`bitdelta_jax.kmerge`) from PEFT LoRA adapters.

    bitdelta kmerge build --base BASE --adapter math=A1 --adapter upper=A2 --adapter sort=A3 \\
        --k 2 --budget-mb 4 --out pool [--gate-threshold 0.9 --val math=m.jsonl ...]

Adapters are added in the order given; each line printed says what the pool did with it (a
new slot, merged into a member, routed to one by the gate's fallback, or an eviction). With
``--gate-threshold F`` a merge is kept only when the merged adapter reaches F × each task's own
adapter's validation exact match (`bitdelta_jax.kmerge_gate`). The pool is written with
`KMergePool.save`, and ``bitdelta serve --kmerge-pool DIR`` serves it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")  # as serving.config (model names)


def _pairs(items: list[str], flag: str, what: str) -> dict[str, str]:
  out: dict[str, str] = {}
  for it in items:
    task, sep, path = it.partition("=")
    if not sep or not task or not path:
      raise ValueError(f"{flag}: expected TASK={what}, got {it!r}")
    if not NAME_RE.match(task) or ".." in task:
      raise ValueError(
        f"{flag}: task name {task!r} is not a valid model name (letters, digits, '_', '.', "
        "'-'; it becomes a model name when the pool is served)"
      )
    if task in out:
      raise ValueError(f"{flag}: task {task!r} is given twice")
    out[task] = path
  return out


def add_kmerge_parser(subparsers) -> argparse.ArgumentParser:
  p = subparsers.add_parser(
    "kmerge",
    help="build a K-Merge pool of LoRA adapters (served with serve --kmerge-pool)",
    description="K-Merge: keep at most K LoRA adapters within a byte budget, merging each new "
    "task's adapter into its most similar member when the pool is full (docs/MERGING.md).",
  )
  sub = p.add_subparsers(dest="kmerge_command", required=True, metavar="ACTION")
  b = sub.add_parser(
    "build",
    help="add PEFT adapters to a new pool, in order, and write it",
    description="Adds PEFT LoRA adapters to a new K-Merge pool in the order given and writes "
    "it (pool.json + one PEFT adapter per member); `bitdelta serve --kmerge-pool DIR` serves it.",
  )
  b.add_argument("--base", required=True, metavar="DIR", help="the HF base the adapters tune")
  b.add_argument(
    "--adapter",
    action="append",
    required=True,
    metavar="TASK=PEFT_DIR",
    help="a task's PEFT LoRA adapter (repeatable; added in this order)",
  )
  b.add_argument("--k", type=int, required=True, help="most members (adapters) in the pool")
  b.add_argument(
    "--budget-mb", type=float, required=True, metavar="MB", help="most bytes of all members, MiB"
  )
  b.add_argument("--out", required=True, metavar="POOL_DIR", help="pool directory to write")
  b.add_argument(
    "--merge",
    choices=("opcm", "average"),
    default="opcm",
    help="how an adapter merges into a member (default: %(default)s)",
  )
  b.add_argument("--alpha", type=float, default=0.5, help="OPCM split threshold (default 0.5)")
  b.add_argument(
    "--plusplus",
    action="store_true",
    help="K-Merge++: merge into the closest member whenever its similarity reaches "
    "--similarity-threshold, even with a free slot",
  )
  b.add_argument(
    "--similarity-threshold",
    type=float,
    default=0.5,
    metavar="T",
    help="K-Merge++ only: mean cosine similarity of ΔW above which to merge (default 0.5)",
  )
  b.add_argument(
    "--gate-threshold",
    type=float,
    metavar="F",
    help="keep a merge only if the merged adapter reaches F x each served task's own adapter's "
    "exact match on its --val set (greedy, teacher-forced, chat template); needs --val for "
    "every task",
  )
  b.add_argument(
    "--val",
    action="append",
    default=[],
    metavar="TASK=FILE.jsonl",
    help='a task\'s validation set: lines {"prompt": ..., "answer": ...} (repeatable)',
  )
  b.add_argument(
    "--system", metavar="TEXT", help="a system line before each validation prompt (chat template)"
  )
  b.add_argument(
    "--fallback",
    choices=("route_closest", "evict_least_used"),
    default="route_closest",
    help="when the gate refuses a merge: route the task to the closest member unchanged, or "
    "evict the least-used member (default: %(default)s)",
  )
  b.set_defaults(fn=cmd_build)
  return p


def _check_fits_base(base_dir, task: str, adapter) -> None:
  """Every adapted module is a linear weight of the base with ΔW's shape."""
  from bitdelta_jax.hf.checkpoints import open_checkpoint

  with open_checkpoint(base_dir) as r:
    names = set(r.names())
    for module, m in sorted(adapter.modules.items()):
      name = f"{module}.weight"
      if name not in names:
        raise ValueError(f"adapter of {task!r}: module {module!r} is not in the base {base_dir}")
      shape = tuple(r.info(name).shape)
      d = (m.B.shape[0], m.A.shape[1])
      if m.fan_in_fan_out:
        d = d[::-1]
      if shape != d:
        raise ValueError(
          f"adapter of {task!r}: module {module!r} changes a {list(d)} weight, but the base's "
          f"is {list(shape)} (an adapter for another base?)"
        )


def cmd_build(args) -> int:
  from bitdelta_jax.kmerge import POOL_FILE, KMergePool, PoolConfig
  from bitdelta_jax.merge.lora import load_adapter

  adapters = _pairs(args.adapter, "--adapter", "PEFT_DIR")
  vals = _pairs(args.val, "--val", "FILE.jsonl")
  if args.gate_threshold is None and vals:
    raise ValueError("--val is only used by the gate: give --gate-threshold too")
  if args.gate_threshold is not None:
    missing = [t for t in adapters if t not in vals]
    if missing:
      raise ValueError(f"--gate-threshold needs a --val set for every task; missing: {missing}")
    extra = [t for t in vals if t not in adapters]
    if extra:
      raise ValueError(f"--val for task(s) {extra} that have no --adapter")
    if args.gate_threshold < 0:
      raise ValueError(f"--gate-threshold must be >= 0, got {args.gate_threshold}")
  if args.budget_mb <= 0:
    raise ValueError(f"--budget-mb must be > 0, got {args.budget_mb}")
  out = Path(args.out)
  if out.exists() and not (out / POOL_FILE).is_file():
    raise ValueError(f"--out: {out} exists and is not a K-Merge pool; refusing to replace it")
  base = Path(args.base)
  if not (base / "config.json").is_file():
    raise ValueError(f"--base: {base} is not an HF model directory (no config.json)")
  loaded = {}
  for task, path in adapters.items():
    try:
      loaded[task] = load_adapter(path)
    except (NotImplementedError, KeyError) as e:
      raise ValueError(f"--adapter {task}={path}: not a usable PEFT LoRA adapter: {e}") from None
    _check_fits_base(base, task, loaded[task])
  gate = None
  if args.gate_threshold is not None:
    from bitdelta_jax.kmerge_gate import validation_gate

    gate = validation_gate(base, loaded, vals, args.gate_threshold, system=args.system)
    for t in gate.unprotected:
      print(
        f"warning: {t}'s own adapter scores 0 on its --val set; the gate cannot protect it",
        file=sys.stderr,
      )
  cfg = PoolConfig(
    k=args.k,
    budget_bytes=int(args.budget_mb * (1 << 20)),
    merge=args.merge,
    alpha=args.alpha,
    plusplus=args.plusplus,
    similarity_threshold=args.similarity_threshold,
    gate_threshold=args.gate_threshold or 0.0,
    fallback=args.fallback,
  )
  pool = KMergePool(cfg, gate=gate)
  for task, adapter in loaded.items():
    r = pool.add(task, adapter)
    line = f"{task}: {r.action} {r.member}"
    if r.similarity is not None:
      line += f" (similarity {r.similarity:.3f})"
    if r.evicted:
      line += f", evicted {r.evicted}"
    if r.scores:
      line += "; gate " + " ".join(f"{t} {s:.2f}" for t, s in r.scores.items())
    print(line)
  print("routing:")
  for task in pool.tasks():
    print(f"  {task} -> {pool.route(task)}")
  for m in pool.members.values():
    print(f"member {m.id}: tasks {', '.join(m.tasks)}; rank {m.adapter.rank}, {m.adapter.nbytes} B")
  print(f"pool: {len(pool.members)}/{cfg.k} members, {pool.nbytes} of {cfg.budget_bytes} bytes")
  pool.save(out)
  print(f"wrote {out}")
  return 0
