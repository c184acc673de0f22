"""The CPU small-M matmul kernel against the plain product (float64 numpy) and its gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.small_matmul import cpu
from pallas_kernels.small_matmul.reference import small_matmul_reference

pytestmark = pytest.mark.skipif(cpu._load() is not None, reason=str(cpu._load()))


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 21])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (37, 101), (8, 16), (19, 5)])
def test_matches_float64_product(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.normal(size=(m, k)).astype(np.float32)
  w = rng.normal(size=(k, n)).astype(np.float32)
  y = np.asarray(jax.jit(cpu.small_matmul)(x, w))
  exact = x.astype(np.float64) @ w.astype(np.float64)
  ref = np.asarray(small_matmul_reference(jnp.asarray(x), jnp.asarray(w)))
  # the kernel's error against the exact product is of the order of XLA's own f32 error
  tol = 4 * max(np.abs(ref - exact).max(), 1e-6 * np.abs(exact).max())
  np.testing.assert_allclose(y, exact, rtol=0, atol=tol)


def test_gradient_is_the_products_gradient():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 24)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(24, 40)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(4, 40)), jnp.float32)
  got = jax.grad(lambda x, w: jnp.sum(cpu.small_matmul(x, w) * g), argnums=(0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum((x @ w) * g), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dispatch_rows_and_dtypes():
  assert cpu.usable(8, jnp.float32, jnp.float32)
  assert not cpu.usable(1, jnp.float32, jnp.float32)  # XLA's GEMV is the better choice
  assert not cpu.usable(cpu.MAX_ROWS + 1, jnp.float32, jnp.float32)
  assert not cpu.usable(8, jnp.bfloat16, jnp.bfloat16)


def test_concurrent_callers_each_get_their_own_product():
  """XLA runs independent custom calls on several threads at once; the kernel's thread pool
  used to let a second caller reset the first one's job (wrong results, and workers writing
  into a buffer XLA had already reused: the crashes seen in full test runs)."""
  import threading

  rng = np.random.default_rng(0)
  cases = [(rng.standard_normal((8, 576), np.float32), rng.standard_normal((576, 1536), np.float32))
           for _ in range(4)]
  want = [x.astype(np.float64) @ w.astype(np.float64) for x, w in cases]
  f = jax.jit(cpu.small_matmul)
  for x, w in cases:
    f(x, w).block_until_ready()
  errors = []

  def work(i):
    x, w = cases[i]
    for _ in range(40):
      got = np.asarray(f(x, w))
      if not np.allclose(got, want[i], rtol=1e-4, atol=1e-3):
        errors.append(i)
        return

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []
