"""``bitdelta merge <method>``: merge HF safetensors checkpoints tensor by tensor.

Only one tensor (times the number of models) is in memory at a time; the output keeps the base's
shard layout and index, takes config.json / tokenizer files from the base (those every merged
model changed alike, e.g. a chat template, from the models), and is written
through `bitdelta_jax.outputs.OutputDir` (kind "checkpoint"): into a temporary sibling directory
swapped into place, and never over anything but a checkpoint that bitdelta wrote. OPCM needs the global norm of its merged
update, so it runs two passes: the unnormalised update S goes to a float32 scratch file first.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bitdelta_jax.hf.checkpoints import open_checkpoint
from bitdelta_jax.hf.safetensors_io import (
  INDEX_FILE,
  CheckpointError,
  CheckpointReader,
  SafetensorsWriter,
)
from bitdelta_jax.merge.baselines import (
  check_linear_weights,
  densities,
  linear_tensor,
  per_model,
  task_arithmetic_family_tensor,
  tensor_key,
)
from bitdelta_jax.merge.monosoup import monosoup_tensor
from bitdelta_jax.merge.opcm import default_projects, project_task_vector
from bitdelta_jax.merge.soups import svd_soup_tensor
from bitdelta_jax.outputs import MARKER, OutputDir

METHODS = (
  "linear",
  "task-arithmetic",
  "ties",
  "dare-linear",
  "dare-ties",
  "monosoup",
  "svd-soup",
  "opcm",
)
# mergekit 0.1.5 registry.py: (sparsify, consensus, default normalize, default rescale)
_GTA = {
  "task-arithmetic": (None, None, False, False),
  "ties": ("magnitude", "sum", True, False),
  "dare-linear": ("random", None, False, True),
  "dare-ties": ("random", "sum", False, True),
}
# The options each method reads; any other option given is refused rather than ignored.
_OPTIONS = {
  "linear": ("weights", "normalize"),
  "task-arithmetic": ("weights", "lambda_", "normalize"),
  "ties": ("weights", "density", "lambda_", "normalize", "rescale", "consensus"),
  "dare-linear": ("weights", "density", "lambda_", "normalize", "rescale", "rescale_mode", "seed"),
  "dare-ties": (
    "weights",
    "density",
    "lambda_",
    "normalize",
    "rescale",
    "rescale_mode",
    "seed",
    "consensus",
  ),
  "monosoup": ("mode", "energy"),
  "svd-soup": ("rank",),
  "opcm": ("alpha",),
}
_DEFAULTS = {
  "lambda_": 1.0,
  "consensus": "sum",
  "rescale_mode": "l1",
  "seed": 0,
  "mode": "freevariance",
  "energy": 0.8,
  "alpha": 0.5,
}
_FLAGS = {"lambda_": "--lambda", "rescale_mode": "--rescale-mode"}
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": jnp.bfloat16}
MERGE_INFO = "bitdelta_merge.json"
_NOT_COPIED = (INDEX_FILE, MERGE_INFO, MARKER)


def add_merge_parser(subparsers) -> argparse.ArgumentParser:
  """Adds the ``merge`` sub-command; its handler is ``args.func = run_merge``."""
  p = subparsers.add_parser(
    "merge",
    help="merge fine-tuned HF checkpoints (streaming, tensor by tensor)",
    description="Merge HF safetensors checkpoints. Parameter names and defaults follow "
    "mergekit 0.1.5; see docs/MERGING.md. An option that the method does not use is refused.",
  )
  p.add_argument(
    "method",
    choices=METHODS + tuple(m.replace("-", "_") for m in METHODS if "-" in m),
    metavar="METHOD",
    help=" | ".join(METHODS),
  )
  p.add_argument("--base", help="base (pre-trained) checkpoint dir; optional for linear")
  p.add_argument("--models", nargs="+", required=True, help="fine-tuned checkpoint dirs")
  p.add_argument("--weights", nargs="+", type=float, help="one weight per model (default 1)")
  p.add_argument(
    "--density",
    nargs="+",
    type=float,
    help="fraction of each task vector kept (ties/dare; >= 0, 0 keeps nothing = the base); "
    "one value or one per model (default 1)",
  )
  p.add_argument(
    "--lambda",
    dest="lambda_",
    metavar="LAMBDA",
    type=float,
    help="scale of the mixed task vector (task arithmetic family; default 1)",
  )
  p.add_argument(
    "--normalize",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="divide by the sum of weights (default: mergekit's per-method default)",
  )
  p.add_argument(
    "--rescale",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="ties/dare: scale each sparsified task vector back to its unpruned L1 norm, as "
    "mergekit's rescale (default: on for dare, off for ties)",
  )
  p.add_argument(
    "--rescale-mode",
    choices=("l1", "density"),
    help="dare: how --rescale rescales: l1 (mergekit, default) or density (divide by density, "
    "the DARE paper)",
  )
  p.add_argument(
    "--consensus", choices=("sum", "count"), help="TIES sign election (default sum, mergekit's)"
  )
  p.add_argument("--seed", type=int, help="DARE drop seed (default 0)")
  p.add_argument("--rank", type=int, help="svd-soup truncation rank")
  p.add_argument(
    "--mode",
    choices=("freevariance", "variance"),
    help="monosoup split rule (default freevariance)",
  )
  p.add_argument("--energy", type=float, help="monosoup 'variance' energy (default 0.8)")
  p.add_argument("--alpha", type=float, help="opcm projection split threshold (default 0.5)")
  p.add_argument("--dtype", choices=tuple(_DTYPES), help="output float dtype (default: base's)")
  p.add_argument("--out", required=True, help="output checkpoint dir")
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace --out if it is a checkpoint that bitdelta wrote (anything else is refused)",
  )
  p.set_defaults(func=run_merge)
  return p


def _is_float(dtype) -> bool:
  return np.issubdtype(dtype, np.floating) or dtype == np.dtype(jnp.bfloat16)


def _flag(attr: str) -> str:
  return _FLAGS.get(attr, "--" + attr.replace("_", "-"))


def _validate(method: str, args) -> None:
  """Checks the arguments, refuses options the method does not use, fills in defaults."""
  for attr in ("weights", "density"):  # one value applies to every model
    v = getattr(args, attr)
    if v is not None and len(v) == 1:
      setattr(args, attr, v[0])
  used = _OPTIONS[method]
  for attr in ("weights", "density", "rescale", *_DEFAULTS, "rank"):
    if getattr(args, attr, None) is not None and attr not in used:
      users = [m for m, opts in _OPTIONS.items() if attr in opts]
      raise SystemExit(
        f"bitdelta merge {method}: {_flag(attr)} does not apply to {method} "
        f"(it applies to {', '.join(users)})"
      )
  if args.rescale is False and args.rescale_mode is not None:
    raise SystemExit(f"bitdelta merge {method}: --rescale-mode contradicts --no-rescale")
  for attr, default in _DEFAULTS.items():
    if getattr(args, attr) is None and attr in used:
      setattr(args, attr, default)
  if method != "linear" and not args.base:
    raise SystemExit(f"bitdelta merge {method}: --base is required")
  if method == "monosoup" and len(args.models) != 1:
    raise SystemExit("bitdelta merge monosoup: takes exactly one fine-tuned model (--models)")
  if method == "svd-soup" and (args.rank is None or args.rank < 1):
    raise SystemExit("bitdelta merge svd-soup: --rank N (>= 1) is required")
  n = len(args.models)
  try:
    ws = [1.0 if x is None else x for x in per_model(args.weights, n, "--weights")]
    if method == "linear":
      check_linear_weights(ws, True if args.normalize is None else args.normalize)
    densities(args.density, n)
  except ValueError as e:
    raise SystemExit(f"bitdelta merge {method}: {e}") from None


def _rescale(method: str, args):
  """The rescale mode of a task-arithmetic-family method: None, "l1" or "density"."""
  on = _GTA[method][3] if args.rescale is None else args.rescale
  if not on or _GTA[method][0] is None:
    return None
  return args.rescale_mode or "l1"


def _tensor_fn(method: str, args) -> Callable:
  """fn(name, base, models) -> float32 merged tensor, for float tensors."""
  n = len(args.models)
  w = jnp.asarray([1.0 if x is None else x for x in per_model(args.weights, n, "w")], jnp.float32)
  if method == "linear":
    normalize = True if args.normalize is None else args.normalize
    return lambda name, b, xs: linear_tensor(jnp.stack(xs), w, normalize)
  if method in _GTA:
    sparsify, consensus, dnorm, _ = _GTA[method]
    normalize = dnorm if args.normalize is None else args.normalize
    rescale = _rescale(method, args)
    dens = densities(args.density, n) if sparsify is not None else None
    cons = args.consensus if consensus else None
    # one compiled function per tensor shape (a Llama has a handful), not op-by-op dispatch
    merge = jax.jit(functools.partial(task_arithmetic_family_tensor, densities=dens,
                                      sparsify=sparsify, consensus=cons, normalize=normalize,
                                      rescale=rescale))

    def gta(name, b, xs):
      key = tensor_key(args.seed, name) if sparsify == "random" else None
      return merge(b, jnp.stack(xs), w, key, args.lambda_)

    return gta
  if method == "monosoup":
    return lambda name, b, xs: (
      monosoup_tensor(b, xs[0], args.mode, args.energy) if b.ndim == 2 else xs[0]
    )
  if method == "svd-soup":
    return lambda name, b, xs: svd_soup_tensor(b, jnp.stack(xs), args.rank)
  raise AssertionError(method)


def _layout(reader: CheckpointReader) -> dict[str, list[str]]:
  files: dict[str, list[str]] = {}
  for name in reader.names():
    files.setdefault(reader.info(name).file.name, []).append(name)
  return files


def _finite(a, name: str, where) -> None:
  """Refuses (`CheckpointError`: exit 2, nothing written) a float tensor holding inf / NaN,
  as an input (``where``: its checkpoint) or as the merge's result."""
  a = np.asarray(a)
  if _is_float(a.dtype):
    bad = int(np.count_nonzero(~np.isfinite(a)))
    if bad:
      raise CheckpointError(f"{where}: tensor {name!r} holds {bad} non-finite value(s) (inf / "
                            "NaN); a merged checkpoint must be finite, nothing written")


