"""The benches are the `bench` package at the repository root (run as ``python -m bench``):
importable here whichever way pytest was started."""

import pathlib
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
