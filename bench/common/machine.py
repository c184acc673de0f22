"""A short description of the machine, saved beside every benchmark result."""

from __future__ import annotations

import os
import platform


def describe() -> dict:
  cpu = "unknown"
  flags: list[str] = []
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name") and cpu == "unknown":
        cpu = line.split(":", 1)[1].strip()
      elif line.startswith("flags") and not flags:
        # the vector extensions the CPU kernels choose by (machines of one name differ)
        have = set(line.split(":", 1)[1].split())
        flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in have]
      if cpu != "unknown" and flags:
        break
  except OSError:
    pass
  mem = None
  try:
    for line in open("/proc/meminfo"):
      if line.startswith("MemTotal"):
        mem = round(int(line.split()[1]) / 1024 / 1024, 1)
  except OSError:
    pass
  caches = {}  # the last-level cache decides what "far larger than the cache" means
  base = "/sys/devices/system/cpu/cpu0/cache"
  try:
    for idx in sorted(os.listdir(base)):
      if not idx.startswith("index"):
        continue
      level = open(f"{base}/{idx}/level").read().strip()
      kind = open(f"{base}/{idx}/type").read().strip()
      if kind != "Instruction":
        caches[f"L{level}"] = open(f"{base}/{idx}/size").read().strip()
  except OSError:
    pass
  out = {"cpu": cpu, "caches": caches, "cpu_flags": flags, "cores": os.cpu_count(), "mem_gib": mem, "python": platform.python_version(),
         "platform": platform.platform()}
  try:
    import jax

    out["jax"] = jax.__version__
    out["backend"] = jax.default_backend()
    out["devices"] = [str(d) for d in jax.devices()]
  except Exception:  # noqa: BLE001 - describing the machine must never fail a bench
    pass
  return out


def machine_line(res: dict) -> str:
  """"Machine: <cpu>, <n> cores, jax <version> (<backend>)." for a results table's header."""
  m = res.get("machine") or describe()
  return f"Machine: {m['cpu']}, {m['cores']} cores, jax {m.get('jax')} ({m.get('backend')})."
