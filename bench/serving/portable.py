"""Realistic variants over a quantized base (issue 49 item 7) → bench/results/serving/portable.{json,md}.

    python -m bench portable                       # build (cached in --work), then measure
    python -m bench portable --rounds 1 --tokens 8 --quick --out /tmp/p   # smoke

Variants made the way users make them, not random bits: a 1B-shaped Llama (hidden 2048, 16
layers, 32 heads / 8 KV heads, intermediate 8192, vocabulary 49152, tied embeddings: SmolLM2's
layout at 1B) with random bf16 weights is the "release"; each fine-tune is that checkpoint with
every linear weight moved by 0.3% of its spread (Gaussian), the norms by 1%, and the embedding
(which is also the LM head) left unchanged, written as a bf16 checkpoint; one more fine-tune
(``vemb``) also moves its embedding by 0.3%. The served bases are the release's Q4_0 and Q8_0
GGUFs written by ``bitdelta quantize`` (which records the release as their source). Deltas:

* ``portable``: ``bitdelta compress --base RELEASE`` (Δ against the bf16 source), ONE directory
  per fine-tune, served over both GGUFs (the lineage the files record lets them load);
* ``vs_q4_0``: ``bitdelta compress --base release.Q4_0.gguf`` without the source (Δ against the
  blocks; tensors that requantize to the file's blocks, the embedding here, kept as the base's).

Measured per format, one server at a time holding 5 variants (4 + vemb) in 5 device slots, in
interleaved rounds (`harness.interleaved`), default activations (int8): one stream of the base,
of ``v0`` and of ``vemb``; 8 concurrent on the base and 8 spread over v0..v3 (2 each); every
request greedy, exactly ``--tokens`` tokens (``ignore_eos``), streamed (TTFT recorded). Memory:
each server's peak and resident RSS, and a server of the same file without variants, so the
variants' resident cost can be set against their delta bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench.common.paths import ROOT, results_dir

SHAPE = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
FORMATS = ("q4_0", "q8_0")
N_VARIANTS = 4
LINEAR_NOISE, NORM_NOISE = 0.003, 0.01
PROMPT = ("You are a helpful assistant. Summarise the following paragraph in two sentences, "
          "keeping every number it mentions. Paragraph {tag}: the harbour of the old town "
          "handled 1,250 ships in 1898, twice the traffic of 1880, and its warehouses held "
          "grain, timber and wool for the inland markets until the railway reached the valley.")
DEFAULT_WORK = pathlib.Path(tempfile.gettempdir()) / "bitdelta_portable_bench"


def _cli(*args) -> None:
  subprocess.run([sys.executable, "-m", "bitdelta_jax.cli", *args], check=True, cwd=ROOT)


def write_release(out: pathlib.Path, seed: int = 0) -> None:
  """The bf16 "release", written tensor by tensor (`random_models.llama_specs`' layout, tied head)."""
  import ml_dtypes
  import numpy as np

  from bench.common.random_models import llama_specs
  from bitdelta_jax.hf.safetensors_io import SafetensorsWriter
  from bitdelta_jax.synthetic import SyntheticConfig
  from bitdelta_jax.zoo.tokenizer_build import write_tokenizer

  c = SyntheticConfig(**SHAPE)
  specs, lin = llama_specs(c)  # tied: no lm_head
  bf16 = np.dtype(ml_dtypes.bfloat16)
  r = np.random.default_rng(seed)
  tmp = out.with_name(out.name + ".partial")
  tmp.mkdir(parents=True, exist_ok=True)
  with SafetensorsWriter(tmp / "model.safetensors", {n: (s, bf16) for n, s in specs.items()},
                         {"format": "pt"}) as w:
    for name, s in specs.items():
      if len(s) == 1:
        v = 1.0 + 0.1 * r.standard_normal(s, np.float32)
      elif name in lin:
        v = r.standard_normal(s, np.float32) / np.sqrt(s[1])
      else:
        v = 0.02 * r.standard_normal(s, np.float32)
      w.write(name, v.astype(bf16))
  (tmp / "config.json").write_text(json.dumps(c.hf_config(), indent=2))
  write_tokenizer(tmp)
  os.rename(tmp, out)


def write_finetune(release: pathlib.Path, out: pathlib.Path, seed: int, *,
                   embedding: bool) -> None:
  """``release`` with every linear weight + 0.3% of its spread, norms + 1%, the embedding
  unchanged unless ``embedding`` (then + 0.3% too); bf16, tensor by tensor."""
  import shutil

  import ml_dtypes
  import numpy as np

  from bitdelta_jax.hf.safetensors_io import CheckpointReader, SafetensorsWriter

  bf16 = np.dtype(ml_dtypes.bfloat16)
  r = np.random.default_rng(seed)
  tmp = out.with_name(out.name + ".partial")
  tmp.mkdir(parents=True, exist_ok=True)
  with CheckpointReader(release) as src, SafetensorsWriter(
      tmp / "model.safetensors", {n: (src.info(n).shape, bf16) for n in src.names()},
      {"format": "pt"}) as w:
    for name in src.names():
      v = src.read(name)
      if name == "model.embed_tokens.weight" and not embedding:
        w.write(name, v)
        continue
      f = v.astype(np.float32)
      if f.ndim == 1:
        f *= 1.0 + NORM_NOISE * r.standard_normal(f.shape, np.float32)
      else:
        f += LINEAR_NOISE * float(f.std()) * r.standard_normal(f.shape, np.float32)
      w.write(name, f.astype(bf16))
  for f in release.iterdir():
    if f.suffix != ".safetensors":
      shutil.copy2(f, tmp / f.name)
  os.rename(tmp, out)


def _dir_bytes(path) -> int:
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def build(work: pathlib.Path) -> dict:
  """Everything the measurements serve, cached under ``work``; fine-tunes are deleted once
  compressed (their sizes kept)."""
  work.mkdir(parents=True, exist_ok=True)
  info_file = work / "built.json"
  info = json.loads(info_file.read_text()) if info_file.exists() else {}
  release = work / "release-bf16"
  if not release.exists():
    print("writing the bf16 release", flush=True)
    write_release(release)
  ggufs = {f: work / f"release.{f.upper()}.gguf" for f in FORMATS}
  for fmt, g in ggufs.items():
    if not g.exists():
      print(f"quantizing {g.name}", flush=True)
      _cli("quantize", "--base", str(release), "--format", fmt, "--out", str(g), "--quiet")
  names = [f"v{i}" for i in range(N_VARIANTS)] + ["vemb"]
  info.setdefault("finetune_bytes", {})
  info.setdefault("compress_s", {})
  for i, name in enumerate(names):
    d = work / f"{name}-portable"
    q = work / f"{name}-vs-q4_0"
    if d.exists() and (q.exists() or name not in ("v0", "vemb")):
      continue
    ft = work / f"{name}-ft"
    if not ft.exists():
      print(f"writing fine-tune {name}", flush=True)
      write_finetune(release, ft, 100 + i, embedding=name == "vemb")
    info["finetune_bytes"][name] = _dir_bytes(ft)
    if not d.exists():
      t0 = time.time()
      _cli("compress", "--base", str(release), "--finetuned", str(ft), "--out", str(d), "--quiet")
      info["compress_s"][f"{name}-portable"] = time.time() - t0
    if name in ("v0", "vemb") and not q.exists():  # against the Q4_0 file, no source given
      t0 = time.time()
      _cli("compress", "--base", str(ggufs["q4_0"]), "--finetuned", str(ft), "--out", str(q),
           "--quiet")
      info["compress_s"][f"{name}-vs-q4_0"] = time.time() - t0
    subprocess.run(["rm", "-rf", str(ft)], check=True)
    info_file.write_text(json.dumps(info, indent=1))
  return {"release": release, "ggufs": ggufs, "names": names, "info": info,
          "portable": {n: work / f"{n}-portable" for n in names},
          "vs_q4_0": {n: work / f"{n}-vs-q4_0" for n in ("v0", "vemb")}}


def _manifest_sizes(delta_dir) -> dict:
  from bitdelta_jax.delta.store import read_manifest

  m = read_manifest(delta_dir)
  kinds: dict[str, int] = {}
  for t in m["report"]["tensors"]:
    kinds[t["kind"]] = kinds.get(t["kind"], 0) + t["bytes_after"]
  emb = next(t for t in m["report"]["tensors"] if t["name"] == "model.embed_tokens.weight")
  return {"bytes": _dir_bytes(delta_dir), "by_kind": kinds, "embedding": emb["kind"],
          "embedding_bytes": emb["bytes_after"], "base": m["base"].get("quantization")}


def _stream(port: int, jobs: list[tuple[str, str]], tokens: int) -> list[dict]:
  from bench.common.load import run_requests

  recs, _ = asyncio.run(run_requests(f"http://127.0.0.1:{port}", jobs, len(jobs), tokens))
  return recs


def measure(built: dict, args, work: pathlib.Path) -> dict:
  from harness import interleaved

  from bench.common.server import free_port, launch_server, process_mb, stop_server, wait_healthy

  names = built["names"]
  servers = {fmt: (g, {n: str(built["portable"][n]) for n in names})
             for fmt, g in built["ggufs"].items()}
  servers["q4_0_novariants"] = (built["ggufs"]["q4_0"], {})
  procs, ports, start_s = {}, {}, {}
  res: dict = {"ttft_s": {}}
  ttfts: dict[str, list[float]] = {}
  try:
    for name, (g, vs) in servers.items():  # one at a time: a start-up compiles on both cores
      ports[name] = free_port()
      log = open(work / f"{name}.log", "w")
      t0 = time.time()
      procs[name] = launch_server(g, vs, ports[name], log, device_slots=max(1, len(vs)))
      start_s[name] = wait_healthy(procs[name], ports[name], log, t0, timeout_s=3600)
      print(f"  {name} up in {start_s[name]:.0f} s", flush=True)
    counter = iter(range(10**9))
    fns, made = {}, {}

    def scenario(key, port, models):
      def run():
        tag = next(counter)
        recs = _stream(port, [(m, PROMPT.format(tag=f"{tag}-{i}")) for i, m in enumerate(models)],
                       args.tokens)
        ttfts.setdefault(key, []).extend(r["ttft"] for r in recs)
        return recs
      fns[key], made[key] = run, args.tokens * len(models)

    for fmt in FORMATS:
      p = ports[fmt]
      scenario(fmt, p, ["base"])
      scenario(f"{fmt}_variant", p, ["v0"])
      scenario(f"{fmt}_variant_emb", p, ["vemb"])
      scenario(f"{fmt}_conc8", p, ["base"] * 8)
      scenario(f"{fmt}_conc8_4var", p, [f"v{i % N_VARIANTS}" for i in range(8)])
    t = interleaved(fns, args.rounds, block=lambda out: out)
    res["tokens_per_s"] = {k: made[k] / t.median(k) for k in fns}
    res["median_s"] = {k: t.median(k) for k in fns}
    res["ttft_s"] = {k: sorted(v)[len(v) // 2] for k, v in ttfts.items()}
    res["memory_mb"] = {k: process_mb(p.pid) for k, p in procs.items()}
    res["server_start_s"] = start_s
    res["wall_s"] = t.wall
  finally:
    for p in procs.values():
      stop_server(p)
  return res


GOALS = [  # (what, value key, goal, at least?)
  ("a realistic variant's one stream vs the base's, Q4_0", "q4_0_variant/q4_0", 0.85),
  ("a realistic variant's one stream vs the base's, Q8_0", "q8_0_variant/q8_0", 0.85),
  ("8 concurrent over 4 variants vs 8 on the base, Q4_0", "q4_0_conc8_4var/q4_0_conc8", 0.85),
  ("8 concurrent over 4 variants vs 8 on the base, Q8_0", "q8_0_conc8_4var/q8_0_conc8", 0.85),
]


def report(res: dict) -> list[str]:
  from bench.common.machine import machine_line

  tps = res["tokens_per_s"]
  ratio = {f"{a}/{b}": tps[a] / tps[b] for a, b in (k.split("/") for _, k, _ in GOALS)}
  for fmt in FORMATS:
    ratio[f"{fmt}_variant_emb/{fmt}"] = tps[f"{fmt}_variant_emb"] / tps[fmt]
  res["ratios"] = ratio
  sz = res["sizes"]
  L = ["# Realistic variants over a quantized base (1B-shaped Llama, Q4_0 and Q8_0)", "",
       machine_line(res) + f" Commit {res['commit']}, {res['run_at']}.", "",
       "`python -m bench portable` (module docstring: how the release, its fine-tunes and "
       "GGUFs are made). Fine-tunes: every linear weight + 0.3% of its spread, norms + 1%, "
       "embedding (= the tied LM head) unchanged; `vemb` also moves its embedding 0.3%. "
       f"{res['rounds']} interleaved rounds, medians; {res['tokens']} greedy tokens per request "
       "(ignore_eos), streamed; default activations (int8).", "",
       "## Delta size", "",
       "| delta | compressed against | bytes on disk | vs the bf16 fine-tune | embedding |",
       "|---|---|---:|---:|---|"]
  for key, label in (("portable", "the bf16 source (served over Q4_0 and Q8_0)"),
                     ("vs_q4_0", "the Q4_0 file, no source given")):
    for n, s in sz[key].items():
      ft = res["finetune_bytes"][n]
      L.append(f"| {n} | {label} | {s['bytes'] / 1e6:.1f} MB | {ft / s['bytes']:.1f}x smaller | "
               f"{s['embedding']} ({s['embedding_bytes'] / 1e6:.1f} MB) |")
  L += ["", "## Speed (output tokens/s)", "",
        "| scenario | Q4_0 | Q8_0 | TTFT p50 Q4_0 (s) | TTFT p50 Q8_0 (s) |", "|---|---:|---:|---:|---:|"]
  for suffix, label in (("", "base, one stream"), ("_variant", "variant v0, one stream"),
                        ("_variant_emb", "variant vemb (changed embedding), one stream"),
                        ("_conc8", "base, 8 concurrent"),
                        ("_conc8_4var", "8 concurrent over v0..v3 (2 each)")):
    row = [f"{tps[f'{f}{suffix}']:.1f}" for f in FORMATS]
    tt = [f"{res['ttft_s'].get(f'{f}{suffix}', float('nan')):.2f}" for f in FORMATS]
    L.append(f"| {label} | {' | '.join(row)} | {' | '.join(tt)} |")
  mem = res["memory_mb"]
  n_var = len(sz["portable"])
  per_slot = (mem["q4_0"]["now"] - mem["q4_0_novariants"]["now"]) / n_var
  delta_mb = sum(s["bytes"] for s in sz["portable"].values()) / n_var / 2**20
  res["per_variant_resident_mb"] = per_slot
  L += ["", "## Memory", "",
        "| server | peak RSS (MB) | resident after the rounds (MB) | start (s) |",
        "|---|---:|---:|---:|"]
  for k, m in mem.items():
    L.append(f"| {k} | {m['peak']:.0f} | {m['now']:.0f} | {res['server_start_s'][k]:.0f} |")
  L += ["", f"Resident cost per variant (Q4_0 server with {n_var} variants in {n_var} slots minus "
        f"the same file without variants, / {n_var}): {per_slot:.0f} MB, against "
        f"{delta_mb:.0f} MB of delta on disk ({per_slot / delta_mb:.2f}x; the host cache "
        f"also keeps a copy of each loaded delta: `--host-cache-mb`).", "", "## Goals", ""]
  for what, key, goal in GOALS:
    v = ratio[key]
    L.append(f"- {what}: {v:.2f}x ({'met' if v >= goal else 'missed'}, goal >= {goal})")
  best = min(res["finetune_bytes"][n] / s["bytes"] for n, s in sz["portable"].items())
  L.append(f"- delta vs its bf16 fine-tune, smallest ratio over the portable deltas: {best:.1f}x "
           f"({'met' if best >= 14 else 'missed'}, goal >= 14)")
  return L


def main(argv=None) -> int:
  from bench.common.report import write

  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--work", default=str(DEFAULT_WORK))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--build-only", action="store_true")
  p.add_argument("--quick", action="store_true", help="(smoke) results not written to bench/")
  p.add_argument("--out", default=None, help="results directory (default bench/results/serving)")
  a = p.parse_args(argv)
  work = pathlib.Path(a.work)
  built = build(work)
  if a.build_only:
    return 0
  res = measure(built, a, work)
  res["sizes"] = {"portable": {n: _manifest_sizes(d) for n, d in built["portable"].items()},
                  "vs_q4_0": {n: _manifest_sizes(d) for n, d in built["vs_q4_0"].items()}}
  res["finetune_bytes"] = built["info"]["finetune_bytes"]
  res["compress_s"] = built["info"]["compress_s"]
  res["rounds"], res["tokens"], res["shape"] = a.rounds, a.tokens, SHAPE
  res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, cwd=ROOT).stdout.strip()
  res["run_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
  lines = report(res)
  if a.quick and not a.out:
    print("\n".join(lines))
    return 0
  write(pathlib.Path(a.out or results_dir("serving")) / "portable", res, lines)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
