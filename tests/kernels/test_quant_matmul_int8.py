"""quant_matmul's int8-activation path (`cpu_rows.rows_call(..., activations="int8")`) against an
independent numpy computation of the same arithmetic, and its error against the f32-activation
(dequantized) product, reported.

The numpy side: x quantized per row and 32-block as ggml's Q8_0 with an f32 scale (d = max|x|/127,
q = rint(x·(1/d)), ties to even, in f32 as the kernel), Σ q_x·q_w per (row, block, column) in
int64 (exact: what the kernel's int32 sums must equal), then (d_w·d_x)·Σ + m_w·d_x·Σq_x in
float64; the delta term is the f32 path's, from unpacked signs in float64. Tolerance: the f32
row of STYLE's table (atol 1e-7, rtol 1e-6) relative to the sum of the terms' magnitudes (the
scale of the f32 steps' rounding). One wrong integer product moves a result by about
d_x·d_w, far above that bound (`test_the_bound_sees_one_integer_off`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bits import group_k_for, packed_rows, unpack_signs
from pallas_kernels.quant_matmul import blocks, cpu_rows

ATOL, RTOL = 1e-7, 1e-6  # f32 (STYLE.md's dtype table)
FORMATS = blocks.FORMATS
pytestmark = pytest.mark.skipif(cpu_rows.unavailable_reason() is not None,
                                reason=f"kernel: {cpu_rows.unavailable_reason()}")


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """ggml Q8_0 of x ``[M, K]`` with an f32 scale: q int64 ``[M, K/32, 32]``, d f32 ``[M, K/32]``."""
  xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
  amax = np.abs(xb).max(-1)
  d = (amax / np.float32(127)).astype(np.float32)
  with np.errstate(divide="ignore"):
    inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
  q = np.rint(xb * inv[..., None])  # f32 product, rounded half to even
  assert np.abs(q).max(initial=0) <= 127
  return q.astype(np.int64), d


def weight_ints(qk) -> np.ndarray:
  """The stored integers ``[K/32, 32, N]``: q8_0's q, q4_0's nibble − 8, q4_1's nibble."""
  v = blocks._values(np.asarray(qk.qs), qk.format, np).astype(np.int64)
  return v - 8 if qk.format == "q4_0" else v


def want_int8(x, qk, bits=None, scale=None, slots=None, g=None):
  """float64 result of the int8-activation arithmetic, the magnitude of its terms, and the
  int64 block sums ``[M, K/32, N]``."""
  q, dx = quantize_x(x)
  isum = np.einsum("mbj,bjn->mbn", q, weight_ints(qk))  # exact
  dw = np.asarray(qk.d, np.float64)
  terms = dx.astype(np.float64)[:, :, None] * dw[None] * isum
  y, mag = terms.sum(1), np.abs(terms).sum(1)
  if qk.format == "q4_1":
    mins = np.asarray(qk.m, np.float64)[None] * (dx.astype(np.float64) * q.sum(-1))[:, :, None]
    y, mag = y + mins.sum(1), mag + np.abs(mins).sum(1)
  if bits is not None:
    k, n = qk.shape
    x64 = x.astype(np.float64)
    signs = unpack_signs(bits, (k, n), g, np.float64)  # [S, K, N]
    per = np.einsum("mk,skn->smn", x64, signs) * scale.astype(np.float64)[:, None, :]
    on = (slots > 0)[:, None]
    y = y + np.where(on, per[slots, np.arange(x.shape[0])], 0)
    mag = mag + np.where(on, np.abs(x64) @ np.ones((k, n)) * scale[slots], 0)
  return y, mag, isum


def want_f32_activations(x, qk) -> np.ndarray:
  """float64 x · dequant(W): what the f32-activation path computes (to f32 rounding)."""
  return x.astype(np.float64) @ blocks.dequantize(qk).astype(np.float64)


def _check(got, want, mag):
  err = np.abs(np.asarray(got, np.float64) - want)
  bound = ATOL + RTOL * mag
  assert (err <= bound).all(), f"worst excess {np.max(err / bound):.3g}x the f32 bound"


def _case(fmt, m, k, n, s, seed):
  rng = np.random.default_rng(seed)
  w = (rng.standard_normal((k, n)) * 0.05 + rng.uniform(-0.02, 0.02, (1, n))).astype(np.float32)
  qk = blocks.quantize(w, fmt)
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[:, :32] *= 1e-3  # blocks of very different scales
  if k >= 96:
    x[:, 64:96] = 0  # an all-zero block: d = 0
  g = group_k_for(k)
  bits = rng.integers(0, 256, (s, packed_rows(k, g), n), dtype=np.uint8)
  scale = rng.uniform(0.001, 0.01, (s, n)).astype(np.float32)
  return g, qk, x, bits, scale


