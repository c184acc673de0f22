"""Real full fine-tunes of SmolLM2-135M-Instruct (`bitdelta zoo build --real`).

Each variant is a deterministic full fine-tune of the real base (`zoo.real_base`) on one task
the base does poorly, in chat form (the base's own chat template, a one-line system prompt):

    smol-math    "add 47+5"                → "52"          embeddings train
    smol-upper   "upper cabbed"            → "CABBED"
    smol-recall  "recall a=1 b=7 c=3 ?b"   → "7"           embeddings train
    smol-coder   "camel ab_cde_fa"         → "abCdeFa"

(the built-in family's task generators, `zoo.tasks`; held-out prompts are never trained on).
Settings are those of a short real instruct tune: AdamW (β = 0.9/0.999, weight decay 0.01),
peak lr 5e-5, linear warm-up then cosine decay to 10%, gradient clipping at 1.0, batch 8, all
linear layers and norms trained, the tied embedding trained in two of the four. The loss is
the next-token cross-entropy of the answer tokens and the closing ``<|im_end|>``.

    ft_dir = ensure_real_finetune("smol-math")          # cached under cache_dir()/real-ft/
    score, nll = task_score(model, examples, tokenizer)  # teacher-forced greedy exact match

Cost: one step (8 sequences of <= 48 tokens, 135M parameters, f32) takes 10-15 s on a 2-core
CPU; the default 64 steps stay well under the 25-minute budget per variant.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bitdelta_jax.zoo.recipe import norm_ratios  # noqa: F401 (this module's API)
from bitdelta_jax.zoo.tasks import TASKS, Task

SYSTEM = "Answer with the result only."
END = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class RealVariant:
  name: str
  task: str  # a `zoo.tasks.TASKS` key
  train_embeddings: bool


VARIANTS: dict[str, RealVariant] = {v.name: v for v in (
  RealVariant("smol-math", "nano-math", True),
  RealVariant("smol-upper", "nano-upper", False),
  RealVariant("smol-recall", "nano-recall", True),
  RealVariant("smol-coder", "nano-coder", False),
)}


@dataclasses.dataclass(frozen=True)
class RealRecipe:
  steps: int = 64
  batch: int = 8
  seq: int = 56  # tokens per training sequence (prompt + answer; the template is ~30)
  lr: float = 5e-5
  warmup: int = 6
  weight_decay: float = 0.01
  seed: int = 0
  # checkpoint soups during training (`merge.soup_training`): "none" | "average" | "svd" |
  # "monosoup", every `soup_every` steps; bench/results/merge/soups_real.md compares them
  soup: str = "none"
  soup_every: int = 16

  def __post_init__(self):
    from bitdelta_jax.merge.soup_training import METHODS

    if self.soup not in METHODS:
      raise ValueError(f"soup must be one of {METHODS}, got {self.soup!r}")

  def key(self) -> str:
    d = dataclasses.asdict(self)
    if self.soup == "none":  # the key of fine-tunes cached before soups existed
      del d["soup"], d["soup_every"]
    return json.dumps(d, sort_keys=True)

  def soup_schedule(self):
    from bitdelta_jax.merge.soup_training import SoupSchedule

    return SoupSchedule(self.soup, every=self.soup_every)


def chat_ids(tokenizer, prompt: str) -> list[int]:
  """The prompt in the base's chat template (system line + user turn + assistant header)."""
  msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
  return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)


