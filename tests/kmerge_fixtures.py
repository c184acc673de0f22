"""LoRA adapters on the built-in nano base for the K-Merge tests (pool, gate, CLI, serving).

    from kmerge_fixtures import NANO, random_adapter, ConstantTrainer
    a = random_adapter(seed=0)                       # random rank-4 factors on q/v projections
    t = ConstantTrainer(); a7 = t.train("7", seed=1)  # a LoRA that answers "7" to any prompt

`ConstantTrainer` fine-tunes rank-4 factors of the v/o projections for 40 Adam steps on 64
chat-formatted prompts (about 5 s on 2 cores; one compiled step shared by every adapter).
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np

from bitdelta_jax.merge.lora import LoraAdapter, from_factors
from bitdelta_jax.zoo import SHIPPED

NANO = SHIPPED / "nano"
# nano: hidden 128, 4 heads of 32 (q/o 128x128), 2 kv heads (k/v 64x128), MLP 352
SHAPES = {"q_proj": (128, 128), "v_proj": (64, 128), "o_proj": (128, 128)}


def random_adapter(seed: int, modules=("q_proj", "v_proj"), layers=(0, 1, 2, 3), rank: int = 4,
                   scale: float = 0.3) -> LoraAdapter:
  """Random factors (scale 1) on the given attention projections of the nano base."""
  rng = np.random.default_rng(seed)
  factors = {}
  for layer in layers:
    for mod in modules:
      out_f, in_f = SHAPES[mod]
      factors[f"model.layers.{layer}.self_attn.{mod}"] = (
        (rng.standard_normal((rank, in_f)) * scale).astype(np.float32),
        (rng.standard_normal((out_f, rank)) * scale).astype(np.float32))
  return from_factors(factors, {"r": rank, "lora_alpha": rank})


def prompts(seed: int, n: int) -> list[str]:
  r = random.Random(seed)
  return ["".join(r.choice("abcdefghij") for _ in range(5)) for _ in range(n)]


class ConstantTrainer:
  """Trains LoRAs that answer one constant string to every prompt (see the module docstring)."""

  def __init__(self, base_dir=NANO, steps: int = 40):
    import optax
    from flax import nnx

    from bitdelta_jax.kmerge_gate import AdapterScorer
    from bitdelta_jax.models.loading import hf_name

    self.scorer = sc = AdapterScorer(base_dir)
    self.steps = steps
    self.modules = sorted(m for m in sc._kernels if m.endswith(("v_proj", "o_proj")))
    opt = self.opt = optax.adam(1e-2)

    def loss(f, t, m):
      def one(kp, leaf):
        n, tr = hf_name(tuple(k.key for k in kp))
        n = n.removesuffix(".weight")
        return leaf + (f[n][1] @ f[n][0]).T if tr and n in f else leaf

      logits = nnx.merge(sc.graphdef, jax.tree_util.tree_map_with_path(one, sc.params),
                         sc.rest)(t)[:, :-1]
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], -1)[..., 0]
      return jnp.sum(nll * m[:, :-1]) / jnp.sum(m[:, :-1])

    def step(f, st, t, m):
      value, g = jax.value_and_grad(loss)(f, t, m)
      u, st = opt.update(g, st, f)
      return optax.apply_updates(f, u), st, value

    self._step = jax.jit(step)

  def train(self, answer: str, seed: int) -> LoraAdapter:
    from bitdelta_jax.kmerge_gate import encode_examples

    toks, mask = encode_examples(self.scorer.tokenizer, [(p, answer) for p in prompts(seed, 64)])
    toks, mask = jnp.asarray(toks), jnp.asarray(mask)
    r = np.random.default_rng(seed)
    kern = self.scorer._kernels
    f = {m: (jnp.asarray(r.standard_normal((4, kern[m][0])) * 0.05, jnp.float32),
             jnp.zeros((kern[m][1], 4), jnp.float32)) for m in self.modules}
    st = self.opt.init(f)
    for _ in range(self.steps):
      f, st, _ = self._step(f, st, toks, mask)
    return from_factors({m: (np.asarray(a), np.asarray(b)) for m, (a, b) in f.items()},
                        {"r": 4, "lora_alpha": 4})
