"""Scale distillation (BitDelta §3.2): train only the α of a compressed variant so that its
logits match the fine-tuned model's on calibration text; with the low-rank delta modes
(``dqrelo``, ``svd``, ``delta-come``), their factors a·b train too.

Everything else is frozen: the trainable pytree holds one α per 1-bit matrix (shape [1]
per-matrix or [N] per-column) and, for ``residual`` / ``lora`` tensors, their factors
``a [K, r]``, ``b [r, N]``. The student (`build_student`) is the fine-tuned model with its
linear weights replaced by the base's and the delta in slot 1 of its banks (1-bit bank and
LoRA bank): everything the delta keeps exactly (changed embeddings, LM head, norms, biases,
a grown vocabulary) is taken from the fine-tune and frozen, as in the paper. Factors train in
f32 and are written back re-quantised at their stored widths (bf16/f16 rounding, or fresh
8/4/2-bit codes), so a delta's bytes never change; the held-out judgement that decides what
is kept is made on the re-quantised values. The teacher is the fine-tuned model. Two models
in memory, never three.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from bitdelta_jax.delta.entries import DeltaMismatchError, LoraEntry, ResidualEntry
from bitdelta_jax.delta.format import PackedDelta
from bitdelta_jax.delta.residual import CodedLora, lora_rank_of, recode
from bitdelta_jax.delta.store import load_delta, update_entries
from bitdelta_jax.hf.checkpoints import open_checkpoint
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
  factors: bool = True  # also train the low-rank factors of residual / lora tensors


def _is_vocab(name: str) -> bool:
  """1-bit embedding / LM-head deltas: served 1-bit, but their α is not distilled."""
  return "embed_tokens" in name or "lm_head" in name


def _key(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


# bank variable of a DeltaDense → its part of the trainable pytree
_ROLES = {"delta_scale": "alpha", "lora_a": "a", "lora_b": "b"}


def _bank_leaves(banks) -> dict[tuple[str, ...], tuple[str, str]]:
  """Path of a layer's ``delta_scale`` / ``lora_a`` / ``lora_b`` bank in the SlotBank state →
  (HF weight name, "alpha" | "a" | "b")."""
  out = {}
  for path, _ in jax.tree_util.tree_flatten_with_path(banks)[0]:
    k = _key(path)
    for field, role in _ROLES.items():
      if field in k:
        out[k] = (".".join(k[:k.index(field)]) + ".weight", role)
  return out


def _slot_parts(model, slot: int):
  """``(where, merge, state)``: ``where`` maps (HF name, role) to the slot's current bank
  value; ``merge(params, *state) -> model`` (pure) writes ``params = {"alpha": {name: α},
  "a": {name: [K, r]}, "b": {name: [r, N]}}`` into slot ``slot`` (α broadcast over the
  columns, factors into the first r rank rows); ``state = (params, banks, rest)`` is the
  model's state to pass to it (as jit arguments, not constants)."""
  if not 0 < int(slot) < model.config.num_slots:
    raise ValueError(f"slot must be in [1, {model.config.num_slots}) (slot 0 is the base), "
                     f"got {slot}")
  graphdef, params, banks, rest = nnx.split(model, nnx.Param, SlotBank, ...)
  by_path = _bank_leaves(banks)
  flat = {_key(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(banks)[0]}
  where = {nr: flat[k][slot] for k, nr in by_path.items()}

  def merge(new: Mapping[str, Mapping[str, jax.Array]], params, banks, rest):
    def put(path, leaf):
      hit = by_path.get(_key(path))
      v = None if hit is None else new.get(hit[1], {}).get(hit[0])
      if v is None:
        return leaf
      v = jnp.asarray(v).astype(leaf.dtype)
      if hit[1] == "alpha":
        return leaf.at[slot].set(jnp.broadcast_to(v, leaf.shape[1:]))
      if hit[1] == "a":
        return leaf.at[slot, :, :v.shape[1]].set(v)
      return leaf.at[slot, :v.shape[0]].set(v)
    return nnx.merge(graphdef, params, jax.tree_util.tree_map_with_path(put, banks), rest)

  return where, merge, (params, banks, rest)


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
  where, merge, state = _slot_parts(model, slot)
  scales = {n: jnp.asarray(v, jnp.float32) for (n, role), v in where.items() if role == "alpha"}
  return scales, WithScales(lambda a, *st: merge({"alpha": a}, *st), state)


class WithScales:
  """``with_scales(scales, state=None)``: the model with one slot's α replaced (`slot_scales`);
  ``state`` (a pytree: pass it into a jitted function) defaults to the model's own."""

  def __init__(self, merge: Callable, state: tuple):
    self._merge, self.state = merge, state

  def __call__(self, scales, state=None):
    return self._merge(scales, *(self.state if state is None else state))


class Distilled(NamedTuple):
  """What `distill` found: ``scales`` ``{name: α}`` (np.float32, the entry's own scale shape),
  ``factors`` ``{name: CodedLora}`` (re-coded at their stored widths; empty when only α
  trained), ``curve`` (train / held-out MSE)."""

  scales: dict[str, np.ndarray]
  factors: dict[str, CodedLora]
  curve: dict


def _start(delta: Mapping, where: Mapping, factors: bool):
  """The trainable pytree at the delta's own values, and the stored factors it re-codes to."""
  tree: dict[str, dict[str, jax.Array]] = {"alpha": {}, "a": {}, "b": {}}
  coded, missing = {}, []
  for n, e in delta.items():
    packed = e.packed if isinstance(e, ResidualEntry) else e
    lora = e.lora if isinstance(e, ResidualEntry) else e if isinstance(e, LoraEntry) else None
    if isinstance(packed, PackedDelta) and not _is_vocab(n):
      if (n, "alpha") not in where:
        missing.append(n)
        continue
      tree["alpha"][n] = jnp.asarray(packed.scale, jnp.float32)
    if lora is not None and factors:
      if (n, "a") not in where:
        missing.append(n)
        continue
      tree["a"][n], tree["b"][n] = (jnp.asarray(lora.a, jnp.float32),
                                    jnp.asarray(lora.b, jnp.float32))
      coded[n] = lora
  if missing:
    raise ValueError(f"the delta has 1-bit or low-rank tensors that are not linear layers of "
                     f"this model (or the model has no LoRA bank for them): {sorted(missing)[:3]}")
  return tree, coded


def _recoded(tree, coded: Mapping) -> tuple[dict, dict[str, CodedLora]]:
  """``tree`` with its factors re-quantised to their stored widths (what would be written)."""
  if not coded:
    return tree, {}
  out = {n: recode(e, np.asarray(tree["a"][n]), np.asarray(tree["b"][n]))
         for n, e in coded.items()}
  return {"alpha": tree["alpha"], "a": {n: jnp.asarray(c.a) for n, c in out.items()},
          "b": {n: jnp.asarray(c.b) for n, c in out.items()}}, out


def distill(student, teacher, delta: dict, batches: Iterator[np.ndarray],
            cfg: DistillConfig = DistillConfig(), *, progress: bool = True) -> Distilled:
  """Distils the scales of ``delta`` (already loaded in ``student``'s slot 1) and, with
  ``cfg.factors``, the low-rank factors of its ``residual`` / ``lora`` tensors.

  Factors train in f32 and are re-quantised to their stored widths (`residual.recode`) before
  each held-out judgement, so the candidate judged is the one that would be written. What is
  kept is the best on two fixed held-out calibration batches (never worse than the start).
  """
  where, merge, state = _slot_parts(student, SLOT)
  params, coded = _start(delta, where, cfg.factors)

  # Both models' weights are jit arguments, never closed-over constants (XLA would fold and
  # copy them into every executable: gigabytes and minutes for a 135M model).
  t_graph, t_state = nnx.split(teacher)

  @jax.jit
  def teacher_fn(t_state, tokens):
    return nnx.merge(t_graph, t_state)(tokens)

  def teacher_logits(tokens):
    return teacher_fn(t_state, tokens)

  opt = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)

  def mse(p, state, tokens, target):
    model = merge(p, *state)
    slots = jnp.full((tokens.shape[0],), SLOT, jnp.int32)
    return jnp.mean(jnp.square(model(tokens, slot_ids=slots) - target))

  @jax.jit
  def step_fn(p, opt_state, tokens, target, state):
    loss, g = jax.value_and_grad(mse)(p, state, tokens, target)
    upd, opt_state = opt.update(g, opt_state, p)
    return optax.apply_updates(p, upd), opt_state, loss

  eval_fn = jax.jit(mse)

  # A fixed held-out set of batches judges every candidate: the curve is measured on the same
  # data before and after, and the best seen is kept (a too-large lr cannot make it worse).
  held = [jnp.asarray(next(batches)) for _ in range(2)]
  held_t = [teacher_logits(t) for t in held]

  def held_loss(p):
    return float(np.mean([eval_fn(p, state, t, y) for t, y in zip(held, held_t)]))

  opt_state = opt.init(params)
  losses = []
  best, best_coded = params, dict(coded)
  best_loss = first = held_loss(params)
  with tqdm(range(cfg.steps), desc="distill", disable=not progress, leave=False) as bar:
    for i in bar:
      tokens = jnp.asarray(next(batches))
      params, opt_state, loss = step_fn(params, opt_state, tokens, teacher_logits(tokens), state)
      losses.append(loss)
      if (i + 1) % cfg.eval_every == 0 or i == cfg.steps - 1:
        cand, cand_coded = _recoded(params, coded)
        hl = held_loss(cand)
        if hl < best_loss:
          best, best_coded, best_loss = cand, cand_coded, hl
        bar.set_postfix(mse=f"{hl:.3e}")
  nnx.update(student, nnx.state(merge(best, *state), SlotBank))
  curve = {"train_mse": [float(x) for x in losses], "held_mse_before": first,
           "held_mse_after": best_loss}
  scales = {n: np.asarray(a) for n, a in best["alpha"].items()}
  return Distilled(scales, best_coded, curve)


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


