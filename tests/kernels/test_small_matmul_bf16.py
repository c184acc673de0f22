"""The CPU small-M kernels for bf16 weights (`cpu_bf16`: NN ``x · W`` and NT ``x · Eᵀ``)
against float64 numpy on the bf16-rounded inputs.

Every build the tests can make here: the native one (``vdpbf16ps`` where the CPU has AVX-512
BF16), the same without AVX-512 BF16 (W widened to f32 + FMA, AVX-512 code), and the portable
one (no target flags). Shapes: K odd and K < 32, N not a multiple of 8, 16 or 32, M = 1, 3,
17, 33, 64 (row blocks of 8 and their remainders, the thread pool). Then the gradients, the
dispatch rules, `cpu.dense`, and the delta kernel on a bf16 base (`delta_matmul_cpu` with bf16
x and W_base).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.small_matmul import cpu, cpu_bf16
from pallas_kernels.small_matmul.reference import (
  small_matmul_bf16_nt_reference,
  small_matmul_bf16_reference,
)

pytestmark = pytest.mark.skipif(cpu_bf16._load() is not None, reason=str(cpu_bf16._load()))

BF16 = ml_dtypes.bfloat16
BUILDS = {  # name -> target flags (None: the native build)
  "native": None,
  "widen_avx512": ("-march=native", "-mno-avx512bf16"),
  "portable": (),
}


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      return next(
        (set(line.split(":")[1].split()) for line in f if line.startswith("flags")), set()
      )
  except OSError:
    return set()


@pytest.fixture(scope="module")
def targets():
  out = {"native": ("bitdelta_small_matmul", cpu_bf16.isa())}  # build names (`cpu.build_target`)
  for name, arch in BUILDS.items():
    if arch is not None:
      target = f"bitdelta_small_matmul_bf16_test_{name}"
      out[name] = (target, cpu_bf16.build_target(arch, target))
  return out


def test_paths_each_build_takes(targets):
  assert targets["widen_avx512"][1] == 0 and targets["portable"][1] == 0
  # the native build runs vdpbf16ps exactly where the CPU reports AVX-512 BF16
  assert targets["native"][1] == int("avx512_bf16" in _cpu_flags())


def _exact_error(exact, ref) -> float:
  """The bound for an f32 sum of exact bf16 products: 4x the reference's own f32 error on the
  same inputs, or 1e-6 of the largest output (as test_small_matmul.py)."""
  return 4 * max(float(np.abs(ref - exact).max()), 1e-6 * float(np.abs(exact).max()))


SHAPES = [(576, 1536), (1536, 576), (576, 192), (37, 101), (19, 5), (8, 16), (1, 33), (64, 7)]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("m", [1, 3, 17, 33, 64])
@pytest.mark.parametrize("k,n", SHAPES)
def test_nn_matches_float64_of_the_bf16_inputs(targets, build, m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.normal(size=(m, k)).astype(BF16)
  w = rng.normal(size=(k, n)).astype(BF16)
  target = targets[build][0]
  y = np.asarray(jax.jit(lambda x, w: cpu_bf16.small_matmul_bf16(x, w, target=target))(x, w))
  assert y.dtype == np.float32 and y.shape == (m, n)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  ref = np.asarray(small_matmul_bf16_reference(jnp.asarray(x), jnp.asarray(w)))
  np.testing.assert_allclose(y, exact, rtol=0, atol=_exact_error(exact, ref))


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("m", [1, 3, 17, 33, 64])
@pytest.mark.parametrize("k,n", SHAPES + [(576, 4099)])
def test_nt_matches_float64_of_the_bf16_inputs(targets, build, m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n + 1)
  x = rng.normal(size=(m, k)).astype(BF16)
  e = rng.normal(size=(n, k)).astype(BF16)
  target = targets[build][0]
  y = np.asarray(jax.jit(lambda x, e: cpu_bf16.small_matmul_bf16_nt(x, e, target=target))(x, e))
  assert y.dtype == np.float32 and y.shape == (m, n)
  exact = x.astype(np.float64) @ e.astype(np.float64).T
  ref = np.asarray(small_matmul_bf16_nt_reference(jnp.asarray(x), jnp.asarray(e)))
  np.testing.assert_allclose(y, exact, rtol=0, atol=_exact_error(exact, ref))


def test_f32_rows_are_rounded_to_bf16_first(targets):
  """Every path computes bf16(x) · W (x of a bf16 model already is bf16)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(5, 300)).astype(np.float32)
  w = rng.normal(size=(300, 70)).astype(BF16)
  exact = x.astype(BF16).astype(np.float64) @ w.astype(np.float64)
  for target, _ in targets.values():
    y = np.asarray(cpu_bf16.small_matmul_bf16(jnp.asarray(x), jnp.asarray(w), target=target))
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-4)
    y = np.asarray(cpu_bf16.small_matmul_bf16_nt(jnp.asarray(x), jnp.asarray(w).T, target=target))
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-4)


