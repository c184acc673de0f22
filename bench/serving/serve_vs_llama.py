"""Our server against llama.cpp's llama-server on the same GGUF file, driven by guidellm: output
tokens/s, TTFT, ITL, peak RSS and start time at concurrency 1/4/8/16 (issue 47 item 7).

    python -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm==0.8.1   # pinned, package registry
    # llama-server from the llama-cpp-python sdist's vendored llama.cpp (`bench/common/peers.py`)
    python -m bench serve_vs_llama --guidellm /tmp/gl/bin/guidellm --llama-server PATH \\
        [--models smollm2 1b_q4_0] [--concurrency 1 4 8 16] [--rounds 2]

Per model, rounds of: each server started (order rotating round by round), its seconds to a
200 from /health timed, then guidellm 0.8.1 unchanged against ``/v1/completions`` (synthetic
text, 64 output tokens, ``ignore_eos``):

* **unique prompts**: 128-token prompts, a new guidellm seed for every run (round and
  concurrency; both servers get the same prompts within a round), so neither side's prompt cache has seen a prompt before (llama-server keeps
  each slot's last prompt and reuses its longest common prefix; ours shares full KV pages of
  a prefix it has in memory);
* **shared prefix**: one 96-token prefix before 32 unique tokens in every request (guidellm's
  ``prefix_buckets``), at concurrency 1 and 8: what both caches save.

Ours is started, its /health waited for, and then its background compile of the larger step
buckets (`/health` ``buckets.compiling`` empty) before the first run: the runs measure the
steady state; the start columns say what the start costs. Then the server's peak RSS (``VmHWM``) is read and it is stopped. Servers: ours as
`bitdelta serve --base FILE --max-batch 16` (int8 activations, the default), llama-server
``-t 2 -tb 2 -np 16 -c 16·512`` (continuous batching over 16 sequences). Medians over rounds;
ratios ours / llama-server per row. Models: the shipped SmolLM2-135M-Instruct Q4_1 file
(``smollm2``) and a 1B-shaped Llama with random weights as Q4_0 (``1b_q4_0``,
`bench.common.random_models`; speed only); ``7b_q4_0`` on request (hours on 2 cores).

Writes bench/results/serving/serve_vs_llama.{json,md,png}; the guidellm reports and server
logs stay in ``--work``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

from bench.common import report, server
from bench.common.machine import describe, machine_line
from bench.common.paths import results_dir
from bench.common.peers import launch_llama_server, llama_server_binary

SERVERS = ("ours", "llama")
OUTPUT_TOKENS = 64
PROMPT_TOKENS = 128
PREFIX_TOKENS, SUFFIX_TOKENS = 96, 32
MAX_SEQ = 512
PARALLEL = 16
# (goal name, model, concurrency, table, metric, bound): ours / llama must be >= (tok/s) or
# <= (TTFT) the bound (the goals, ratios in one run)
GOALS = (("output tok/s ≥ 1.1× at c1", "1b_q4_0", 1, "unique", "output_tok_s", ">=", 1.1),
         ("output tok/s ≥ 1.5× at c8", "1b_q4_0", 8, "unique", "output_tok_s", ">=", 1.5),
         ("output tok/s ≥ 1.5× at c16", "1b_q4_0", 16, "unique", "output_tok_s", ">=", 1.5),
         ("TTFT median ≤ 1.0× at c1", "1b_q4_0", 1, "unique", "ttft_ms", "<=", 1.0),
         ("TTFT median ≤ 1.5× at c8", "1b_q4_0", 8, "unique", "ttft_ms", "<=", 1.5),
         ("SmolLM2 Q4_1 one stream ≥ 0.9×", "smollm2", 1, "unique", "output_tok_s", ">=", 0.9))


def model_files(names: list[str], work: pathlib.Path) -> dict[str, dict]:
  """{name: {"gguf": file, "tokenizer": a HF tokenizer dir guidellm counts tokens with}}."""
  from bench.common.random_models import DEFAULT_WORK, make

  out = {}
  for name in names:
    if name == "smollm2":
      from bitdelta_jax.zoo.real_base import import_real_base, real_gguf

      out[name] = {"gguf": real_gguf(), "tokenizer": import_real_base()}
    elif name in ("1b_q4_0", "7b_q4_0"):
      from bitdelta_jax.zoo.tokenizer_build import write_tokenizer

      gguf = make(name.split("_")[0], ["q4_0"], 0, DEFAULT_WORK)["q4_0"][0]
      tok = work / "tokenizer-llama"  # the random models' tokenizer (random_models writes it)
      if not (tok / "tokenizer.json").exists():
        tok.mkdir(parents=True, exist_ok=True)
        write_tokenizer(tok)
      out[name] = {"gguf": gguf, "tokenizer": tok}
    else:
      raise SystemExit(f"unknown model {name!r} (smollm2, 1b_q4_0, 7b_q4_0)")
  return out


def guidellm_cmd(exe: str, url: str, model: str, tokenizer, streams: int, requests: int,
                 seed: int, shared_prefix: bool, out: pathlib.Path) -> list[str]:
  if shared_prefix:
    data = (f"kind=synthetic_text,prompt_tokens={SUFFIX_TOKENS},output_tokens={OUTPUT_TOKENS},"
            f"prefix_buckets[0].prefix_tokens={PREFIX_TOKENS},prefix_buckets[0].prefix_count=1")
  else:
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"
  return [exe, "run",
          "--backend", f"kind=openai_http,target={url},model={model},"
                       "request_format=/v1/completions",
          "--profile", f"kind=concurrent,streams={streams}",
          "--data", data, "--seed", f"kind=static,value={seed}",
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
          "--constraint", f"kind=max_requests,count={requests}",
          "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def summarize(path: pathlib.Path) -> dict:
  """A guidellm report → output tokens/s (every successful request's output tokens over the
  run's duration), TTFT and ITL median and p99, requests done and failed."""
  b = json.loads(path.read_text())["benchmarks"][0]
  m = b["metrics"]
  tokens = m["output_token_count"]["successful"]
  out = {"output_tok_s": tokens["total_sum"] / b["duration"], "requests": tokens["count"],
         "failed": m["output_token_count"].get("errored", {}).get("count", 0)}
  for key, name in (("time_to_first_token_ms", "ttft_ms"), ("inter_token_latency_ms", "itl_ms")):
    s = m[key]["successful"]
    out[name] = {"median": s["median"], "p99": s["percentiles"]["p99"]}
  return out


def requests_for(streams: int) -> int:
  return max(8, 2 * streams)


def start(which: str, gguf: pathlib.Path, llama_exe: str, log, cache: pathlib.Path):
  port = server.free_port()
  t0 = time.time()
  if which == "ours":
    cmd = server.serve_command(gguf, {}, port, max_batch=PARALLEL, max_seq_len=MAX_SEQ)
    proc = server.launch(cmd, log, env={"BITDELTA_COMPILE_CACHE": str(cache)})
  else:
    proc = launch_llama_server(llama_exe, gguf, port, log, parallel=PARALLEL, ctx=MAX_SEQ)
  seconds = server.wait_healthy(proc, port, log, t0, poll_s=0.1)
  url = server.url_of(port)
  server.wait_all_buckets(url)  # ours: the background compile of the larger step buckets;
  # the runs measure the steady state
  return proc, url, seconds, time.time() - t0


def one_server(which: str, spec: dict, a, work: pathlib.Path, seed: int) -> dict:
  """Start ``which`` on the model, every run, peak RSS, stop: {"start_s", "peak_rss_mb",
  "unique": {c: summary}, "prefix": {c: summary}}."""
  tag = f"{spec['name']}_{which}_r{seed // 1000}"
  with open(work / f"{tag}.log", "w") as log:
    proc, url, start_s, all_s = start(which, spec["gguf"], a.llama_server, log,
                                      work / f"cache-{spec['name']}")
    model = "base" if which == "ours" else "model"
    res = {"start_s": round(start_s, 2), "all_ready_s": round(all_s, 2), "unique": {},
           "prefix": {}}
    try:
      runs = [("unique", c) for c in a.concurrency] + [("prefix", c) for c in a.prefix_concurrency]
      for i, (table, c) in enumerate(runs):
        out = work / f"{tag}_{table}_c{c}.json"
        cmd = guidellm_cmd(a.guidellm, url, model, spec["tokenizer"], c, requests_for(c),
                           seed + i, table == "prefix", out)
        p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if p.returncode:
          raise RuntimeError(f"guidellm failed on {which} {table} c{c}:\n{p.stderr[-3000:]}")
        res[table][str(c)] = summarize(out)
        print(which, spec["name"], table, c, json.dumps(res[table][str(c)]), flush=True)
      res["peak_rss_mb"] = round(server.process_mb(proc.pid)["peak"], 1)
    finally:
      server.stop_server(proc)
  return res


def median_runs(runs: list[dict]) -> dict:
  """Per table and concurrency, the median over rounds of each number."""
  out = {"start_s": statistics.median(r["start_s"] for r in runs),
         "all_ready_s": statistics.median(r["all_ready_s"] for r in runs),
         "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs)}
  for table in ("unique", "prefix"):
    out[table] = {}
    for c in runs[0][table]:
      rs = [r[table][c] for r in runs]
      out[table][c] = {
        "output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
        "ttft_ms": {q: statistics.median(r["ttft_ms"][q] for r in rs) for q in ("median", "p99")},
        "itl_ms": {q: statistics.median(r["itl_ms"][q] for r in rs) for q in ("median", "p99")},
        "failed": sum(r["failed"] for r in rs)}
  return out


def goals(res: dict) -> list[dict]:
  out = []
  for name, model, c, table, metric, op, bound in GOALS:
    med = res["models"].get(model, {}).get("median")
    if not med or str(c) not in med["ours"][table]:
      out.append({"goal": name, "ratio": None, "met": None})
      continue
    pick = (lambda s: s["output_tok_s"]) if metric == "output_tok_s" else (
      lambda s: s["ttft_ms"]["median"])
    ratio = pick(med["ours"][table][str(c)]) / pick(med["llama"][table][str(c)])
    out.append({"goal": name, "ratio": round(ratio, 2),
                "met": ratio >= bound if op == ">=" else ratio <= bound})
  return out


def decode_ms(s: dict, streams) -> float:
  """ms per output token after the first, from a run's medians: each of ``streams`` streams
  makes tok/s / streams tokens a second, so a request lasts streams·64 / tok/s; less its TTFT,
  over the 63 tokens after the first (both servers; needs no text between tokens)."""
  latency_ms = 1e3 * int(streams) * OUTPUT_TOKENS / s["output_tok_s"]
  return (latency_ms - s["ttft_ms"]["median"]) / (OUTPUT_TOKENS - 1)


def render(res: dict) -> str:
  lines = ["# Our server vs llama-server on the same GGUF file (guidellm 0.8.1)", "",
           f"`{res['command']}`. {res['machine_line']} Both servers use the 2 cores "
           "(llama-server `-t 2 -tb 2`; ours its pool of 2 threads); guidellm runs on the same "
           f"machine. {res['rounds']} rounds, server order rotating, medians. Prompts "
           f"{PROMPT_TOKENS} tokens (unique: a new seed per run) or {PREFIX_TOKENS} shared + "
           f"{SUFFIX_TOKENS} unique; {OUTPUT_TOKENS} output tokens, `ignore_eos`. "
           "Ratios: ours / llama-server.", ""]
  for m in res["models"].values():
    med = m["median"]
    lines += [f"## {m['label']}", "",
              f"Start to a 200 from /health (median over rounds; ours has a warm compile cache "
              f"from round 2): ours {med['ours']['start_s']:.1f} s (every step bucket compiled "
              f"{med['ours']['all_ready_s']:.1f} s; the runs start then), llama-server "
              f"{med['llama']['start_s']:.1f} s. "
              f"Peak RSS: ours {med['ours']['peak_rss_mb']:.0f} MiB, llama-server "
              f"{med['llama']['peak_rss_mb']:.0f} MiB.", ""]
    for table, title in (("unique", "unique prompts"), ("prefix", "a shared 96-token prefix")):
      cs = list(med["ours"][table])
      if not cs:
        continue
      lines += [f"### {title}", "",
                "| concurrency | out tok/s llama | ours | ratio | TTFT median ms llama | ours | "
                "ratio | TTFT p99 llama / ours | decode ms/token llama / ours | ITL median ms "
                "llama / ours | ITL p99 llama / ours | failed |", "|---|" + "---|" * 11]
      for c in cs:
        o, l_ = med["ours"][table][c], med["llama"][table][c]
        itl = lambda s, q: f"{s['itl_ms'][q]:.1f}" if s["itl_ms"]["median"] > 0 else "n/a"
        lines.append(
          f"| {c} | {l_['output_tok_s']:.1f} | {o['output_tok_s']:.1f} | "
          f"{o['output_tok_s'] / l_['output_tok_s']:.2f}× | {l_['ttft_ms']['median']:.0f} | "
          f"{o['ttft_ms']['median']:.0f} | "
          f"{o['ttft_ms']['median'] / l_['ttft_ms']['median']:.2f}× | "
          f"{l_['ttft_ms']['p99']:.0f} / {o['ttft_ms']['p99']:.0f} | "
          f"{decode_ms(l_, c):.0f} / {decode_ms(o, c):.0f} | "
          f"{itl(l_, 'median')} / {itl(o, 'median')} | {itl(l_, 'p99')} / {itl(o, 'p99')} | "
          f"{l_['failed']} / {o['failed']} |")
      lines.append("")
  lines += ["ITL n/a: guidellm saw no text between tokens (llama-server streams a random-weight "
            "model's tokens as empty pieces of incomplete UTF-8, so only their count, from "
            "`usage`, and the first chunk's time are known). Decode ms/token is derived from "
            "the medians for both (`decode_ms`: a request lasts concurrency·64 / tok/s; less "
            "its TTFT, over 63 tokens).", "",
            "## Goals (issue 47)", "", "| goal | ratio | |", "|---|---|---|"]
  for g in res["goals"]:
    mark = "not run" if g["met"] is None else ("met" if g["met"] else "**missed**")
    lines.append(f"| {g['goal']} | {g['ratio'] if g['ratio'] is not None else '–'} | {mark} |")
  return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(res["models"])
  fig, axes = plt.subplots(1, 2 * len(models), figsize=(5 * len(models) * 2, 3.6), squeeze=False)
  for j, name in enumerate(models):
    med = res["models"][name]["median"]
    cs = list(med["ours"]["unique"])
    for k, (metric, title) in enumerate((("output_tok_s", "output tok/s"),
                                         ("ttft_ms", "TTFT median, ms"))):
      ax = axes[0][2 * j + k]
      for i, who in enumerate(SERVERS):
        vals = [med[who]["unique"][c][metric] if metric == "output_tok_s"
                else med[who]["unique"][c][metric]["median"] for c in cs]
        xs = [x + 0.4 * i for x in range(len(cs))]
        ax.bar(xs, vals, width=0.38, label="ours" if who == "ours" else "llama-server")
      ax.set_xticks([x + 0.2 for x in range(len(cs))], [f"c{c}" for c in cs])
      ax.set_title(f"{res['models'][name]['label']}: {title}", fontsize=9)
      ax.legend(fontsize=8)
  fig.suptitle(f"unique prompts, guidellm; {res['machine_line']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


LABELS = {"smollm2": "SmolLM2-135M-Instruct, the shipped Q4_1 file",
          "1b_q4_0": "1B-shaped Llama, Q4_0 (random weights)",
          "7b_q4_0": "7B-shaped Llama, Q4_0 (random weights)"}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--guidellm", required=True, help="the guidellm executable (0.8.1)")
  p.add_argument("--llama-server", default=llama_server_binary(),
                 help="llama.cpp's llama-server (default $LLAMA_SERVER)")
  p.add_argument("--models", nargs="+", default=["smollm2", "1b_q4_0"])
  p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16])
  p.add_argument("--prefix-concurrency", nargs="*", type=int, default=[1, 8])
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--work", default=str(pathlib.Path(tempfile.gettempdir()) / "serve_vs_llama"))
  p.add_argument("--render", action="store_true", help="rewrite the markdown from the JSON")
  a = p.parse_args(argv)
  out_dir = results_dir("serving")
  if a.render:
    res = json.loads((out_dir / "serve_vs_llama.json").read_text())
    (out_dir / "serve_vs_llama.md").write_text(render(res))
    plot(res, out_dir / "serve_vs_llama.png")
    return 0
  if not a.llama_server:
    raise SystemExit("--llama-server PATH (or $LLAMA_SERVER) is required")
  work = pathlib.Path(a.work)
  work.mkdir(parents=True, exist_ok=True)
  files = model_files(a.models, work)
  mach = describe()
  res = {"machine": mach, "machine_line": machine_line({"machine": mach}), "rounds": a.rounds,
         "command": "python -m bench serve_vs_llama " + " ".join(
           f"--models {' '.join(a.models)} --concurrency {' '.join(map(str, a.concurrency))} "
           f"--rounds {a.rounds}".split()),
         "guidellm": "0.8.1", "models": {}}
  for name, f in files.items():
    spec = {"name": name, **f}
    runs = {w: [] for w in SERVERS}
    for r in range(a.rounds):
      order = SERVERS if r % 2 == 0 else SERVERS[::-1]
      for which in order:
        # the same prompts for both servers within a round (each a fresh process: no cache
        # carries over), new ones every round and every run
        runs[which].append(one_server(which, spec, a, work, seed=1000 * (r + 1)))
    res["models"][name] = {"label": LABELS[name], "gguf": str(f["gguf"]), "runs": runs,
                           "median": {w: median_runs(runs[w]) for w in SERVERS}}
    report.write_json(out_dir / "serve_vs_llama.json", {**res, "goals": goals(res)}, indent=1)
  res["goals"] = goals(res)
  report.write_json(out_dir / "serve_vs_llama.json", res, indent=1)
  (out_dir / "serve_vs_llama.md").write_text(render(res))
  plot(res, out_dir / "serve_vs_llama.png")
  print(render(res))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
