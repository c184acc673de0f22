"""LoRA fine-tuning of the project's NNX model (f32, optax), producing PEFT adapters.

    trainer = LoraTrainer(from_pretrained(base_dir, jnp.float32))
    adapter, losses = trainer.train(batches, LoraRecipe())   # LoraAdapter, scale folded into B
    logits = trainer.forward(adapter)(tokens)                # base + ΔW, one jit for all adapters

The base stays frozen; each adapted linear layer gets ΔW = (α / r) · B · A with PEFT's
initialisation (A ~ U(±1/√in), B = 0). The forward adds the dense ΔW to the kernel, which at
SmolLM2 sizes costs less than the layer itself and keeps one compiled program for training and
one for evaluation whatever the adapter.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bitdelta_jax.losses import masked_xent
from bitdelta_jax.merge.lora import LoraAdapter, from_factors
from bitdelta_jax.models.loading import hf_name


@dataclasses.dataclass(frozen=True)
class LoraRecipe:
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q_proj", "v_proj", "up_proj", "down_proj")
  steps: int = 64
  batch: int = 8
  seq: int = 48
  lr: float = 1e-3
  warmup: int = 8
  seed: int = 0

  def key(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  def optimizer(self) -> optax.GradientTransformation:
    warmup = min(self.warmup, self.steps // 4)
    sched = optax.warmup_cosine_decay_schedule(0.0, self.lr, warmup, self.steps, self.lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))


def _with_deltas(params, deltas: dict):
  """params with kernel += ΔW for {HF module name: ΔW [in, out]} (traceable)."""

  def one(kp, leaf):
    name, transposed = hf_name(tuple(k.key for k in kp))
    d = deltas.get(name.removesuffix(".weight")) if transposed else None
    return leaf if d is None else leaf + d.astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(one, params)


class LoraTrainer:
  """A frozen base model, LoRA training on it, and its forward with any adapter."""

  def __init__(self, model):
    self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
    self.params = nnx.to_pure_dict(params)
    self.modules: dict[str, tuple[int, int]] = {}  # HF module name -> (in, out)
    for kp, leaf in jax.tree_util.tree_flatten_with_path(self.params)[0]:
      name, transposed = hf_name(tuple(k.key for k in kp))
      if transposed:
        self.modules[name.removesuffix(".weight")] = tuple(leaf.shape)

  def _logits(self, params, tokens):
    return nnx.merge(self.graphdef, params, self.rest)(tokens)

  @functools.cached_property
  def _forward(self):
    @jax.jit
    def fwd(params, deltas, tokens):
      return self._logits(_with_deltas(params, deltas), tokens)

    return fwd

  def deltas(self, adapter: LoraAdapter | None) -> dict:
    """{HF module name: ΔW [in, out]} of ``adapter`` (None: none), each checked to fit the base."""
    if adapter is None:
      return {}
    out = {k.removesuffix(".weight"): v for k, v in adapter.deltas().items()}
    unknown = set(out) - set(self.modules)
    if unknown:
      raise ValueError(f"the adapter adapts modules the base does not have: {sorted(unknown)[:3]}")
    for module, d in out.items():
      if self.modules[module] != d.T.shape:
        raise ValueError(f"adapter module {module!r}: ΔW is {list(d.shape)}, the base's weight "
                         f"{list(self.modules[module][::-1])}")
    return {m: jnp.asarray(np.ascontiguousarray(d.T)) for m, d in out.items()}

  def params_with(self, adapter: LoraAdapter | None):
    """The base parameters with every adapted kernel += ΔW (the base itself for None)."""
    return _with_deltas(self.params, self.deltas(adapter)) if adapter is not None else self.params

  def forward(self, adapter: LoraAdapter | None):
    """tokens [B, T] -> logits [B, T, V] of base + adapter (None: the base)."""
    deltas = self.deltas(adapter)
    return lambda tokens: self._forward(self.params, deltas, tokens)

  def init_factors(self, recipe: LoraRecipe, name: str) -> dict:
    rng = np.random.default_rng(zlib.crc32(f"{name}:lora:{recipe.seed}".encode()))
    factors = {}
    for mod, (d_in, d_out) in sorted(self.modules.items()):
      if mod.rsplit(".", 1)[-1] in recipe.targets:
        bound = 1.0 / math.sqrt(d_in)
        factors[mod] = (jnp.asarray(rng.uniform(-bound, bound, (recipe.rank, d_in)), jnp.float32),
                        jnp.zeros((d_out, recipe.rank), jnp.float32))
    if not factors:
      raise ValueError(f"no linear layer of the base matches the targets {recipe.targets}")
    return factors

  def train(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], recipe: LoraRecipe,
            name: str = "lora", log=None) -> tuple[LoraAdapter, list[float]]:
    """``recipe.steps`` Adam steps on ``(tokens, mask)`` batches → (adapter, loss curve)."""
    opt = recipe.optimizer()
    scale = recipe.alpha / recipe.rank

    def loss(factors, params, tokens, mask):
      deltas = {n: scale * (a.T @ b.T) for n, (a, b) in factors.items()}  # [in, out]
      return masked_xent(self._logits(_with_deltas(params, deltas), tokens), tokens, mask)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(factors, opt_state, params, tokens, mask):  # params an argument, never a constant
      value, grads = jax.value_and_grad(loss)(factors, params, tokens, mask)
      updates, opt_state = opt.update(grads, opt_state, factors)
      return optax.apply_updates(factors, updates), opt_state, value

    factors = self.init_factors(recipe, name)
    opt_state = opt.init(factors)
    losses = []
    for i in range(recipe.steps):
      toks, mask = next(batches)
      factors, opt_state, value = step(factors, opt_state, self.params, jnp.asarray(toks),
                                      jnp.asarray(mask))
      losses.append(value)
      if log is not None and (i % 10 == 0 or i == recipe.steps - 1):
        log(i, float(value))
    adapter = from_factors(
      {n: (np.asarray(a), np.asarray(b) * scale) for n, (a, b) in factors.items()},
      {"r": recipe.rank, "lora_alpha": recipe.rank,
       "target_modules": sorted(recipe.targets)})
    return adapter, [float(x) for x in losses]
