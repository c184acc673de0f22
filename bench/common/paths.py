"""Where the repository and the results are."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
AREAS = ("kernels", "engine", "serving", "compress", "merge", "fidelity", "gpu")


def results_dir(area: str) -> pathlib.Path:
  """``bench/results/<area>/`` (one folder per area of bench/)."""
  if area not in AREAS:
    raise ValueError(f"unknown bench area {area!r}; known: {AREAS}")
  return RESULTS / area
