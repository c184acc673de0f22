"""`bitdelta zoo build`: the deterministic recipe of the built-in model family.

1. Pre-train a tiny Llama-architecture base (`nano`) on the standard library's sources, the
   variants' tasks as plain text and a few general skills as chat exchanges (an "instruct" base).
2. Fine-tune one variant per task (`nano-math`, `nano-reverse`, ...) from the bf16 base with a
   small learning rate, in the chat format; embeddings and LM head stay frozen, so a variant
   differs from the base only in its linear layers and norms (which BitDelta and the slot banks
   carry), by ~3% of their norm.
3. Save the base (bf16, HF format, byte-level tokenizer, chat template); save each full
   fine-tune (f32, HF format) in the cache; compress each into a 1-bit delta and distil its
   scales.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx

from bitdelta_jax.delta.compress import CompressPolicy
from bitdelta_jax.delta.stream import compress_checkpoints
from bitdelta_jax.hf.safetensors_io import save_file
from bitdelta_jax.models import ModelConfig, base_tensors, from_pretrained
from bitdelta_jax.models.llama import LlamaForCausalLM
from bitdelta_jax.zoo.corpus import encode_bytes, lm_batches, stdlib_text
from bitdelta_jax.zoo.data import batch_examples, example_ids
from bitdelta_jax.zoo.tasks import TASKS
from bitdelta_jax.zoo.tokenizer_build import BOS, EOS, PAD, VOCAB_SIZE, write_tokenizer
from bitdelta_jax.zoo.train import train

FROZEN = ("embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True)
class ZooConfig:
  hidden_size: int = 128
  intermediate_size: int = 352
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  max_position_embeddings: int = 512
  pretrain_steps: int = 1500
  pretrain_batch: int = 16
  pretrain_seq: int = 128
  pretrain_lr: float = 3e-3
  # A real fine-tune's settings (Adam, warm-up then cosine decay to 10%) at a learning rate that
  # moves the linear weights by ~3% (‖Δ‖/‖W‖; the old 3e-4 moved them 11-22%), within 2x of
  # real fine-tunes (0.2-2%): lower rates or fewer steps leave the tasks half-learned here.
  finetune_steps: int = 1000
  finetune_batch: int = 32
  finetune_seq: int = 40
  finetune_lr: float = 1.5e-5
  n_eval: int = 256
  text_every: int = 4  # one pre-training batch in this many is stdlib text, the rest task lines
  base_skills: int = 6  # how many of `BASE_SKILLS` the base sees as chat exchanges
  # The two hardest tasks (they need carries / a lookup) get twice the pre-training lines and
  # twice the fine-tuning steps.
  pretrain_task_weights: tuple[tuple[str, int], ...] = (("nano-math", 2), ("nano-recall", 2))
  finetune_steps_override: tuple[tuple[str, int], ...] = (("nano-math", 2000),
                                                          ("nano-recall", 2000))
  tasks: tuple[str, ...] = tuple(TASKS)
  seed: int = 0

  @classmethod
  def micro(cls) -> ZooConfig:
    """Seconds, for tests: same code path, tiny sizes, no accuracy goal (a larger fine-tuning
    rate, so 15 steps still make a delta worth distilling)."""
    return cls(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
               pretrain_steps=20, pretrain_batch=8, pretrain_seq=64, finetune_steps=15,
               finetune_lr=3e-4,
               finetune_batch=16, n_eval=32, tasks=("nano-math", "nano-reverse"),
               finetune_steps_override=())

  def hf_config(self) -> dict:
    return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE,
      "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads, "head_dim": self.hidden_size // self.num_heads,
      "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
      "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
      "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
    }


def _task_batches(task, batch: int, seq: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  rng = random.Random(f"{task.name}:train:{seed}")
  while True:
    yield batch_examples([task.example(rng) for _ in range(batch)], seq)


def _pretrain_batches(cfg: ZooConfig) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Alternates stdlib text windows with rows of task lines.

  The variants' tasks appear in plain text (``reverse abc = cba<eos>``), as a real base model
  has seen such things in its corpus; the general skills of `BASE_SKILLS` appear as chat
  exchanges (``<bos><|user|>echo abc<|assistant|>abc<eos>``), as an instruct base has been
  tuned on such. A fine-tune then only has to connect a new instruction in the chat format,
  which the base knows, to a skill it has, so the base scores low on the held-out chat prompts
  and the deltas stay as small as real fine-tunes' (`ZooConfig.base_skills`).
  """
  from bitdelta_jax.zoo.data import encode_example
  from bitdelta_jax.zoo.tasks import BASE_SKILLS

  ids = encode_bytes(stdlib_text())
  text = lm_batches(ids, cfg.pretrain_batch, cfg.pretrain_seq, cfg.seed)
  rng = random.Random(f"skills:{cfg.seed}")
  weights = dict(cfg.pretrain_task_weights)
  sources = [(TASKS[n], False) for n in cfg.tasks for _ in range(weights.get(n, 1))]
  sources += [(t, True) for t in BASE_SKILLS[: cfg.base_skills]]
  width = cfg.pretrain_seq + 1
  step = 0
  while True:
    step += 1
    if step % cfg.text_every == 1 or cfg.text_every == 1:
      toks = next(text)
      yield toks, np.ones_like(toks, np.float32)
      continue
    toks = np.full((cfg.pretrain_batch, width), PAD, np.int32)
    mask = np.zeros((cfg.pretrain_batch, width), np.float32)
    for row in range(cfg.pretrain_batch):
      toks[row, 0] = BOS
      pos = 1
      while True:
        task, chat = rng.choice(sources)
        p, a = task.example(rng)
        line = (encode_example(p, a)[0] if chat else
                np.concatenate([encode_bytes(f"{p} = {a}".encode()), [EOS]]))
        if pos + len(line) > width:
          break
        toks[row, pos:pos + len(line)] = line
        mask[row, pos - 1:pos + len(line) - 1] = 1.0
        pos += len(line)
    yield toks, mask