def _run(fmt, layout, m, k, n, target=None, s=3):
  g, qk, x, bits, scale = _case(fmt, m, k, n, s, seed=3 * m + k + n)
  qj = jax.tree.map(jnp.asarray, qk)
  kw = {"activations": "int8"} | ({} if target is None else {"target": target})
  call = jax.jit(lambda x, q, *a: cpu_rows.rows_call(x, q, *a, group_k=g, **kw))
  if layout == "plain":
    got, want = call(x, qj), want_int8(x, qk)
  elif layout == "one variant":
    got = call(x, qj, bits[1], scale[1])
    want = want_int8(x, qk, bits, scale, np.ones(m, np.int64), g)
  else:
    slots = np.arange(m) % s  # 0 (base) included
    got = call(x, qj, bits, scale, jnp.asarray(slots, jnp.int32))
    want = want_int8(x, qk, bits, scale, slots, g)
  assert got.dtype == jnp.float32 and got.shape == (m, n)
  _check(got, *want[:2])
  return got, x, qk


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["plain", "one variant", "bank"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k,n", [(96, 40), (576, 203), (1536, 576)])
def test_int8_matches_numpy(fmt, layout, m, k, n):
  """n = 40, 203: columns past the last 16 / 32-column tile take the scalar loop."""
  _run(fmt, layout, m, k, n)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [17, 40])
def test_int8_passes_of_16_rows(fmt, m):
  _run(fmt, "bank", m, 576, 200)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_portable_build(fmt):
  cpu_rows.build_target((), "bitdelta_quant_rows_portable")  # the scalar loops
  for m in (1, 3, 17):
    _run(fmt, "bank", m, 576, 200, target="bitdelta_quant_rows_portable")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bound_sees_one_integer_off(fmt):
  """The tolerance is tight enough to catch a single block sum off by one."""
  g, qk, x, *_ = _case(fmt, 3, 576, 200, 1, seed=1)
  got = np.asarray(cpu_rows.rows_call(jnp.asarray(x), jax.tree.map(jnp.asarray, qk),
                                      activations="int8"))
  want, mag, isum = want_int8(x, qk)
  _check(got, want, mag)
  q, dx = quantize_x(x)
  b = 5  # a block of ordinary scale
  off = want.copy()
  off[1, 7] += float(dx[1, b]) * float(np.asarray(qk.d, np.float64)[b, 7])
  with pytest.raises(AssertionError):
    _check(got, off, mag)


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_error_against_f32_activations_reported(fmt, capsys):
  """The cost of quantizing x: relative to the f32-activation product, on Gaussian x and
  weights. Reported, and bounded by the quantization error's own scale (|Δx| <= d_x/2 per
  element: |Δy| <= Σ_k d_x/2 · |w|), which the kernel must respect."""
  g, qk, x, *_ = _case(fmt, 16, 1536, 576, 1, seed=2)
  qj = jax.tree.map(jnp.asarray, qk)
  y8 = np.asarray(cpu_rows.rows_call(jnp.asarray(x), qj, activations="int8"), np.float64)
  yf = np.asarray(cpu_rows.rows_call(jnp.asarray(x), qj, activations="f32"), np.float64)
  exact = want_f32_activations(x, qk)
  _check(yf, exact, np.abs(x.astype(np.float64)) @ np.abs(blocks.dequantize(qk)))
  _, dx = quantize_x(x)
  half_step = np.repeat(dx.astype(np.float64) / 2, 32, axis=1)  # [M, K]
  bound = half_step @ np.abs(blocks.dequantize(qk).astype(np.float64))
  err = np.abs(y8 - exact)
  assert (err <= bound * (1 + 1e-5) + 1e-6).all()
  rel = np.linalg.norm(y8 - exact) / np.linalg.norm(exact)
  with capsys.disabled():
    print(f"\n{fmt}: int8 vs f32 activations, 16x1536 @ 1536x576: max |dy| {err.max():.3g} "
          f"(max |y| {np.abs(exact).max():.3g}), relative L2 {rel:.2e}, "
          f"max |dy| / bound {np.max(err / bound):.2f}")
  assert rel < 2e-2  # Gaussian x: the quantization error's L2 is ~0.3% of x's per block


