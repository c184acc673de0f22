"""Memory mappings held per compiled engine program (XLA CPU backend).

    python -m bench mappings [--max-seq-len 512]

Linux limits the memory mappings of one process (``vm.max_map_count``, 65530 by default), and
XLA's CPU backend maps each compiled program's code into mappings of its own; when a process
passes the limit, the next compile cannot map its code and the process dies (SIGSEGV inside
XLA: the test suite's crash, fixed by dropping each module's programs). A long-running CPU
server compiles a program per new step shape, so this measures how close it gets: the paged
engine on the built-in nano base and one of its variants, mappings counted after start-up,
after its warm-up, and after a sweep of prompt lengths and batch sizes reaches new shapes.
Writes bench/results/engine/mappings.{json,md}.
"""

from __future__ import annotations

import argparse
import pathlib

from bench.common import (
  machine,
  report,
)
from bench.common.paths import results_dir

OUT = results_dir("engine")


def mappings() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


def limit() -> int:
  try:
    return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
  except OSError:
    return -1


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-seq-len", type=int, default=512)
  args = ap.parse_args()
  from bitdelta_jax.delta.store import load_delta
  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.engine.sampling import SamplingParams
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.zoo import shipped_family

  base, variants = shipped_family()
  model = from_pretrained(base, num_slots=2)
  gen = Generator(model, max_rows=32, max_seq_len=args.max_seq_len)
  gen.load_variant(1, load_delta(next(iter(variants.values())))[0])
  rows = [("loaded", mappings(), gen.compiles)]
  gen.warmup()
  rows.append(("after warm-up", mappings(), gen.compiles))
  p = SamplingParams(max_new_tokens=2)
  for n in range(8, args.max_seq_len - 8, 24):  # new prefill and page buckets
    for slot in (0, 1):
      gen.generate([[5] * n] * (1 + n % 5), slot_ids=slot, params=p)  # and new row buckets
  rows.append(("after the sweep", mappings(), gen.compiles))
  base_maps, cap = rows[0][1], limit()
  per = (rows[-1][1] - base_maps) / max(1, rows[-1][2] - rows[0][2])
  rep = {"machine": machine.describe(), "max_map_count": cap, "max_seq_len": args.max_seq_len,
         "rows": [{"stage": s, "mappings": m, "programs": c} for s, m, c in rows],
         "mappings_per_program": round(per, 1),
         "programs_to_the_limit": int((cap - base_maps) / per) if per > 0 else None}
  OUT.mkdir(exist_ok=True)
  report.write_json(OUT / "mappings.json", rep, indent=1)
  mc = rep["machine"]
  md = ["# Memory mappings per compiled engine program (XLA CPU)", "",
        f"Paged engine on the built-in nano base (+1 variant), max_seq_len {args.max_seq_len}; "
        f"`vm.max_map_count` = {rep['max_map_count']}. Machine: {mc['cpu']}, {mc['cores']} "
        f"cores, jax {mc.get('jax')}. Script: `bench/engine/mappings.py`.", "",
        "| stage | mappings | engine programs |", "|---|---|---|"]
  md += [f"| {s} | {m} | {c} |" for s, m, c in rows]
  md += ["", f"About {rep['mappings_per_program']} mappings per program: "
         f"{rep['programs_to_the_limit']} programs would reach the limit."]
  (OUT / "mappings.md").write_text("\n".join(md) + "\n")
  print("\n".join(md))


if __name__ == "__main__":
  main()
