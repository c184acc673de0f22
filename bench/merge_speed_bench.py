"""Per-tensor merge cost: the task-arithmetic family jitted per shape vs op-by-op (eager).

    python bench/merge_speed_bench.py [--rounds 3] [--layers 30]

The tensors of a SmolLM2-135M-shaped checkpoint (30 layers, hidden 576, MLP 1536, 9/3 heads,
vocab 49152, random f32), two "fine-tunes" of it; each round merges every tensor with
`task_arithmetic_family_tensor` both ways (ties and task-arithmetic), interleaved. Disk
reads are left out: this is the compute `bitdelta merge` does per tensor.
Writes bench/results/merge_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402

from bitdelta_jax.merge.baselines import task_arithmetic_family_tensor  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "results"


def shapes(layers=30, d=576, f=1536, kv=192, vocab=49152):
  out = {"embed": (vocab, d), "norm": (d,)}
  for i in range(layers):
    out |= {f"{i}.q": (d, d), f"{i}.k": (kv, d), f"{i}.v": (kv, d), f"{i}.o": (d, d),
            f"{i}.gate": (f, d), f"{i}.up": (f, d), f"{i}.down": (d, f), f"{i}.n1": (d,),
            f"{i}.n2": (d,)}
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--layers", type=int, default=30, help="decoder layers (the 135M has 30)")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  tensors = {n: rng.standard_normal(s, np.float32) for n, s in shapes(args.layers).items()}
  fts = {n: [t + 0.01 * rng.standard_normal(t.shape, np.float32) for _ in range(2)]
         for n, t in tensors.items()}
  w = jnp.ones((2,), jnp.float32)
  methods = {"task-arithmetic": {}, "ties": dict(densities=(0.5, 0.5), sparsify="magnitude",
                                                  consensus="sum", normalize=True)}
  res = {}
  for method, kw in methods.items():
    eager = functools.partial(task_arithmetic_family_tensor, **kw)
    jitted = jax.jit(functools.partial(task_arithmetic_family_tensor, **kw))
    times = {"eager": [], "jit": []}
    for _ in range(args.rounds):
      for label, fn in (("eager", eager), ("jit", jitted)):
        t = time.perf_counter()
        for n, b in tensors.items():
          np.asarray(fn(jnp.asarray(b), jnp.stack([jnp.asarray(x) for x in fts[n]]), w, None,
                        1.0))
        times[label].append(time.perf_counter() - t)
        print(f"{method} {label}: {times[label][-1]:.2f} s", flush=True)
    e, j = statistics.median(times["eager"]), statistics.median(times["jit"])
    res[method] = {"eager_s": round(e, 2), "jit_s": round(j, 2), "speedup": round(e / j, 2),
                   "first_round": {k: round(v[0], 2) for k, v in times.items()}}
  doc = {"machine": machine.describe(), "rounds": args.rounds, "layers": args.layers,
         "tensors": len(tensors),
         "results": res}
  OUT.mkdir(exist_ok=True)
  (OUT / "merge_speed.json").write_text(json.dumps(doc, indent=2))
  m = doc["machine"]
  lines = ["# Merge compute per checkpoint: jitted per shape vs op-by-op", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')}. {len(tensors)} tensors "
           f"of a SmolLM2-135M-shaped checkpoint with {args.layers} of its 30 layers (embeddings "
           "included), 2 models; medians of "
           f"{args.rounds} interleaved rounds (the first round includes compiles). Script: "
           "`bench/merge_speed_bench.py`.", "",
           "| method | op-by-op (s) | jitted (s) | speedup | first round op-by-op / jitted (s) |",
           "|---|---|---|---|---|"]
  lines += [f"| {k} | {r['eager_s']} | {r['jit_s']} | {r['speedup']}x | "
            f"{r['first_round']['eager']} / {r['first_round']['jit']} |" for k, r in res.items()]
  (OUT / "merge_speed.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
