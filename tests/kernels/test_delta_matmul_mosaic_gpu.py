"""The Mosaic GPU (Hopper) delta_matmul kernels, without a GPU.

* Numerics: the kernel bodies run in the Mosaic GPU interpreter on CPU (``interpret=True``)
  against a float64 numpy evaluation of ``x·W + α ⊙ (x·S)``: one variant and banks (slot-0
  rows, unsorted and out-of-range ids, unused slots), bf16 and f32, non-tile and tile shapes,
  ``group_k`` 128 and 64 (its smallest), 200 rows, split K, several groups per K step, and the
  `api.delta_matmul` path with its gradient; and part of the shared suite of
  `test_delta_matmul` through the api (a thin subclass).
* Lowering: `jax.jit(...).lower(lowering_platforms=("cuda",))` and `jax.export` of the real
  model's shapes and 4096x4096 must hold the Mosaic GPU custom call and no dense ``W_eff``;
  the same inside `jax.shard_map` over 8 forced host devices (the session's mesh worker: the
  device count is fixed when jax starts).

f32 tolerance: the kernel multiplies in bf16 pieces (x and W split as ``hi + mid + lo``) with
f32 accumulation, so it must be as exact as an f32 dot: ``|y − y64| ≤ 1e-5 · Σ_k |x_k|·(|W_kn|
+ |α_n|)``. An f32 sum over K ≤ 576 terms is off by ``√K·2^-24 ≈ 1.4e-6`` of that magnitude
typically and ``K·2^-24 ≈ 3.4e-5`` at worst; silent TF32 (``2^-11`` per product) or a dropped
piece (``2^-9``) would be 40x over. bf16: the kernel's max error against float64 is at most
1.5x the reference implementation's own (both round an f32 sum to bf16 once).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_delta_matmul import CASES, DeltaMatmulSuite, _ids, make_case

from bitdelta_jax.delta.format import group_k_for, pack, unpack_signs
from pallas_kernels.delta_matmul import api, delta_matmul, delta_matmul_reference
from pallas_kernels.delta_matmul import mosaic_gpu as mg
from pallas_kernels.delta_matmul.config import MosaicConfig

pytestmark = pytest.mark.skipif(
  mg.unavailable_reason(interpret=True) is not None,
  reason=str(mg.unavailable_reason(interpret=True)),
)

F32_REL = 1e-5
BF16_ERR_RATIO = 1.5


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """An exception inside an interpreted kernel leaves the interpreter's state behind."""
  yield
  try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  except ImportError:  # pragma: no cover - another jax layout
    return
  interpret_pallas_call.reset_gpu_interpret_mode_state()


class TestMosaicGpuInterpret(DeltaMatmulSuite):
  """The shared suite through `api.delta_matmul` in the Mosaic GPU interpreter: two of its
  cases (the others overlap the cases below; ~2 s each here), group_k 256, all rows base only."""

  IMPL = "mosaic_gpu"
  INTERPRET = True
  CASES = [c for c in CASES if c[:3] in ((16, 300, 130), (64, 136, 40)) and c[5]]

  @pytest.mark.parametrize("case", CASES, ids=_ids)
  def test_matches_reference(self, case):
    self.check(case)


# --- the kernel's own cases, against float64 --------------------------------------------------


def _case(m, k, n, dtype, bank, *, group_k=128, slots=None, n_slots=4, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) * 0.5).astype(np.float32)
  grans = ["column", "matrix"]
  packs = [
    pack(rng.standard_normal((k, n)).astype(np.float32), grans[i % 2], group_k)
    for i in range(n_slots if bank else 1)
  ]
  scales = [np.broadcast_to(p.scale, (n,)) for p in packs]
  if not bank:
    return x, w, packs[0].bits, packs[0].scale, None, packs[0].group_k, scales
  bits = np.stack([p.bits for p in packs])
  scale = np.stack(scales).astype(np.float32) * 0.1
  scale[0] = 1e3  # slot 0 must never contribute
  if slots is None:
    slots = rng.integers(-2, n_slots + 2, size=m)  # unsorted, with out-of-range ids
  return x, w, bits, scale, np.asarray(slots, np.int32), packs[0].group_k, list(scale)


def _exact(x, w, bits, slots, g, scales):
  """float64 ``y`` and ``Σ_k |x|·(|W| + |α|)`` (the f32 error scale), per row's slot."""
  k, n = w.shape
  x64, w64 = x.astype(np.float64), w.astype(np.float64)
  y, mag = x64 @ w64, np.abs(x64) @ np.abs(w64)
  bank = bits if slots is not None else bits[None]
  rows = slots if slots is not None else np.ones(x.shape[0], int)
  for i, s in enumerate(rows):
    if slots is not None and not 0 < s < len(bank):
      continue
    s_idx = s if slots is not None else 0
    signs = unpack_signs(bank[s_idx], (k, n), g, np.float64)
    alpha = np.asarray(scales[s_idx], np.float64)
    y[i] += alpha * (x64[i] @ signs)
    mag[i] += np.abs(alpha) * np.abs(x64[i]).sum()
  return y, mag


