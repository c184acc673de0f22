"""Running the project's code from this checkout and from an earlier commit, side by side.

Used by the before/after benches (merge_speed, compress_defaults, variant_step, onednn):
`checkouts` yields {"now": this checkout, "before": a temporary git worktree of REF}, `run_cli`
times one `bitdelta` command importing from one of them, `run_worker` runs a bench module's
``--worker`` mode in its own process and returns the JSON it printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

from bench.common.paths import ROOT


@contextlib.contextmanager
def checkouts(before: str | None, tmp: pathlib.Path):
  """{"now": ROOT} plus, with ``before``, {"before": a detached worktree of that ref}
  (removed on exit)."""
  srcs = {"now": ROOT}
  if before:
    wt = pathlib.Path(tmp) / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), before],
                   check=True, capture_output=True)
    srcs["before"] = wt
  try:
    yield srcs
  finally:
    if "before" in srcs:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                      str(srcs["before"])], capture_output=True)


def copy_side_files(src: pathlib.Path, dst: pathlib.Path) -> None:
  """A checkpoint's files other than its weights (config, tokenizer), not bitdelta's marker."""
  for f in src.iterdir():
    if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith(".bitdelta"):
      shutil.copy2(f, dst / f.name)


def run_cli(src: pathlib.Path, argv: list[str]) -> tuple[float, float]:
  """(wall seconds, peak RSS GiB) of `python -m bitdelta_jax.cli ARGV` importing from src."""
  env = dict(os.environ, PYTHONPATH=str(src), JAX_PLATFORMS="cpu")
  cmd = ["/usr/bin/time", "-f", "TIME %e %M", sys.executable, "-m", "bitdelta_jax.cli", *argv]
  p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(src))
  line = [x for x in p.stderr.splitlines() if x.startswith("TIME ")]
  if p.returncode != 0 or not line:
    raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
  _, wall, kb = line[-1].split()
  return float(wall), int(kb) / 2**20


def run_worker(module: str, src: pathlib.Path, args: list[str],
               env: dict[str, str] | None = None) -> dict:
  """Runs ``python -m MODULE --worker ARGS`` (a bench of this checkout) importing the project
  from ``src`` (extra ``env``) and returns the JSON of its ``RESULT `` line. ``src`` comes
  first on the path, this checkout after it: the project's packages are ``src``'s, `bench` is
  this checkout's unless ``src`` has a `bench` package of its own."""
  full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{src}{os.pathsep}{ROOT}",
                  **(env or {}))
  r = subprocess.run([sys.executable, "-m", module, "--worker", *args], env=full_env,
                     capture_output=True, text=True, cwd=str(src))
  line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
  if r.returncode or not line:
    raise SystemExit(f"{module} worker ({src}) failed:\n{r.stderr[-3000:]}")
  return json.loads(line[0][len("RESULT "):])
