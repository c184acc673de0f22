"""quant_matmul: ggml Q8_0/Q4_0/Q4_1 blocks (`blocks`) against the ``gguf`` package's numpy port
of llama.cpp, and the native CPU kernel (`cpu_rows`) against a float64 numpy computation and the
jnp reference, with every slot layout, under jit, with the api's choice (and its group_k
mapping), bf16 activations, non-finite scales and gradients.

Tolerance: f32 from STYLE's dtype table, (atol 1e-7, rtol 1e-6), the rtol taken relative to
the sum of the magnitudes of the terms the kernel adds (``|x|·(|d·q| + |m| + α)``: the scale of
an f32 sum's rounding error, as in tests/kernels/test_delta_matmul_cpu_rows.py).
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bits import group_k_for, packed_rows, unpack_signs
from pallas_kernels.quant_matmul import api, blocks, cpu_rows
from pallas_kernels.quant_matmul.reference import quant_matmul_reference

ATOL, RTOL = 1e-7, 1e-6  # f32 (STYLE.md's dtype table)
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
FORMATS = blocks.FORMATS
needs_kernel = pytest.mark.skipif(cpu_rows.unavailable_reason() is not None,
                                  reason=f"kernel: {cpu_rows.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _f32_activations(monkeypatch):
  """This module checks the f32-activation path (q4's default is int8 x:
  tests/kernels/test_quant_matmul_int8.py)."""
  monkeypatch.setenv("BITDELTA_QUANT_ACTIVATIONS", "f32")


def _adversarial_rows() -> np.ndarray:
  """[N, K] rows whose blocks hit every corner of the quantizers' rules."""
  r = np.random.default_rng(7)
  ramp = np.arange(32, dtype=np.float32)
  rows = [
    np.zeros(32),                                     # zero block: d = 0, inverse 0
    np.full(32, 0.37), np.full(32, -2.5),             # constant blocks
    (ramp - 15.5) / 15.5,                             # symmetric ramp: ±1 at the ends
    (ramp % 8 + 0.5) * 0.125,                         # values on the .5 rounding ties
    np.where(ramp == 3, -9.0, r.uniform(-1, 1, 32)),  # negative maximum (q4_0 keeps its sign)
    np.where(ramp == 3, 9.0, r.uniform(-1, 1, 32)),   # positive maximum
    np.full(32, -9.0) * (ramp == 0) + 9.0 * (ramp == 31),  # ±max tie: the first one wins
    r.uniform(-1, 1, 32) * 1e-30,                     # tiny: d underflows f16
    r.uniform(-1, 1, 32) * 6e4, r.uniform(-1, 1, 32) * 1e6,  # huge: d near / past f16's max
    r.standard_normal(32), r.standard_normal(32) * 0.02 + 0.05,
  ]
  blk = np.stack([np.asarray(b, np.float32) for b in rows])  # [13, 32]
  # 8 columns of 4 blocks each, every block kind at several positions
  idx = (np.arange(8 * 4) * 5) % len(blk)
  return blk[idx].reshape(8, 4 * 32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["random", "adversarial"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the 1e6 block's d is inf in f16, as ggml's
def test_blocks_are_gguf_quants_bit_for_bit(fmt, kind):
  w_NxK = (np.random.default_rng(1).standard_normal((24, 96)).astype(np.float32)
           if kind == "random" else _adversarial_rows())
  want = gguf.quants.quantize(w_NxK, QTYPE[fmt])
  got = blocks.quantize_rows(w_NxK, fmt)
  np.testing.assert_array_equal(got, want.view(np.uint8))
  qk = blocks.quantize(w_NxK.T, fmt)
  k, n = w_NxK.shape[1], w_NxK.shape[0]
  assert qk.shape == (k, n) and qk.format == fmt
  np.testing.assert_array_equal(blocks.to_ggml_rows(qk), want.view(np.uint8))
  back = blocks.from_ggml_rows(want.view(np.uint8), fmt, (k, n))
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(qk), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  deq = gguf.quants.dequantize(want, QTYPE[fmt])  # [N, K]
  np.testing.assert_array_equal(blocks.dequantize(qk), deq.T.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(blocks.dequantize_jnp(jax.tree.map(jnp.asarray, qk))),
                                deq.T.astype(np.float32))
  assert qk.nbytes == want.nbytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_take_columns_dequantizes_only_those_columns(fmt):
  w = np.random.default_rng(2).standard_normal((64, 50)).astype(np.float32)
  qk = jax.tree.map(jnp.asarray, blocks.quantize(w, fmt))
  ids = jnp.asarray([[3, 0, 49], [7, 7, 12]], jnp.int32)
  got = jax.jit(blocks.take_columns)(qk, ids)
  np.testing.assert_array_equal(np.asarray(got), blocks.dequantize(qk).T[np.asarray(ids)])


# ---------------------------------------------------------------- the kernel


def _case(fmt, m, k, n, s, seed):
  rng = np.random.default_rng(seed)
  g = group_k_for(k)
  w = (rng.standard_normal((k, n)) * 0.05 + rng.uniform(-0.02, 0.02, (1, n))).astype(np.float32)
  qk = blocks.quantize(w, fmt)
  x = rng.standard_normal((m, k)).astype(np.float32)
  bits = rng.integers(0, 256, (s, packed_rows(k, g), n), dtype=np.uint8)
  scale = rng.uniform(0.001, 0.01, (s, n)).astype(np.float32)
  return g, qk, x, bits, scale


def _want64(x, qk, bits, scale, slots, g):
  """float64: x·dequant(W) + α_s ⊙ (x·S_s) per row, and the magnitude of the terms summed."""
  x64 = x.astype(np.float64)
  k, n = qk.shape
  v = blocks._values(np.asarray(qk.qs), qk.format, np).astype(np.float64)  # [K/32, 32, N]
  d = np.asarray(qk.d, np.float64)[:, None]
  if qk.format == "q4_0":
    v = v - 8
  w = (d * v).reshape(k, n)
  mag = np.abs(w)
  if qk.format == "q4_1":
    mins = np.broadcast_to(np.asarray(qk.m, np.float64)[:, None], v.shape).reshape(k, n)
    w, mag = w + mins, mag + np.abs(mins)
  y, scale_terms = x64 @ w, np.abs(x64) @ mag
  if bits is not None:
    signs = unpack_signs(bits, (k, n), g, np.float64)  # [S, K, N]
    per = np.einsum("mk,skn->smn", x64, signs) * scale.astype(np.float64)[:, None, :]
    rows = np.arange(x.shape[0])
    on = (slots > 0)[:, None]
    y = y + np.where(on, per[slots, rows], 0)
    scale_terms = scale_terms + np.where(on, np.abs(x64) @ np.ones((k, n)) * scale[slots], 0)
  return y, scale_terms


def _check(got, want, terms):
  err = np.abs(np.asarray(got, np.float64) - want)
  bound = ATOL + RTOL * terms
  assert (err <= bound).all(), f"worst excess {np.max(err / bound):.3g}x the f32 bound"


LAYOUTS = {
  "plain": None,
  "one variant": "one",
  "bank mixed": lambda m, s: np.arange(m) % s,             # 0 included
  "bank all base": lambda m, s: np.zeros(m, np.int64),
}


def _run(fmt, layout, m, k, n, s=3, target=None):
  g, qk, x, bits, scale = _case(fmt, m, k, n, s, seed=m * 7 + k + n)
  qj = jax.tree.map(jnp.asarray, qk)
  kw = {} if target is None else {"target": target}
  call = jax.jit(lambda x, q, *a: cpu_rows.rows_call(x, q, *a, group_k=g, **kw))
  how = LAYOUTS[layout]
  if how is None:
    got = call(x, qj)
    want = _want64(x, qk, None, None, None, g)
  elif how == "one":
    got = call(x, qj, bits[1], scale[1])
    want = _want64(x, qk, bits, scale, np.ones(m, np.int64), g)
  else:
    slots = how(m, s)
    got = call(x, qj, bits, scale, jnp.asarray(slots, jnp.int32))
    want = _want64(x, qk, bits, scale, slots, g)
  assert got.dtype == jnp.float32 and got.shape == (m, n)
  _check(got, *want)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,n", [(96, 40), (576, 200), (1536, 576)])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 40])
def test_kernel_matches_float64_bank_mixed(fmt, k, n, m):
  _run(fmt, "bank mixed", m, k, n)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["plain", "one variant", "bank all base"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 200), (3, 96, 40), (16, 1536, 576), (40, 576, 200)])
