"""A small optax training loop over the project's NNX model (full-parameter, f32)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from bitdelta_jax.losses import masked_xent


def train(
  model, batches: Iterator[tuple[np.ndarray, np.ndarray]], steps: int, optimizer:
  optax.GradientTransformation, *, desc: str = "train", progress: bool = True,
  log: Callable[[int, float], None] | None = None,
) -> list[float]:
  """Trains every ``nnx.Param`` of ``model`` in place; returns the loss curve."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt_state = optimizer.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, mask):
    def loss_fn(p):
      m = nnx.merge(graphdef, p, rest)
      return masked_xent(m(tokens), tokens, mask)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  with tqdm(range(steps), desc=desc, disable=not progress, leave=False) as bar:
    for i in bar:
      tokens, mask = next(batches)
      params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
      if i % 10 == 0 or i == steps - 1:
        lv = float(loss)
        bar.set_postfix(loss=f"{lv:.3f}")
        if log:
          log(i, lv)
      losses.append(loss)
  nnx.update(model, params)
  return [float(x) for x in losses]
