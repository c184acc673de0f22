"""A quality gate for `bitdelta_jax.kmerge.KMergePool` from per-task validation sets.

    gate = validation_gate(base_dir, {"math": math_adapter, ...}, {"math": [(prompt, answer)]},
                           threshold_fraction=0.9)
    pool = KMergePool(PoolConfig(k=2, budget_bytes=B, gate_threshold=gate.threshold), gate=gate)

A candidate adapter's score on a task is teacher-forced greedy exact match on that task's
validation examples, run on base + adapter: greedy decoding reproduces the answer and its end
token exactly when the argmax at every answer position is the answer token (as
`bitdelta_jax.zoo.evaluate`). Prompts are rendered with the tokenizer's chat template (a user
turn, after an optional system line) when it has one, else encoded as plain text; the answer is
followed by the tokenizer's first stop token (its EOS), where generation ends.

The gate returns the score relative to the task's own adapter (its score / the own adapter's
score on the same examples), so the pool keeps a merge only when the merged adapter reaches
``threshold_fraction`` × its own adapter's score on every task the member serves. A task whose
own adapter scores 0 cannot be protected: its relative score is 1 (`ValidationGate.unprotected`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bitdelta_jax.merge.lora import LoraAdapter, load_adapter

Example = tuple[str, str]  # (prompt, answer)
BATCH = 16  # rows per scoring call: one compiled shape per validation set


def read_val_set(path: str | os.PathLike) -> list[Example]:
  """A JSONL validation file: one ``{"prompt": ..., "answer": ...}`` object per line (blank
  lines skipped). A malformed line is a ValueError naming the file and line."""
  out = []
  path = Path(path)
  for i, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      p, a = row["prompt"], row["answer"]
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
        f'{path}:{i}: expected {{"prompt": ..., "answer": ...}} ({type(e).__name__}: {e})'
      ) from None
    if not isinstance(p, str) or not isinstance(a, str) or not a:
      raise ValueError(f"{path}:{i}: prompt and answer must be strings, the answer non-empty")
    out.append((p, a))
  if not out:
    raise ValueError(f"{path}: no examples")
  return out


def encode_examples(tokenizer, examples: Sequence[Example], system: str | None = None):
  """``(tokens [N, T], mask [N, T])``, right-padded to a multiple of 16; mask 1 at the
  positions whose next token is an answer token or the closing stop token."""
  stop = tokenizer.stop_token_ids[:1]
  rows = []
  for p, a in examples:
    if tokenizer.chat_template:
      msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": p}
      ]
      pi = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    else:
      pi = tokenizer.encode(p)
    rows.append((pi, tokenizer.encode(a, add_special_tokens=False) + list(stop)))
  seq = -(-max(len(p) + len(a) for p, a in rows) // 16) * 16
  toks = np.zeros((len(rows), seq), np.int32)
  mask = np.zeros((len(rows), seq), np.float32)
  for i, (pi, ai) in enumerate(rows):
    toks[i, : len(pi) + len(ai)] = pi + ai
    mask[i, len(pi) - 1 : len(pi) + len(ai) - 1] = 1.0
  return toks, mask


class AdapterScorer:
  """Teacher-forced greedy exact match of base + LoRA adapter (one base load, one compiled
  forward per token length; the adapter's ΔW is added to the base kernels on the host)."""

  def __init__(self, base_dir: str | os.PathLike):
    from flax import nnx

    from bitdelta_jax.merge.lora_train import LoraTrainer
    from bitdelta_jax.models import from_pretrained
    from bitdelta_jax.models.tokenizer import Tokenizer

    self.tokenizer = Tokenizer.from_dir(base_dir)
    self.trainer = LoraTrainer(from_pretrained(base_dir, dtype=jnp.float32))
    graphdef, rest = self.graphdef, self.rest = self.trainer.graphdef, self.trainer.rest
    self.params = self.trainer.params
    self._kernels = self.trainer.modules  # HF module name -> its kernel's shape ([in, out])

    def hits(params, tokens, mask):
      logits = nnx.merge(graphdef, params, rest)(tokens)[:, :-1]
      hit = (jnp.argmax(logits, -1) == tokens[:, 1:]) | (mask[:, :-1] == 0)
      return jnp.all(hit, axis=1)

    self._hits = jax.jit(hits)

  def params_with(self, adapter: LoraAdapter | None):
    """The base parameters with every adapted kernel += ΔWᵀ (`LoraTrainer.params_with`)."""
    return self.trainer.params_with(adapter)

  def score(self, adapter: LoraAdapter | None, encoded) -> float:
    """Exact match in [0, 1] of base + ``adapter`` on ``encoded`` (`encode_examples`)."""
    toks, mask = encoded
    params = self.params_with(adapter)
    hits = 0
    for i in range(0, len(toks), BATCH):
      t, m = toks[i : i + BATCH], mask[i : i + BATCH]
      n = len(t)
      if n < BATCH:  # one shape, one compile
        t = np.concatenate([t, np.repeat(t[-1:], BATCH - n, 0)])
        m = np.concatenate([m, np.repeat(m[-1:], BATCH - n, 0)])
      hits += int(np.sum(np.asarray(self._hits(params, jnp.asarray(t), jnp.asarray(m)))[:n]))
    return hits / len(toks)


class ValidationGate:
  """``gate(adapter, task)`` → the adapter's exact match on ``task``'s validation set over
  that of the task's own adapter (see the module docstring). ``threshold`` is the fraction a
  merge must reach on every task (`PoolConfig.gate_threshold`); ``log`` records each call."""

  def __init__(
    self,
    scorer: AdapterScorer,
    own_adapters: Mapping[str, LoraAdapter],
    val_sets: Mapping[str, Sequence[Example]],
    threshold_fraction: float,
    system: str | None = None,
  ):
    missing = sorted(set(own_adapters) - set(val_sets))
    if missing:
      raise ValueError(f"no validation set for the task(s) {missing}")
    if not 0 <= threshold_fraction:
      raise ValueError(f"threshold_fraction must be >= 0, got {threshold_fraction}")
    self.scorer, self.threshold = scorer, float(threshold_fraction)
    self.own_adapters = dict(own_adapters)
    self.encoded = {t: encode_examples(scorer.tokenizer, val_sets[t], system) for t in own_adapters}
    self.own_scores: dict[str, float] = {}
    self.log: list[dict] = []

  def own_score(self, task: str) -> float:
    if task not in self.own_scores:
      self.own_scores[task] = self.scorer.score(self.own_adapters[task], self.encoded[task])
    return self.own_scores[task]

  @property
  def unprotected(self) -> list[str]:
    """Tasks whose own adapter scores 0 (any merge passes the gate for them)."""
    return [t for t in self.own_adapters if self.own_score(t) == 0]

  def __call__(self, adapter: LoraAdapter, task: str) -> float:
    if task not in self.encoded:
      raise KeyError(f"the gate has no validation set for task {task!r}")
    own = self.own_score(task)
    score = self.scorer.score(adapter, self.encoded[task])
    rel = score / own if own > 0 else 1.0
    self.log.append({"task": task, "score": score, "own": own, "relative": rel})
    return rel


def validation_gate(
  base_dir: str | os.PathLike,
  own_adapters: Mapping[str, LoraAdapter | str | os.PathLike],
  val_sets: Mapping[str, Sequence[Example] | str | os.PathLike],
  threshold_fraction: float,
  *,
  system: str | None = None,
) -> ValidationGate:
  """The gate of a pool over ``base_dir``: ``own_adapters`` {task: adapter or PEFT dir},
  ``val_sets`` {task: [(prompt, answer)] or a JSONL file}; see `ValidationGate`."""
  adapters = {
    t: a if isinstance(a, LoraAdapter) else load_adapter(a) for t, a in own_adapters.items()
  }
  sets = {t: v if isinstance(v, list | tuple) else read_val_set(v) for t, v in val_sets.items()}
  return ValidationGate(AdapterScorer(base_dir), adapters, sets, threshold_fraction, system)
