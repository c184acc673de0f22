"""The built-in model family: a tiny Llama-architecture base (`nano`) and task variants.

    from bitdelta_jax.zoo import shipped_family
    base_dir, variants = shipped_family()     # Path, {"nano-math": Path(delta dir), ...}

The package ships the bf16 base and the compressed, scale-distilled variant deltas
(`bitdelta_jax/zoo/shipped/`), built by `bitdelta zoo build --ship`. Full-precision fine-tunes
are rebuilt by the recipe when an evaluation needs them and cached under `cache_dir()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "shipped"
SHIPPED_REAL = Path(__file__).resolve().parent / "shipped_real"


def cache_dir() -> Path:
  from pallas_kernels.cache import cache_root

  return cache_root() / "zoo"


def shipped_family(root: str | os.PathLike | None = None) -> tuple[Path, dict[str, Path]]:
  """(base directory, {variant name: delta directory}) of the shipped family."""
  root = Path(root) if root else SHIPPED
  fam = root / "family.json"
  if not fam.exists():
    raise FileNotFoundError(
      f"{fam}: the built-in family is not there; build it with `bitdelta zoo build --ship`")
  meta = json.loads(fam.read_text())
  return root / meta["base"], {n: root / "deltas" / n for n in meta["variants"]}


def shipped_real_family(root: str | os.PathLike | None = None, *, download: bool = True
                        ) -> tuple[Path, dict[str, Path], dict[str, str]]:
  """(real base directory, {variant: delta directory}, {variant: an example prompt it answers
  correctly}) of the shipped real family (`bitdelta zoo build --real --ship`). The base is
  SmolLM2-135M-Instruct, imported on first use (`zoo.real_base.import_real_base`)."""
  from bitdelta_jax.zoo.real_base import import_real_base

  root = Path(root) if root else SHIPPED_REAL
  fam = root / "family.json"
  if not fam.exists():
    raise FileNotFoundError(
      f"{fam}: the real family is not there; build it with `bitdelta zoo build --real --ship`")
  meta = json.loads(fam.read_text())
  base = import_real_base(download=download)
  return (base, {n: root / "deltas" / n for n in meta["variants"]},
          dict(meta.get("examples", {})))