def _read_all(readers, name, shape) -> list[np.ndarray]:
  out = []
  for r in readers:
    if name not in r:
      raise CheckpointError(f"{r.path}: lacks tensor {name!r} that the base has")
    info = r.info(name)
    if info.shape != shape:
      raise CheckpointError(
        f"{r.path}: tensor {name!r} has shape {list(info.shape)}, the base {list(shape)}"
      )
    x = r.read(name, copy=False)
    _finite(x, name, r.path)
    out.append(x)
  return out


def run_merge(args) -> int:
  method = args.method.replace("_", "-")
  _validate(method, args)
  out = Path(args.out)
  # Refuses (OutputError, a ValueError: exit 2) anything at --out but a checkpoint bitdelta
  # wrote, before any input is read; the result is written beside and swapped in.
  with OutputDir(out, kind="checkpoint", overwrite=args.overwrite) as target:
    tmp = target.tmp
    base_dir = Path(args.base or args.models[0])
    base = open_checkpoint(base_dir)
    models = [open_checkpoint(m) for m in args.models]
    try:
      layout = _layout(base)
      out_dtype = {}
      for name in base.names():
        dt = base.info(name).dtype
        out_dtype[name] = np.dtype(_DTYPES[args.dtype]) if args.dtype and _is_float(dt) else dt
      if method == "opcm":
        _run_opcm(base, models, layout, out_dtype, tmp, args.alpha)
      else:
        _run_tensorwise(_tensor_fn(method, args), base, models, layout, out_dtype, tmp, args)
      _finish(base_dir, tmp, layout, base, out_dtype, method, args)
    finally:
      for r in (base, *models):
        r.close()
    target.commit()
  n = sum(len(v) for v in layout.values())
  print(
    f"bitdelta merge {method}: {n} tensors from {len(models)} model(s) -> {out}", file=sys.stderr
  )
  return 0