def _is_linear_entry(entry) -> bool:
  return isinstance(entry, (PackedDelta, LoraEntry, ResidualEntry))


def build_student(base_dir, ft_dir, delta: Mapping, *, dtype=jnp.float32):
  """The model whose slot ``SLOT`` is base + the delta's linear entries (α·sign(Δ), or with the
  low-rank modes α·sign + a·b or a·b alone, in the slot's LoRA bank), with every other tensor
  (embeddings, LM head, norms, biases; a grown vocabulary too) as in the fine-tune, or, when
  the delta stores them 1-bit, as the delta serves them (base + α·sign, α not trained)."""
  packed = {n for n, e in delta.items() if _is_linear_entry(e)}
  with open_checkpoint(base_dir) as base, open_checkpoint(ft_dir) as ft:
    for n in sorted(packed):
      if n not in base or n not in ft:
        raise DeltaMismatchError(f"1-bit tensor {n!r} of the delta is missing from "
                                 f"{base_dir if n not in base else ft_dir}")
      if base.info(n).shape != ft.info(n).shape:
        raise DeltaMismatchError(f"tensor {n!r} has shape {list(base.info(n).shape)} in "
                                 f"{base_dir} but {list(ft.info(n).shape)} in {ft_dir}")
    # 1-bit embedding / LM-head deltas stay 1-bit in the student (their α does not train)
    emb = any("embed_tokens" in n or "lm_head" in n for n in packed)
    cfg = load_config(ft_dir, num_slots=SLOT + 1, packed_embedding_slots=emb,
                      lora_rank=lora_rank_of(delta[n] for n in packed))
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
  """Distils a delta directory's scales (and, with ``cfg.factors``, the low-rank factors of a
  ``dqrelo`` / ``svd`` / ``delta-come`` delta) against its fine-tune and writes them back
  atomically, in their stored format; the manifest's ``scales`` and ``factors`` say how.

  ``calibration``: a path (text / jsonl), a token array, or a list of token arrays: task
  examples, each already encoded in the model's chat format (the built-in family's:
  `bitdelta_jax.zoo.data.example_ids`), concatenated.
  """
  from bitdelta_jax.hf.gguf_checkpoint import resolve_base

  base_dir = resolve_base(base_dir)
  cfg = cfg or DistillConfig()
  if steps is not None:
    cfg = dataclasses.replace(cfg, steps=steps)
  if cfg.steps < 0 or cfg.seq < 1 or cfg.batch < 1 or not cfg.lr > 0:
    raise ValueError(f"distill: steps must be >= 0, seq and batch >= 1 and lr > 0; got "
                     f"steps={cfg.steps}, seq={cfg.seq}, batch={cfg.batch}, lr={cfg.lr}")
  from bitdelta_jax.hf.fingerprint import fingerprint_checkpoint

  delta, manifest = load_delta(
    delta_dir, base_fingerprint=fingerprint_checkpoint(base_dir, content=False))
  if isinstance(calibration, (str, Path)):
    # The fine-tune's own tokenizer when it has one (it may have grown the vocabulary).
    tok_dir = ft_dir if (Path(ft_dir) / "tokenizer.json").exists() else base_dir
    ids, source = read_calibration(calibration, tok_dir), Path(calibration).name
  elif isinstance(calibration, np.ndarray):
    ids, source = calibration, "token array"
  else:
    parts = [np.asarray(x) for x in calibration]
    if not parts or any(x.ndim != 1 or not np.issubdtype(x.dtype, np.integer) for x in parts):
      first = type(calibration[0]).__name__ if len(calibration) else "nothing"
      raise TypeError("distill: calibration must be a path, a token array or a non-empty list "
                      "of token arrays (task examples already encoded, e.g. by "
                      f"bitdelta_jax.zoo.data.example_ids); got a list of {first}")
    ids = np.concatenate(parts)
    source = f"{len(calibration)} task examples"
  student = build_student(base_dir, ft_dir, delta)
  teacher = from_pretrained(ft_dir, dtype=jnp.float32)
  t = time.perf_counter()
  scales, factors, curve = distill(student, teacher, delta, token_windows(ids, cfg), cfg,
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
  factors_info = None
  if factors:
    widths = sorted({int(w) for e in factors.values() for w in e.widths})
    factors_info = {
      "method": "distilled", "init": manifest.get("factors", {}).get("method", "svd"),
      "tensors": len(factors), "widths": widths,
      "note": "trained in f32 with α (same steps, optimizer and held-out rule), re-quantised "
              "to each component's stored width before every held-out judgement; the "
              "manifest's report errors are of the undistilled delta"}
    info["factors_distilled"] = len(factors)
  update_entries(delta_dir, scales, factors, info, factors_info)
  return info


def add_distill_parser(sub) -> None:
  p = sub.add_parser(
    "distill", help="distil a delta's scales (and low-rank factors) against its fine-tune "
    "(optax)",
    description="Train the scales α of a delta so that base + α·sign(Δ) matches the "
    "fine-tune's logits on calibration text (BitDelta §3.2); with a dqrelo / svd / delta-come "
    "delta, its low-rank factors train too and are written back at their stored widths. "
    "Tensors the delta keeps exactly (embeddings, LM head, norms) are taken from the "
    "fine-tune and not trained.")
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
  p.add_argument("--scales-only", action="store_true",
                 help="train only α, not the low-rank factors of a dqrelo / svd / delta-come "
                 "delta")
  p.add_argument("--quiet", action="store_true", help="print nothing but errors")

  def run(args) -> int:
    cfg = DistillConfig(steps=args.steps, lr=args.lr, seq=args.seq, batch=args.batch,
                        factors=not args.scales_only)
    info = distill_checkpoint(args.base, args.finetuned, args.delta, args.calibration, cfg,
                              progress=not args.quiet)
    if not args.quiet:
      print(json.dumps(info, indent=1))
    return 0

  p.set_defaults(fn=run)
