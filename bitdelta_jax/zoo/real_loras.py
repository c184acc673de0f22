"""LoRA adapters of SmolLM2-135M-Instruct for related tasks (`bitdelta zoo build --real-loras`).

One PEFT adapter per task of `zoo.lora_tasks` (four families of related tasks), trained with
`merge.lora_train` on the real base in chat form (the system line and template of
`zoo.real_family`), deterministic, cached under ``cache_dir()/real-lora/<task>/``:

    path = ensure_real_lora("lora-add")          # adapter_config.json + adapter_model.safetensors
    info = json.loads((path / "info.json").read_text())  # recipe, losses, held-out scores

``info.json`` records the held-out exact match (teacher-forced greedy, `real_family.score`) of
the adapter and of the base on the same prompts, so a user sees what each adapter adds.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bitdelta_jax.merge.lora import save_adapter
from bitdelta_jax.merge.lora_train import LoraRecipe, LoraTrainer
from bitdelta_jax.zoo.lora_tasks import LORA_TASKS, family_of
from bitdelta_jax.zoo.real_family import encode, score

RECIPE = LoraRecipe()
N_HELDOUT = 64


def batches(task_name: str, tokenizer, recipe: LoraRecipe) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  task = LORA_TASKS[task_name]
  rng = random.Random(f"{task_name}:real-lora:{recipe.seed}")
  while True:
    yield encode(tokenizer, [task.example(rng) for _ in range(recipe.batch)], recipe.seq)


def heldout(task_name: str, n: int = N_HELDOUT, seed: int = 0) -> list[tuple[str, str]]:
  return LORA_TASKS[task_name].heldout(n, seed)


def validation(task_name: str, n: int, seed: int = 1) -> list[tuple[str, str]]:
  """Training-side examples (never held out, a different stream from training): the quality
  gate's validation set."""
  rng = random.Random(f"{task_name}:real-lora-val:{seed}")
  return [LORA_TASKS[task_name].example(rng) for _ in range(n)]


class RealLoraContext:
  """The real base loaded once: its tokenizer and a `LoraTrainer` (train and score adapters)."""

  def __init__(self, base_dir=None):
    from bitdelta_jax.models import from_pretrained
    from bitdelta_jax.models.tokenizer import Tokenizer
    from bitdelta_jax.zoo.real_base import import_real_base

    self.base_dir = Path(base_dir) if base_dir else import_real_base()
    self.tokenizer = Tokenizer.from_dir(self.base_dir)
    self.trainer = LoraTrainer(from_pretrained(self.base_dir, jnp.float32))

  def score(self, adapter, examples, seq: int = RECIPE.seq, batch: int = 16) -> dict:
    """`real_family.score` of base + adapter (None: the base) on ``examples``."""
    return score(self.trainer.forward(adapter), examples, self.tokenizer, seq=seq, batch=batch)


def ensure_real_lora(task_name: str, recipe: LoraRecipe = RECIPE, *, ctx: RealLoraContext | None = None,
                     cache_root: Path | None = None, progress: bool = True,
                     n_heldout: int = N_HELDOUT) -> Path:
  """The cached adapter of ``task_name`` (trained, scored and written on first use)."""
  from bitdelta_jax.outputs import OutputDir

  if task_name not in LORA_TASKS:
    raise KeyError(f"unknown LoRA task {task_name!r}; known: {sorted(LORA_TASKS)}")
  out = _lora_dir(task_name, cache_root)
  if _cached(task_name, recipe, cache_root) is not None:
    return out
  ctx = ctx or RealLoraContext()
  t0 = time.time()
  log = (lambda i, v: print(f"  {task_name} step {i:4d} loss {v:.4f}", flush=True)) if progress else None
  adapter, losses = ctx.trainer.train(batches(task_name, ctx.tokenizer, recipe), recipe,
                                      task_name, log=log)
  seconds = time.time() - t0
  ex = heldout(task_name, n_heldout)
  own, base = ctx.score(adapter, ex), ctx.score(None, ex)
  with OutputDir(out, kind="adapter", overwrite=True) as od:
    save_adapter(adapter, od.tmp, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    (od.tmp / "info.json").write_text(json.dumps({
      "recipe": recipe.key(), "task": task_name, "family": family_of(task_name),
      "description": LORA_TASKS[task_name].description, "losses": losses, "seconds": seconds,
      "heldout": {"n": len(ex), "score": own["score"], "nll": own["nll"],
                  "base_score": base["score"], "base_nll": base["nll"]},
      "bytes": adapter.nbytes}, indent=1))
    od.commit()
  if progress:
    print(f"{task_name}: held-out EM {own['score']:.1f}% (base {base['score']:.1f}%), "
          f"{seconds:.0f} s", flush=True)
  return out


def _lora_dir(task_name: str, cache_root: Path | None) -> Path:
  from bitdelta_jax.zoo import cache_dir

  return (cache_root or cache_dir() / "real-lora") / task_name


def _cached(task_name: str, recipe: LoraRecipe, cache_root: Path | None) -> Path | None:
  out = _lora_dir(task_name, cache_root)
  info = out / "info.json"
  ok = info.exists() and json.loads(info.read_text()).get("recipe") == recipe.key()
  return out if ok else None


def build_real_loras(tasks: Sequence[str] | None = None, recipe: LoraRecipe = RECIPE, *,
                     cache_root: Path | None = None, progress: bool = True) -> dict[str, Path]:
  """Every task's adapter (cached); {task: adapter dir}. The base loads once, if any is due."""
  tasks = list(tasks or LORA_TASKS)
  ctx = None if all(_cached(t, recipe, cache_root) for t in tasks) else RealLoraContext()
  return {t: ensure_real_lora(t, recipe, ctx=ctx, cache_root=cache_root, progress=progress)
          for t in tasks}