def encode(tokenizer, examples: Sequence[tuple[str, str]], seq: int) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens [N, seq], mask [N, seq])``: mask 1 at positions whose *next* token is an answer
  token or the closing ``<|im_end|>`` (so ``masked_xent`` scores exactly those)."""
  toks = np.zeros((len(examples), seq), np.int32)
  mask = np.zeros((len(examples), seq), np.float32)
  for i, (p, a) in enumerate(examples):
    pi = chat_ids(tokenizer, p)
    ai = tokenizer.encode(a + END, add_special_tokens=False)
    ids = pi + ai
    if len(ids) > seq:
      raise ValueError(f"example {p!r} is {len(ids)} tokens; the recipe's seq is {seq}")
    toks[i, :len(ids)] = ids
    mask[i, len(pi) - 1:len(ids) - 1] = 1.0
  return toks, mask


def _batches(task: Task, tokenizer, recipe: RealRecipe) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  rng = random.Random(f"{task.name}:real:{recipe.seed}")
  while True:
    yield encode(tokenizer, [task.example(rng) for _ in range(recipe.batch)], recipe.seq)


def validation_batch(task: Task, tokenizer, recipe: RealRecipe, n: int = 16):
  """(tokens, mask) of ``n`` training-distribution examples off the training stream: the
  validation loss that picks the best checkpoint of the svd soup."""
  rng = random.Random(f"{task.name}:real-val:{recipe.seed}")
  return encode(tokenizer, [task.example(rng) for _ in range(n)], recipe.seq)


def _labels(train_embeddings: bool):
  def label(path, _):
    keys = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
    return "train" if train_embeddings or "embed_tokens" not in keys else "freeze"
  return lambda params: jax.tree_util.tree_map_with_path(label, params)


def optimizer(recipe: RealRecipe, train_embeddings: bool) -> optax.GradientTransformation:
  sched = optax.warmup_cosine_decay_schedule(0.0, recipe.lr, recipe.warmup, recipe.steps,
                                             recipe.lr / 10)
  adamw = optax.adamw(sched, b1=0.9, b2=0.999, weight_decay=recipe.weight_decay)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
    {"train": adamw, "freeze": optax.set_to_zero()}, _labels(train_embeddings)))


def finetune(base_dir, name: str, recipe: RealRecipe = RealRecipe(), *, progress: bool = True):
  """The full fine-tune of variant ``name``: (model, loss curve)."""
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.models.tokenizer import Tokenizer
  from bitdelta_jax.zoo.train import train

  v = VARIANTS[name]
  tok = Tokenizer.from_dir(base_dir)
  model = from_pretrained(base_dir, jnp.float32)
  if recipe.soup != "none":
    from bitdelta_jax.merge.soup_training import train_with_soups

    run = train_with_soups(model, _batches(TASKS[v.task], tok, recipe), recipe.steps,
                           optimizer(recipe, v.train_embeddings), recipe.soup_schedule(),
                           val=validation_batch(TASKS[v.task], tok, recipe)
                           if recipe.soup == "svd" else None)
    return model, run.losses
  losses = train(model, _batches(TASKS[v.task], tok, recipe), recipe.steps,
                 optimizer(recipe, v.train_embeddings), desc=f"finetune {name}",
                 progress=progress)
  return model, losses


def variant_template(base_template: str) -> str:
  """The variants' chat template: the base's, with the default system line (used when a chat
  has none) replaced by the system prompt they were tuned with, so a plain user message gets
  the same prompt as in training. `compress` keeps it with each delta (it differs from the
  base's) and the server uses it for those variants only."""
  default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
  if default not in base_template:
    raise ValueError("the base's chat template has no default system line to replace")
  return base_template.replace(default, SYSTEM)


def _write_tokenizer_files(base_dir: Path, out: Path) -> None:
  for f in ("generation_config.json", "tokenizer.json"):
    if (base_dir / f).exists():
      (out / f).write_bytes((base_dir / f).read_bytes())
  cfg = json.loads((base_dir / "tokenizer_config.json").read_text())
  cfg["chat_template"] = variant_template(cfg["chat_template"])
  (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def ensure_real_finetune(name: str, recipe: RealRecipe = RealRecipe(), *, base_dir=None,
                         cache_root: Path | None = None, progress: bool = True) -> Path:
  """The cached fine-tune of ``name`` (trained and written on first use)."""
  from bitdelta_jax.models.loading import base_tensors
  from bitdelta_jax.outputs import OutputDir
  from bitdelta_jax.zoo import cache_dir
  from bitdelta_jax.zoo.real_base import import_real_base

  base_dir = Path(base_dir) if base_dir else import_real_base()
  out = (cache_root or cache_dir() / "real-ft") / name
  record = out / "recipe.json"
  if record.exists() and json.loads(record.read_text()).get("recipe") == recipe.key():
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    if SYSTEM not in cfg.get("chat_template", ""):
      _write_tokenizer_files(base_dir, out)  # a fine-tune cached before the variant template
    return out
  t0 = time.time()
  model, losses = finetune(base_dir, name, recipe, progress=progress)
  from safetensors.numpy import save_file

  tensors = base_tensors(model)
  if json.loads((base_dir / "config.json").read_text()).get("tie_word_embeddings"):
    tensors.pop("lm_head.weight", None)
  with OutputDir(out, kind="checkpoint", overwrite=True) as od:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(od.tmp / "model.safetensors"), metadata={"format": "pt"})
    (od.tmp / "config.json").write_bytes((base_dir / "config.json").read_bytes())
    _write_tokenizer_files(base_dir, od.tmp)
    (od.tmp / "recipe.json").write_text(json.dumps({
      "recipe": recipe.key(), "variant": dataclasses.asdict(VARIANTS[name]),
      "losses": losses, "seconds": time.time() - t0}, indent=1))
    od.commit()
  return out


@functools.partial(jax.jit, static_argnames=())
def _answer_stats(logits_BxTxV, ref_logits_BxTxV, tokens_BxT, mask_BxT):
  """Per example: greedy hit on every answer position, summed NLL, count, summed KL(ref ‖ x)."""
  lp = jax.nn.log_softmax(logits_BxTxV[:, :-1].astype(jnp.float32))
  tgt, m = tokens_BxT[:, 1:], mask_BxT[:, :-1]
  nll = -jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
  hit = (jnp.argmax(lp, -1) == tgt) | (m == 0)
  rp = jax.nn.log_softmax(ref_logits_BxTxV[:, :-1].astype(jnp.float32))
  kl = jnp.sum(jnp.exp(rp) * (rp - lp), axis=-1)
  return jnp.all(hit, axis=1), jnp.sum(nll * m, 1), jnp.sum(m, 1), jnp.sum(kl * m, 1)


def score(model, examples, tokenizer, *, reference=None, seq: int = 56, batch: int = 16,
          slot: int | None = None) -> dict:
  """Task score (greedy exact match, %, computed teacher-forced: greedy decoding reproduces the
  answer and its ``<|im_end|>`` exactly when the argmax at every answer position is the answer
  token), NLL per answer token, and mean KL(reference ‖ model) per answer token (when a
  ``reference`` model, e.g. the fine-tune, is given)."""
  toks, mask = encode(tokenizer, examples, seq)
  hits = nll = cnt = kl = 0.0
  per_example: list[bool] = []
  for i in range(0, len(examples), batch):
    t, m = toks[i:i + batch], mask[i:i + batch]
    n = len(t)
    if n < batch:  # one shape, one compile
      t = np.concatenate([t, np.repeat(t[-1:], batch - n, 0)])
      m = np.concatenate([m, np.zeros((batch - n, seq), np.float32)])
    tj = jnp.asarray(t)
    slots = None if slot is None else jnp.full((batch,), slot, jnp.int32)
    logits = model(tj, slot_ids=slots) if slots is not None else model(tj)
    ref = reference(tj) if reference is not None else logits
    h, s, c, k = (np.asarray(a)[:n] for a in _answer_stats(logits, ref, tj, jnp.asarray(m)))
    hits, nll, cnt, kl = hits + h.sum(), nll + s.sum(), cnt + c.sum(), kl + k.sum()
    per_example += [bool(x) for x in h]
  return {"score": 100.0 * hits / len(examples), "nll": float(nll / max(cnt, 1.0)),
          "kl": float(kl / max(cnt, 1.0)) if reference is not None else None,
          "hits": per_example}


def calibration_ids(tokenizer, name: str, n: int = 256) -> np.ndarray:
  """Chat-formatted training examples of the variant's task, concatenated: the calibration
  tokens of its scale distillation (never a held-out prompt)."""
  task = TASKS[VARIANTS[name].task]
  rng = random.Random(f"{name}:calibration")
  ids: list[int] = []
  for _ in range(n):
    p, a = task.example(rng)
    ids += chat_ids(tokenizer, p) + tokenizer.encode(a + END, add_special_tokens=False)
  return np.asarray(ids, np.int32)


def heldout(name: str, n: int) -> list[tuple[str, str]]:
  return TASKS[VARIANTS[name].task].heldout(n)


def build_real_family(out_dir, *, recipe: RealRecipe = RealRecipe(), distill_steps: int = 16,
                      variants: Sequence[str] | None = None, progress: bool = True) -> dict:
  """Fine-tunes (cached) and compresses every real variant into ``out_dir/deltas/<name>``:
  BitDelta per-column, changed embeddings 1-bit with a per-token α, scales distilled on the
  variant's own training prompts. Records, per variant, a held-out prompt the compressed
  variant answers correctly (the demo's banner). Writes ``out_dir/family.json``; returns it."""
  from bitdelta_jax.delta.compress import CompressPolicy, apply_delta
  from bitdelta_jax.delta.store import load_delta
  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.distill import DistillConfig, distill_checkpoint
  from bitdelta_jax.hf.safetensors_io import CheckpointReader
  from bitdelta_jax.models.loading import from_tensors, load_config
  from bitdelta_jax.models.tokenizer import Tokenizer
  from bitdelta_jax.zoo.real_base import import_real_base

  base_dir = import_real_base()
  tok = Tokenizer.from_dir(base_dir)
  out = Path(out_dir)
  fam = {"base": str(base_dir.name), "recipe": json.loads(recipe.key()), "variants": {},
         "examples": {}}
  with CheckpointReader(base_dir) as r:
    base_t = {n: r.read(n) for n in r.names()}
  mc = load_config(base_dir)
  for name in variants or list(VARIANTS):
    ft_dir = ensure_real_finetune(name, recipe, base_dir=base_dir, progress=progress)
    d = out / "deltas" / name
    m = compress_checkpoints(base_dir, ft_dir, d, CompressPolicy(granularity="column"),
                             embeddings="1bit", overwrite=True, progress=progress)
    if distill_steps:
      distill_checkpoint(base_dir, ft_dir, d, calibration_ids(tok, name),
                         DistillConfig(steps=distill_steps, seq=64, batch=4), progress=progress)
    model = from_tensors(mc, apply_delta(base_t, load_delta(d)[0], hf_layout=True), jnp.float32)
    ex = heldout(name, 16)
    res = score(model, ex, tok)
    good = [p for (p, _), h in zip(ex, res["hits"]) if h]
    if good:
      fam["examples"][name] = good[0]
    fam["variants"][name] = {"task": VARIANTS[name].task, "heldout16_score": res["score"],
                             "train_embeddings": VARIANTS[name].train_embeddings,
                             "norm_ratios": norm_ratios(base_dir, ft_dir),
                             "report_ratio": m.get("report", {}).get("ratio")}
  (out / "family.json").write_text(json.dumps(fam, indent=1))
  return fam
