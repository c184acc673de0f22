"""The CPU few-rows kernel (`pallas_kernels.delta_matmul.cpu_rows`) against the plain-jnp
reference: base and every slot's 1-bit delta in one pass, f32 and bf16 W, odd shapes, every
slot layout, the AVX-512, AVX2 and portable builds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.delta.format import group_k_for, packed_rows
from pallas_kernels.delta_matmul import cpu_rows
from pallas_kernels.delta_matmul.reference import delta_matmul_reference

pytestmark = pytest.mark.skipif(
  not cpu_rows.usable(1, jnp.float32, jnp.float32), reason="the CPU rows kernel cannot run here")

PORTABLE = "bitdelta_delta_rows_portable"


@pytest.fixture(scope="module")
def portable():
  cpu_rows.build_target((), PORTABLE)  # no -march: GCC's generic vectors
  return PORTABLE


@pytest.fixture(scope="module")
def avx2():
  target = "bitdelta_delta_rows_avx2"
  try:
    cpu_rows.build_target(("-march=native", "-mno-avx512f"), target)
  except RuntimeError as e:
    pytest.skip(f"no AVX2 build here: {e}")
  return target


def _case(m, k, n, s, seed):
  rng = np.random.default_rng(seed)
  g = group_k_for(k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  bits = rng.integers(0, 256, (s, packed_rows(k, g), n), dtype=np.uint8)
  scale = rng.uniform(0.01, 0.1, (s, n)).astype(np.float32)
  bits[0], scale[0] = 0, 0  # slot 0: the base
  return g, x, w, bits, scale


def _check(got, want, x, w, alpha=0.1):
  # f32 sums of k products in another order: per element a few eps of |x|·(|w| + α)
  bound = np.abs(x).astype(np.float64) @ (np.abs(w).astype(np.float64) + alpha)
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - np.asarray(want)),
                               2e-6 * bound + 1e-30)


LAYOUTS = {
  "base": lambda m, s: np.zeros(m),
  "one slot": lambda m, s: np.full(m, s - 1),
  "mixed": lambda m, s: np.arange(m) % s,
  "every row its own": lambda m, s: (np.arange(m) % (s - 1)) + 1,
  "reversed": lambda m, s: (np.arange(m)[::-1] % s),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m,k,n,s", [(1, 576, 1536, 4), (3, 37, 45, 3), (8, 130, 33, 5),
                                     (16, 1536, 576, 15), (5, 64, 16, 2), (2, 7, 100, 3)])
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_rows_kernel_matches_the_reference(layout, m, k, n, s, wdtype):
  g, x, w, bits, scale = _case(m, k, n, s, seed=m * 1000 + k + n)
  slots = jnp.asarray(LAYOUTS[layout](m, s), jnp.int32)
  wj = jnp.asarray(w).astype(wdtype)
  got = jax.jit(lambda *a: cpu_rows.rows_call(*a, group_k=g))(
    jnp.asarray(x), wj, jnp.asarray(bits), jnp.asarray(scale), slots)
  # bf16 W is widened exactly: judged against the f32 reference on the same (rounded) weights
  w32 = wj.astype(jnp.float32)
  want = delta_matmul_reference(jnp.asarray(x), w32, jnp.asarray(bits), jnp.asarray(scale),
                                slots, group_k=g)
  assert got.dtype == jnp.float32 and got.shape == (m, n)
  _check(got, want, x, np.asarray(w32))


@pytest.mark.parametrize("m,k,n", [(1, 576, 192), (4, 33, 70), (16, 256, 48)])
def test_without_a_bank_it_is_the_plain_product(m, k, n):
  rng = np.random.default_rng(k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  got = cpu_rows.rows_call(jnp.asarray(x), jnp.asarray(w))
  _check(got, x.astype(np.float64) @ w.astype(np.float64), x, w)


@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_portable_build_matches_the_native_one(portable, wdtype):
  g, x, w, bits, scale = _case(6, 200, 72, 4, seed=7)
  slots = jnp.asarray([0, 1, 3, 1, 2, 0], jnp.int32)
  args = (jnp.asarray(x), jnp.asarray(w).astype(wdtype), jnp.asarray(bits), jnp.asarray(scale),
          slots)
  got = cpu_rows.rows_call(*args, group_k=g, target=portable)
  want = delta_matmul_reference(args[0], args[1].astype(jnp.float32), *args[2:], group_k=g)
  _check(got, want, x, w)


@pytest.mark.parametrize("layout", ["one slot", "mixed", "every row its own"])
@pytest.mark.parametrize("m,k,n,s", [(3, 37, 45, 3), (8, 576, 203, 5), (16, 130, 33, 4)])
def test_avx2_build_matches_the_reference(avx2, layout, m, k, n, s):
  """The AVX2 path (on an AVX-512 machine the native build skips it): slots of up to 4 rows by
  8-entry table lookups (`native/lut_delta.h`), larger ones blended into W; odd N (a scalar
  tail)."""
  g, x, w, bits, scale = _case(m, k, n, s, seed=m * 100 + k + n)
  slots = jnp.asarray(LAYOUTS[layout](m, s), jnp.int32)
  args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale), slots)
  got = jax.jit(lambda *a: cpu_rows.rows_call(*a, group_k=g, target=avx2))(*args)
  _check(got, delta_matmul_reference(*args, group_k=g), x, w)


def test_a_slot_past_the_bank_is_an_error():
  g, x, w, bits, scale = _case(2, 64, 32, 3, seed=1)
  with pytest.raises(Exception, match="slot id is past the bank"):
    jax.block_until_ready(cpu_rows.rows_call(
      jnp.asarray(x), jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale),
      jnp.asarray([0, 3], jnp.int32), group_k=g))


def test_usable_only_for_a_few_float_rows(monkeypatch):
  assert cpu_rows.usable(1, jnp.float32, jnp.float32)
  assert cpu_rows.usable(cpu_rows.MAX_ROWS, jnp.bfloat16, jnp.bfloat16)
  assert not cpu_rows.usable(cpu_rows.MAX_ROWS + 1, jnp.float32, jnp.float32)
  assert not cpu_rows.usable(4, jnp.float32, jnp.int8)
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")
  assert not cpu_rows.usable(1, jnp.float32, jnp.float32)


def test_gradients_are_the_reference_formulas():
  """Scale distillation differentiates a model's few-row forward: x, W and α get the reference
  formula's gradients."""
  g, x, w, bits, scale = _case(3, 70, 24, 3, seed=5)
  slots = jnp.asarray([0, 2, 1], jnp.int32)
  args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale))
  loss = lambda f: lambda x, w, a: jnp.sum(jnp.sin(f(x, w, a)))  # noqa: E731
  got = jax.grad(loss(lambda x, w, a: cpu_rows.rows_call(x, w, jnp.asarray(bits), a, slots,
                                                         group_k=g)), argnums=(0, 1, 2))(*args)
  want = jax.grad(loss(lambda x, w, a: delta_matmul_reference(x, w, jnp.asarray(bits), a, slots,
                                                              group_k=g)), argnums=(0, 1, 2))(*args)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