def test_kernel_matches_float64_every_layout(fmt, layout, m, k, n):
  _run(fmt, layout, m, k, n)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m,k,n", [(1, 96, 5), (3, 576, 203), (17, 1536, 77)])
def test_kernel_columns_past_the_last_vector(fmt, layout, m, k, n):
  """N not a multiple of 8: the columns past the last 8-wide vector take the scalar paths."""
  _run(fmt, layout, m, k, n)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_portable_build(fmt):
  cpu_rows.build_target((), "bitdelta_quant_rows_portable")  # GCC's generic vectors
  for m in (2, 17):
    _run(fmt, "bank mixed", m, 576, 200, target="bitdelta_quant_rows_portable")


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_build_equals_native_build(fmt):
  """The AVX2 build (AVX-512 turned off) against this machine's (on an AVX-512 CPU: 16-column
  base tiles with the same FMA chain per column, and the delta's 16-entry tables): the base
  product bit for bit, and both within the float64 bound with variants (the delta sums run in
  another order); column counts with 64-, 16- and 8-wide remainders and a scalar tail."""
  target = "bitdelta_quant_rows_avx2"
  try:
    cpu_rows.build_target(("-march=native", "-mno-avx512f"), target)
  except RuntimeError as e:
    pytest.skip(f"no AVX2 build here: {e}")
  for m, k, n, seed in ((1, 576, 1000, 1), (3, 96, 88, 2), (8, 1536, 216, 3), (17, 576, 203, 4)):
    g, qk, x, bits, scale = _case(fmt, m, k, n, 3, seed=seed)
    qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
    base = cpu_rows.rows_call(xj, qj, group_k=g)
    np.testing.assert_array_equal(np.asarray(base),
                                  np.asarray(cpu_rows.rows_call(xj, qj, group_k=g, target=target)))
    slots = jnp.asarray(np.arange(m) % 3, jnp.int32)  # 0: the base; bank rows 1, 2
    want = _want64(x, qk, bits, scale, np.asarray(slots), g)
    for t in (cpu_rows._TARGET, target):
      _check(cpu_rows.rows_call(xj, qj, bits, scale, slots, group_k=g, target=t), *want)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_equals_kernel(fmt):
  g, qk, x, bits, scale = _case(fmt, 5, 576, 200, 3, seed=11)
  qj = jax.tree.map(jnp.asarray, qk)
  slots = jnp.asarray([0, 2, 1, 2, 0], jnp.int32)
  ref = quant_matmul_reference(jnp.asarray(x), qj, bits, scale, slots, group_k=g)
  ker = cpu_rows.rows_call(jnp.asarray(x), qj, bits, scale, slots, group_k=g)
  _, terms = _want64(x, qk, bits, scale, np.asarray(slots), g)
  _check(ker, np.asarray(ref, np.float64), 2 * terms)  # two f32 results: each within the bound


