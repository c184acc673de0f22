"""The `bitdelta` command line: compress | apply | inspect | distill | zoo | eval | merge | kmerge | serve | demo.

Every command that fails on bad input prints ``error: <what and where>`` and exits with 2,
leaving no partial output behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

EXIT_BAD_INPUT = 2


def _policy(args):
  from bitdelta_jax.delta.compress import CompressPolicy

  mode = getattr(args, "mode", "bitdelta")
  extra = {}
  if mode == "bitdelta" and (args.budget is not None or args.rank):
    raise ValueError("--rank and --budget are for --mode dqrelo, svd or delta-come")
  if mode != "bitdelta":
    extra = dict(mode=mode, rank=args.rank or 0, budget=args.budget, iters=args.iters,
                 factor_width=0 if args.factor_bits == "mixed" else int(args.factor_bits),
                 factor_dtype=args.factor_dtype)
  return CompressPolicy(granularity=args.scale.replace("per-", ""), group_k=args.group_k,
                        dense=args.dense, **extra)


def _fraction(text: str) -> float:
  """``1/15`` or ``0.0667`` → a fraction in (0, 1]."""
  try:
    num, _, den = text.partition("/")
    value = float(num) / float(den) if den else float(num)
  except (ValueError, ZeroDivisionError):
    raise argparse.ArgumentTypeError(
      f"expected a fraction like 1/15 or 0.0667, got {text!r}") from None
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"the budget must be in (0, 1], got {text!r}")
  return value


def _print_pair_messages(m: dict) -> None:
  for w in m.get("warnings", []):
    print(f"warning: {w}", file=sys.stderr)
  for n in m.get("notes", []):
    print(f"note: {n}", file=sys.stderr)


def cmd_compress(args) -> int:
  from bitdelta_jax.delta.report import Report, describe_embeddings
  from bitdelta_jax.delta.stream import compress_checkpoints  # every mode

  m = compress_checkpoints(args.base, args.finetuned, args.out, _policy(args),
                           overwrite=args.overwrite, progress=not args.quiet,
                           embeddings=args.embeddings, base_source=args.base_source)
  _print_pair_messages(m)
  if not args.quiet:
    print(Report.from_dict(m["report"]).format(max_rows=None if args.verbose else 30))
    for line in describe_embeddings(m):
      print(line)
    if m.get("mode", "bitdelta") != "bitdelta":
      print(f"mode {m['mode']}: serving needs lora_rank >= {m['lora_rank']} "
            f"(the server reads it from the manifest)")
    print(f"wrote {args.out}")
  return 0


def cmd_apply(args) -> int:
  from bitdelta_jax.delta.stream import apply_checkpoint
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base
  from bitdelta_jax.hf.lineage import establish

  if args.base_source:
    establish(resolve_base(args.base), args.base_source)
  out = apply_checkpoint(args.base, args.delta, args.out, overwrite=args.overwrite,
                         progress=not args.quiet)
  if not args.quiet:
    print(f"wrote {out}")
  return 0


def cmd_inspect(args) -> int:
  from bitdelta_jax.delta.report import (
    Report,
    describe_embeddings,
    describe_policy,
    describe_scales,
  )
  from bitdelta_jax.delta.store import read_manifest

  m = read_manifest(args.delta)
  if args.json:
    print(json.dumps(m, indent=1))
    return 0
  kinds: dict[str, int] = {}
  for t in m["tensors"].values():
    kinds[t["kind"]] = kinds.get(t["kind"], 0) + 1
  src = m.get("source") or {}
  print(f"delta:          {args.delta}")
  print(f"format:         {m['format']} v{m['format_version']} ({m['layout']})")
  print(f"created:        {m['created']}")
  if src.get("base") or src.get("finetuned"):
    print(f"made from:      {src.get('finetuned', '?')} against base {src.get('base', '?')}")
  print(f"base digest:    {m['base']['digest'][:16]}… ({len(m['base']['tensors'])} tensors)")
  print(f"policy:         "
        f"{describe_policy(m['policy'], m.get('embeddings', 'exact'), names=list(m['tensors']))}")
  print(f"scales:         {describe_scales(m['scales'])}")
  for line in describe_embeddings(m):
    print(f"embeddings:     {line}")
  print("tensors:        " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())))
  for w in m.get("warnings", []):
    print(f"warning:        {w}")
  for n in m.get("notes", []):
    print(f"note:           {n}")
  print(Report.from_dict(m["report"]).format(max_rows=None if args.verbose else 30))
  if args.verify:  # reads every array: a truncated or corrupt one is an error (exit 2)
    from bitdelta_jax.delta.store import load_delta

    load_delta(args.delta, verify=True)
    print(f"verified:       every array of {len(m['tensors'])} tensors read, crc32s match")
  else:
    print("verified:       no (arrays not read; --verify checks every crc32)")
  return 0


def cmd_quantize(args) -> int:
  from pathlib import Path

  from bitdelta_jax.hf.gguf_export import write_gguf

  base, out = Path(args.base), Path(args.out)
  if not base.is_dir():
    raise ValueError(f"--base {base}: not a directory")
  if out.exists() and not args.force:
    raise ValueError(f"--out {out} exists; pass --force to replace it")
  path = write_gguf(base, out, dtype=args.format, overwrite=args.force)
  if not args.quiet:
    print(f"wrote {path} ({args.format}, {path.stat().st_size / 1e6:.1f} MB)")
  return 0


def build_parser() -> argparse.ArgumentParser:
  from bitdelta_jax import __version__

  p = argparse.ArgumentParser(prog="bitdelta", description=__doc__.splitlines()[0])
  p.add_argument("--version", action="version", version=f"bitdelta-jax {__version__}",
                 help="print the version and exit")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

  c = sub.add_parser("compress", help="compress an HF fine-tune against its base into 1-bit deltas",
                     description="Compress an HF fine-tune against its base into a delta directory "
                     "(1-bit signs and scales of the linear layers, other changed tensors exactly).")
  c.add_argument("--base", required=True, metavar="DIR",
                 help="the base: an HF checkpoint directory or a GGUF file (Q8_0 / Q4_0 / Q4_1)")
  c.add_argument("--base-source", metavar="DIR",
                 help="with a GGUF --base: the unquantized HF checkpoint it was quantized from "
                      "(checked once: every tensor within its format's rounding). Δ is then taken against it: the delta stores no rounding and "
                      "serves over it and every GGUF quantized from it (bitdelta quantize "
                      "records its source itself)")
  c.add_argument("--finetuned", required=True, metavar="DIR",
                 help="HF fine-tuned checkpoint directory (same architecture as --base)")
  c.add_argument("--out", required=True, metavar="DIR",
                 help="delta directory to create (an existing one is replaced only with "
                 "--overwrite, and only if it is a delta)")
  c.add_argument("--scale", choices=("per-matrix", "per-column"), default="per-matrix",
                 help="one scale α per matrix (the paper's default) or per output column "
                 "(default: %(default)s)")
  c.add_argument("--group-k", type=int, default=128, metavar="K",
                 help="rows per bit-plane group, a multiple of 8 (default: %(default)s)")
  c.add_argument("--dense", choices=("value", "delta"), default="value",
                 help="store changed non-linear tensors as the fine-tuned value or a dense delta "
                 "(default: %(default)s)")
  c.add_argument("--mode", choices=("bitdelta", "dqrelo", "svd", "delta-come"),
                 default="bitdelta",
                 help="how linear weights are compressed: bitdelta = α·sign(Δ); dqrelo = 1-bit "
                 "plus a compensated low-rank residual; svd = truncated SVD; delta-come = "
                 "singular vectors at mixed precision (needs --budget). Modes other than "
                 "bitdelta are served from a model's LoRA slots (default: %(default)s)")
  c.add_argument("--rank", type=int, default=None, metavar="R",
                 help="rank of the low-rank part for dqrelo/svd (ignored with --budget)")
  c.add_argument("--budget", type=_fraction, default=None, metavar="FRACTION",
                 help="bytes per linear weight as a fraction of its bf16 bytes, e.g. 1/15; sets "
                 "the rank (and for mixed factor bits, the bits per singular vector)")
  c.add_argument("--factor-bits", choices=("16", "8", "4", "2", "mixed"), default="16",
                 help="storage of the low-rank factors: 16-bit floats, a uniform code per "
                 "singular vector, or mixed widths chosen within --budget (default: %(default)s)")
  c.add_argument("--factor-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                 help="float type of 16-bit factors (default: %(default)s)")
  c.add_argument("--iters", type=int, default=2, metavar="N",
                 help="dqrelo: alternations between the low-rank part and the signs/α "
                 "(default: %(default)s)")
  c.add_argument("--embeddings", choices=("auto", "exact", "1bit"), default="auto",
                 help="changed embeddings / LM head: 1-bit with one scale per token (1/16 of "
                      "their bf16 bytes; --mode bitdelta only), kept exactly, or auto: 1-bit "
                      "when that reconstructs the fine-tuned matrix within 1%% "
                      "(|W_ft - W_1bit| / |W_base|), else exact (default: %(default)s)")
  c.add_argument("--overwrite", action="store_true", help="replace --out if it is a delta")
  c.add_argument("--quiet", action="store_true",
                 help="print nothing but warnings and errors (no progress, no report)")
  c.add_argument("--verbose", action="store_true", help="report every tensor")
  c.set_defaults(fn=cmd_compress)

  a = sub.add_parser("apply", help="write base + delta as an HF checkpoint",
                     description="Materialise W_base + α·sign(Δ) (and the kept tensors) as an HF "
                     "checkpoint directory that transformers loads.")
  a.add_argument("--base", required=True, metavar="DIR",
                 help="HF base checkpoint directory the delta was made for")
  a.add_argument("--base-source", metavar="DIR",
                 help="with a GGUF --base: the unquantized HF checkpoint it was quantized from "
                      "(checked once: every tensor within its format's rounding); a delta compressed against it then applies over the file")
  a.add_argument("--delta", required=True, metavar="DIR", help="delta directory (from compress)")
  a.add_argument("--out", required=True, metavar="DIR",
                 help="checkpoint directory to create (an existing one is replaced only with "
                 "--overwrite, and only if bitdelta wrote it)")
  a.add_argument("--overwrite", action="store_true",
                 help="replace --out if it is a checkpoint bitdelta wrote")
  a.add_argument("--quiet", action="store_true", help="print nothing but errors")
  a.set_defaults(fn=cmd_apply)

  i = sub.add_parser("inspect", help="print a delta's manifest and report",
                     description="Print a delta's policy, scales and size report.")
  i.add_argument("delta", metavar="DELTA_DIR", help="delta directory")
  i.add_argument("--json", action="store_true", help="print the raw manifest as JSON")
  i.add_argument("--verbose", action="store_true", help="report every tensor")
  i.add_argument("--verify", action="store_true",
                 help="read every array and check its crc32 (a truncated or corrupt delta is "
                      "an error, exit 2)")
  i.set_defaults(fn=cmd_inspect)

  q = sub.add_parser("quantize", help="write an HF Llama checkpoint as a GGUF (ggml blocks or float)",
                     description="Write an HF Llama checkpoint as a llama.cpp GGUF: every 2-D weight "
                     "in ggml's Q8_0 / Q4_0 / Q4_1 blocks (llama.cpp's reference quantizer, the same "
                     "bytes) or as f32 / bf16; norms stay f32. Streams tensor by tensor, written "
                     "through a temporary file renamed into place.")
  q.add_argument("--base", required=True, metavar="DIR", help="HF checkpoint directory (Llama)")
  q.add_argument("--format", required=True, choices=("q8_0", "q4_0", "q4_1", "f32", "bf16"),
                 help="type of the 2-D weights (quantized formats need input dimensions that are "
                 "multiples of 32)")
  q.add_argument("--out", required=True, metavar="FILE.gguf", help="GGUF file to write")
  q.add_argument("--force", action="store_true", help="replace --out if it exists")
  q.add_argument("--quiet", action="store_true", help="print nothing but errors")
  q.set_defaults(fn=cmd_quantize)

  for register in _extra_commands():
    register(sub)
  return p


COMMANDS_GROUP = "bitdelta.commands"


def _extra_commands():
  """Subcommands of the library's other modules (merge, K-Merge, distill, zoo), then those that
  installed packages contribute through the ``bitdelta.commands`` entry points (the server's
  ``serve``, ``demo`` and ``bench``: `serving` sits above the library, so the library names
  them only through the installed metadata, pyproject.toml)."""
  from importlib.metadata import entry_points

  from bitdelta_jax.distill import add_distill_parser
  from bitdelta_jax.kmerge_cli import add_kmerge_parser
  from bitdelta_jax.merge.cli import add_merge_parser
  from bitdelta_jax.zoo.cli import add_zoo_parsers

  plugins = sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name)
  return [add_merge_parser, add_kmerge_parser, add_distill_parser, add_zoo_parsers,
          *(ep.load() for ep in plugins)]


class _QuietJaxBackendWarnings(logging.Filter):
  """Drops jax's "a TPU may be present ... falling back to cpu" start-up warning: a CPU machine
  that merely has a Google PCI device is not a TPU host, and a user cannot act on it."""

  def filter(self, record: logging.LogRecord) -> bool:
    msg = record.getMessage()  # "... backend 'tpu': ... libtpu.so" says tpu in lower case
    return not ("tpu" in msg.lower() and ("may be present" in msg
                                          or "Unable to initialize backend" in msg))


def _quiet_backend_warnings() -> None:
  for name in ("jax._src.xla_bridge", "jax"):
    log = logging.getLogger(name)
    if not any(isinstance(f, _QuietJaxBackendWarnings) for f in log.filters):
      log.addFilter(_QuietJaxBackendWarnings())


class _Interrupts:
  """Counts Ctrl-C while a command runs. A KeyboardInterrupt raised inside a library call
  can come out as another exception (numpy turns one inside an array conversion into
  "setting an array element with a sequence."), which must still read as ``interrupted``."""

  def __init__(self):
    self.count = 0

  def __call__(self, signum, frame):
    self.count += 1
    raise KeyboardInterrupt

  def install(self):
    """Takes over SIGINT from Python's default handler; returns a function that undoes it."""
    if threading.current_thread() is not threading.main_thread() or \
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
      return lambda: None
    signal.signal(signal.SIGINT, self)
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


def run_command(fn, args) -> int:
  """Runs one subcommand: bad input is ``error: ...`` and exit 2, Ctrl-C ``interrupted`` and
  exit 130 (whatever exception it surfaced as)."""
  interrupts = _Interrupts()
  restore = interrupts.install()
  try:
    from pallas_kernels import settings

    settings.check_all()  # a BITDELTA_* variable that does not parse: exit 2, naming it
    rc = fn(args)
    sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
    return rc
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  except (ValueError, OSError) as e:  # DeltaMismatchError, DeltaStoreError, OutputError too
    if interrupts.count:
      print("interrupted", file=sys.stderr)
      return 130
    if isinstance(e, BrokenPipeError):
      return _closed_pipe()
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT
  finally:
    restore()


def main(argv: list[str] | None = None) -> int:
  _quiet_backend_warnings()
  args = build_parser().parse_args(argv)
  return run_command(getattr(args, "fn", None) or args.func, args)


def _closed_pipe() -> int:
  """The reader of our stdout went away (``bitdelta inspect X | head -1``): end quietly.

  stdout is pointed at /dev/null so the interpreter's final flush does not fail again.
  """
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
  except (OSError, ValueError):
    pass
  return 0


if __name__ == "__main__":
  sys.exit(main())