def _check(m, k, n, dtype, bank, *, group_k=128, slots=None, config=None):
  x, w, bits, scale, sl, g, scales = _case(m, k, n, dtype, bank, group_k=group_k, slots=slots)
  xd, wd = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  args = (xd, wd, jnp.asarray(bits), jnp.asarray(scale))
  if bank:
    fn = lambda *a: mg.delta_matmul_bank(*a, group_k=g, config=config, interpret=True)
    args += (jnp.asarray(sl),)
  else:
    fn = lambda *a: mg.delta_matmul_single(*a, group_k=g, config=config, interpret=True)
  got = np.asarray(jax.jit(fn)(*args), np.float64)
  assert got.shape == (m, n)
  # the same math on the dtype-rounded inputs, in float64
  y64, mag = _exact(np.asarray(xd, np.float32), np.asarray(wd, np.float32), bits, sl, g, scales)
  err = np.abs(got - y64)
  if dtype == jnp.float32:
    worst = np.unravel_index(np.argmax(err / mag), err.shape)
    assert np.all(err <= F32_REL * mag), (worst, err[worst], mag[worst])
  else:
    ref_slots = None if sl is None else jnp.asarray(np.where((sl < 0) | (sl >= len(bits)), 0, sl))
    ref = delta_matmul_reference(*args[:4], ref_slots, group_k=g)
    ref_err = np.abs(np.asarray(ref, np.float64) - y64).max()
    assert err.max() <= BF16_ERR_RATIO * ref_err + 1e-6 * np.abs(y64).max(), (err.max(), ref_err)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bank", [False, True], ids=["one", "bank"])
def test_non_tile_shapes_and_out_of_range_slots(dtype, bank):
  # M=17, K=200 (padded to 256), N=40 (padded to 64); ids -2..5 over 4 slots, unsorted
  _check(17, 200, 40, dtype, bank)


@pytest.mark.parametrize(
  "dtype,bank", [(jnp.float32, True), (jnp.bfloat16, False)], ids=["f32-bank", "bf16-one"]
)
def test_smallest_group_k_64(dtype, bank):
  # 64-row groups (as the real model's K=576 gets), 3 K steps
  _check(3, 192, 64, dtype, bank, group_k=64, slots=[2, 0, 2])


def test_200_rows_two_m_tiles():
  _check(200, 136, 24, jnp.bfloat16, True)


def test_tile_multiples_pass_unpadded():
  _check(64, 256, 128, jnp.bfloat16, False)


def test_split_k_groups_per_step_and_wide_tiles():
  # 4 groups of 128: 2 K steps of 2 groups, one per split; 128 columns per CTA
  cfg = MosaicConfig(block_m=64, block_n=128, groups_per_step=2, num_stages=2, split_k=2)
  _check(5, 512, 100, jnp.float32, True, config=cfg)


def test_unsupported_group_size_says_why():
  assert "multiple of 64" in mg.shapes_supported((2, 72), (72, 64), (9, 64), 72)
  assert mg.shapes_supported((2, 576), (576, 1536), (72, 1536), 64) is None
  x, w, bits, scale, _ = make_case(2, 72, 64, jnp.float32, "matrix", False)
  with pytest.raises(NotImplementedError, match="multiple of 64"):
    mg.delta_matmul_single(x, w, bits, scale, group_k=72, interpret=True)


def test_api_path_and_reference_gradient():
  x, w, bits, scale, _ = make_case(3, 200, 40, jnp.float32, "column", False)
  f = lambda x, w, s: delta_matmul(x, w, bits, s, implementation="mosaic_gpu", interpret=True)
  ref = lambda x, w, s: delta_matmul_reference(x, w, bits, s)
  y, vjp = jax.vjp(jax.jit(f), x, w, scale)
  y_ref, vjp_ref = jax.vjp(ref, x, w, scale)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-5, atol=2e-4)
  for g, g_ref in zip(vjp(jnp.ones_like(y)), vjp_ref(jnp.ones_like(y)), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6, atol=1e-6)


# --- dispatch -------------------------------------------------------------------------------


def test_dispatch_and_lowering_platform():
  if jax.default_backend() == "cpu":
    assert "lowering_platform" in api.unavailable_reason("mosaic_gpu")
  assert api.unavailable_reason("mosaic_gpu", interpret=True) is None
  with api.lowering_platform("cuda"):
    assert api.target_platform() == "cuda"
    assert api.unavailable_reason("mosaic_gpu") is None
    assert api._PREFERENCE[api.target_platform()][0] == "mosaic_gpu"
  assert ("pallas_triton" in api._PREFERENCE["cuda"]) == (jax.__version_info__ < (0, 11))