@needs_kernel
def test_api_takes_the_kernel_and_names_fallbacks(monkeypatch):
  g, qk, x, bits, scale = _case("q4_1", 2, 96, 40, 2, seed=3)
  qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
  assert api.fallback_reasons(xj, qj) == {"cpu_rows": None, "reference": None}
  y = jax.jit(lambda x, q: api.quant_matmul(x, q, bits[1], scale[1], group_k=g))(xj, qj)
  _check(y, *_want64(x, qk, bits, scale, np.ones(2, np.int64), g))
  empty = jnp.zeros((0, 96), jnp.float32)
  assert "rows" in api.fallback_reasons(empty, qj)["cpu_rows"]
  with pytest.raises(RuntimeError, match="cannot run"):
    api.quant_matmul(empty, qj, group_k=g, implementation="cpu_rows")
  monkeypatch.setenv("BITDELTA_QUANT_ROWS", "0")
  assert "BITDELTA_QUANT_ROWS=0" in api.fallback_reasons(xj, qj)["cpu_rows"]
  with pytest.raises(RuntimeError, match="BITDELTA_QUANT_ROWS"):
    api.quant_matmul(xj, qj, group_k=g, implementation="cpu_rows")
  ref = api.quant_matmul(xj, qj, bits[1], scale[1], group_k=g)  # falls back to the reference
  _check(ref, *_want64(x, qk, bits, scale, np.ones(2, np.int64), g))


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_prefill_sizes_past_512_rows_take_the_kernel(fmt):
  """A step of more than 512 rows (a 512-token prefill chunk beside decode rows) runs the
  kernel, not the reference's dequantized GEMM: same numbers as numpy, every slot layout."""
  g, qk, x, bits, scale = _case(fmt, 530, 96, 40, 3, seed=5)
  qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
  slots = np.random.default_rng(1).integers(0, 3, 530).astype(np.int32)
  assert api.fallback_reasons(xj, qj)["cpu_rows"] is None
  y = api.quant_matmul(xj, qj, bits, scale, jnp.asarray(slots), group_k=g)
  _check(y, *_want64(x, qk, bits, scale, slots, g))


def test_shapes_supported_names_the_reason():
  qk = blocks.quantize(np.ones((64, 16), np.float32), "q8_0")
  odd = blocks.QuantizedKernel(qk.qs, qk.d, None, "q8_0", (40, 16))
  assert "multiple of the 32" in cpu_rows.shapes_supported(1, odd)
  other = blocks.QuantizedKernel(qk.qs, qk.d, None, "q5_0", (64, 16))
  assert "q5_0" in cpu_rows.shapes_supported(1, other)
  assert "rows" in cpu_rows.shapes_supported(0, qk)
  assert cpu_rows.shapes_supported(1, qk) is None