def _run_tensorwise(fn, base, models, layout, out_dtype, tmp: Path, args) -> None:
  for fname, names in layout.items():
    specs = {n: (base.info(n).shape, out_dtype[n]) for n in names}
    with SafetensorsWriter(tmp / fname, specs, {"format": "pt"}) as writer:
      for name in names:
        b = base.read(name, copy=False)
        _finite(b, name, base.path)
        xs = _read_all(models, name, b.shape)
        if _is_float(b.dtype):
          merged = np.asarray(fn(name, jnp.asarray(b), [jnp.asarray(x) for x in xs]))
        else:  # integer buffers are not merged
          merged = b if args.base else xs[0]
        merged = merged.astype(out_dtype[name])
        _finite(merged, name, "the merge's result (e.g. an overflow of --dtype)")
        writer.write(name, merged)


def _run_opcm(base, models, layout, out_dtype, tmp: Path, alpha: float) -> None:
  scratch = tmp / ".opcm-scratch.safetensors"
  names = [n for ns in layout.values() for n in ns]
  floats = [n for n in names if _is_float(base.info(n).dtype)]
  tv_sq = np.zeros(len(models))
  s_sq = 0.0
  specs = {n: (base.info(n).shape, np.float32) for n in floats}
  with SafetensorsWriter(scratch, specs) as writer:  # pass 1: S per tensor
    for name in floats:
      b = base.read(name, copy=False)
      _finite(b, name, base.path)
      b = jnp.asarray(b, jnp.float32)
      xs = _read_all(models, name, b.shape)
      acc = None
      for i, x in enumerate(xs):
        tv = jnp.asarray(x, jnp.float32) - b
        tv_sq[i] += float(jnp.sum(tv * tv))
        if acc is None:
          acc = tv
        elif default_projects(name, tv):
          acc = acc + project_task_vector(acc, tv, alpha)
        else:
          acc = acc + tv
      s_sq += float(jnp.sum(acc * acc))
      writer.write(name, np.asarray(acc))
  s_norm = np.sqrt(s_sq)
  scale = float(np.sqrt(tv_sq).mean() / s_norm) if s_norm > 0 else 0.0
  with CheckpointReader(scratch) as acc_reader:  # pass 2: θ_0 + S · mean‖τ‖ / ‖S‖
    for fname, fnames in layout.items():
      specs = {n: (base.info(n).shape, out_dtype[n]) for n in fnames}
      with SafetensorsWriter(tmp / fname, specs, {"format": "pt"}) as writer:
        for name in fnames:
          b = base.read(name, copy=False)
          if name in acc_reader:
            merged = b.astype(np.float32) + scale * acc_reader.read(name, copy=False)
          else:
            merged = b
          merged = merged.astype(out_dtype[name])
          _finite(merged, name, "the merge's result (e.g. an overflow of --dtype)")
          writer.write(name, merged)
  scratch.unlink()


