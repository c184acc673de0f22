"""The CPU f32 NT kernel (`cpu.small_matmul_nt`: ``x · Eᵀ`` for a tied LM head) against float64
numpy, in the native build (AVX-512 here), an AVX2 build (``-mno-avx512f``) and the portable one
(no target flags: generic vectors lowered to SSE2); its gradient, the dispatch rules, and a tied
Llama's logits through the kernel against the XLA path (`layers._head_matmul`).

Shapes: K odd, K < 16 and K not a multiple of 16; N not a multiple of the 12-row E block or the
register tiles (12, 6, 3 E rows); M = 1..16 (one and two row blocks of 8 and their remainders),
and the SmolLM2 head shape (49152 x 576) that the pool splits into many chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.small_matmul import cpu
from pallas_kernels.small_matmul.reference import small_matmul_nt_reference

pytestmark = pytest.mark.skipif(cpu._load() is not None, reason=str(cpu._load()))

BUILDS = {  # name -> target flags (None: the native build)
  "native": None,
  "avx2": ("-march=native", "-mno-avx512f"),
  "portable": (),
}


@pytest.fixture(scope="module")
def targets():
  out = {"native": "bitdelta_small_matmul"}
  for name, arch in BUILDS.items():
    if arch is not None:
      out[name] = f"bitdelta_small_matmul_test_{name}"
      cpu.build_target(arch, out[name])
  return out


def _check(x, e, y):
  exact = x.astype(np.float64) @ e.astype(np.float64).T
  ref = np.asarray(small_matmul_nt_reference(jnp.asarray(x), jnp.asarray(e)))
  # the kernel's error against the exact product is of the order of XLA's own f32 error
  tol = 4 * max(np.abs(ref - exact).max(), 1e-6 * np.abs(exact).max())
  assert y.dtype == np.float32 and y.shape == exact.shape
  np.testing.assert_allclose(y, exact, rtol=0, atol=tol)


SHAPES = [(576, 1000), (576, 4099), (37, 101), (19, 5), (15, 13), (1, 33), (16, 7), (33, 12)]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("m", list(range(1, 17)))
@pytest.mark.parametrize("k,n", SHAPES)
def test_nt_matches_float64_product(targets, build, m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.normal(size=(m, k)).astype(np.float32)
  e = rng.normal(size=(n, k)).astype(np.float32)
  target = targets[build]
  y = np.asarray(jax.jit(lambda x, e: cpu.small_matmul_nt(x, e, target=target))(x, e))
  _check(x, e, y)


@pytest.mark.slow
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("m", [1, 5, 16])
def test_nt_on_the_smollm2_head_shape(targets, build, m):
  rng = np.random.default_rng(m)
  x = rng.normal(size=(m, 576)).astype(np.float32)
  e = (0.05 * rng.normal(size=(49152, 576))).astype(np.float32)
  target = targets[build]
  _check(x, e, np.asarray(cpu.small_matmul_nt(jnp.asarray(x), jnp.asarray(e), target=target)))


def test_gradient_is_the_products_gradient():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 24)), jnp.float32)
  e = jnp.asarray(rng.normal(size=(40, 24)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(4, 40)), jnp.float32)
  got = jax.grad(lambda x, e: jnp.sum(cpu.small_matmul_nt(x, e) * g), argnums=(0, 1))(x, e)
  want = jax.grad(lambda x, e: jnp.sum((x @ e.T) * g), argnums=(0, 1))(x, e)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dispatch_rows_dtypes_and_switches(monkeypatch):
  f32, bf = jnp.float32, jnp.bfloat16
  assert cpu.usable_nt(cpu.NT_MIN_ROWS, f32, f32) and cpu.usable_nt(cpu.NT_MAX_ROWS, f32, f32)
  assert not cpu.usable_nt(cpu.NT_MAX_ROWS + 1, f32, f32)
  assert not cpu.usable_nt(cpu.NT_MIN_ROWS - 1, f32, f32)
  assert not cpu.usable_nt(1, bf, bf) and not cpu.usable_nt(1, f32, bf)
  monkeypatch.setenv("BITDELTA_CPU_HEAD", "0")
  assert not cpu.usable_nt(cpu.NT_MIN_ROWS, f32, f32)
  monkeypatch.setenv("BITDELTA_CPU_HEAD", "1")
  monkeypatch.setenv("BITDELTA_SMALL_MATMUL", "0")
  assert not cpu.usable_nt(cpu.NT_MIN_ROWS, f32, f32)


CFG = dict(model_type="llama", vocab_size=1003, hidden_size=72, intermediate_size=200,
           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=18, num_slots=2,
           tie_word_embeddings=True)


def _forward(model):
  from flax import nnx

  graphdef, state = nnx.split(model)
  # a fresh function per call: the kernel dispatch is decided at trace time
  return jax.jit(lambda st, ids, s: nnx.merge(graphdef, st)(ids, slot_ids=s)), state


@pytest.mark.parametrize("rows,t", [(1, 1), (3, 1), (16, 1), (2, 5), (17, 1)])
def test_tied_llama_logits_through_the_kernel_equal_the_xla_path(monkeypatch, rows, t):
  """An f32 tied Llama (V = 1003, D = 72): its LM head runs the NT kernel for NT_MIN_ROWS to
  NT_MAX_ROWS rows (``BITDELTA_CPU_HEAD=0``: XLA's einsum); the logits agree within f32 rounding."""
  from flax import nnx

  from bitdelta_jax.models import LlamaForCausalLM, ModelConfig

  model = LlamaForCausalLM(ModelConfig(**CFG), dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(rows * 10 + t)
  ids = jnp.asarray(rng.integers(0, CFG["vocab_size"], (rows, t)), jnp.int32)
  slots = jnp.zeros((rows,), jnp.int32)
  f, state = _forward(model)
  assert ("@bitdelta_small_matmul_nt(" in f.lower(state, ids, slots).as_text()) == (
    cpu.NT_MIN_ROWS <= rows * t <= cpu.NT_MAX_ROWS)
  got = np.asarray(f(state, ids, slots))
  monkeypatch.setenv("BITDELTA_CPU_HEAD", "0")
  fx, _ = _forward(model)
  assert "@bitdelta_small_matmul_nt(" not in fx.lower(state, ids, slots).as_text()
  want = np.asarray(fx(state, ids, slots))
  assert got.shape == (rows, t, CFG["vocab_size"]) and np.abs(want).max() > 0.1
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