@pytest.mark.parametrize("nt", [False, True])
def test_gradient_is_the_products_gradient(nt):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 24)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(40, 24) if nt else (24, 40)), jnp.bfloat16)
  g = jnp.asarray(rng.normal(size=(4, 40)), jnp.float32)
  kernel = cpu_bf16.small_matmul_bf16_nt if nt else cpu_bf16.small_matmul_bf16

  def product(x, w):
    w = w.astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.T if nt else w)

  got = jax.grad(lambda x, w: jnp.sum(kernel(x, w) * g), argnums=(0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum(product(x, w) * g), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2)


def test_dispatch_rows_and_dtypes(monkeypatch):
  bf = jnp.bfloat16
  for usable, limit in (
    (cpu_bf16.usable, cpu_bf16.MAX_ROWS),
    (cpu_bf16.usable_nt, cpu_bf16.NT_MAX_ROWS),
  ):
    assert usable(1, bf, bf) and usable(limit, bf, bf)
    assert not usable(limit + 1, bf, bf)
    assert not usable(1, jnp.float32, bf)  # f32 x with bf16 W: XLA, no silent rounding
    assert not usable(1, bf, jnp.float32)
  monkeypatch.setenv("BITDELTA_SMALL_MATMUL", "0")
  assert not cpu_bf16.usable(1, bf, bf) and not cpu_bf16.usable_nt(1, bf, bf)


@pytest.mark.parametrize("m", [1, 8, 65])
def test_dense_bf16_is_the_rounded_exact_product(m):
  rng = np.random.default_rng(m)
  x = rng.normal(size=(m, 200)).astype(BF16)
  w = rng.normal(size=(200, 72)).astype(BF16)
  y = jax.jit(cpu.dense)(jnp.asarray(x), jnp.asarray(w))
  assert y.dtype == jnp.bfloat16
  exact = x.astype(np.float64) @ w.astype(np.float64)
  # one bf16 rounding of the f32 sum: half an ulp (2^-8 relative) plus the sum's own error
  np.testing.assert_allclose(np.asarray(y, np.float64), exact, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (3, 37, 101), (17, 200, 72), (33, 576, 192)])
def test_delta_matmul_on_a_bf16_base(m, k, n):
  """`delta_matmul_cpu` with bf16 x and W_base: the bf16 kernel's base + the LUT delta term,
  judged against float64 of the same bf16 inputs relative to the reference's own error."""
  from bitdelta_jax.delta.format import group_k_for, pack, unpack_signs
  from pallas_kernels.delta_matmul import cpu as delta_cpu
  from pallas_kernels.delta_matmul.reference import delta_matmul_reference

  if delta_cpu.unavailable_reason():
    pytest.skip(delta_cpu.unavailable_reason())
  rng = np.random.default_rng(m + k + n)
  g = group_k_for(k, 128)
  packs = [pack(rng.standard_normal((k, n)).astype(np.float32), "column", g) for _ in range(3)]
  bits = np.stack([p.bits for p in packs])
  scale = np.stack([p.scale for p in packs]).astype(np.float32)
  signs = np.stack([unpack_signs(p.bits, (k, n), g, np.float64) for p in packs])
  bits[0], scale[0] = 0, 0  # slot 0 = base
  x = rng.normal(size=(m, k)).astype(BF16)
  w = rng.normal(size=(k, n)).astype(BF16)
  slots = (np.arange(m) % 3).astype(np.int32)
  args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale), jnp.asarray(slots))
  y = jax.jit(lambda *a: delta_cpu.delta_matmul_cpu(*a, group_k=g))(*args)
  ref = jax.jit(lambda *a: delta_matmul_reference(*a, group_k=g))(*args)
  assert y.dtype == ref.dtype == jnp.bfloat16
  x64, exact = x.astype(np.float64), x.astype(np.float64) @ w.astype(np.float64)
  for i, s in enumerate(slots):
    if s > 0:
      exact[i] += scale[s] * (x64[i] @ signs[s])
  err = np.abs(np.asarray(y, np.float64) - exact).max()
  ref_err = np.abs(np.asarray(ref, np.float64) - exact).max()
  assert err <= 1.5 * ref_err + 1e-6 * np.abs(exact).max(), (err, ref_err)
