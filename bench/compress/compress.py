"""Compression throughput vs plain reading, and peak RSS, on a synthetic ~1.3 GB HF pair.

    python -m bench compress [--layers 4] [--repeats 3]

Reading and compressing are interleaved in one run (page cache warm for both), medians and the
ratio are reported. Peak RSS is measured in a fresh subprocess that only compresses.
Writes bench/results/compress/compress.json and compress.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.common.machine import describe
from bench.common.paths import ROOT, results_dir
from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.synthetic import SyntheticConfig, write_pair

RESULTS = results_dir("compress")


def read_all(*dirs) -> int:
  """Reads every tensor of every checkpoint in 32 MB row blocks (the compressor's own reads)."""
  n = 0
  for d in dirs:
    with CheckpointReader(d) as r:
      for name in r.names():
        t = r.info(name)
        rows = t.shape[0] if t.shape else 1
        step = max(1, (32 << 20) // max(1, t.nbytes // max(rows, 1)))
        for r0 in range(0, rows, step):
          n += r.read_rows(name, r0, r0 + step).nbytes
  return n


def drop_caches() -> bool:
  """Empties the page cache (needs root); False where that is not allowed."""
  try:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def child(base, ft, out):
  t = time.perf_counter()
  compress_checkpoints(base, ft, out, CompressPolicy(), progress=False, overwrite=True)
  dt = time.perf_counter() - t
  print(json.dumps({"seconds": dt, "peak_rss": peak_rss()}))


def peak_rss() -> int:
  """VmHWM of this process (ru_maxrss would include the parent's RSS from before exec)."""
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
      return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--child", nargs=3)
  a = ap.parse_args()
  if a.child:
    return child(*a.child)
  cfg = SyntheticConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                        num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=4)
  tmp = Path(tempfile.mkdtemp(prefix="bitdelta-bench-"))
  try:
    t = time.perf_counter()
    base, ft = write_pair(tmp, cfg, seed=0, max_shard_bytes=256 << 20)
    print(f"wrote the pair in {time.perf_counter() - t:.1f}s")
    with CheckpointReader(ft) as r:
      ft_bytes = sum(r.info(n).nbytes for n in r.names())
      sizes = sorted((r.info(n).nbytes for n in r.names()), reverse=True)
    with CheckpointReader(base) as r:
      base_bytes = sum(r.info(n).nbytes for n in r.names())
    read_all(base, ft)  # warm the page cache
    reads, comps = [], []
    out = tmp / "delta"
    for _ in range(a.repeats):
      t = time.perf_counter()
      read_all(base, ft)
      reads.append(time.perf_counter() - t)
      t = time.perf_counter()
      m = compress_checkpoints(base, ft, out, CompressPolicy(), progress=False, overwrite=True)
      comps.append(time.perf_counter() - t)
    cold_reads, cold_comps = [], []
    for i in range(2 if drop_caches() else 0):  # cold: every byte comes from the disk
      drop_caches()
      t = time.perf_counter()
      read_all(base, ft)
      cold_reads.append(time.perf_counter() - t)
      drop_caches()
      t = time.perf_counter()
      compress_checkpoints(base, ft, tmp / f"cold{i}", CompressPolicy(), progress=False)
      cold_comps.append(time.perf_counter() - t)
    r = subprocess.run([sys.executable, "-m", "bench.compress.compress", "--child", str(base),
                        str(ft), str(tmp / "d2")], capture_output=True, text=True, check=True,
                       cwd=ROOT)
    ch = json.loads(r.stdout.strip().splitlines()[-1])
    # What just importing jax and the package costs, for context.
    r0 = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp, bitdelta_jax.delta.stream; "
                         "jnp.ones(4).block_until_ready(); "
                         "from bench.compress.compress import peak_rss; "
                         "print(peak_rss())"], capture_output=True, text=True, check=True,
                        cwd=ROOT)
    baseline = int(r0.stdout.strip())
    tot = m["report"]["totals"]
    read_s, comp_s = statistics.median(reads), statistics.median(comps)
    goal_rss = sum(sizes[:3]) + (300 << 20)
    res = {
      "machine": describe(),
      "config": cfg.__dict__,
      "ft_bytes": ft_bytes, "base_bytes": base_bytes,
      "read_seconds_median": read_s, "compress_seconds_median": comp_s,
      "read_gbps_ft": ft_bytes / read_s / 1e9, "compress_gbps_ft": ft_bytes / comp_s / 1e9,
      "compress_over_read_speed": read_s / comp_s,
      "peak_rss_bytes": ch["peak_rss"], "import_baseline_rss_bytes": baseline,
      "three_largest_tensors_bytes": sum(sizes[:3]), "rss_goal_bytes": goal_rss,
      "linear_ratio": tot["linear_ratio"],
      "linear_bytes_after_over_before": tot["linear_bytes_after"] / tot["linear_bytes_before"],
      "reads": reads, "compressions": comps,
      "cold_read_seconds": cold_reads, "cold_compress_seconds": cold_comps,
      "cold_compress_over_read_speed": (statistics.median(cold_reads) / statistics.median(cold_comps)
                                        if cold_reads else None),
    }
    RESULTS.mkdir(exist_ok=True)
    report.write_json(RESULTS / "compress.json", res, indent=1)
    mb = 1 << 20
    md = [
      "# Compression throughput and memory", "",
      f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, jax "
      f"{res['machine'].get('jax')}. Pair: synthetic Llama-style bf16, {cfg.num_hidden_layers} "
      f"layers, hidden {cfg.hidden_size}, ft {ft_bytes / 1e9:.2f} GB + base {base_bytes / 1e9:.2f} GB "
      f"(sharded, 256 MB shards). Page cache warm; median of {a.repeats} interleaved runs.", "",
      "| measure | value |", "|---|---|",
      f"| read base+ft (s) | {read_s:.2f} |",
      f"| compress (s) | {comp_s:.2f} |",
      f"| read throughput (GB of ft / s) | {res['read_gbps_ft']:.2f} |",
      f"| compress throughput (GB of ft / s) | {res['compress_gbps_ft']:.2f} |",
      f"| **compress / read speed, page cache warm** (goal ≥ 0.5) | "
      f"**{res['compress_over_read_speed']:.2f}** |",
      (f"| cold cache (caches dropped): read {statistics.median(cold_reads):.2f} s, compress "
       f"{statistics.median(cold_comps):.2f} s | **{res['cold_compress_over_read_speed']:.2f}** |"
       if cold_reads else "| cold cache | not measured (cannot drop caches) |"),
      f"| peak RSS (MB) | {ch['peak_rss'] / mb:.0f} |",
      f"| of which importing jax + package (MB) | {baseline / mb:.0f} |",
      f"| goal: 3 largest tensors + 300 MB (MB) | {goal_rss / mb:.0f} |",
      f"| linear delta bytes / bf16 linear bytes (goal ≤ 1/15 = 0.0667) | "
      f"{res['linear_bytes_after_over_before']:.4f} |",
    ]
    (RESULTS / "compress.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
