"""Scale distillation (BitDelta §3.2): train only the α of a compressed variant so that its
logits match the fine-tuned model's on calibration text.

Everything but the scales is frozen: the trainable pytree holds one α per packed matrix (shape
[1] per-matrix or [N] per-column) and nothing else. The student (`build_student`) is the
fine-tuned model with its linear weights replaced by the base's and the 1-bit deltas in slot 1
of its banks: everything the delta keeps exactly (changed embeddings, LM head, norms, biases,
a grown vocabulary) is taken from the fine-tune and frozen, as in the paper, and only α trains.
The teacher is the fine-tuned model. Two models in memory, never three.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from bitdelta_jax.delta.compress import DeltaMismatchError
from bitdelta_jax.delta.format import PackedDelta
from bitdelta_jax.delta.store import load_delta, update_scales
from bitdelta_jax.hf.safetensors_io import CheckpointReader
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.models.layers import SlotBank
from bitdelta_jax.models.loading import from_tensors, load_config
from bitdelta_jax.models.slots import load_variant

SLOT = 1


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """Defaults after the paper: AdamW, lr 1e-4, 200 steps, sequence 128, batch 4."""

  steps: int = 200
  lr: float = 1e-4
  seq: int = 128
  batch: int = 4
  weight_decay: float = 0.0
  seed: int = 0
  eval_every: int = 20


def _is_vocab(name: str) -> bool:
  """1-bit embedding / LM-head deltas: served 1-bit, but their α is not distilled."""
  return "embed_tokens" in name or "lm_head" in name


def _key(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def _scale_leaves(banks) -> dict[str, tuple[str, ...]]:
  """HF weight name → path of that layer's ``delta_scale`` bank in the SlotBank state."""
  out = {}
  for path, _ in jax.tree_util.tree_flatten_with_path(banks)[0]:
    k = _key(path)
    if "delta_scale" in k:
      i = k.index("delta_scale")
      out[".".join(k[:i]) + ".weight"] = k
  return out