def _save_hf(model, directory: Path, cfg: ZooConfig, dtype) -> Path:
  directory.mkdir(parents=True, exist_ok=True)
  tensors = {k: v.astype(dtype) for k, v in base_tensors(model).items()}
  save_file(tensors, directory / "model.safetensors")
  hf = cfg.hf_config() | {"torch_dtype": "bfloat16" if dtype == ml_dtypes.bfloat16 else "float32"}
  (directory / "config.json").write_text(json.dumps(hf, indent=2))
  write_tokenizer(directory)
  return directory


def _labels(params):
  """"train" for parameters the fine-tune trains, "freeze" for embeddings and LM head."""
  def label(path, _):
    keys = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
    return "freeze" if any(k in FROZEN for k in keys) else "train"
  return jax.tree_util.tree_map_with_path(label, params)


def pretrain(cfg: ZooConfig, *, progress: bool = True) -> tuple[LlamaForCausalLM, list[float]]:
  mcfg = ModelConfig.from_hf_dict(cfg.hf_config())
  model = LlamaForCausalLM(mcfg, dtype=jnp.float32, rngs=nnx.Rngs(cfg.seed))
  sched = optax.warmup_cosine_decay_schedule(0.0, cfg.pretrain_lr, max(1, cfg.pretrain_steps // 10),
                                             cfg.pretrain_steps, cfg.pretrain_lr / 10)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
  losses = train(model, _pretrain_batches(cfg), cfg.pretrain_steps, opt, desc="pretrain nano",
                 progress=progress)
  return model, losses


def finetune(base_dir: Path, task_name: str, cfg: ZooConfig, *, progress: bool = True):
  """Full fine-tune (embeddings / LM head frozen) of the bf16 base, computed in f32."""
  model = from_pretrained(base_dir, dtype=jnp.float32)
  task = TASKS[task_name]
  steps = dict(cfg.finetune_steps_override).get(task_name, cfg.finetune_steps)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
    {"train": optax.adam(optax.warmup_cosine_decay_schedule(
       0.0, cfg.finetune_lr, min(20, max(1, steps // 4)), steps, cfg.finetune_lr / 10)),
     "freeze": optax.set_to_zero()}, _labels))
  losses = train(model, _task_batches(task, cfg.finetune_batch, cfg.finetune_seq, cfg.seed),
                 steps, opt, desc=f"finetune {task_name}", progress=progress)
  return model, losses


def delta_norm_ratio(base_dir: Path, ft_dir: Path) -> float:
  """‖W_ft − W_base‖_F / ‖W_base‖_F over all linear weights."""
  from bitdelta_jax.hf.checkpoints import open_checkpoint

  num = den = 0.0
  with open_checkpoint(base_dir) as b, open_checkpoint(ft_dir) as f:
    for n in b.names():
      if b.info(n).shape and len(b.info(n).shape) == 2 and not any(x in n for x in FROZEN):
        wb = b.read(n).astype(np.float64)
        num += float(np.sum((f.read(n).astype(np.float64) - wb) ** 2))
        den += float(np.sum(wb**2))
  return float(np.sqrt(num / den))


def norm_ratios(base_dir, ft_dir) -> dict[str, float]:
  """‖Δ‖/‖W‖ per layer type (q/k/v/o, gate/up/down, norms, embeddings), over all layers."""
  from bitdelta_jax.hf.checkpoints import open_checkpoint

  num: dict[str, float] = {}
  den: dict[str, float] = {}
  with open_checkpoint(base_dir) as b, open_checkpoint(ft_dir) as f:
    for n in f.names():
      kind = n.split(".")[-2] if n.endswith(".weight") else n
      if "embed_tokens" in n:
        kind = "embed_tokens"
      w, d = b.read(n).astype(np.float64), f.read(n).astype(np.float64) - b.read(n)
      num[kind] = num.get(kind, 0.0) + float(np.sum(d * d))
      den[kind] = den.get(kind, 0.0) + float(np.sum(w * w))
  return {k: float(np.sqrt(num[k] / den[k])) for k in sorted(num)}


def finetune_cache_path(base_dir: Path, name: str, cfg: ZooConfig, cache_root: Path) -> Path:
  """Where `ensure_finetune` keeps the fine-tune of ``name`` (complete once it holds a
  config.json): keyed by the base's content digest and the recipe config."""
  import hashlib

  from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint

  digest = fingerprint_checkpoint(base_dir)["digest"]
  key = hashlib.sha256((digest + json.dumps(dataclasses.asdict(cfg), sort_keys=True)).encode())
  return Path(cache_root) / key.hexdigest()[:16] / name


def ensure_finetune(base_dir: Path, name: str, cfg: ZooConfig, cache_root: Path, *,
                    progress: bool = True) -> Path:
  """The full-precision fine-tune of ``name`` from ``base_dir``: from the cache (keyed by the
  base's content digest and the recipe config), else trained now and cached atomically."""
  from bitdelta_jax.delta.store import AtomicDir

  ft_dir = finetune_cache_path(base_dir, name, cfg, cache_root)
  if (ft_dir / "config.json").exists():
    return ft_dir
  model, _ = finetune(Path(base_dir), name, cfg, progress=progress)
  with AtomicDir(ft_dir, overwrite=True) as out:
    _save_hf(model, out.tmp, cfg, np.float32)
    out.commit()
  return ft_dir


def build(out_dir: str | Path, cache_dir: str | Path, cfg: ZooConfig = ZooConfig(), *,
          granularity: str = "column", distill_steps: int | None = None,
          progress: bool = True) -> dict:
  """Runs the whole recipe. Writes ``out_dir/nano`` (base), ``out_dir/deltas/<variant>`` and
  ``out_dir/family.json``; full fine-tunes go to ``cache_dir/<variant>``."""
  from bitdelta_jax.distill import distill_checkpoint
  from bitdelta_jax.zoo.evaluate import exact_match_and_nll

  out_dir, cache_dir = Path(out_dir), Path(cache_dir)
  t0 = time.perf_counter()
  model, pre_losses = pretrain(cfg, progress=progress)
  base_dir = _save_hf(model, out_dir / "nano", cfg, ml_dtypes.bfloat16)
  del model
  family = {"base": "nano", "config": dataclasses.asdict(cfg), "pretrain_final_loss":
            float(np.mean(pre_losses[-10:])), "variants": {}}
  for name in cfg.tasks:
    ts = time.perf_counter()
    ft_dir = ensure_finetune(base_dir, name, cfg, cache_dir, progress=progress)
    held = TASKS[name].heldout(cfg.n_eval, cfg.seed)
    em_ft, _ = exact_match_and_nll(from_pretrained(ft_dir, dtype=jnp.float32), held)
    delta_dir = out_dir / "deltas" / name
    compress_checkpoints(base_dir, ft_dir, delta_dir, CompressPolicy(granularity=granularity),
                         overwrite=True, progress=False)
    calib = example_ids(TASKS[name].example(random.Random(f"{name}:calib:{i}"))
                        for i in range(512))
    dist = distill_checkpoint(base_dir, ft_dir, delta_dir, calib,
                              steps=distill_steps or (10 if cfg.pretrain_steps < 100 else 200),
                              progress=progress)
    family["variants"][name] = {
      "task": TASKS[name].description, "exact_match_finetune": em_ft, "delta_norm_ratio": delta_norm_ratio(base_dir, ft_dir),
      "distill": dist, "seconds": time.perf_counter() - ts,
    }
  from bitdelta_jax.zoo.banner_examples import pick_banner_examples

  # the demo banner's prompts: ones the compressed variants answer correctly
  family["examples"] = pick_banner_examples(
    base_dir, {n: out_dir / "deltas" / n for n in cfg.tasks})
  family["seconds"] = time.perf_counter() - t0
  (out_dir / "family.json").write_text(json.dumps(family, indent=1))
  return family
