"""delta_matmul: every implementation against the reference (one shared suite, thin subclasses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.delta.format import PackedDelta, dense_delta, pack, unpack_signs
from pallas_kernels.delta_matmul import api, cpu, delta_matmul, delta_matmul_reference

# (rtol, atol) per dtype. f32: kernels sum over K in another order than the reference (tables,
# bit planes, 2·x·B − rowsum), O(1) terms, K ≤ 512 → ~1e-5 relative. bf16 is judged against an
# f32 exact result relative to the reference's own bf16 error (≤ 1.5x); this is only a sanity
# bound on top.
TOL = {jnp.float32: (2e-5, 2e-4), jnp.bfloat16: (2e-2, 5e-1)}
BF16_ERR_RATIO = 1.5
N_SLOTS = 5
EMPTY_SLOT = 3  # no row ever uses it

# Pairwise cover of M x dtype x granularity x {one variant, bank}; K, N not tile multiples.
#        M,   K,   N, dtype,        granularity, bank
CASES = [
  (1, 200, 72, jnp.float32, "column", False),
  (1, 200, 72, jnp.bfloat16, "matrix", True),
  (3, 256, 128, jnp.float32, "matrix", True),
  (3, 256, 128, jnp.bfloat16, "column", False),
  (16, 300, 130, jnp.float32, "column", True),
  (16, 300, 130, jnp.bfloat16, "matrix", False),
  (64, 136, 40, jnp.float32, "matrix", False),
  (64, 136, 40, jnp.bfloat16, "column", True),
]


def _ids(case):
  m, k, n, dt, gran, bank = case
  return f"M{m}-K{k}-N{n}-{jnp.dtype(dt).name}-{gran}-{'bank' if bank else 'one'}"


def make_case(m, k, n, dtype, granularity, bank, *, group_k=128, seed=0):
  """x, w_base, bits, scale, slot_ids (None for one variant) as jnp arrays."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.5, dtype)
  if not bank:
    pd = pack(rng.standard_normal((k, n)).astype(np.float32), granularity, group_k)
    return x, w, jnp.asarray(pd.bits), jnp.asarray(pd.scale), None
  packs = [
    pack(rng.standard_normal((k, n)).astype(np.float32), granularity, group_k)
    for _ in range(N_SLOTS)
  ]
  bits = np.stack([p.bits for p in packs])
  scale = np.stack([p.scale for p in packs]) * 0.1
  scale[0] = 1e3  # slot 0's entry must never contribute: a leak would be obvious
  slots = rng.choice([s for s in range(N_SLOTS) if s != EMPTY_SLOT], size=m)
  slots[0] = 0  # a base-only row in every bank case
  return x, w, jnp.asarray(bits), jnp.asarray(scale), jnp.asarray(slots, jnp.int32)


def _f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


class DeltaMatmulSuite:
  """Shared tests; subclasses set IMPL (and INTERPRET for Pallas on CPU)."""

  IMPL: str = "reference"
  INTERPRET: bool = False
  CASES = CASES

  def call(self, x, w, bits, scale, slots, group_k=128):
    fn = jax.jit(
      lambda *a: delta_matmul(
        *a, group_k=group_k, implementation=self.IMPL, interpret=self.INTERPRET
      )
    )
    return fn(x, w, bits, scale, slots)

  def check(self, case, group_k=128):
    m, k, n, dtype, gran, bank = case
    x, w, bits, scale, slots = make_case(m, k, n, dtype, gran, bank, group_k=group_k)
    got = self.call(x, w, bits, scale, slots, group_k)
    assert got.shape == (m, n) and got.dtype == jnp.dtype(dtype)
    ref = delta_matmul_reference(x, w, bits, scale, slots, group_k=group_k)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_f32(got), _f32(ref), rtol=rtol, atol=atol)
    if dtype == jnp.bfloat16:
      exact = _f32(
        delta_matmul_reference(
          x.astype(jnp.float32), w.astype(jnp.float32), bits, scale, slots, group_k=group_k
        )
      )
      err = np.abs(_f32(got) - exact).max()
      ref_err = np.abs(_f32(ref) - exact).max()
      assert err <= BF16_ERR_RATIO * ref_err + 1e-6, (err, ref_err)

  @pytest.mark.parametrize("case", CASES, ids=_ids)
  def test_matches_reference(self, case):
    self.check(case)

  def test_group_k_256(self):
    self.check((16, 512, 64, jnp.bfloat16, "column", True), group_k=256)

  def test_all_rows_base_only(self):
    x, w, bits, scale, slots = make_case(4, 200, 72, jnp.float32, "column", True)
    got = self.call(x, w, bits, scale, jnp.zeros_like(slots))
    np.testing.assert_allclose(_f32(got), _f32(x) @ _f32(w), rtol=2e-5, atol=2e-4)


