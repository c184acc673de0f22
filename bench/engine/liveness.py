"""What the issue-24 liveness machinery costs, and n > 1 requests that used to hang.

    python -m bench liveness [--rounds 7]

1. **Sweep cost per engine iteration** (`bitdelta_jax.engine.engine.Engine._sweep`: cancelled, stalled and
   orphaned choices) against one engine step (`Generator.step`, decode) with 1, 8 and 32
   live sequences, in interleaved rounds, on the built-in `nano` base (the smallest model the
   product ships, so the step is short and the ratio an upper bound).
2. **n > 1 whose leader has one prompt token left** through the real server (1-token prompts;
   17-token prompts whose first page is a prefix-cache hit): every request answers; latency
   p50 of n = 4 against n = 1 of the same prompt, interleaved. Before the fix these never
   answered.

Writes bench/results/engine/liveness.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import (
  machine,
  report,
)
from bench.common.paths import results_dir

OUT = results_dir("engine")


def _family():
  from bitdelta_jax.zoo import shipped_family

  return shipped_family()


def sweep_vs_step(rounds: int) -> list[dict]:
  import jax.numpy as jnp

  from bitdelta_jax.engine.engine import Engine
  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.engine.request import Request
  from bitdelta_jax.engine.sampling import SamplingParams
  from bitdelta_jax.models import from_pretrained
  from serving.config import ServerConfig
  from serving.metrics import Metrics

  base, _ = _family()
  gen = Generator(from_pretrained(base, jnp.float32, num_slots=2), max_rows=32,
                       max_seq_len=256, page_size=16)
  engine = Engine(ServerConfig(base=str(base)).engine_config(), Metrics(), None)
  out = []
  for live in (1, 8, 32):
    p = SamplingParams(max_new_tokens=10_000)  # no stop ids: never ends by itself
    reqs = []
    for i in range(live):
      r = Request(prompt=[1, 2, 3 + i], slot=0, params=p, model="bench", emit=lambda ev: None)
      gen.add_group([r])
      reqs.append(r)
    engine._live = set(reqs)
    for _ in range(3):  # prefill + compile the decode bucket
      gen.step()
    sweep_s, step_s = [], []
    for _ in range(rounds):
      t = time.perf_counter()
      for _ in range(100):
        engine._sweep(gen)
      sweep_s.append((time.perf_counter() - t) / 100)
      t = time.perf_counter()
      for _ in range(5):
        gen.step()
      step_s.append((time.perf_counter() - t) / 5)
    for r in reqs:
      gen.finish(r)
    sw, st = statistics.median(sweep_s), statistics.median(step_s)
    out.append({"live": live, "sweep_us": round(sw * 1e6, 1), "step_ms": round(st * 1e3, 2),
                "sweep_over_step": round(sw / st, 5)})
  return out


def forks_through_the_server(rounds: int) -> list[dict]:
  import requests

  from serving.app import ServerThread
  from serving.config import ServerConfig

  base, variants = _family()
  name, path = next(iter(variants.items()))
  cfg = ServerConfig(base=str(base), base_name="nano", port=0, variants=((name, str(path)),),
                     device_slots=1, max_batch=8, max_seq_len=256, warmup=True)
  out = []
  with ServerThread(cfg) as h:
    url = h.url + "/v1/completions"

    def once(prompt, n):
      t = time.perf_counter()
      r = requests.post(url, timeout=120, json={"model": name, "prompt": prompt, "n": n,
                                                "max_tokens": 8, "temperature": 1.0,
                                                "seed": 1, "ignore_eos": True})
      assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
      return time.perf_counter() - t

    for label, prompt in (("1-token prompt", [42]), ("17 tokens, first page cached",
                                                      list(range(3, 20)))):
      once(prompt, 4)  # compiles, and caches the prompt's full pages
      one, four = [], []
      for _ in range(rounds):
        one.append(once(prompt, 1))
        four.append(once(prompt, 4))
      a, b = statistics.median(one), statistics.median(four)
      out.append({"prompt": label, "n1_ms": round(a * 1e3, 1), "n4_ms": round(b * 1e3, 1),
                  "n4_over_n1": round(b / a, 3), "answered": 2 * rounds + 1})
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=7)
  args = ap.parse_args()
  res = {"machine": machine.describe(), "rounds": args.rounds,
         "sweep": sweep_vs_step(args.rounds), "forks": forks_through_the_server(args.rounds)}
  OUT.mkdir(exist_ok=True)
  report.write_json(OUT / "liveness.json", res, indent=2)
  m = res["machine"]
  lines = ["# Liveness (issue 24): what the sweep costs, n > 1 that used to hang", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')} ({m.get('backend')}). "
           f"Medians of {args.rounds} interleaved rounds. Script: `bench/engine/liveness.py`.", "",
           "## Sweep per engine iteration vs one decode step (built-in `nano` base)", "",
           "| live sequences | sweep (µs) | step (ms) | sweep / step |", "|---|---|---|---|"]
  lines += [f"| {r['live']} | {r['sweep_us']} | {r['step_ms']} | {r['sweep_over_step']:.2%} |"
            for r in res["sweep"]]
  lines += ["", "## n > 1 whose leader has one prompt token left (through the server)", "",
            "Before the fix these requests never answered (the choices were never forked).", "",
            "| prompt | n = 1 (ms) | n = 4 (ms) | n4 / n1 | requests answered |",
            "|---|---|---|---|---|"]
  lines += [f"| {r['prompt']} | {r['n1_ms']} | {r['n4_ms']} | {r['n4_over_n1']} | "
            f"{r['answered']} of {r['answered']} |" for r in res["forks"]]
  (OUT / "liveness.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