def _slot_scale_parts(model, slot: int):
  """``(scales, merge, state)``: the slot's α, ``merge(scales, *state) -> model`` (pure), and
  the model's state ``(params, banks, rest)`` to pass to it (as jit arguments, not constants)."""
  if not 0 < int(slot) < model.config.num_slots:
    raise ValueError(f"slot must be in [1, {model.config.num_slots}) (slot 0 is the base), "
                     f"got {slot}")
  graphdef, params, banks, rest = nnx.split(model, nnx.Param, SlotBank, ...)
  where = _scale_leaves(banks)
  flat = {_key(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(banks)[0]}
  scales = {n: jnp.asarray(flat[k][slot], jnp.float32) for n, k in where.items()}
  by_path = {k: n for n, k in where.items()}

  def merge(new: Mapping[str, jax.Array], params, banks, rest):
    def put(path, leaf):
      n = by_path.get(_key(path))
      if n is None or n not in new:
        return leaf
      return leaf.at[slot].set(jnp.broadcast_to(new[n], leaf.shape[1:]).astype(leaf.dtype))
    return nnx.merge(graphdef, params, jax.tree_util.tree_map_with_path(put, banks), rest)

  return scales, merge, (params, banks, rest)


def slot_scales(model, slot: int = SLOT) -> tuple[dict[str, jax.Array], Callable]:
  """The α of one variant slot as a differentiable pytree, and a pure ``α → model`` function.

  Returns ``(scales, with_scales)``: ``scales`` is ``{HF weight name: f32 [N]}`` (one α per
  output column; a per-matrix α appears broadcast), ``with_scales(scales)`` returns a copy of
  ``model`` whose slot ``slot`` uses them, so ``jax.grad`` of a loss of
  ``with_scales(scales)(tokens, slot_ids=...)`` is the gradient with respect to that
  variant's scales alone. Under `jax.jit`, pass the model's other weights as an argument,
  ``with_scales(scales, state)`` with ``state = with_scales.state``: weights closed over
  would be folded into the executable as constants (minutes and gigabytes for a 135M model).
  """
  scales, merge, state = _slot_scale_parts(model, slot)
  return scales, WithScales(merge, state)


class WithScales:
  """``with_scales(scales, state=None)``: the model with one slot's α replaced (`slot_scales`);
  ``state`` (a pytree: pass it into a jitted function) defaults to the model's own."""

  def __init__(self, merge: Callable, state: tuple):
    self._merge, self.state = merge, state

  def __call__(self, scales, state=None):
    return self._merge(scales, *(self.state if state is None else state))


def distill(student, teacher, delta: dict, batches: Iterator[np.ndarray],
            cfg: DistillConfig = DistillConfig(), *, progress: bool = True):
  """Distils the scales of ``delta`` (already loaded in ``student``'s slot 1).

  Returns ``({hf name: new α (np.float32, the entry's own scale shape)}, curves)``; the α kept
  is the best on two fixed held-out calibration batches (never worse than the start).
  """
  start, merge, state = _slot_scale_parts(student, SLOT)
  alphas = {n: jnp.asarray(e.scale, jnp.float32) for n, e in delta.items()
            if isinstance(e, PackedDelta) and n in start}
  missing = sorted(n for n, e in delta.items() if isinstance(e, PackedDelta) and n not in start
                   and not _is_vocab(n))
  if missing:
    raise ValueError(f"the delta has 1-bit tensors that are not linear layers of this model: "
                     f"{missing[:3]}")

  # Both models' weights are jit arguments, never closed-over constants (XLA would fold and
  # copy them into every executable: gigabytes and minutes for a 135M model).
  t_graph, t_state = nnx.split(teacher)

  @jax.jit
  def teacher_fn(t_state, tokens):
    return nnx.merge(t_graph, t_state)(tokens)

  def teacher_logits(tokens):
    return teacher_fn(t_state, tokens)

  opt = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)

  def mse(a, state, tokens, target):
    model = merge(a, *state)
    slots = jnp.full((tokens.shape[0],), SLOT, jnp.int32)
    return jnp.mean(jnp.square(model(tokens, slot_ids=slots) - target))

  @jax.jit
  def step_fn(a, opt_state, tokens, target, state):
    loss, g = jax.value_and_grad(mse)(a, state, tokens, target)
    upd, opt_state = opt.update(g, opt_state, a)
    return optax.apply_updates(a, upd), opt_state, loss

  def step(a, opt_state, tokens, target):
    return step_fn(a, opt_state, tokens, target, state)

  eval_fn = jax.jit(mse)

  def eval_loss(a, tokens, target):
    return eval_fn(a, state, tokens, target)

  # A fixed held-out set of batches judges every candidate: the curve is measured on the same
  # data before and after, and the best α seen is kept (a too-large lr cannot make it worse).
  held = [jnp.asarray(next(batches)) for _ in range(2)]
  held_t = [teacher_logits(t) for t in held]

  def held_loss(a):
    return float(np.mean([eval_loss(a, t, y) for t, y in zip(held, held_t)]))

  opt_state = opt.init(alphas)
  losses = []
  best, best_loss = alphas, held_loss(alphas)
  first = best_loss
  with tqdm(range(cfg.steps), desc="distill", disable=not progress, leave=False) as bar:
    for i in bar:
      tokens = jnp.asarray(next(batches))
      alphas, opt_state, loss = step(alphas, opt_state, tokens, teacher_logits(tokens))
      losses.append(loss)
      if (i + 1) % cfg.eval_every == 0 or i == cfg.steps - 1:
        hl = held_loss(alphas)
        if hl < best_loss:
          best, best_loss = alphas, hl
        bar.set_postfix(mse=f"{hl:.3e}")
  nnx.update(student, nnx.state(merge(best, *state), SlotBank))
  curve = {"train_mse": [float(x) for x in losses], "held_mse_before": first,
           "held_mse_after": best_loss}
  return {n: np.asarray(a) for n, a in best.items()}, curve


