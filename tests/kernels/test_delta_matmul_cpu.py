"""The C++ CPU delta kernel (`pallas_kernels/delta_matmul/cpu_kernel.cc`) against float64 numpy.

    out[m] = base[m] + α[s] ⊙ (x[m] · S_s),  s = slots[m]; s < 0 or s >= S: out = base.

Both strategies (LUT, expand-then-FMA) forced through ``expand_rows`` and the default choice,
and the merged entry point (`cpu.merged_call`: base GEMM in the kernel, W_base + α·S panels for
big slots, LUT on top for small ones), which `delta_matmul_cpu` takes for many f32 rows;
every slot layout (one slot, all base, mixed, unsorted runs, a slot no row uses); per-matrix and
per-column α; group sizes 64, 128, 16 and a tiny single group; K not a multiple of 8 or of the
group, N not a multiple of 16 or 64, M = 1, 3, 17, 130, 513 (blocks of 4 and 6 rows, remainders,
the thread pool); and the AVX2 and portable builds, which this machine's native build may skip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bitdelta_jax.delta.format import group_k_for, pack, unpack_signs
from pallas_kernels.delta_matmul import cpu, delta_matmul

pytestmark = pytest.mark.skipif(
  cpu.unavailable_reason() is not None, reason=str(cpu.unavailable_reason())
)

# f32 sums over K <= 1536 of O(1) terms in another order than float64; the same bound as
# test_delta_matmul.py's ISA test.
RTOL, ATOL = 1e-4, 1e-3
N_SLOTS = 5
ABSENT = 3  # a slot with a delta that no row uses
STRATEGIES = {"lut": 1 << 30, "expand": 1, "default": 0}

#   M,   K,    N, group_k asked, α
CASES = [
  (1, 576, 576, 128, "column"),  # SmolLM2 q/o: 64-row groups
  (3, 1536, 130, 128, "matrix"),  # SmolLM2 down's K: 128-row groups; N % 16 != 0
  (17, 200, 72, 128, "column"),  # K % 8 == 0 but not a group multiple: padded last group
  (130, 576, 192, 64, "matrix"),  # SmolLM2 k/v
  (513, 136, 40, 64, "column"),  # group 16 (group_k_for), many rows, N < 64
  (17, 19, 7, 128, "matrix"),  # tiny K, not a multiple of 8: one group of 24 rows
  (130, 300, 100, 128, "column"),  # K % 8 != 0 with several groups
]


def _layout(name: str, m: int, rng) -> np.ndarray:
  if name == "one":
    return np.full(m, 1, np.int32)
  if name == "base":  # only base rows: negative and out of range
    return rng.choice([-1, -7, N_SLOTS, 99], size=m).astype(np.int32)
  if name == "mixed":  # every present slot, base rows, random order
    return rng.choice([-1, 0, 1, 2, 4], size=m).astype(np.int32)
  if name == "unsorted_runs":  # mostly one slot, others interleaved
    s = np.full(m, 2, np.int32)
    s[rng.random(m) < 0.3] = 4
    s[::7] = -1
    s[1::5] = 0
    return s
  raise ValueError(name)


LAYOUTS = ("one", "base", "mixed", "unsorted_runs")


def _bank(k: int, n: int, group_k: int, granularity: str, rng):
  g = group_k_for(k, group_k)
  packs = [
    pack(rng.standard_normal((k, n)).astype(np.float32), granularity, g) for _ in range(N_SLOTS)
  ]
  bits = np.stack([p.bits for p in packs])
  scale = np.stack([p.scale for p in packs]).astype(np.float32)
  signs = np.stack([unpack_signs(p.bits, (k, n), g, np.float64) for p in packs])
  return g, bits, scale, signs


def _want(x, base, scale, signs, slots) -> np.ndarray:
  want = base.astype(np.float64)
  for i, s in enumerate(slots):
    if 0 <= s < N_SLOTS:
      want[i] += scale[s].astype(np.float64) * (x[i].astype(np.float64) @ signs[s])
  return want


def _call(x, bits, scale, slots, base, g, expand_rows, target=cpu._TARGET):
  return np.asarray(
    cpu.fused_call(
      jnp.asarray(x),
      jnp.asarray(bits),
      jnp.asarray(scale),
      jnp.asarray(slots),
      jnp.asarray(base),
      group_k=g,
      target=target,
      expand_rows=expand_rows,
    )
  )


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-{c[4]}")
def test_kernel_matches_numpy(case):
  m, k, n, group_k, gran = case
  rng = np.random.default_rng(m * 1000 + k + n)
  g, bits, scale, signs = _bank(k, n, group_k, gran, rng)
  x = rng.standard_normal((m, k)).astype(np.float32)
  base = rng.standard_normal((m, n)).astype(np.float32)
  for layout in LAYOUTS:
    slots = _layout(layout, m, rng)
    assert ABSENT not in slots
    want = _want(x, base, scale, signs, slots)
    for strategy, expand_rows in STRATEGIES.items():
      got = _call(x, bits, scale, slots, base, g, expand_rows)
      np.testing.assert_allclose(
        got, want, rtol=RTOL, atol=ATOL, err_msg=f"{layout} {strategy} G{g}"
      )
      if layout == "base":
        np.testing.assert_array_equal(got, base)  # base rows are copied, not recomputed


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-{c[4]}")
def test_merged_matches_numpy(case):
  m, k, n, group_k, gran = case
  rng = np.random.default_rng(m * 1000 + k + n + 1)
  g, bits, scale, signs = _bank(k, n, group_k, gran, rng)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  base = x.astype(np.float64) @ w.astype(np.float64)
  for layout in LAYOUTS:
    slots = _layout(layout, m, rng)
    want = _want(x, base, scale, signs, slots)
    for strategy, expand_rows in {**STRATEGIES, "split": max(2, m // 3)}.items():
      got = np.asarray(
        cpu.merged_call(
          jnp.asarray(x),
          jnp.asarray(w),
          jnp.asarray(bits),
          jnp.asarray(scale),
          jnp.asarray(slots),
          group_k=g,
          expand_rows=expand_rows,
        )
      )
      np.testing.assert_allclose(
        got, want, rtol=RTOL, atol=ATOL, err_msg=f"merged {layout} {strategy} G{g}"
      )


@pytest.mark.parametrize("layout", ["one slot", "one slot, few base rows", "one slot, many base",
                                    "two slots"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] >= cpu.EXPAND_MIN_ROWS],
                         ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}")
def test_many_rows_of_one_slot_take_xlas_dot_on_the_expanded_weight(case, layout):
  """`delta_matmul_cpu` for many f32 rows (from EXPAND_MIN_ROWS): every row in one variant slot
  runs XLA's dot on W + α⊙S; anything else (base rows too, several slots) the merged kernel.
  Both against numpy; the program holds both branches, chosen at run time."""
  m, k, n, group_k, gran = case
  rng = np.random.default_rng(m + k + n + 2)
  g, bits, scale, signs = _bank(k, n, group_k, gran, rng)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  ids = np.full(m, 2, np.int32)  # the API's slot ids: 0 is the base
  if layout == "one slot, few base rows":
    ids[:: max(5, m // 8)] = 0
  elif layout == "one slot, many base":
    ids[: m // 2] = 0
  elif layout == "two slots":
    ids[::3] = 4
  want = _want(x, x.astype(np.float64) @ w.astype(np.float64), scale, signs,
               np.where(ids == 0, -1, ids))
  f = jax.jit(lambda *a: cpu.delta_matmul_cpu(*a, group_k=g))
  args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale), jnp.asarray(ids))
  hlo = f.lower(*args).as_text()
  assert "bitdelta_delta_expand" in hlo and "bitdelta_delta_matmul_merged" in hlo
  np.testing.assert_allclose(np.asarray(f(*args)), want, rtol=RTOL, atol=ATOL, err_msg=layout)


def test_a_short_chunk_of_one_slot_takes_the_merged_kernel():
  """Below EXPAND_MIN_ROWS rows (a short prompt's chunk) writing W + α⊙S costs more than the
  merged kernel's extra work: one slot's rows take the merged kernel, no expansion."""
  m, k, n = cpu.EXPAND_MIN_ROWS - 1, 576, 192
  assert m >= cpu.MERGED_MIN_ROWS
  rng = np.random.default_rng(12)
  g, bits, scale, signs = _bank(k, n, 64, "column", rng)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  ids = np.full(m, 3, np.int32)
  f = jax.jit(lambda *a: cpu.delta_matmul_cpu(*a, group_k=g))
  args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale), jnp.asarray(ids))
  hlo = f.lower(*args).as_text()
  assert "bitdelta_delta_expand" not in hlo and "bitdelta_delta_matmul_merged" in hlo
  want = _want(x, x.astype(np.float64) @ w.astype(np.float64), scale, signs, ids)
  np.testing.assert_allclose(np.asarray(f(*args)), want, rtol=RTOL, atol=ATOL)


def test_expanded_weight_is_w_plus_alpha_signs():
  rng = np.random.default_rng(11)
  g, bits, scale, signs = _bank(200, 72, 128, "column", rng)
  w = rng.standard_normal((200, 72)).astype(np.float32)
  for s in (0, 3):
    got = cpu.expand_call(jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale),
                          jnp.asarray(s, jnp.int32), group_k=g)
    np.testing.assert_array_equal(np.asarray(got), (w + scale[s] * signs[s]).astype(np.float32))


def test_strategies_mix_in_one_call():
  """A slot above the threshold (expand) beside slots below it (LUT) in one call."""
  rng = np.random.default_rng(3)
  m, k, n = 40, 576, 192
  g, bits, scale, signs = _bank(k, n, 128, "column", rng)
  x = rng.standard_normal((m, k)).astype(np.float32)
  base = rng.standard_normal((m, n)).astype(np.float32)
  slots = np.full(m, 1, np.int32)
  slots[[3, 11, 29]] = 2
  slots[[5, 6]] = 4
  rng.shuffle(slots)
  got = _call(x, bits, scale, slots, base, g, expand_rows=8)  # slot 1: 35 rows; others < 8
  np.testing.assert_allclose(got, _want(x, base, scale, signs, slots), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("m", [17, cpu.MERGED_MIN_ROWS + 3])
@pytest.mark.parametrize("strategy", ["lut", "expand"])
def test_api_slot_zero_is_base_and_env_forces_strategy(strategy, m, monkeypatch):
  """Through `delta_matmul(implementation="cpu")` (few rows: XLA's GEMM + the delta kernel;
  from MERGED_MIN_ROWS: the merged kernel): slot id 0 rows get the base product only;
  ``$BITDELTA_CPU_EXPAND_ROWS`` picks the strategy (read when the call is traced)."""
  monkeypatch.setenv("BITDELTA_CPU_EXPAND_ROWS", str(STRATEGIES[strategy]))
  rng = np.random.default_rng(5)
  k, n = 576, 130
  g, bits, scale, signs = _bank(k, n, 128, "column", rng)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  slot_ids = rng.choice([0, 1, 2, 4], size=m).astype(np.int32)
  got = jax.jit(lambda *a: delta_matmul(*a, group_k=g, implementation="cpu"))(
    jnp.asarray(x), jnp.asarray(w), jnp.asarray(bits), jnp.asarray(scale), jnp.asarray(slot_ids)
  )
  base = x.astype(np.float64) @ w.astype(np.float64)
  want = _want(x, base, scale, signs, np.where(slot_ids == 0, -1, slot_ids))
  np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)


def _cpu_has(flag: str) -> bool:
  try:
    return flag in open("/proc/cpuinfo").read().split()
  except OSError:
    return False


_ISA_BUILDS = [(("-march=native", "-mno-avx512f"), 2, "avx2"), ((), 0, "portable")]


@pytest.mark.parametrize("arch,tile,label", _ISA_BUILDS, ids=[b[2] for b in _ISA_BUILDS])
def test_other_builds_match_numpy(arch, tile, label):
  """The AVX2 and portable builds, both strategies, on a subset of the cases."""
  if label == "avx2" and not (_cpu_has("avx2") and _cpu_has("fma")):
    pytest.skip("this CPU has no AVX2/FMA")
  target = f"bitdelta_delta_matmul_cpu_test_{label}"
  assert cpu.build_target(arch, target) == tile
  for m, k, n, group_k, gran in (CASES[1], CASES[2], CASES[4], CASES[5]):
    rng = np.random.default_rng(m + k + n)
    g, bits, scale, signs = _bank(k, n, group_k, gran, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    base = rng.standard_normal((m, n)).astype(np.float32)
    slots = _layout("mixed", m, rng)
    want = _want(x, base, scale, signs, slots)
    w = rng.standard_normal((k, n)).astype(np.float32)
    want_merged = _want(x, x.astype(np.float64) @ w.astype(np.float64), scale, signs, slots)
    for strategy in ("lut", "expand"):
      got = _call(x, bits, scale, slots, base, g, STRATEGIES[strategy], target)
      np.testing.assert_allclose(
        got, want, rtol=RTOL, atol=ATOL, err_msg=f"{label} {strategy} {m}x{k}x{n}"
      )
      got = np.asarray(
        cpu.merged_call(
          jnp.asarray(x),
          jnp.asarray(w),
          jnp.asarray(bits),
          jnp.asarray(scale),
          jnp.asarray(slots),
          group_k=g,
          target=target + "_merged",
          expand_rows=STRATEGIES[strategy],
        )
      )
      np.testing.assert_allclose(
        got, want_merged, rtol=RTOL, atol=ATOL, err_msg=f"{label} merged {strategy} {m}x{k}x{n}"
      )