def test_mode_is_chosen_by_argument_then_environment(monkeypatch):
  monkeypatch.delenv("BITDELTA_QUANT_ACTIVATIONS", raising=False)
  assert {cpu_rows.activations_for(f) for f in FORMATS} == {"int8"}  # llama.cpp's, by default
  monkeypatch.setenv("BITDELTA_QUANT_ACTIVATIONS", "f32")
  assert cpu_rows.activations_for("q4_1") == "f32"
  assert cpu_rows.activations_for("q4_1", "int8") == "int8"
  monkeypatch.setenv("BITDELTA_QUANT_ACTIVATIONS", "int8")
  assert cpu_rows.activations_for("q8_0") == "int8"
  monkeypatch.setenv("BITDELTA_QUANT_ACTIVATIONS", "auto")
  assert {f: cpu_rows.activations_for(f) for f in FORMATS} == cpu_rows.FASTEST_ACTIVATIONS
  monkeypatch.setenv("BITDELTA_QUANT_ACTIVATIONS", "int4")
  with pytest.raises(ValueError, match="int4"):
    cpu_rows.activations_for("q4_0")


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_and_environment_reach_the_kernel(fmt, monkeypatch):
  """A call without ``activations`` runs the format's default, or what the environment says
  (read when traced): the same numbers as naming the mode."""
  g, qk, x, *_ = _case(fmt, 2, 96, 40, 1, seed=6)
  qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
  named = {a: np.asarray(cpu_rows.rows_call(xj, qj, activations=a)) for a in ("f32", "int8")}
  assert not np.array_equal(named["f32"], named["int8"])
  monkeypatch.delenv("BITDELTA_QUANT_ACTIVATIONS", raising=False)
  np.testing.assert_array_equal(np.asarray(cpu_rows.rows_call(xj, qj)),
                                named["int8"])
  for a in ("f32", "int8"):  # a new program each: a traced one keeps the mode it was traced with
    monkeypatch.setenv("BITDELTA_QUANT_ACTIVATIONS", a)
    fresh = jax.jit(lambda x, q: cpu_rows.rows_call(x, q))
    np.testing.assert_array_equal(np.asarray(fresh(xj, qj)), named[a])


def _cpu_flags() -> set[str]:
  import pathlib

  info = pathlib.Path("/proc/cpuinfo")
  return set(info.read_text().split()) if info.exists() else set()