class _StudentTensors(Mapping):
  """HF tensors of the student: the base's for 1-bit (packed) weights, else the fine-tune's."""

  def __init__(self, base: CheckpointReader, ft: CheckpointReader, packed: set[str]):
    self.base, self.ft, self.packed = base, ft, packed

  def __getitem__(self, name: str) -> np.ndarray:
    return (self.base if name in self.packed else self.ft).read(name)

  def __iter__(self):
    return iter(self.ft.names())

  def __len__(self) -> int:
    return len(self.ft.names())


def build_student(base_dir, ft_dir, delta: Mapping, *, dtype=jnp.float32):
  """The model whose slot ``SLOT`` is base + α·sign(Δ) on the linear layers, with every other
  tensor (embeddings, LM head, norms, biases; a grown vocabulary too) as in the fine-tune, or,
  when the delta stores them 1-bit, as the delta serves them (base + α·sign, α not trained)."""
  packed = {n for n, e in delta.items() if isinstance(e, PackedDelta)}
  with CheckpointReader(base_dir) as base, CheckpointReader(ft_dir) as ft:
    for n in sorted(packed):
      if n not in base or n not in ft:
        raise DeltaMismatchError(f"1-bit tensor {n!r} of the delta is missing from "
                                 f"{base_dir if n not in base else ft_dir}")
      if base.info(n).shape != ft.info(n).shape:
        raise DeltaMismatchError(f"tensor {n!r} has shape {list(base.info(n).shape)} in "
                                 f"{base_dir} but {list(ft.info(n).shape)} in {ft_dir}")
    # 1-bit embedding / LM-head deltas stay 1-bit in the student (their α does not train)
    emb = any("embed_tokens" in n or "lm_head" in n for n in packed)
    cfg = load_config(ft_dir, num_slots=SLOT + 1, packed_embedding_slots=emb)
    student = from_tensors(cfg, _StudentTensors(base, ft, packed), dtype)
  load_variant(student, SLOT, {n: delta[n] for n in packed})
  return student


def token_windows(ids: np.ndarray, cfg: DistillConfig) -> Iterator[np.ndarray]:
  """Endless random ``[batch, seq]`` windows of a token stream."""
  if len(ids) <= cfg.seq:
    raise ValueError(f"calibration text has {len(ids)} tokens, need more than seq={cfg.seq}")
  rng = np.random.default_rng(cfg.seed)
  while True:
    starts = rng.integers(0, len(ids) - cfg.seq, size=cfg.batch)
    yield np.stack([ids[s:s + cfg.seq] for s in starts]).astype(np.int32)


def read_calibration(path: str | Path, tokenizer_dir: str | Path) -> np.ndarray:
  """A text file, or a jsonl file with a "text" field (or "prompt"/"completion"), → token ids."""
  from tokenizers import Tokenizer

  path = Path(path)
  tok_file = Path(tokenizer_dir) / "tokenizer.json"
  if not tok_file.exists():
    raise FileNotFoundError(f"{tok_file}: no tokenizer.json to encode calibration text")
  tok = Tokenizer.from_file(str(tok_file))
  texts = []
  if path.suffix == ".jsonl":
    for i, line in enumerate(path.read_text().splitlines()):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
      text = rec.get("text") or (rec.get("prompt", "") + rec.get("completion", ""))
      if not text:
        raise ValueError(f"{path}:{i + 1}: no 'text' (or 'prompt'/'completion') field")
      texts.append(text)
  else:
    texts.append(path.read_text())
  ids = [i for t in texts for i in tok.encode(t).ids]
  return np.asarray(ids, np.int32)