def test_dispatch_falls_through_when_the_kernel_refuses_a_shape():
  # K=72: one 72-row group, which the Mosaic GPU kernel refuses; the next GPU choice lowers
  x, w, bits, scale, _ = make_case(2, 72, 64, jnp.bfloat16, "matrix", False)
  with api.lowering_platform("cuda"):
    text = (
      jax.jit(lambda *a: delta_matmul(*a))
      .trace(x, w, bits, scale)
      .lower(lowering_platforms=("cuda",))
      .as_text()
    )
  assert mg.CUSTOM_CALL_TARGET not in text


def test_heuristic_configs_fit_shared_memory():
  for m in (1, 8, 64, 200, 1024):
    for k, n in ((576, 1536), (1536, 576), (4096, 4096), (200, 72), (576, 49152)):
      for itemsize in (2, 4):
        g = group_k_for(k, 128)
        cfg = MosaicConfig.heuristic(m, k, n, g, itemsize)
        steps = -(-k // g) // cfg.groups_per_step
        assert steps % cfg.split_k == 0, cfg
        for banked in (False, True):
          assert cfg.smem_bytes(g, itemsize, banked) <= 200 * 1024, (m, k, n, itemsize, cfg)


# --- lowering for CUDA without a GPU ----------------------------------------------------------

_RESULT = re.compile(r"->\s*(.*)$|:\s*(tensor<[^>]*>)\s*$")
_TENSOR = re.compile(r"tensor<((?:\d+x)+)(\w+)>")


def _dense_results(text: str, min_elements: int) -> list[str]:
  """Ops whose result is a float tensor of ``>= min_elements`` (a [K, N] ``W_eff`` would be)."""
  hits = []
  for line in text.splitlines():
    line = line.strip()
    if not line.startswith("%") or "custom_call" in line:
      continue
    m = _RESULT.search(line)
    for dims, dt in _TENSOR.findall((m.group(1) or m.group(2)) if m else ""):
      size = int(np.prod([int(d) for d in dims.rstrip("x").split("x")]))
      if dt in ("f32", "bf16", "f16") and size >= min_elements:
        hits.append(line[:160])
  return hits


def _abstract(m, k, n, dtype, bank, n_slots=4):
  g = group_k_for(k, 128)
  rows = -(-k // g) * g // 8
  sds = jax.ShapeDtypeStruct
  if bank:
    args = (
      sds((m, k), dtype),
      sds((k, n), dtype),
      sds((n_slots, rows, n), jnp.uint8),
      sds((n_slots, n), jnp.float32),
      sds((m,), jnp.int32),
    )
    return (lambda *a: mg.delta_matmul_bank(*a, group_k=g)), args
  args = (sds((m, k), dtype), sds((k, n), dtype), sds((rows, n), jnp.uint8), sds((n,), jnp.float32))
  return (lambda *a: mg.delta_matmul_single(*a, group_k=g)), args


@pytest.mark.parametrize(
  "m,k,n,dtype,bank",
  [
    (1, 576, 1536, jnp.bfloat16, False),  # SmolLM2 q/gate/up at decode
    (8, 1536, 576, jnp.bfloat16, True),  # SmolLM2 down, mixed variants
    (1, 4096, 4096, jnp.bfloat16, False),
    (64, 4096, 4096, jnp.bfloat16, True),
    (8, 576, 1536, jnp.float32, True),
  ],
)
def test_lowers_for_cuda_with_no_dense_weights(m, k, n, dtype, bank):
  fn, args = _abstract(m, k, n, dtype, bank)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(f"stablehlo.custom_call @{mg.CUSTOM_CALL_TARGET}(") == 1
  assert _dense_results(text, k * n) == []
  # the packed bits go into the kernel as they are: no op outside it computes on them
  assert not re.search(r"stablehlo\.(shift_right_logical|and|convert)[^\n]*xui8>", text)


def test_dense_check_finds_an_unpacked_delta():
  """The check above can fail: the reference forms ``[K, N]`` signs outside any kernel."""
  fn = lambda x, w, b, s: delta_matmul_reference(x, w, b, s, group_k=64)
  _, args = _abstract(1, 576, 1536, jnp.bfloat16, False)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert _dense_results(text, 576 * 1536)


def test_export_and_api_dispatch_for_cuda():
  fn, args = _abstract(1, 576, 1536, jnp.bfloat16, False)
  exp = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
  assert exp.platforms == ("cuda",)
  assert mg.CUSTOM_CALL_TARGET in exp.mlir_module()
  with api.lowering_platform("cuda"):
    lowered = (
      jax.jit(lambda *a: delta_matmul(*a, group_k=64))
      .trace(*args)
      .lower(lowering_platforms=("cuda",))
    )
  assert mg.CUSTOM_CALL_TARGET in lowered.as_text()


@pytest.mark.mesh  # the session's 8-device worker (tests/mesh/kernel_lowering.py)
def test_lowers_inside_shard_map_over_8_devices(mesh_worker):
  res = mesh_worker.call("mesh/kernel_lowering.py:delta_matmul")
  assert res == {"devices": 8, "calls": 1, "partitions": ["8"], "export_devices": 8}, res
