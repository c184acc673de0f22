"""Merging benchmarks on the built-in family (issue 8 part 5).

**soups** (`--part soups`): four variants of the same full fine-tune of the base on a task
(the recipe's: embeddings / LM head frozen, Adam, same data stream): no averaging; naive
checkpoint averaging (every ``every`` steps, params ← mean of the checkpoints taken every
``every/avg_window`` steps within that period, the current one included); `SvdSoupHook`
(params ← svd_soup(start, [params, best], rank) every ``every`` steps, "best" by a validation
loss on training-distribution examples, checked every ``every/avg_window`` steps); MonoSoup
(params ← monosoup(start, params) every ``every`` steps, i.e. applied to the update from the
run's start point). A merge also happens at the last step, so the evaluated model is the merged
one. Measured: smoothness (std of the step-to-step change of the training loss, whole run and
second half), final held-out exact match and NLL. The loop is the library's
(`bitdelta_jax.merge.soup_training.soup_train`, shared with bench/merge/soups_real.py).

**kmerge** (`--part kmerge`): one LoRA fine-tune of the base per task (q/v/up/down projections),
then for each of ``seeds`` shuffled arrival orders and K = 1..#tasks a pool is fed the adapters
one by one and every task is scored with the adapter that serves it; normalised score = exact
match of that adapter / exact match of the task's own LoRA, averaged over tasks. Methods:
K-Merge (`KMergePool`, OPCM merge), K-Merge++ (`plusplus=True`), random assignment (same pool,
but a new adapter merges into a uniformly random member instead of the most similar one; mean
of ``random_draws`` draws per order), and task-oracle clustering (the partition of the tasks
into K groups, each merged with the same OPCM recurrence in arrival order, with the best mean
normalised score: an upper bound for any assignment, found by enumerating every partition).
The byte budget is K adapters, so only K binds. A merged member's adapter depends only on the
ordered list of tasks merged into it, so scores are cached by that list.

    python -m bench merge_builtin [--part soups|kmerge|both] [--base DIR] [--micro]

Writes bench/results/merge/merge_soups.{json,md,png} and bench/results/merge/kmerge.{json,md,png}
(``--out-prefix`` changes the names, e.g. for the micro smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import pathlib
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.common import report
from bench.common.paths import results_dir
from bitdelta_jax.merge.lora import LoraAdapter, from_factors, load_adapter, save_adapter
from bitdelta_jax.merge.soup_training import SoupSchedule, copy_tree, soup_train
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models.loading import hf_name
from bitdelta_jax.zoo.data import batch_examples
from bitdelta_jax.zoo.evaluate import exact_match_and_nll
from bitdelta_jax.zoo.recipe import _labels, _task_batches
from bitdelta_jax.zoo.tasks import TASKS
from bitdelta_jax.zoo.train import masked_xent

RESULTS = results_dir("merge")

VARIANTS = ("none", "naive", "svd_soup", "monosoup")


@dataclasses.dataclass(frozen=True)
class SoupConfig:
  tasks: tuple[str, ...] = ("nano-math", "nano-upper", "nano-recall")
  steps: int = 240
  every: int = 40  # merge period N
  avg_window: int = 4  # checkpoints per period (naive averaging) / validation checks per period
  svd_rank: int = 8
  batch: int = 32
  seq: int = 40
  lr: float = 3e-4
  n_val: int = 64  # training-distribution validation examples (SvdSoupHook's score)
  n_eval: int = 128  # held-out examples
  seed: int = 0

  @classmethod
  def micro(cls) -> SoupConfig:
    return cls(
      tasks=("nano-math", "nano-reverse"),
      steps=12,
      every=6,
      avg_window=3,
      svd_rank=2,
      batch=8,
      n_val=8,
      n_eval=16,
    )


@dataclasses.dataclass(frozen=True)
class KMergeConfig:
  tasks: tuple[str, ...] = tuple(TASKS)
  steps: int = 300
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q_proj", "v_proj", "up_proj", "down_proj")
  batch: int = 32
  seq: int = 40
  lr: float = 5e-3
  n_eval: int = 128
  seeds: int = 3
  random_draws: int = 5
  opcm_alpha: float = 0.5
  # K-Merge++ thresholds: the library default, and one between the similarities of related
  # tasks (reverse/sort/coder, math/recall: 0.02-0.04) and the rest (< 0.01) on the shipped base
  pp_thresholds: tuple[float, ...] = (0.5, 0.02)
  seed: int = 0

  @classmethod
  def micro(cls) -> KMergeConfig:
    return cls(
      tasks=("nano-math", "nano-reverse", "nano-upper"),
      steps=10,
      rank=2,
      alpha=4.0,
      batch=8,
      n_eval=16,
      seeds=2,
      random_draws=2,
      pp_thresholds=(0.0,),
    )

  def methods(self) -> tuple[str, ...]:
    return ("kmerge", *(f"kmerge++@{t:g}" for t in self.pp_thresholds), "random", "oracle")


# ---------------------------------------------------------------- model plumbing


@dataclasses.dataclass
class Base:
  graphdef: object
  rest: object
  params: dict  # pure nested dict, f32, flax layout (kernels [in, out])
  modules: dict  # HF module name ('model.layers.0.self_attn.q_proj') -> (in, out)

  def model(self, params=None):
    return nnx.merge(self.graphdef, self.params if params is None else params, self.rest)


def load_base(base_dir) -> Base:
  model = from_pretrained(base_dir, dtype=jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  modules = {}
  for kp, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
    name, transposed = hf_name(tuple(k.key for k in kp))
    if transposed:
      modules[name.removesuffix(".weight")] = tuple(leaf.shape)
  return Base(graphdef, rest, pure, modules)


def add_kernel_deltas(params, deltas: dict):
  """params with kernel += delta for {HF module name: delta [in, out]} (traceable)."""

  def one(kp, leaf):
    name, transposed = hf_name(tuple(k.key for k in kp))
    d = deltas.get(name.removesuffix(".weight")) if transposed else None
    return leaf if d is None else leaf + d

  return jax.tree_util.tree_map_with_path(one, params)


def task_eval(base: Base, params, examples) -> tuple[float, float]:
  return exact_match_and_nll(base.model(params), examples, batch=len(examples))


def val_examples(task, n: int, seed: int):
  rng = random.Random(f"{task.name}:benchval:{seed}")
  return [task.example(rng) for _ in range(n)]


# ---------------------------------------------------------------- (a) soups


# merge_bench's variant names → the library's soup methods (`merge.soup_training`)
SOUP_METHOD = {"none": "none", "naive": "average", "svd_soup": "svd", "monosoup": "monosoup"}


def soup_run(base: Base, task_name: str, variant: str, cfg: SoupConfig, step_fn, loss_fn) -> dict:
  task = TASKS[task_name]
  if cfg.steps % cfg.every:
    raise ValueError("steps must be a multiple of every (the last step merges)")
  opt = _soup_optimizer(cfg)
  start = base.params
  params = copy_tree(start)
  batches = _task_batches(task, cfg.batch, cfg.seq, cfg.seed)  # the same stream for every variant
  vt, vm = (
    jnp.asarray(x) for x in batch_examples(val_examples(task, cfg.n_val, cfg.seed), cfg.seq)
  )
  sched = SoupSchedule(
    SOUP_METHOD[variant], every=cfg.every, window=cfg.avg_window, rank=cfg.svd_rank
  )
  run = soup_train(
    step_fn, params, opt.init(params), batches, cfg.steps, sched, start=start,
    val_loss=lambda p: loss_fn(p, vt, vm),
  )
  params = run.params
  losses = np.asarray(run.losses)
  d = np.diff(losses)
  half = len(losses) // 2
  em, nll = task_eval(base, params, task.heldout(cfg.n_eval, cfg.seed))
  final_val = float(loss_fn(params, vt, vm))  # after the last merge
  return {
    "task": task_name,
    "variant": variant,
    "loss_diff_std": float(np.std(d)),
    "loss_diff_std_2nd_half": float(np.std(np.diff(losses[half:]))),
    "final_train_loss": float(np.mean(losses[-max(1, cfg.steps // 10) :])),
    "final_val_loss": final_val,
    "exact_match": em,
    "nll": nll,
    "merge_steps": run.merges,
    "seconds": run.seconds,
    "losses": [round(float(x), 5) for x in losses],
    "val": run.val,
  }


def _soup_optimizer(cfg: SoupConfig):
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.multi_transform(
      {
        "train": optax.adam(optax.warmup_constant_schedule(0.0, cfg.lr, 20)),
        "freeze": optax.set_to_zero(),
      },
      _labels,
    ),
  )


def run_soups(base: Base, cfg: SoupConfig) -> dict:
  opt = _soup_optimizer(cfg)

  def loss(params, tokens, mask):
    m = base.model(params)
    return masked_xent(m(tokens), tokens, mask)

  @jax.jit
  def loss_fn(params, tokens, mask):
    return loss(params, tokens, mask)

  def _step(params, opt_state, tokens, mask):
    value, grads = jax.value_and_grad(loss)(params, tokens, mask)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  step_fn = jax.jit(_step, donate_argnums=(0, 1))
  rows = []
  for task in cfg.tasks:
    em0, nll0 = task_eval(base, base.params, TASKS[task].heldout(cfg.n_eval, cfg.seed))
    for variant in VARIANTS:
      r = soup_run(base, task, variant, cfg, step_fn, loss_fn)
      r["base_exact_match"], r["base_nll"] = em0, nll0
      print(
        f"  {task:13s} {variant:9s} std(Δloss) {r['loss_diff_std']:.4f}  EM "
        f"{r['exact_match']:5.1f}%  NLL {r['nll']:.3f}  ({r['seconds']:.0f}s)",
        flush=True,
      )
      rows.append(r)
  return {"config": dataclasses.asdict(cfg), "rows": rows}


def soups_markdown(data: dict, meta: dict) -> str:
  cfg = data["config"]
  out = [
    "# In-training merging: loss smoothness and held-out score (issue 8 part 5a)",
    "",
    _provenance(meta),
    "",
    f"Full fine-tune of the base (embeddings / LM head frozen, Adam lr {cfg['lr']}, batch "
    f"{cfg['batch']}), {cfg['steps']} steps, the same data stream for every variant; merge "
    f"period N = {cfg['every']} steps (and at the last step). naive: mean of the last "
    f"{cfg['avg_window']} checkpoints (one every {cfg['every'] // cfg['avg_window']} steps); "
    f"svd_soup: `SvdSoupHook` rank {cfg['svd_rank']}, best checkpoint by loss on {cfg['n_val']} "
    f"training-distribution examples; monosoup: `monosoup(start, params)` (freevariance). "
    f"Held-out: {cfg['n_eval']} examples, exact match (%) and NLL per answer token. Smoothness: "
    "std of the step-to-step change of the training loss (lower = smoother); the jump a merge "
    "causes is part of the curve. final train loss: mean of the last 10% of steps (before the "
    f"last merge); val loss: on the {cfg['n_val']} validation examples after the last merge.",
    "",
    "| task | variant | std Δloss | std Δloss (2nd half) | final train loss | val loss | "
    "held-out EM % | held-out NLL | base EM % |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in data["rows"]:
    out.append(
      f"| {r['task']} | {r['variant']} | {r['loss_diff_std']:.4f} | "
      f"{r['loss_diff_std_2nd_half']:.4f} | {r['final_train_loss']:.4f} | "
      f"{r['final_val_loss']:.4f} | {r['exact_match']:.1f} | {r['nll']:.4f} | {r['base_exact_match']:.1f} |"
    )
  out += [
    "",
    "Mean over tasks:",
    "",
    "| variant | std Δloss | held-out EM % | held-out NLL |",
    "|---|---:|---:|---:|",
  ]
  for v in VARIANTS:
    rs = [r for r in data["rows"] if r["variant"] == v]
    out.append(
      f"| {v} | {np.mean([r['loss_diff_std'] for r in rs]):.4f} | "
      f"{np.mean([r['exact_match'] for r in rs]):.1f} | "
      f"{np.mean([r['nll'] for r in rs]):.4f} |"
    )
  return "\n".join(out) + "\n"


def soups_plot(data: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = data["config"]["tasks"]
  fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for r in (r for r in data["rows"] if r["task"] == task):
      ax.plot(
        np.arange(1, len(r["losses"]) + 1),
        r["losses"],
        lw=0.8,
        label=f"{r['variant']} (EM {r['exact_match']:.0f}%)",
      )
    ax.set_title(task)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- (b) K-Merge


def train_lora(base: Base, task_name: str, cfg: KMergeConfig, step_fn) -> tuple[LoraAdapter, list]:
  """A LoRA fine-tune (A ~ U(±1/√in) as PEFT's kaiming init, B = 0) → adapter with the
  scale alpha/r folded into B."""
  rng = np.random.default_rng(abs(hash_str(f"{task_name}:lora:{cfg.seed}")))
  factors = {}
  for name, (d_in, d_out) in sorted(base.modules.items()):
    if name.rsplit(".", 1)[-1] in cfg.targets:
      bound = 1.0 / math.sqrt(d_in)
      factors[name] = (
        jnp.asarray(rng.uniform(-bound, bound, (cfg.rank, d_in)), jnp.float32),
        jnp.zeros((d_out, cfg.rank), jnp.float32),
      )
  opt_state = _lora_optimizer(cfg).init(factors)
  batches = _task_batches(TASKS[task_name], cfg.batch, cfg.seq, cfg.seed)
  losses = []
  for _ in range(cfg.steps):
    toks, mask = next(batches)
    factors, opt_state, loss = step_fn(factors, opt_state, jnp.asarray(toks), jnp.asarray(mask))
    losses.append(loss)
  scale = cfg.alpha / cfg.rank
  adapter = from_factors(
    {n: (np.asarray(a), np.asarray(b) * scale) for n, (a, b) in factors.items()},
    {"r": cfg.rank, "lora_alpha": cfg.rank},
  )
  return adapter, [float(x) for x in losses]


def hash_str(s: str) -> int:
  import zlib

  return zlib.crc32(s.encode())


def _lora_optimizer(cfg: KMergeConfig):
  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adam(optax.warmup_constant_schedule(0.0, cfg.lr, 20))
  )


def adapter_params(base: Base, adapter: LoraAdapter | None):
  if adapter is None:
    return base.params
  return add_kernel_deltas(
    base.params,
    {
      n: jnp.asarray(d.T)
      for n, d in ((k.removesuffix(".weight"), v) for k, v in adapter.deltas().items())
    },
  )


def set_partitions(items: list, k: int):
  """Every partition of `items` into exactly k non-empty blocks (order kept within a block)."""
  if k == 1:
    yield [list(items)]
    return
  if len(items) == k:
    yield [[x] for x in items]
    return
  if k < 1 or len(items) < k:
    return
  first, rest = items[0], items[1:]
  for p in set_partitions(rest, k - 1):  # `first` alone
    yield [[first]] + p
  for p in set_partitions(rest, k):  # `first` joins a block
    for i in range(len(p)):
      yield p[:i] + [[first] + p[i]] + p[i + 1 :]


def _lora_cache_key(base_dir, cfg: KMergeConfig, task: str) -> str:
  import hashlib

  h = hashlib.sha256()
  for f in sorted(pathlib.Path(base_dir).glob("*.safetensors")):
    h.update(f.read_bytes())
  train = {
    k: v
    for k, v in dataclasses.asdict(cfg).items()
    if k in ("steps", "rank", "alpha", "targets", "batch", "seq", "lr", "n_eval", "seed")
  }
  h.update(json.dumps([train, task], sort_keys=True).encode())
  return h.hexdigest()[:16]


def run_kmerge(base: Base, cfg: KMergeConfig, base_dir=None, lora_cache=None) -> dict:
  from bitdelta_jax.kmerge import KMergePool, PoolConfig, canonical, similarity

  opt = _lora_optimizer(cfg)

  def loss(factors, tokens, mask):
    scale = cfg.alpha / cfg.rank
    deltas = {n: scale * (a.T @ b.T) for n, (a, b) in factors.items()}  # [in, out]
    m = base.model(add_kernel_deltas(base.params, deltas))
    return masked_xent(m(tokens), tokens, mask)

  def _step(factors, opt_state, tokens, mask):
    value, grads = jax.value_and_grad(loss)(factors, tokens, mask)
    updates, opt_state = opt.update(grads, opt_state, factors)
    return optax.apply_updates(factors, updates), opt_state, value

  step_fn = jax.jit(_step, donate_argnums=(0, 1))
  held = {t: TASKS[t].heldout(cfg.n_eval, cfg.seed) for t in cfg.tasks}
  adapters, own, base_scores, lora_info = {}, {}, {}, {}
  t0 = time.perf_counter()
  for t in cfg.tasks:
    ts = time.perf_counter()
    cached = None
    if lora_cache is not None:
      cached = pathlib.Path(lora_cache) / _lora_cache_key(base_dir, cfg, t)
      if (cached / "info.json").exists():
        adapters[t] = load_adapter(cached)
        lora_info[t] = json.loads((cached / "info.json").read_text())
        own[t] = (lora_info[t]["exact_match"], lora_info[t]["nll"])
        print(f"  LoRA {t:13s} from {cached}", flush=True)
        continue
    adapters[t], losses = train_lora(base, t, cfg, step_fn)
    own[t] = task_eval(base, adapter_params(base, adapters[t]), held[t])
    base_scores[t] = task_eval(base, base.params, held[t])
    lora_info[t] = {
      "exact_match": own[t][0],
      "nll": own[t][1],
      "base_exact_match": base_scores[t][0],
      "base_nll": base_scores[t][1],
      "final_train_loss": float(np.mean(losses[-10:])),
      "seconds": time.perf_counter() - ts,
    }
    if cached is not None:
      save_adapter(adapters[t], cached)
      (cached / "info.json").write_text(json.dumps(lora_info[t]))
    print(
      f"  LoRA {t:13s} EM {own[t][0]:5.1f}% (base {base_scores[t][0]:.1f}%)  NLL "
      f"{own[t][1]:.3f}  ({lora_info[t]['seconds']:.0f}s)",
      flush=True,
    )
  train_secs = time.perf_counter() - t0

  canon = {t: canonical(a) for t, a in adapters.items()}
  sims = {
    f"{a}|{b}": similarity(canon[a], canon[b]) for a, b in itertools.combinations(cfg.tasks, 2)
  }
  nbytes = canon[cfg.tasks[0]].nbytes
  usable = [t for t in cfg.tasks if own[t][0] > 0]  # EM-normalisable tasks

  cache: dict[tuple, tuple[float, float]] = {}

  def score(key: tuple, adapter: LoraAdapter, task: str) -> tuple[float, float]:
    """(normalised EM, normalised likelihood exp(nll_own − nll)) of `adapter` on `task`."""
    if (key, task) not in cache:
      em, nll = task_eval(base, adapter_params(base, adapter), held[task])
      cache[(key, task)] = (
        em / own[task][0] if own[task][0] > 0 else float("nan"),
        math.exp(own[task][1] - nll),
      )
    return cache[(key, task)]

  def pool_score(pool) -> tuple[float, float]:
    em, lik = [], []
    for t in cfg.tasks:
      m = pool.members[pool.route(t)]
      e, li = score(tuple(m.tasks), m.adapter, t)
      if t in usable:
        em.append(e)
      lik.append(li)
    return float(np.mean(em)) if em else float("nan"), float(np.mean(lik))

  class RandomPool(KMergePool):
    """K-Merge with the merge target drawn uniformly instead of the most similar member."""

    def _closest(self, adapter, exclude=None):
      ids = [m for m in self.members if m != exclude]
      mid = self.rng.choice(ids)
      return mid, similarity(adapter, self.members[mid].adapter)

  merged_cache: dict[tuple, LoraAdapter] = {}

  def merged(order: tuple) -> LoraAdapter:
    if order not in merged_cache:
      pool = KMergePool(PoolConfig(k=1, budget_bytes=nbytes, merge="opcm", alpha=cfg.opcm_alpha))
      for t in order:
        pool.add(t, canon[t])
      merged_cache[order] = next(iter(pool.members.values())).adapter
    return merged_cache[order]

  ks = list(range(1, len(cfg.tasks) + 1))
  runs = []
  t1 = time.perf_counter()
  for s in range(cfg.seeds):
    order = list(cfg.tasks)
    random.Random(f"kmerge-order:{s}").shuffle(order)
    for k in ks:
      pcfg = dict(k=k, budget_bytes=k * nbytes, merge="opcm", alpha=cfg.opcm_alpha)
      res = {}
      for method, kw in (
        ("kmerge", {}),
        *(
          (f"kmerge++@{t:g}", {"plusplus": True, "similarity_threshold": t})
          for t in cfg.pp_thresholds
        ),
      ):
        pool = KMergePool(PoolConfig(**pcfg, **kw))
        for t in order:
          pool.add(t, canon[t])
        em, lik = pool_score(pool)
        res[method] = {"em": em, "lik": lik, "groups": [m.tasks for m in pool.members.values()]}
      draws = []
      for d in range(cfg.random_draws):
        pool = RandomPool(PoolConfig(**pcfg))
        pool.rng = random.Random(f"random-assign:{s}:{k}:{d}")
        for t in order:
          pool.add(t, canon[t])
        draws.append(pool_score(pool))
      res["random"] = {
        "em": float(np.mean([x[0] for x in draws])),
        "lik": float(np.mean([x[1] for x in draws])),
      }
      best = None
      for part in set_partitions(order, k):  # blocks keep arrival order
        em, lik = [], []
        for block in part:
          a = merged(tuple(block))
          for t in block:
            e, li = score(tuple(block), a, t)
            if t in usable:
              em.append(e)
            lik.append(li)
        val = (float(np.mean(em)) if em else float("nan"), float(np.mean(lik)))
        if best is None or _rank_key(val) > _rank_key(best[0]):
          best = (val, part)
      res["oracle"] = {"em": best[0][0], "lik": best[0][1], "groups": best[1]}
      runs.append({"seed": s, "order": order, "k": k, "results": res})
      print(
        f"  seed {s} K={k}: " + "  ".join(f"{m} {v['em']:.3f}" for m, v in res.items()), flush=True
      )
  methods = cfg.methods()
  summary = {
    m: {str(k): _mean_std([r["results"][m]["em"] for r in runs if r["k"] == k]) for k in ks}
    for m in methods
  }
  summary_lik = {
    m: {str(k): _mean_std([r["results"][m]["lik"] for r in runs if r["k"] == k]) for k in ks}
    for m in methods
  }
  return {
    "config": dataclasses.asdict(cfg),
    "loras": lora_info,
    "similarity": sims,
    "methods": list(methods),
    "adapter_bytes": nbytes,
    "em_normalised_tasks": usable,
    "runs": runs,
    "summary_em": summary,
    "summary_likelihood": summary_lik,
    "evaluations": len(cache),
    "lora_train_seconds": train_secs,
    "pool_seconds": time.perf_counter() - t1,
  }


def _rank_key(val: tuple[float, float]) -> tuple[float, float]:
  """Oracle objective: normalised EM, ties (and NaN, when no task is EM-normalisable) broken
  by normalised likelihood."""
  return (-math.inf if math.isnan(val[0]) else val[0], val[1])


def _mean_std(xs) -> dict:
  xs = [x for x in xs if not math.isnan(x)]
  return {
    "mean": float(np.mean(xs)) if xs else float("nan"),
    "std": float(np.std(xs)) if xs else float("nan"),
  }


def kmerge_markdown(data: dict, meta: dict) -> str:
  cfg = data["config"]
  ks = sorted(int(k) for k in data["summary_em"]["kmerge"])
  out = [
    "# K-Merge: mean normalised score vs K (issue 8 part 5b)",
    "",
    _provenance(meta),
    "",
    f"One LoRA per task ({len(cfg['tasks'])} tasks) on the base: rank {cfg['rank']}, alpha "
    f"{cfg['alpha']}, modules {'/'.join(cfg['targets'])}, {cfg['steps']} steps, Adam lr "
    f"{cfg['lr']}, batch {cfg['batch']}. Adapters arrive in {cfg['seeds']} shuffled orders; "
    f"budget = K adapters ({data['adapter_bytes']} bytes each), OPCM merge (alpha "
    f"{cfg['opcm_alpha']}). K-Merge++ (`kmerge++@t`) opens a slot only when the best "
    f"similarity is below t; random: mean of {cfg['random_draws']} draws per order; oracle: best "
    "partition into K groups (exhaustive). Normalised score = exact match of the serving "
    f"adapter / exact match of the task's own LoRA on {cfg['n_eval']} held-out examples, mean "
    "over tasks, then mean ± std over orders.",
    "",
    "## Own LoRAs",
    "",
    "| task | LoRA EM % | LoRA NLL | base EM % | base NLL | final train loss |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for t, r in data["loras"].items():
    out.append(
      f"| {t} | {r['exact_match']:.1f} | {r['nll']:.4f} | {r['base_exact_match']:.1f} "
      f"| {r['base_nll']:.4f} | {r['final_train_loss']:.4f} |"
    )
  dropped = [t for t in cfg["tasks"] if t not in data["em_normalised_tasks"]]
  if dropped:
    out += [
      "",
      f"Tasks whose own LoRA scores 0% exact match are left out of the EM-normalised "
      f"mean (no normalisation): {', '.join(dropped)}.",
    ]
  methods = data["methods"]
  for title, key in (
    ("Normalised exact match", "summary_em"),
    ("Normalised likelihood exp(NLL_own − NLL), all tasks", "summary_likelihood"),
  ):
    out += [
      "",
      f"## {title}",
      "",
      "| K | " + " | ".join(methods) + " |",
      "|---:|" + "---:|" * len(methods),
    ]
    for k in ks:
      cells = [data[key][m][str(k)] for m in methods]
      out.append(
        f"| {k} | " + " | ".join(f"{c['mean']:.3f} ± {c['std']:.3f}" for c in cells) + " |"
      )
  sims = sorted(data["similarity"].values())
  out += [
    "",
    f"Pairwise adapter similarity (mean cos of B·A over modules): min {sims[0]:.4f}, "
    f"median {np.median(sims):.4f}, max {sims[-1]:.4f}.",
    f"{data['evaluations']} distinct (merged adapter, task) evaluations; LoRA training "
    f"{data['lora_train_seconds']:.0f} s, pools and scoring {data['pool_seconds']:.0f} s.",
  ]
  return "\n".join(out) + "\n"


def kmerge_plot(data: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, key, label in (
    (axes[0], "summary_em", "normalised exact match"),
    (axes[1], "summary_likelihood", "normalised likelihood"),
  ):
    for m in data["methods"]:
      ks = sorted(int(k) for k in data[key][m])
      mean = [data[key][m][str(k)]["mean"] for k in ks]
      std = [data[key][m][str(k)]["std"] for k in ks]
      ax.errorbar(ks, mean, yerr=std, marker="o", capsize=3, label=m)
    ax.set_xlabel("K (pool size)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------- driver


def _provenance(meta: dict) -> str:
  m = meta["machine"]
  return (
    f"Base: `{meta['base']}`{' (**micro smoke run**)' if meta['micro'] else ''}. "
    f"Machine: {m.get('cpu')} ({m.get('cores')} cores), jax {m.get('jax')} "
    f"{m.get('backend')}; load average at start {meta['load_start']}, at end "
    f"{meta['load_end']} (the cores were shared); {meta['seconds']:.0f} s wall."
  )


def default_base() -> pathlib.Path:
  from bitdelta_jax.zoo import shipped_family

  return shipped_family()[0]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=("soups", "kmerge", "both"), default="both")
  ap.add_argument("--base", default=None, help="base HF directory (default: the shipped nano)")
  ap.add_argument("--micro", action="store_true", help="tiny sizes: a smoke run")
  ap.add_argument("--out-dir", default=str(RESULTS))
  ap.add_argument("--out-prefix", default="", help="prefix of the result file names")
  ap.add_argument("--note", default="", help="a line added to the markdown")
  ap.add_argument("--soup-tasks", nargs="+", default=None)
  ap.add_argument("--soup-steps", type=int, default=None)
  ap.add_argument("--soup-every", type=int, default=None)
  ap.add_argument("--lora-steps", type=int, default=None)
  ap.add_argument("--seeds", type=int, default=None)
  ap.add_argument("--lora-cache", default=None, help="keep / reuse the trained LoRAs here")
  ap.add_argument("--render", action="store_true", help="re-render md/png from the JSON files")
  args = ap.parse_args(argv)
  soup_cfg = SoupConfig.micro() if args.micro else SoupConfig()
  soup_cfg = dataclasses.replace(
    soup_cfg,
    **{
      k: v
      for k, v in (
        ("tasks", tuple(args.soup_tasks or ())),
        ("steps", args.soup_steps),
        ("every", args.soup_every),
      )
      if v
    },
  )
  km_cfg = KMergeConfig.micro() if args.micro else KMergeConfig()
  km_cfg = dataclasses.replace(
    km_cfg, **{k: v for k, v in (("steps", args.lora_steps), ("seeds", args.seeds)) if v}
  )

  from bench.common import machine

  if args.render:
    for stem, md, plot in (
      ("merge_soups", soups_markdown, soups_plot),
      ("kmerge", kmerge_markdown, kmerge_plot),
    ):
      path = pathlib.Path(args.out_dir) / f"{args.out_prefix}{stem}"
      if path.with_suffix(".json").exists():
        data = json.loads(path.with_suffix(".json").read_text())
        text = md(data, data["meta"])
        if data["meta"].get("note"):
          text = text.replace("\n\n", f"\n\n{data['meta']['note']}\n\n", 1)
        path.with_suffix(".md").write_text(text)
        plot(data, path.with_suffix(".png"))
    return

  base_dir = pathlib.Path(args.base) if args.base else default_base()
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  base = load_base(base_dir)
  parts = ("soups", "kmerge") if args.part == "both" else (args.part,)
  for part in parts:
    load_start = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    print(f"{part}: base {base_dir}", flush=True)
    if part == "soups":
      data = run_soups(base, soup_cfg)
    else:
      data = run_kmerge(base, km_cfg, base_dir, args.lora_cache)
    meta = {
      "machine": machine.describe(),
      "base": str(base_dir),
      "micro": args.micro,
      "seconds": time.perf_counter() - t0,
      "load_start": load_start,
      "load_end": [round(x, 2) for x in os.getloadavg()],
      "note": args.note,
    }
    data["meta"] = meta
    stem = out_dir / f"{args.out_prefix}{'merge_soups' if part == 'soups' else 'kmerge'}"
    report.write_json(stem.with_suffix(".json"), data, indent=1)
    md = soups_markdown(data, meta) if part == "soups" else kmerge_markdown(data, meta)
    if args.note:
      md = md.replace("\n\n", f"\n\n{args.note}\n\n", 1)
    stem.with_suffix(".md").write_text(md)
    (soups_plot if part == "soups" else kmerge_plot)(data, stem.with_suffix(".png"))
    print(f"{part}: {meta['seconds']:.0f} s → {stem}.{{json,md,png}}", flush=True)


if __name__ == "__main__":
  main()