class TestReference(DeltaMatmulSuite):
  """The reference itself against a dense numpy computation."""

  def call(self, x, w, bits, scale, slots, group_k=128):
    k, n = w.shape
    g = min(group_k, -(-k // 8) * 8)
    x32, w32 = _f32(x), _f32(w)
    bank = np.asarray(bits) if slots is not None else np.asarray(bits)[None]
    scales = np.asarray(scale) if slots is not None else np.asarray(scale)[None]
    sl = np.asarray(slots) if slots is not None else np.zeros(x.shape[0], int)
    y = x32 @ w32
    for i, s in enumerate(sl):
      if slots is None or s != 0:
        pd = PackedDelta(bits=bank[s], scale=scales[s], shape=(k, n), group_k=g)
        y[i] += x32[i] @ np.asarray(dense_delta(pd, np.float32))
    return jnp.asarray(y).astype(x.dtype)


class TestXla(DeltaMatmulSuite):
  IMPL = "xla"


@pytest.mark.skipif(cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason()))
class TestCpu(DeltaMatmulSuite):
  IMPL = "cpu"

  def test_multithreaded_and_ragged_columns(self):
    # Big enough for the worker threads; N not a multiple of the 64-column tile.
    self.check((5, 1032, 2088, jnp.float32, "column", True))

  def test_out_of_range_slot_is_base_only(self):
    x, w, bits, scale, slots = make_case(3, 200, 72, jnp.float32, "matrix", True)
    got = self.call(x, w, bits, scale, jnp.asarray([0, 99, -4], jnp.int32))
    np.testing.assert_allclose(_f32(got), _f32(x) @ _f32(w), rtol=2e-5, atol=2e-4)


def _cpu_has(flag: str) -> bool:
  try:
    return flag in open("/proc/cpuinfo").read().split()
  except OSError:
    return False


# (target flags, the tile that build must run): the AVX2 tile also on AVX-512 machines, and the
# portable loop, so every path is tested wherever the suite runs (CI's CPU may take only one).
_ISA_BUILDS = [(("-march=native", "-mno-avx512f"), 2, "avx2"), ((), 0, "portable")]


@pytest.mark.skipif(cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason()))
@pytest.mark.parametrize("arch,tile,label", _ISA_BUILDS, ids=[b[2] for b in _ISA_BUILDS])
def test_every_cpu_tile_matches_numpy(arch, tile, label):
  """The C++ kernel's AVX2 tile and portable loop (the native build takes only one path per
  machine: AVX-512 where present) against a float64 numpy delta term: row counts 1-9 (blocks
  of 4 rows and remainders), N with 16-column chunks and remainders, both scale layouts,
  base-only and out-of-range slots."""
  if label == "avx2" and not (_cpu_has("avx2") and _cpu_has("fma")):
    pytest.skip("this CPU has no AVX2/FMA")
  target = f"bitdelta_delta_matmul_test_{label}"
  assert cpu.build_target(arch, target) == tile
  rng = np.random.default_rng(7)
  for m, k, n, gran in [(1, 576, 1536, "column"), (3, 200, 72, "matrix"), (5, 136, 40, "column"),
                        (9, 300, 130, "column"), (4, 64, 16, "matrix"), (2, 96, 7, "column")]:
    packs = [pack(rng.standard_normal((k, n)).astype(np.float32), gran) for _ in range(3)]
    bits = np.stack([q.bits for q in packs])
    scale = np.stack([q.scale for q in packs]).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    base = rng.standard_normal((m, n)).astype(np.float32)
    slots = rng.integers(-1, 4, size=m).astype(np.int32)  # -1 and 3: base only
    got = np.asarray(cpu.fused_call(jnp.asarray(x), jnp.asarray(bits), jnp.asarray(scale),
                                    jnp.asarray(slots), jnp.asarray(base),
                                    group_k=packs[0].group_k, target=target))
    want = base.astype(np.float64).copy()
    for i, s in enumerate(slots):
      if 0 <= s < 3:
        signs = unpack_signs(packs[s].bits, (k, n), packs[s].group_k, np.float64)
        want[i] += np.asarray(packs[s].scale, np.float64) * (x[i].astype(np.float64) @ signs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3, err_msg=f"{label} {m}x{k}x{n}")


class TestPallasTritonInterpret(DeltaMatmulSuite):
  IMPL = "pallas_triton"
  INTERPRET = True


_HAS_GPU = jax.default_backend() in ("gpu", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_GPU, reason="needs a GPU")
class TestPallasTritonGpu(DeltaMatmulSuite):
  IMPL = "pallas_triton"
  CASES = [
    (m, 1024, 1024, dt, gran, bank)
    for m in (1, 16, 256)
    for dt, gran, bank in (
      (jnp.bfloat16, "column", False),
      (jnp.bfloat16, "matrix", True),
      (jnp.float32, "column", True),
    )
  ]

  @pytest.mark.parametrize("case", CASES, ids=_ids)
  def test_matches_reference(self, case):
    self.check(case)


