"""Load on an OpenAI-style server: streamed completions at a given concurrency, with each
request's TTFT, tokens and latency; the prompts the serving benches share.

    recs, wall = serve(url, [(model, prompt), ...], concurrency=8, max_tokens=64)
"""

from __future__ import annotations

import asyncio
import json
import time

QUESTIONS = [
  "What is the capital of France?", "Give me three tips for sleeping better.",
  "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
  "What is 17 times 23?", "Name the planets of the solar system.",
  "How do I reverse a list in Python?", "What causes rain?",
  "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
  "Translate 'good morning' into Spanish.", "What is a prime number?",
  "Suggest a name for a pet turtle.", "How does a refrigerator work?",
  "What are the benefits of exercise?", "Describe a cat to someone who has never seen one.",
]


def pct(xs, p):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def run_requests(url, jobs, concurrency, max_tokens):
  """jobs: [(model, prompt)]. Streams each; returns per-request records and the wall time."""
  import aiohttp

  sem = asyncio.Semaphore(concurrency)
  recs = [None] * len(jobs)

  async def one(session, i, model, prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with sem:
      t0 = time.perf_counter()
      ttft, tokens, text = None, 0, []
      async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
          line = line.strip()
          if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
          ev = json.loads(line[6:])
          if ev.get("choices"):
            if ttft is None:
              ttft = time.perf_counter() - t0
            text.append(ev["choices"][0].get("text", ""))
          if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
      recs[i] = {"model": model, "ttft": ttft, "tokens": tokens, "text": "".join(text),
                 "latency": time.perf_counter() - t0}

  async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64),
                                   timeout=aiohttp.ClientTimeout(total=3600)) as s:
    t0 = time.perf_counter()
    await asyncio.gather(*(one(s, i, m, p) for i, (m, p) in enumerate(jobs)))
    wall = time.perf_counter() - t0
  return recs, wall


def serve(url, jobs, concurrency, max_tokens, warm=True):
  """`run_requests` (once unmeasured first when ``warm``): ``(records, wall seconds)``."""
  if warm:
    asyncio.run(run_requests(url, jobs, concurrency, max_tokens))
  return asyncio.run(run_requests(url, jobs, concurrency, max_tokens))
