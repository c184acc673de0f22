"""The `bitdelta` command line: compress | apply | inspect | distill | zoo | eval | merge | serve | demo.

Every command that fails on bad input prints ``error: <what and where>`` and exits with 2,
leaving no partial output behind.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_BAD_INPUT = 2


def _policy(args):
  from bitdelta_jax.delta.compress import CompressPolicy

  return CompressPolicy(granularity=args.scale.replace("per-", ""), group_k=args.group_k,
                        dense=args.dense)


def cmd_compress(args) -> int:
  from bitdelta_jax.delta.report import Report
  from bitdelta_jax.delta.stream import compress_checkpoints

  m = compress_checkpoints(args.base, args.finetuned, args.out, _policy(args),
                           overwrite=args.overwrite, progress=not args.quiet)
  print(Report.from_dict(m["report"]).format(max_rows=None if args.verbose else 30))
  print(f"wrote {args.out}")
  return 0


def cmd_apply(args) -> int:
  from bitdelta_jax.delta.stream import apply_checkpoint

  out = apply_checkpoint(args.base, args.delta, args.out, overwrite=args.overwrite,
                         progress=not args.quiet)
  print(f"wrote {out}")
  return 0


def cmd_inspect(args) -> int:
  from bitdelta_jax.delta.report import Report
  from bitdelta_jax.delta.store import read_manifest

  m = read_manifest(args.delta)
  if args.json:
    print(json.dumps(m, indent=1))
    return 0
  kinds: dict[str, int] = {}
  for t in m["tensors"].values():
    kinds[t["kind"]] = kinds.get(t["kind"], 0) + 1
  print(f"delta:          {args.delta}")
  print(f"format:         {m['format']} v{m['format_version']} ({m['layout']})")
  print(f"created:        {m['created']}")
  print(f"base digest:    {m['base']['digest'][:16]}… ({len(m['base']['tensors'])} tensors)")
  print(f"policy:         {json.dumps(m['policy'])}")
  print(f"scales:         {json.dumps(m['scales'])}")
  print(f"tensors:        {kinds}")
  print(Report.from_dict(m["report"]).format(max_rows=None if args.verbose else 30))
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="bitdelta", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="command", required=True)

  c = sub.add_parser("compress", help="compress an HF fine-tune against its base into 1-bit deltas")
  c.add_argument("--base", required=True, help="HF base directory")
  c.add_argument("--finetuned", required=True, help="HF fine-tuned directory")
  c.add_argument("--out", required=True, help="delta directory to create")
  c.add_argument("--scale", choices=("per-matrix", "per-column"), default="per-matrix")
  c.add_argument("--group-k", type=int, default=128, help="rows per bit-plane group (x8)")
  c.add_argument("--dense", choices=("value", "delta"), default="value",
                 help="store changed non-linear tensors as the fine-tuned value or a dense delta")
  c.add_argument("--overwrite", action="store_true")
  c.add_argument("--quiet", action="store_true")
  c.add_argument("--verbose", action="store_true", help="report every tensor")
  c.set_defaults(fn=cmd_compress)

  a = sub.add_parser("apply", help="write base + delta as an HF checkpoint")
  a.add_argument("--base", required=True)
  a.add_argument("--delta", required=True)
  a.add_argument("--out", required=True)
  a.add_argument("--overwrite", action="store_true")
  a.add_argument("--quiet", action="store_true")
  a.set_defaults(fn=cmd_apply)

  i = sub.add_parser("inspect", help="print a delta's manifest and report")
  i.add_argument("delta")
  i.add_argument("--json", action="store_true")
  i.add_argument("--verbose", action="store_true")
  i.set_defaults(fn=cmd_inspect)

  for register in _extra_commands():
    register(sub)
  return p


def _extra_commands():
  """Subcommands contributed by other modules (merge, zoo, serve, ...), when present."""
  from bitdelta_jax.distill import add_distill_parser
  from bitdelta_jax.merge.cli import add_merge_parser
  from bitdelta_jax.zoo.cli import add_zoo_parsers
  from serving.cli import add_demo_parser, add_serve_parsers

  return [add_merge_parser, add_distill_parser, add_zoo_parsers, add_serve_parsers,
          add_demo_parser]


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    fn = getattr(args, "fn", None) or args.func
    return fn(args)
  except (ValueError, OSError) as e:  # DeltaMismatchError, DeltaStoreError, CheckpointError too
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
  sys.exit(main())
