"""``bitdelta bench serve``: load against any OpenAI-compatible server, measured per request.

    bitdelta bench serve --url http://127.0.0.1:8000 --model math --concurrency 1,4,8
    bitdelta bench serve --url URL --model M --requests 32 --prompt-words 96 --output-tokens 64
                         [--shared-prefix 48] [--api-key KEY] [--out run.json]

At each concurrency C, C clients each send streamed ``/v1/completions`` requests back to back
(``max_tokens`` = ``--output-tokens``, ``ignore_eos``, temperature 0) until ``--requests`` have
been sent; a request's prompt is ``--prompt-words`` random words from a per-run seed, so no two
prompts share a prefix and neither side's prompt cache flatters a run (``--shared-prefix N``
starts every prompt with the same N words to measure one). For each level it reports output
tokens per second (all requests' tokens over the level's wall time), time to first token and
inter-token latency (median and p99, from the streamed chunks' arrival times), prompt and
output tokens (the server's ``usage``, else counted chunks) and errors. It asks nothing of the
server beyond the OpenAI streaming protocol (``ignore_eos`` is vLLM's and llama.cpp's
extension), so this server, vLLM and ``llama-server`` are measured alike. Exit 1 if any
request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this "
         "be or had not but what all when we there can one your more time if will up out so "
         "them into has some could two may then do first any like now my over such our man "
         "me even most made after also did many off before must through years where much way "
         "well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day "
         "same another know while last might us great old year off come since against go came "
         "right used take three").split()


@dataclasses.dataclass
class Sample:
  ok: bool
  ttft_s: float | None = None
  itl_s: list[float] = dataclasses.field(default_factory=list)
  prompt_tokens: int | None = None
  output_tokens: int = 0
  error: str | None = None


def prompt_text(rng: random.Random, words: int, shared: list[str]) -> str:
  return " ".join(shared + [rng.choice(WORDS) for _ in range(max(0, words - len(shared)))])


async def one_request(session, url: str, headers: dict, body: dict) -> Sample:
  import aiohttp

  t0 = time.perf_counter()
  last = None
  s = Sample(ok=False)
  chunks = 0
  try:
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
      if r.status != 200:
        s.error = f"HTTP {r.status}: {(await r.text())[:200]}"
        return s
      async for raw in r.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
          continue
        data = line[5:].strip()
        if data == "[DONE]":
          break
        ev = json.loads(data)
        if "error" in ev:
          s.error = str(ev["error"].get("message", ev["error"]))[:200]
          return s
        if ev.get("usage"):
          s.prompt_tokens = ev["usage"].get("prompt_tokens")
          s.output_tokens = ev["usage"].get("completion_tokens") or s.output_tokens
        if any(c.get("text") for c in ev.get("choices", ())):
          now = time.perf_counter()
          chunks += 1
          if last is None:
            s.ttft_s = now - t0
          else:
            s.itl_s.append(now - last)
          last = now
  except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
    s.error = f"{type(e).__name__}: {e}"[:200]
    return s
  s.output_tokens = s.output_tokens or chunks
  s.ok = s.ttft_s is not None
  if not s.ok:
    s.error = "no token streamed"
  return s


def _pct(xs, q) -> float | None:
  return round(float(np.percentile(xs, q)) * 1e3, 2) if len(xs) else None


def summarize(concurrency: int, samples: list[Sample], wall_s: float) -> dict:
  ok = [s for s in samples if s.ok]
  ttft = [s.ttft_s for s in ok]
  itl = [x for s in ok for x in s.itl_s]
  out_tokens = sum(s.output_tokens for s in ok)
  prompt = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
  return {
    "concurrency": concurrency, "requests": len(samples), "ok": len(ok),
    "errors": len(samples) - len(ok),
    "first_error": next((s.error for s in samples if not s.ok), None),
    "wall_s": round(wall_s, 3), "output_tokens": out_tokens,
    "output_tok_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
    "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
    "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
    "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
    "prompt_tokens_mean": round(float(np.mean(prompt)), 1) if prompt else None,
  }


async def run_level(url: str, model: str, concurrency: int, requests: int, *, prompt_words: int,
                    output_tokens: int, shared_prefix: int = 0, api_key: str | None = None,
                    seed: int = 0, timeout_s: float = 600.0) -> dict:
  """One concurrency level: ``requests`` streamed completions by ``concurrency`` clients."""
  import aiohttp

  rng = random.Random(seed)
  shared = [rng.choice(WORDS) for _ in range(shared_prefix)]
  bodies = [{"model": model, "prompt": prompt_text(rng, prompt_words, shared),
             "max_tokens": output_tokens, "temperature": 0, "stream": True,
             "ignore_eos": True, "stream_options": {"include_usage": True}}
            for _ in range(requests)]
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  queue = list(reversed(bodies))
  samples: list[Sample] = []

  async def client(session):
    while queue:
      samples.append(await one_request(session, url, headers, queue.pop()))

  timeout = aiohttp.ClientTimeout(total=timeout_s)
  async with aiohttp.ClientSession(timeout=timeout) as session:
    t0 = time.perf_counter()
    await asyncio.gather(*(client(session) for _ in range(min(concurrency, requests))))
    wall = time.perf_counter() - t0
  return summarize(concurrency, samples, wall)


def table(levels: list[dict]) -> str:
  rows = ["| concurrency | requests (ok) | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
          "|---|---|---|---|---|"]
  for r in levels:
    rows.append(f"| {r['concurrency']} | {r['requests']} ({r['ok']}) | {r['output_tok_s']} | "
                f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / "
                f"{r['itl_ms_p99']} |")
  return "\n".join(rows)


def cmd_bench_serve(args) -> int:
  levels_in = []
  for part in str(args.concurrency).split(","):
    if not part.strip().isdigit() or int(part) < 1:
      raise ValueError(f"--concurrency: expected positive integers like 1,4,8, got "
                       f"{args.concurrency!r}")
    levels_in.append(int(part))
  for name in ("requests", "output_tokens", "prompt_words"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
  if not 0 <= args.shared_prefix <= args.prompt_words:
    raise ValueError("--shared-prefix: must be in [0, --prompt-words]")
  url = args.url.rstrip("/")
  seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
  levels = []
  for i, c in enumerate(levels_in):
    r = asyncio.run(run_level(url, args.model, c, args.requests, prompt_words=args.prompt_words,
                              output_tokens=args.output_tokens, shared_prefix=args.shared_prefix,
                              api_key=args.api_key, seed=seed + i))
    levels.append(r)
    print(f"concurrency {c}: {r['output_tok_s']} output tok/s, TTFT p50 {r['ttft_ms_p50']} ms, "
          f"ITL p50 {r['itl_ms_p50']} ms, {r['errors']} error(s)"
          + (f" (first: {r['first_error']})" if r["errors"] else ""), file=sys.stderr, flush=True)
  print(table(levels))
  if args.out:
    out = {"url": url, "model": args.model, "seed": seed, "prompt_words": args.prompt_words,
           "shared_prefix": args.shared_prefix, "output_tokens": args.output_tokens,
           "levels": levels}
    Path(args.out).write_text(json.dumps(out, indent=1))
  return 0 if all(r["errors"] == 0 for r in levels) else 1


def add_bench_parser(sub) -> None:
  b = sub.add_parser("bench", help="measure a running server (bench serve)")
  bsub = b.add_subparsers(dest="bench_command", required=True)
  p = bsub.add_parser("serve", help="streamed completions at given concurrencies against any "
                      "OpenAI-compatible server: output tok/s, TTFT and ITL percentiles",
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      description=__doc__)
  p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
  p.add_argument("--model", required=True, help="the model (variant) name to request")
  p.add_argument("--concurrency", default="1,4,8", help="levels, comma-separated (1,4,8)")
  p.add_argument("--requests", type=int, default=32, help="requests per level (32)")
  p.add_argument("--prompt-words", type=int, default=96, help="random words per prompt (96)")
  p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                 help="the first N words of every prompt are the same (0)")
  p.add_argument("--output-tokens", type=int, default=64, help="max_tokens, EOS ignored (64)")
  p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
  p.add_argument("--seed", type=int, default=None, help="prompt seed (default: a new one)")
  p.add_argument("--out", default=None, help="also write the levels as JSON here")
  p.set_defaults(func=cmd_bench_serve)