@needs_kernel
@pytest.mark.parametrize("layout", ["plain", "one variant", "bank"])
def test_gradient_is_the_references(layout):
  g, qk, x, bits, scale = _case("q4_0", 3, 96, 40, 3, seed=5)
  qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
  ct = jnp.asarray(np.random.default_rng(9).standard_normal((3, 40)), jnp.float32)
  if layout == "plain":
    args, wrt = (), (0,)
  elif layout == "one variant":
    args, wrt = (jnp.asarray(bits[1]), jnp.asarray(scale[1])), (0, 2)
  else:
    args, wrt = (jnp.asarray(bits), jnp.asarray(scale), jnp.asarray([1, 0, 2], jnp.int32)), (0, 2)

  def loss(f):
    return lambda x, *a: jnp.sum(f(x, qj, *a, group_k=g) * ct)

  kernel = jax.jit(jax.grad(loss(cpu_rows.rows_call), argnums=wrt))(xj, *args)
  ref = jax.jit(jax.grad(loss(quant_matmul_reference), argnums=wrt))(xj, *args)
  for a, b in zip(kernel, ref, strict=True):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_activations(fmt):
  """bf16 x is widened exactly: with an f32 result the kernel meets the f32 bound on the rounded
  x; with the default (bf16) result its error is at most 1.5x the reference's own (STYLE.md)."""
  g, qk, x, bits, scale = _case(fmt, 5, 576, 200, 3, seed=21)
  qj = jax.tree.map(jnp.asarray, qk)
  xb = jnp.asarray(x).astype(jnp.bfloat16)
  x_rounded = np.asarray(xb.astype(jnp.float32))
  slots = np.asarray([0, 1, 2, 1, 0])
  args = (bits, scale, jnp.asarray(slots, jnp.int32))
  f32 = jax.jit(lambda x, q: api.quant_matmul(x, q, *args, group_k=g, implementation="cpu_rows",
                                              preferred_element_type=jnp.float32))(xb, qj)
  want, terms = _want64(x_rounded, qk, bits, scale, slots, g)
  _check(f32, want, terms)
  kern = jax.jit(lambda x, q: api.quant_matmul(x, q, *args, group_k=g,
                                               implementation="cpu_rows"))(xb, qj)
  ref = jax.jit(lambda x, q: api.quant_matmul(x, q, *args, group_k=g,
                                              implementation="reference"))(xb, qj)
  assert kern.dtype == ref.dtype == jnp.bfloat16
  err = lambda y: np.max(np.abs(np.asarray(y.astype(jnp.float32), np.float64) - want))  # noqa: E731
  assert err(kern) <= 1.5 * err(ref) + 1e-30


@needs_kernel
def test_api_maps_group_k_like_delta_matmul():
  """Layers pass their configured group_k (128); K = 576 packs 64-row groups
  (`group_k_for`): the api hands the kernel and the reference the group actually used."""
  g, qk, x, bits, scale = _case("q8_0", 3, 576, 72, 3, seed=4)
  assert g == 64
  qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
  slots = np.asarray([2, 0, 1])
  want = _want64(x, qk, bits, scale, slots, g)
  for impl in api.fallback_reasons(xj, qj):  # this platform's (mosaic_gpu: its own tests)
    y = api.quant_matmul(xj, qj, bits, scale, jnp.asarray(slots, jnp.int32), group_k=128,
                         implementation=impl)
    _check(y, *want)
  with pytest.raises(ValueError, match="bits must be"):
    api.quant_matmul(xj, qj, bits[:, :8], scale, jnp.asarray(slots), group_k=128)
  with pytest.raises(ValueError, match="needs slot_ids"):
    api.quant_matmul(xj, qj, bits, scale, group_k=128)


@needs_kernel
@pytest.mark.parametrize("m", [3, 20])
def test_a_non_finite_scale_reaches_only_its_slots_rows(m):
  """As the f32 rows kernel: α·(2·x·B − Σx), so an inf/nan α makes its own rows non-finite and
  leaves the base rows and the other slots' rows exact."""
  g, qk, x, bits, scale = _case("q4_0", m, 96, 40, 4, seed=8)
  scale[2, 5], scale[3, 7] = np.inf, np.nan
  slots = np.arange(m) % 4
  got = np.asarray(cpu_rows.rows_call(jnp.asarray(x), jax.tree.map(jnp.asarray, qk), bits,
                                      scale, jnp.asarray(slots, jnp.int32), group_k=g))
  finite = slots < 2
  assert not np.isfinite(got[slots == 2][:, 5]).any() and np.isnan(got[slots == 3][:, 7]).all()
  clean = np.ones_like(got, bool)
  clean[slots == 2, 5] = clean[slots == 3, 7] = False
  assert np.isfinite(got[clean]).all() and finite.any()
  safe = np.where(np.isfinite(scale), scale, 0)
  want, terms = _want64(x, qk, bits, safe, slots, g)
  err = np.abs(got[clean] - want[clean])
  assert (err <= ATOL + RTOL * terms[clean]).all()
