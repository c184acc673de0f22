"""What a multi-process server pays per step to send its plan: bytes and microseconds.

Builds the engine's real ragged batches (`Generator._batch` on the
SmolLM2-135M config, no weights needed: only the scheduler runs) for decode steps of 1, 8 and
32 rows and prefill chunks of 64 and 512 tokens, with and without logit controls (a grammar
mask and a penalty history), and measures for each: the plan's size (`step_plan.encode`), the
time to encode it, to decode it, and to send it to one follower over loopback TCP
(`bitdelta_jax.engine.multihost.channel`, the receiver on a thread) until that follower has decoded it.
Medians of interleaved rounds. Results: ``bench/results/engine/plan.{json,md}``.

    python -m bench plan [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import types

import numpy as np

from bench.common import (
  machine,
  report,
)
from bench.common.paths import results_dir
from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.multihost import codec as step_plan
from bitdelta_jax.engine.multihost.channel import PlanReceiver, PlanSender
from bitdelta_jax.engine.sampling import SamplingParams
from bitdelta_jax.models.config import ModelConfig

VOCAB, MAX_SEQ, PAGE = 49152, 2048, 16


class _NoDevice:
  """A runner that is never called: the bench only builds batches."""


def _scheduler(max_rows: int) -> Generator:
  """The real scheduler on a SmolLM2-sized config, without a model or device state."""
  model = types.SimpleNamespace(config=ModelConfig(
    model_type="llama", vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, num_slots=4))
  return Generator(model, max_rows=max_rows, max_seq_len=MAX_SEQ, page_size=PAGE,
                        runner=_NoDevice())


def cases() -> dict:
  out = {}
  plain = SamplingParams(temperature=0.8, max_new_tokens=8)
  pen = SamplingParams(temperature=0.8, max_new_tokens=8, presence_penalty=0.5)
  for rows in (1, 8, 32):
    for name, p in (("plain", plain), ("penalties", pen)):
      g = _scheduler(rows)
      seqs = [g.add(list(range(3, 300)), 1 + i % 3, p) for i in range(rows)]
      for s in seqs:  # as if the prompt were computed: the next step is decode
        s.pages = [g.pool.allocate() for _ in range(-(-len(s.tokens) // PAGE))]
        s.n_cached = len(s.tokens) - 1
      g.waiting.clear()
      g.running = list(seqs)
      batch, *_, base_only = g._batch([(s, 1) for s in seqs], [])
      out[f"decode {rows} rows, {name}"] = step_plan.batch_fields(batch, base_only)
  for tokens in (64, 512):
    g = _scheduler(8)
    s = g.add(list(range(3, 3 + tokens)), 1, plain)
    g.waiting.clear()
    s.pages = [g.pool.allocate() for _ in range(-(-tokens // PAGE))]
    g.running = [s]
    batch, *_, base_only = g._batch([], [(s, tokens)])
    out[f"prefill {tokens} tokens"] = step_plan.batch_fields(batch, base_only)
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=200)
  a = ap.parse_args()
  plans = {k: ("run", v) for k, v in cases().items()}
  sender = PlanSender(1, host="127.0.0.1")
  got = threading.Event()
  stop = threading.Event()

  def follower():
    r = PlanReceiver("127.0.0.1", sender.port, sender.token, 1)
    while not stop.is_set():
      try:
        step_plan.decode(r.recv())
      except ConnectionError:
        return
      got.set()

  t = threading.Thread(target=follower, daemon=True)
  t.start()
  sender.accept(10)
  times: dict[str, dict[str, list]] = {k: {"encode": [], "decode": [], "send": []} for k in plans}
  for _ in range(a.rounds):
    for name, (op, fields) in plans.items():  # interleaved
      t0 = time.perf_counter()
      data = step_plan.encode(op, fields)
      t1 = time.perf_counter()
      step_plan.decode(data)
      t2 = time.perf_counter()
      got.clear()
      sender.send(data)
      got.wait()
      t3 = time.perf_counter()
      times[name]["encode"].append(t1 - t0)
      times[name]["decode"].append(t2 - t1)
      times[name]["send"].append(t3 - t2)
  stop.set()
  sender.close()
  rows = []
  for name, (op, fields) in plans.items():
    med = {k: statistics.median(v) * 1e6 for k, v in times[name].items()}
    raw = sum(np.asarray(v).nbytes for v in fields.values() if hasattr(v, "nbytes"))
    rows.append({"plan": name, "bytes": len(step_plan.encode(op, fields)), "array_bytes": raw,
                 "encode_us": med["encode"], "decode_us": med["decode"],
                 "send_and_decode_us": med["send"]})
  res = {"machine": machine.describe(), "rounds": a.rounds, "rows": rows}
  out = results_dir("engine")
  report.write_json(out / "plan.json", res, indent=1)
  lines = ["# Plan cost per step (multi-process serving)", "",
           f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores. Medians of {a.rounds} interleaved "
           "rounds; one follower on loopback (a thread of this process). `send` is from "
           "`PlanSender.send` until the follower has decoded the plan. `arrays` is the batch's "
           "arrays as the runner gets them (a ragged batch of the token bucket, mostly padding); "
           "the plan sends each array's trailing padding as a count and one value.", "",
           "| plan | plan bytes | arrays, bytes | encode µs | decode µs | send + decode µs |",
           "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['plan']} | {r['bytes']:,} | {r['array_bytes']:,} | {r['encode_us']:.0f} "
                 f"| {r['decode_us']:.0f} | {r['send_and_decode_us']:.0f} |")
  (out / "plan.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