def shared_tokenizer_files(base_dir: Path, models: list[Path]) -> dict[str, Path]:
  """Tokenizer files (chat template, tokenizer config, generation config, ...) that every
  merged model has, byte for byte alike, and that differ from the base's: the merge keeps
  those, not the base's. Where the models disagree the base's file stays, with a warning."""
  from bitdelta_jax.delta.stream import TOKENIZER_FILES

  out = {}
  for f in TOKENIZER_FILES:
    have = [m / f for m in models if (m / f).is_file()]
    if not have:
      continue
    contents = {p.read_bytes() for p in have}
    base_f = Path(base_dir) / f
    same_as_base = base_f.is_file() and contents == {base_f.read_bytes()}
    if len(contents) == 1 and len(have) == len(models) and not same_as_base:
      out[f] = have[0]
    elif not same_as_base and len(contents) > 1:
      print(f"warning: the merged models' {f} differ; the merge keeps the base's",
            file=sys.stderr)
  return out


def _finish(base_dir: Path, tmp: Path, layout, base, out_dtype, method, args) -> None:
  if (base_dir / INDEX_FILE).exists() or len(layout) > 1:
    weight_map = {n: f for f, ns in layout.items() for n in ns}
    total = sum(
      int(np.prod(base.info(n).shape)) * np.dtype(out_dtype[n]).itemsize for n in weight_map
    )
    (tmp / INDEX_FILE).write_text(
      json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
  if base_dir.is_dir():
    for f in base_dir.iterdir():
      if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
        shutil.copy2(f, tmp / f.name)
  for name, src in shared_tokenizer_files(base_dir, [Path(m) for m in args.models]).items():
    shutil.copy2(src, tmp / name)  # what every merged model changed alike (a chat template)
  normalize = args.normalize
  if normalize is None and method in ("linear", *_GTA):
    normalize = True if method == "linear" else _GTA[method][2]
  info = {
    "method": method,
    "base": args.base,
    "models": list(args.models),
    "weights": args.weights,
    "density": args.density,
    "lambda": args.lambda_,
    "normalize": normalize,
    "rescale": _rescale(method, args) if method in _GTA else None,
    "consensus": args.consensus,
    "seed": args.seed,
    "rank": args.rank,
    "mode": args.mode,
    "energy": args.energy,
    "alpha": args.alpha,
  }
  (tmp / MERGE_INFO).write_text(json.dumps(info, indent=2))