def _same_bits(fmt, target, cases):
  """The native build and ``target`` give the same bits on each (rows, K, N, seed) case, plain
  and with a bank of 3 slots (the base's rows included), and both pass the numpy check."""
  for m, k, n, seed in cases:
    g, qk, x, bits, scale = _case(fmt, m, k, n, 3, seed=seed)
    qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
    slots = jnp.asarray(np.arange(m) % 3, jnp.int32)
    for args in ((), (bits, scale, slots)):
      got = [np.asarray(cpu_rows.rows_call(xj, qj, *args, group_k=g, activations="int8",
                                           target=t)) for t in (cpu_rows._TARGET, target)]
      np.testing.assert_array_equal(got[0], got[1])
    _check(got[0], *want_int8(x, qk, bits, scale, np.asarray(slots), g)[:2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_vnni_tiles_equal_the_avx2_int8_tiles(fmt):
  """Where the CPU has AVX-512 VNNI and VBMI, the int8 path runs the vpdpbusd tiles (4 byte
  rows transposed per column by byte permutes); built without VNNI it runs the AVX2 vpmaddubsw /
  vpmaddwd tiles. Integer block sums are exact and the f32 step is the same per lane, so the
  two builds agree bit for bit: 1-4 row tiles, 64- and 16-column tiles and the scalar tail,
  with and without variants."""
  if not {"avx512_vnni", "avx512vbmi", "avx512bw"} <= _cpu_flags():
    pytest.skip("this CPU has no AVX-512 VNNI + VBMI: the native build is the AVX2 one")
  target = "bitdelta_quant_rows_novnni"
  try:
    cpu_rows.build_target(("-march=native", "-mno-avx512vnni"), target)
  except RuntimeError as e:
    pytest.skip(f"no build without VNNI here: {e}")
  _same_bits(fmt, target, ((1, 576, 1000, 1), (2, 96, 88, 2), (7, 1536, 216, 3),
                           (17, 576, 203, 4)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_strips_equal_the_per_tile_path(fmt):
  """With AVX-512 VNNI (+ BW), more than 8 rows walk 64-column strips over a copy of each block
  transposed once (`BaseVnniStrips`); built with the strip threshold out of reach the same
  rows run the per-tile paths. Same integer sums, same f32 step per lane: bit for bit, at row
  counts around the 4-row tiles and the 16-row passes, strips with a 16-column and a scalar
  tail, with and without variants; and against numpy."""
  if not {"avx512_vnni", "avx512bw"} <= _cpu_flags():
    pytest.skip("this CPU has no AVX-512 VNNI: the native build has no strip path")
  target = "bitdelta_quant_rows_nostrips"
  cpu_rows.build_target(("-march=native", "-DBITDELTA_QROWS_STRIP_ROWS=1000000"), target)
  _same_bits(fmt, target, ((9, 96, 64, 1), (12, 576, 208, 2), (13, 1536, 203, 3),
                           (33, 576, 1000, 4)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_activation_quantizer_same_in_every_build(fmt):
  """x is quantized per 32-block by AVX-512 code where the build has it and by the scalar loop
  elsewhere, over the thread pool for large calls: the same q, d and Σq (ties to even
  included), so the int8 products of the native and the AVX2 build agree bit for bit."""
  target = "bitdelta_quant_rows_avx2_int8"
  try:
    cpu_rows.build_target(("-march=native", "-mno-avx512f"), target)
  except RuntimeError as e:
    pytest.skip(f"no AVX2 build here: {e}")
  g, qk, x, bits, scale = _case(fmt, 40, 1536, 96, 3, seed=7)
  x[0, :32] = np.arange(32, dtype=np.float32) - 15.5  # amax 15.5: halves of odd steps
  x[1, :32] = 0.5 * (np.arange(32, dtype=np.float32) - 16)
  x[1, 0] = 127.0  # d = 1: x·(1/d) = -7.5, -7, ... exact ties
  x[2, 32:64] = -0.0
  qj, xj = jax.tree.map(jnp.asarray, qk), jnp.asarray(x)
  for m in (1, 40):  # one block at a time, and over the pool
    got = [np.asarray(cpu_rows.rows_call(xj[:m], qj, group_k=g, activations="int8", target=t))
           for t in (cpu_rows._TARGET, target)]
    np.testing.assert_array_equal(got[0], got[1])
    _check(got[0], *want_int8(x[:m], qk)[:2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_tiles_equal_the_vnni_paths(fmt):
  """With AMX-INT8, int8 activations past 16 rows take tile multiplies (`BaseAmx`: each block
  transposed once per pass of up to 512 rows, sums per 16 x 16 tile, the f32 step with y in
  registers across blocks), 6-16 rows `BaseAmxFew` (one x tile per block, y in memory); built
  with both thresholds out of reach the same rows run the VNNI paths. Integer sums are exact
  and the f32 step the same per lane: bit for bit, at row counts inside one 16-row tile, across
  tiles and across the 512-row pass (a 1-row pass after it takes the VNNI tiles), strips with a
  16-column and a scalar tail, with and without variants; and against numpy."""
  if not {"amx_int8", "amx_tile"} <= _cpu_flags():
    pytest.skip("this CPU has no AMX-INT8: the native build has no AMX path")
  if reason := cpu_rows.amx_unavailable_reason():  # a CPU with AMX, an old kernel or compiler
    pytest.skip(f"this CPU has AMX-INT8 but: {reason}")
  target = "bitdelta_quant_rows_noamx"
  cpu_rows.build_target(("-march=native", "-DBITDELTA_QROWS_AMX_ROWS=1000000",
                         "-DBITDELTA_QROWS_AMX_FEW_ROWS=1000000"), target)
  _same_bits(fmt, target, ((6, 96, 64, 5), (11, 576, 219, 6), (16, 1536, 136, 7),
                           (17, 96, 64, 1), (33, 576, 219, 2), (130, 1536, 136, 3),
                           (513, 96, 136, 4)))


def test_amx_turned_off_by_the_environment():
  """``BITDELTA_AMX=0`` keeps the kernel off the tiles (read once per process: a fresh one)."""
  if not {"amx_int8", "amx_tile"} <= _cpu_flags():
    pytest.skip("this CPU has no AMX-INT8")
  import os
  import subprocess
  import sys

  if reason := cpu_rows.amx_unavailable_reason():
    pytest.skip(f"this CPU has AMX-INT8 but: {reason}")
  # on (unset or 1: only "0" turns it off): this process, checked above; off: one fresh process
  code = ("from pallas_kernels.quant_matmul import cpu_rows; "
          "print(cpu_rows.amx_unavailable_reason())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "BITDELTA_AMX": "0", "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip() == "turned off by BITDELTA_AMX=0", (out.stdout, out.stderr[-2000:])
