"""A bf16 model on CPU: its decode-sized matmuls (linear layers, tied LM head) run the bf16
small-M kernels, and its logits match the f32 computation of the same bf16 weights as closely
as XLA's own bf16 path does.

Tolerance: a bf16 model rounds its activations to bf16 after every layer (norms, projections,
residual adds), which XLA's bf16 dots do exactly as the kernel does; the kernel's products are
exact and its sums f32, so its logits' error against the f32 model (the same bf16 weights,
f32 activations) must be within 1.5x the error of the XLA bf16 path (the Levanter rule in
docs/STYLE), and small against the logits themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bitdelta_jax.models import LlamaForCausalLM, ModelConfig
from bitdelta_jax.models.layers import DeltaDense
from pallas_kernels.delta_matmul import cpu_rows
from pallas_kernels.small_matmul import cpu_bf16

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or cpu_bf16._load() is not None, reason="CPU kernels unavailable"
)

CFG = ModelConfig(
  model_type="llama",
  vocab_size=256,
  hidden_size=96,
  intermediate_size=200,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=24,
  num_slots=3,
  tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def models():
  """(bf16 model with variants in slots 1 and 2, the f32 model of the same bf16 weights)."""
  m16 = LlamaForCausalLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  for _, mod in nnx.iter_graph(m16):
    if isinstance(mod, DeltaDense):
      bits = rng.integers(0, 256, mod.delta_bits.shape, dtype=np.uint8)
      scale = rng.uniform(0.002, 0.01, mod.delta_scale.shape).astype(np.float32)
      bits[0], scale[0] = 0, 0
      mod.delta_bits[...] = jnp.asarray(bits)
      mod.delta_scale[...] = jnp.asarray(scale)
  m32 = LlamaForCausalLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(1))
  state = jax.tree.map(
    lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, nnx.state(m16)
  )
  nnx.update(m32, state)
  return m16, m32


def _forward(model):
  graphdef, state = nnx.split(model)
  # a fresh function per call: the kernel dispatch is decided at trace time
  return jax.jit(lambda st, ids, s: nnx.merge(graphdef, st)(ids, slot_ids=s)), state


@pytest.mark.parametrize("rows,t", [(1, 1), (2, 4), (3, 5), (8, 8)])
def test_bf16_logits_match_the_f32_model_like_xlas_bf16(models, monkeypatch, rows, t):
  m16, m32 = models
  rng = np.random.default_rng(rows * 10 + t)
  ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (rows, t)), jnp.int32)
  slots = jnp.asarray(np.arange(rows) % 3 if rows > 1 else [1], jnp.int32)

  f, state = _forward(m16)
  hlo = f.lower(state, ids, slots).as_text()
  # linear layers: the few-rows kernel (base + deltas in one pass); the tied LM head: the NT
  # kernel; else XLA
  assert ("@bitdelta_delta_rows(" in hlo) == (rows * t <= cpu_rows.MAX_ROWS)
  assert ("@bitdelta_small_matmul_bf16_nt(" in hlo) == (rows * t <= cpu_bf16.NT_MAX_ROWS)
  got = np.asarray(f(state, ids, slots), np.float64)
  f32, state32 = _forward(m32)
  exact = np.asarray(f32(state32, ids, slots), np.float64)
  monkeypatch.setenv("BITDELTA_SMALL_MATMUL", "0")  # XLA's bf16 dots everywhere
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")
  fx, _ = _forward(m16)
  hlo_x = fx.lower(state, ids, slots).as_text()
  assert "@bitdelta_small_matmul_bf16" not in hlo_x and "@bitdelta_delta_rows" not in hlo_x
  xla = np.asarray(fx(state, ids, slots), np.float64)

  err, xla_err = np.abs(got - exact).max(), np.abs(xla - exact).max()
  scale = np.abs(exact).max()
  assert xla_err > 0  # the bf16 model does round: the comparison means something
  assert err <= 1.5 * xla_err, (err, xla_err)
  assert err <= 0.02 * scale, (err, scale)
