"""`python -m bench list`: every bench with its docstring's first line; `python -m bench NAME
[args...]`: run that bench's ``main`` with the args (as ``python -m bench.<area>.NAME``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import sys

from bench.common.paths import AREAS

HERE = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Bench:
  name: str  # what `python -m bench NAME` takes: the module's name, unique across areas
  area: str
  description: str  # the module docstring's first line

  @property
  def module(self) -> str:
    return f"bench.{self.area}.{self.name}"


def benches() -> list[Bench]:
  """Every module of an area folder with a top-level ``main`` (read from the source: nothing is
  imported), in area order."""
  out = []
  for area in AREAS:
    for path in sorted((HERE / area).glob("*.py")):
      tree = ast.parse(path.read_text())
      if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
        continue  # a helper of its area (e.g. gpu_prefill, one stage of gpu_check)
      doc = (ast.get_docstring(tree) or "").strip().splitlines()
      out.append(Bench(path.stem, area, doc[0].rstrip(" →;,:") if doc else ""))
  return out


def find(name: str) -> Bench:
  found = {b.name: b for b in benches()}
  if name not in found:
    raise SystemExit(f"no bench {name!r}; `python -m bench list` lists them")
  return found[name]


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0
  if argv[0] == "list":
    all_ = benches()
    width = max(len(b.name) for b in all_)
    for area in AREAS:
      rows = [b for b in all_ if b.area == area]
      if rows:
        print(f"{area}/")
        for b in rows:
          print(f"  {b.name:<{width}}  {b.description}")
    return 0
  bench = find(argv[0])
  sys.argv = [f"python -m bench {bench.name}", *argv[1:]]  # argparse reads sys.argv
  rc = importlib.import_module(bench.module).main()
  return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
  raise SystemExit(main())
