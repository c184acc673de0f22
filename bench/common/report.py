"""Results files: the JSON (with the machine it ran on), the markdown table, a figure.

    md = write(results_dir("kernels") / "kernel_choice", res, lines, fig=fig)
    # -> bench/results/kernels/kernel_choice.{json,md,png}
"""

from __future__ import annotations

import json
import pathlib

from bench.common import machine


def write_json(path: pathlib.Path, res: dict, *, indent: int = 1) -> pathlib.Path:
  """``res`` to ``path`` (parents made; numpy scalars and paths as their str / float)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(res, indent=indent, default=_plain) + "\n")
  return path


def write(stem: pathlib.Path, res: dict, lines: list[str] | None = None, *, fig=None,
          with_machine: bool = True, indent: int = 1) -> pathlib.Path:
  """``res`` to ``STEM.json`` (``machine.describe()`` added under "machine" unless it has one or
  ``with_machine`` is false), ``lines`` to ``STEM.md``, ``fig`` (a matplotlib figure) to
  ``STEM.png``; returns the markdown's path."""
  stem = pathlib.Path(stem)
  if with_machine and "machine" not in res:
    res = {"machine": machine.describe(), **res}
  write_json(stem.with_name(stem.name + ".json"), res, indent=indent)
  md = stem.with_name(stem.name + ".md")
  if lines is not None:
    md.write_text("\n".join(lines) + "\n")
  if fig is not None:
    fig.savefig(stem.with_name(stem.name + ".png"), dpi=120)
  return md


def _plain(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)
