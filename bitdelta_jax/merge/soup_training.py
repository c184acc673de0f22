"""Checkpoint soups during training: one loop for the benches and the fine-tune recipes.

Every ``every`` steps the parameters are replaced by a merge (the optimizer state is kept):

    none      plain training
    average   mean of the last ``window`` checkpoints, taken every ``every // window`` steps
              (the current one included)
    svd       svd_soup(start, [params, best], rank): the seed's rank-r SVD average with the best
              checkpoint so far, "best" by a validation loss checked every ``every // window`` steps
    monosoup  monosoup(start, params): the paper's single-checkpoint spectral re-weighting of the
              update since the start of the run

``start`` is the run's starting point (the base for a fine-tune). Leaves the run has not moved
(frozen embeddings) are left out of the SVD-based rules: their update is zero and their SVD the
most expensive.

    sched = SoupSchedule("monosoup", every=16)
    run = soup_train(step_fn, params, opt_state, batches, steps, sched, val_loss=val_fn)
    run.params, run.losses, run.val, run.merges
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bitdelta_jax.merge.baselines import Tree
from bitdelta_jax.merge.monosoup import monosoup
from bitdelta_jax.merge.soups import SvdSoupHook, svd_soup

METHODS = ("none", "average", "svd", "monosoup")

StepFn = Callable[[Tree, Any, jax.Array, jax.Array], tuple[Tree, Any, jax.Array]]


@dataclasses.dataclass(frozen=True)
class SoupSchedule:
  """What to merge and when. ``window`` is the number of checks per merge period: checkpoints
  averaged (``average``), validation checks that pick the best checkpoint (``svd``)."""

  method: str = "none"
  every: int = 16  # merge period N, in steps
  window: int = 4
  rank: int = 8  # svd
  monosoup_mode: str = "freevariance"

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"soup method must be one of {METHODS}, got {self.method!r}")
    if self.every < 1 or self.window < 1 or self.rank < 1:
      raise ValueError("soup every, window and rank must be >= 1")

  @property
  def check(self) -> int:
    """Steps between checks (checkpoints, validation losses)."""
    return max(1, self.every // self.window)

  def is_check(self, step: int) -> bool:
    return step % self.check == 0

  def is_merge(self, step: int) -> bool:
    return self.method != "none" and step % self.every == 0


@dataclasses.dataclass
class SoupRun:
  params: Tree
  opt_state: Any
  losses: list[float]  # training loss per step (before that step's update)
  val: list[tuple[int, float]]  # (step, validation loss) at every check, before a merge
  merges: list[int]  # steps after which the parameters were merged
  seconds: float
  merge_seconds: float = 0.0  # of which merging


def copy_tree(tree: Tree) -> Tree:
  return jax.tree.map(jnp.array, tree)  # jnp.array copies: training steps donate their inputs


def _moved_leaves(start: Tree, params: Tree) -> dict[int, tuple[jax.Array, jax.Array]]:
  """{leaf index: (start leaf, leaf)} for the float leaves that differ from the start."""
  out = {}
  for i, (a, b) in enumerate(zip(jax.tree.leaves(start), jax.tree.leaves(params))):
    if jnp.issubdtype(b.dtype, jnp.floating) and bool(jnp.any(a != b)):
      out[i] = (a, b)
  return out


def _on_moved(rule: Callable[[dict, dict], dict], start: Tree, params: Tree) -> Tree:
  """Applies ``rule(start_sub, params_sub)`` to the moved leaves only (flat dicts by index)."""
  moved = _moved_leaves(start, params)
  merged = rule({str(i): a for i, (a, _) in moved.items()},
                {str(i): b for i, (_, b) in moved.items()}) if moved else {}
  leaves, treedef = jax.tree.flatten(params)
  leaves = [merged.get(str(i), leaf) for i, leaf in enumerate(leaves)]
  return jax.tree.unflatten(treedef, leaves)


class Souper:
  """The state of one run's soups: the checkpoint window (``average``), the best checkpoint
  (``svd``). ``observe`` at every check, ``merge`` at every merge step."""

  def __init__(self, schedule: SoupSchedule, start: Tree):
    self.schedule = schedule
    self.start = start
    self.window: list[Tree] = []
    self.hook = SvdSoupHook(base=start, every=schedule.every, rank=schedule.rank,
                            _soup=_svd_soup_moved)

  def observe(self, params: Tree, val_loss: float | None) -> None:
    if self.schedule.method == "average":
      self.window = (self.window + [copy_tree(params)])[-self.schedule.window:]
    elif self.schedule.method == "svd":
      if val_loss is None:
        raise ValueError("the svd soup needs a validation loss to pick the best checkpoint")
      self.hook.observe(params, val_loss)

  def merge(self, step: int, params: Tree) -> Tree:
    m = self.schedule.method
    if m == "average" and self.window:
      return jax.tree.map(lambda *xs: sum(xs) / len(xs), *self.window)
    if m == "svd":
      return self.hook(step, params)
    if m == "monosoup":
      mode = self.schedule.monosoup_mode
      return _on_moved(lambda b, p: monosoup(b, p, mode=mode), self.start, params)
    return params


def _svd_soup_moved(start: Tree, checkpoints: list[Tree], rank: int) -> Tree:
  """svd_soup(start, checkpoints, rank) on the leaves the first checkpoint moved."""
  params, *others = checkpoints
  others_leaves = [jax.tree.leaves(o) for o in others]

  def rule(start_sub: dict, params_sub: dict) -> dict:
    subs = [{k: leaves[int(k)] for k in params_sub} for leaves in others_leaves]
    return svd_soup(start_sub, [params_sub, *subs], rank)

  return _on_moved(rule, start, params)


def soup_train(step_fn: StepFn, params: Tree, opt_state, batches: Iterator, steps: int,
               schedule: SoupSchedule, *, start: Tree | None = None,
               val_loss: Callable[[Tree], float] | None = None,
               log: Callable[[int, float, float | None], None] | None = None) -> SoupRun:
  """Runs ``steps`` optimizer steps with the schedule's soups.

  ``step_fn(params, opt_state, tokens, mask) -> (params, opt_state, loss)`` may donate its
  inputs; ``start`` (default: a copy of ``params``) is the point the SVD rules measure updates
  from. ``val_loss(params)`` is evaluated at every check when given (required by ``svd``).
  ``log(step, train_loss, val_loss)`` is called at every check."""
  start = copy_tree(params) if start is None else start
  souper = Souper(schedule, start)
  losses, val, merges = [], [], []
  merge_s = 0.0
  t0 = time.perf_counter()
  for step in range(1, steps + 1):
    tokens, mask = next(batches)
    params, opt_state, loss = step_fn(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
    losses.append(loss)
    if schedule.is_check(step):
      vl = float(val_loss(params)) if val_loss is not None else None
      if vl is not None:
        val.append((step, vl))
      souper.observe(params, vl)
      if log is not None:
        log(step, float(loss), vl)
    if schedule.is_merge(step):
      tm = time.perf_counter()
      # fresh buffers for the donating step; waited for, so merge_s is the merge's time
      params = jax.block_until_ready(copy_tree(souper.merge(step, params)))
      merge_s += time.perf_counter() - tm
      merges.append(step)
  return SoupRun(params, opt_state, [float(x) for x in losses], val, merges,
                 time.perf_counter() - t0, merge_s)


def model_step_fns(graphdef, rest, optimizer: optax.GradientTransformation,
                   loss: Callable | None = None) -> tuple[StepFn, Callable]:
  """Jitted ``(step_fn, loss_fn)`` for an NNX model split as ``nnx.split(model, nnx.Param,
  ...)``: the step of `zoo.train.train` (donating), and the masked answer loss."""
  from flax import nnx

  from bitdelta_jax.losses import masked_xent

  def xent(params, tokens, mask):
    return masked_xent(nnx.merge(graphdef, params, rest)(tokens), tokens, mask)

  loss = loss or xent

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step_fn(params, opt_state, tokens, mask):
    value, grads = jax.value_and_grad(loss)(params, tokens, mask)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step_fn, jax.jit(loss)


def train_with_soups(model, batches: Iterator, steps: int,
                     optimizer: optax.GradientTransformation, schedule: SoupSchedule, *,
                     val: tuple[np.ndarray, np.ndarray] | None = None,
                     log: Callable[[int, float, float | None], None] | None = None) -> SoupRun:
  """`zoo.train.train` with soups: trains every ``nnx.Param`` of ``model`` in place from its
  current values (the soups' start point). ``val`` = (tokens, mask) of a validation batch."""
  from flax import nnx

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  step_fn, loss_fn = model_step_fns(graphdef, rest, optimizer)
  val_loss = None
  if val is not None:
    vt, vm = jnp.asarray(val[0]), jnp.asarray(val[1])
    val_loss = lambda p: loss_fn(p, vt, vm)  # noqa: E731
  start = copy_tree(params)
  run = soup_train(step_fn, params, optimizer.init(params), batches, steps, schedule,
                   start=start, val_loss=val_loss, log=log)
  nnx.update(model, run.params)
  return run
