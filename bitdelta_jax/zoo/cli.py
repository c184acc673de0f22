"""`bitdelta zoo build` and `bitdelta eval`."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path


def _build(args) -> int:
  from bitdelta_jax.zoo import SHIPPED, cache_dir
  from bitdelta_jax.zoo.recipe import ZooConfig, build

  cfg = ZooConfig.micro() if args.micro else ZooConfig()
  out = SHIPPED if args.ship else Path(args.out)
  cache = Path(args.cache) if args.cache else cache_dir()
  with tempfile.TemporaryDirectory(prefix="bitdelta-zoo-", dir=out.parent) as tmp:
    fam = build(Path(tmp) / "family", cache, cfg, progress=not args.quiet)
    if out.exists():
      if not (args.overwrite or args.ship):
        raise FileExistsError(f"{out}: output directory already exists (use --overwrite)")
      shutil.rmtree(out)
    shutil.move(str(Path(tmp) / "family"), out)
  print(json.dumps({n: {k: v[k] for k in ("exact_match_finetune", "delta_norm_ratio")}
                    for n, v in fam["variants"].items()}, indent=1))
  print(f"built the family in {fam['seconds']:.0f}s → {out}")
  return 0


def _eval(args) -> int:
  from bitdelta_jax.zoo.fidelity import run_eval

  run_eval(Path(args.out), variants=args.variants, n_eval=args.n_eval, progress=not args.quiet)
  print(f"wrote {args.out}/fidelity.{{json,md,png}}")
  return 0


def add_zoo_parsers(sub) -> None:
  z = sub.add_parser("zoo", help="the built-in model family")
  zs = z.add_subparsers(dest="zoo_command", required=True)
  b = zs.add_parser("build", help="pre-train the base and fine-tune + compress the variants")
  b.add_argument("--micro", action="store_true", help="seconds-long recipe for tests")
  b.add_argument("--out", default="nano-family", help="output directory")
  b.add_argument("--ship", action="store_true", help="write into the package's shipped/ folder")
  b.add_argument("--cache", help="where full fine-tunes are cached (default: user cache)")
  b.add_argument("--overwrite", action="store_true")
  b.add_argument("--quiet", action="store_true")
  b.set_defaults(fn=_build)

  e = sub.add_parser("eval", help="fidelity of BitDelta on the built-in family")
  e.add_argument("--out", default="bench/results")
  e.add_argument("--variants", nargs="*")
  e.add_argument("--n-eval", type=int, default=256)
  e.add_argument("--quiet", action="store_true")
  e.set_defaults(fn=_eval)