# --- dispatch, fallback and loud failures ------------------------------------------------------


def test_default_dispatch_matches_reference():
  x, w, bits, scale, slots = make_case(3, 200, 72, jnp.float32, "column", True)
  got = jax.jit(lambda *a: delta_matmul(*a))(x, w, bits, scale, slots)
  ref = delta_matmul_reference(x, w, bits, scale, slots)
  np.testing.assert_allclose(_f32(got), _f32(ref), rtol=2e-5, atol=2e-4)


def test_dispatch_falls_through_on_not_implemented(monkeypatch):
  calls = []

  def refuse(*a, **kw):
    calls.append("cpu")
    raise NotImplementedError("test: cpu kernel refuses this shape")

  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")  # the few-rows kernel would take 2 rows first
  monkeypatch.setattr(cpu, "unavailable_reason", lambda: None)
  monkeypatch.setattr(cpu, "delta_matmul_cpu", refuse)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  x, w, bits, scale, _ = make_case(2, 200, 72, jnp.float32, "matrix", False)
  got = delta_matmul(x, w, bits, scale)
  assert calls == ["cpu"]
  np.testing.assert_allclose(
    _f32(got), _f32(delta_matmul_reference(x, w, bits, scale)), rtol=2e-5, atol=2e-4
  )


def test_dispatch_skips_unavailable_cpu_kernel(monkeypatch):
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")  # the few-rows kernel would take 1 row first
  monkeypatch.setattr(cpu, "unavailable_reason", lambda: "test: no compiler")
  x, w, bits, scale, _ = make_case(1, 200, 72, jnp.float32, "matrix", False)
  got = delta_matmul(x, w, bits, scale)
  np.testing.assert_allclose(
    _f32(got), _f32(delta_matmul_reference(x, w, bits, scale)), rtol=2e-5, atol=2e-4
  )
  with pytest.raises(RuntimeError, match="no compiler"):
    delta_matmul(x, w, bits, scale, implementation="cpu")


@pytest.mark.skipif(_HAS_GPU, reason="checks the CPU-only failure")
def test_named_gpu_kernel_without_gpu_fails_loudly():
  x, w, bits, scale, _ = make_case(1, 200, 72, jnp.float32, "matrix", False)
  with pytest.raises(RuntimeError, match="GPU backend"):
    delta_matmul(x, w, bits, scale, implementation="pallas_triton")


def test_unknown_implementation():
  x, w, bits, scale, _ = make_case(1, 200, 72, jnp.float32, "matrix", False)
  with pytest.raises(ValueError, match="unknown implementation"):
    delta_matmul(x, w, bits, scale, implementation="cuda_magic")


def test_pallas_refuses_small_groups_with_reason():
  # K=72 → one group of 72 rows, 9 packed rows: not a Triton-friendly block.
  x, w, bits, scale, _ = make_case(2, 72, 64, jnp.float32, "matrix", False)
  with pytest.raises(NotImplementedError, match="power of two"):
    delta_matmul(x, w, bits, scale, implementation="pallas_triton", interpret=True)
  assert api.pallas_gpu.shapes_supported(x.shape, w.shape, bits.shape, 72) is not None


def test_bad_shapes_raise():
  x, w, bits, scale, slots = make_case(2, 200, 72, jnp.float32, "matrix", True)
  with pytest.raises(ValueError, match="needs slot_ids"):
    delta_matmul(x, w, bits, scale)
  with pytest.raises(ValueError, match="x must be"):
    delta_matmul(x[:, :100], w, bits, scale, slots)


@pytest.mark.parametrize("banked", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_kernels_lower_for_cuda(banked, dtype):
  """The Pallas → Triton IR lowering runs without a GPU; catches unsupported ops early."""
  k = n = 256
  x = jax.ShapeDtypeStruct((16, k), dtype)
  w = jax.ShapeDtypeStruct((k, n), dtype)
  s = 4 if banked else None
  bits = jax.ShapeDtypeStruct((s, k // 8, n) if banked else (k // 8, n), jnp.uint8)
  scale = jax.ShapeDtypeStruct((s, n) if banked else (n,), jnp.float32)
  slots = jax.ShapeDtypeStruct((16,), jnp.int32) if banked else None
  if banked:
    fn = lambda x, w, b, sc, sl: api.pallas_gpu.delta_matmul_bank(x, w, b, sc, sl, group_k=128)
    args = (x, w, bits, scale, slots)
  else:
    fn = lambda x, w, b, sc: api.pallas_gpu.delta_matmul_single(x, w, b, sc, group_k=128)
    args = (x, w, bits, scale)
  try:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
    pytest.skip(f"no Triton lowering in this jaxlib: {e}")
  text = lowered.as_text()
  assert "bitdelta_bank_matmul" in text or "bitdelta_delta_matmul" in text