def distill_checkpoint(base_dir, ft_dir, delta_dir, calibration, cfg: DistillConfig | None = None,
                       *, steps: int | None = None, progress: bool = True) -> dict:
  """Distils a delta directory's scales against its fine-tune and writes them back atomically.

  ``calibration``: a path (text / jsonl), a token array, or a list of (prompt, answer) task
  examples (encoded in the chat format and concatenated).
  """
  cfg = cfg or DistillConfig()
  if steps is not None:
    cfg = dataclasses.replace(cfg, steps=steps)
  if cfg.steps < 0 or cfg.seq < 1 or cfg.batch < 1 or not cfg.lr > 0:
    raise ValueError(f"distill: steps must be >= 0, seq and batch >= 1 and lr > 0; got "
                     f"steps={cfg.steps}, seq={cfg.seq}, batch={cfg.batch}, lr={cfg.lr}")
  from bitdelta_jax.delta.stream import fingerprint_checkpoint

  delta, manifest = load_delta(
    delta_dir, base_fingerprint=fingerprint_checkpoint(base_dir, content=False))
  if isinstance(calibration, (str, Path)):
    # The fine-tune's own tokenizer when it has one (it may have grown the vocabulary).
    tok_dir = ft_dir if (Path(ft_dir) / "tokenizer.json").exists() else base_dir
    ids, source = read_calibration(calibration, tok_dir), Path(calibration).name
  elif isinstance(calibration, np.ndarray):
    ids, source = calibration, "token array"
  else:
    from bitdelta_jax.zoo.data import encode_example

    ids = np.concatenate([encode_example(p, a)[0] for p, a in calibration])
    source = f"{len(calibration)} task examples"
  student = build_student(base_dir, ft_dir, delta)
  teacher = from_pretrained(ft_dir, dtype=jnp.float32)
  t = time.perf_counter()
  scales, curve = distill(student, teacher, delta, token_windows(ids, cfg), cfg,
                          progress=progress)
  losses = curve["train_mse"]
  info = {
    "method": "distilled", "init": manifest["scales"].get("method", "mean_abs"),
    "steps": cfg.steps, "lr": cfg.lr, "seq": cfg.seq, "batch": cfg.batch, "optimizer": "adamw",
    "calibration": source, "held_mse_before": curve["held_mse_before"],
    "held_mse_after": curve["held_mse_after"],
    "train_mse_first": losses[0] if losses else None,
    "train_mse_last10": float(np.mean(losses[-10:])) if losses else None,
    "seconds": time.perf_counter() - t,
  }
  update_scales(delta_dir, scales, info)
  return info


def add_distill_parser(sub) -> None:
  p = sub.add_parser(
    "distill", help="distil a delta's scales against its fine-tune (optax)",
    description="Train only the scales α of a delta so that base + α·sign(Δ) matches the "
    "fine-tune's logits on calibration text (BitDelta §3.2). Tensors the delta keeps exactly "
    "(embeddings, LM head, norms) are taken from the fine-tune and not trained.")
  p.add_argument("--base", required=True, metavar="DIR",
                 help="HF base checkpoint directory the delta was made for")
  p.add_argument("--finetuned", required=True, metavar="DIR",
                 help="HF fine-tuned checkpoint directory (the teacher)")
  p.add_argument("--delta", required=True, metavar="DIR",
                 help="delta directory (its scales are replaced, atomically)")
  p.add_argument("--calibration", required=True, metavar="FILE",
                 help='text file, or jsonl with a "text" (or "prompt"/"completion") field')
  p.add_argument("--steps", type=int, default=DistillConfig.steps,
                 help="optimizer steps (default: %(default)s)")
  p.add_argument("--lr", type=float, default=DistillConfig.lr,
                 help="AdamW learning rate (default: %(default)s)")
  p.add_argument("--seq", type=int, default=DistillConfig.seq,
                 help="tokens per calibration window (default: %(default)s)")
  p.add_argument("--batch", type=int, default=DistillConfig.batch,
                 help="windows per step (default: %(default)s)")
  p.add_argument("--quiet", action="store_true", help="print nothing but errors")

  def run(args) -> int:
    cfg = DistillConfig(steps=args.steps, lr=args.lr, seq=args.seq, batch=args.batch)
    info = distill_checkpoint(args.base, args.finetuned, args.delta, args.calibration, cfg,
                              progress=not args.quiet)
    if not args.quiet:
      print(json.dumps(info, indent=1))
    return 0

  p.set_defaults(fn=run)
