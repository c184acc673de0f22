"""The Mosaic GPU (Hopper) quantized-base kernels (`quant_matmul.mosaic_gpu`), without a GPU.

* Numerics: the kernel bodies run in the Mosaic GPU interpreter against float64 numpy over the
  ``gguf`` package's own dequantization of the same bytes (`to_ggml_rows`), for Q8_0, Q4_0 and
  Q4_1, shapes that are not tile multiples (M 5 or 66, K 192, N 40), and every slot
  layout: the plain product, one variant, a bank with rows of several slots (unsorted, slot 0
  holding bits and a huge α that must not be read, ids out of range), a bank whose rows are all
  base rows, and a slot without a delta (zero bits and α) whose rows must equal the base.
  The kernel's definition is ``x · round(W)`` (W rounded once to x's dtype) with f32 sums, so
  it is compared with float64 ``x · round(W) + α ⊙ (x · S)``: ``|y − y64| ≤ 1e-5 · Σ_k |x_k|
  (|round(W)_kn| + |α_n|)`` (an f32 sum of K = 192 terms is off by ~K·2^-24 = 1.1e-5 of that
  at worst, ~√K·2^-24 = 8e-7 typically; a wrong scale, nibble or slot is off by O(1)). Against
  the f32 definition ``x · W`` the rounding adds at most ``u · Σ_k |x_k||W_kn|`` (``u`` = 2^-9
  bf16, 2^-12 f16), also checked. Through `api.quant_matmul`: the same, the gradient (the
  reference's), and dispatch (Mosaic GPU first under CUDA, reasons otherwise).
* Lowering: each kernel for CUDA (`lower(lowering_platforms=("cuda",))`) at SmolLM2's shapes and
  4096 x 4096; a GGUF-style model's whole serving step (`quant_lowering`) on one device and over
  8 forced host devices (a subprocess): Mosaic GPU calls present, and no op outside a kernel
  computes on the blocks or bits (no dense dequantized weight); the same check finds the
  reference's dequantization.
"""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quant_lowering as ql
from test_delta_matmul_mosaic_gpu import _fresh_interpreter  # noqa: F401 (autouse fixture)

from bitdelta_jax.delta.format import pack, unpack_signs
from pallas_kernels.bits import group_k_for
from pallas_kernels.platform import lowering_platform
from pallas_kernels.quant_matmul import api, blocks
from pallas_kernels.quant_matmul import mosaic_gpu as qmg

pytestmark = pytest.mark.skipif(
  qmg.unavailable_reason(interpret=True) is not None,
  reason=str(qmg.unavailable_reason(interpret=True)),
)

F32_REL = 1e-5
ROUNDING = {jnp.dtype(jnp.bfloat16): 2.0**-9, jnp.dtype(jnp.float16): 2.0**-12}
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}


def _case(m, k, n, fmt, layout, *, n_slots=4, seed=0):
  """x, blocks, bits/scale/slot_ids for ``layout``, and the slot of each row (None: base)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) * 0.5 + (0.3 if fmt == "q4_1" else 0)).astype(np.float32)
  qk = blocks.quantize(w, fmt)
  if layout == "plain":
    return x, qk, None, None, None, [None] * m
  packs = [pack(rng.standard_normal((k, n)).astype(np.float32), ("column", "matrix")[i % 2], 128)
           for i in range(n_slots)]
  scales = np.stack([np.broadcast_to(p.scale, (n,)) for p in packs]).astype(np.float32) * 0.1
  bits = np.stack([p.bits for p in packs])
  if layout == "single":
    return x, qk, bits[1], scales[1], None, [1] * m
  scales[0] = 1e3  # slot 0 must never be read
  if layout == "no_delta_slot":  # slot 2 is loaded but has no delta for this tensor
    bits[2], scales[2] = 0, 0.0
    slots = rng.choice([0, 1, 2], size=m)
  elif layout == "base_rows":
    slots = np.zeros(m, int)
  else:  # several slots, unsorted, ids out of range (base only)
    slots = rng.integers(-2, n_slots + 2, size=m)
  rows = [s if 0 < s < n_slots else None for s in slots]
  return x, qk, bits, scales, np.asarray(slots, np.int32), rows


def _exact(x, qk, bits, scales, rows, dtype):
  """float64 (y over round(W), y over W, Σ|x|(|round(W)| + |α|), Σ|x||W|) for each row."""
  k, n = qk.shape
  w = gguf.quants.dequantize(blocks.to_ggml_rows(qk), QTYPE[qk.format]).reshape(n, k).T
  w = w.astype(np.float64)
  w_r = np.asarray(jnp.asarray(w, dtype), np.float64)
  x64 = np.asarray(jnp.asarray(x, dtype), np.float64)
  y_r, y, mag, mag_w = x64 @ w_r, x64 @ w, np.abs(x64) @ np.abs(w_r), np.abs(x64) @ np.abs(w)
  g = group_k_for(k, 128)
  for i, s in enumerate(rows):
    if s is None:
      continue
    b = bits if bits.ndim == 2 else bits[s]
    alpha = np.asarray(scales if scales.ndim == 1 else scales[s], np.float64)
    d = alpha * (x64[i] @ unpack_signs(b, (k, n), g, np.float64))
    y_r[i] += d
    y[i] += d
    mag[i] += np.abs(alpha) * np.abs(x64[i]).sum()
    mag_w[i] += np.abs(alpha) * np.abs(x64[i]).sum()
  return y_r, y, mag, mag_w


def _check(got, x, qk, bits, scales, rows, dtype):
  y_r, y, mag, mag_w = _exact(x, qk, bits, scales, rows, dtype)
  got = np.asarray(got, np.float64)
  assert got.shape == y.shape
  err = np.abs(got - y_r)
  worst = np.unravel_index(np.argmax(err / mag), err.shape)
  assert np.all(err <= F32_REL * mag), (worst, err[worst], mag[worst])
  # against the f32 definition: at most the rounding of each weight to x's dtype
  bound = ROUNDING[jnp.dtype(dtype)] * mag_w + F32_REL * mag
  assert np.all(np.abs(got - y) <= bound)
  return got


def _run(x, qk, bits, scales, slots, dtype, **kw):
  g = group_k_for(qk.shape[0], 128)
  args = [jnp.asarray(x, dtype), jax.tree.map(jnp.asarray, qk)]
  if bits is not None:
    args += [jnp.asarray(bits), jnp.asarray(scales)]
    if slots is not None:
      args.append(jnp.asarray(slots))
  fn = lambda x, q, *rest: qmg.quant_matmul_mosaic(x, q, *rest, group_k=g, interpret=True, **kw)
  return jax.jit(fn)(*args)


@pytest.mark.parametrize("fmt,layout", [
  ("q8_0", "plain"), ("q4_0", "plain"), ("q4_1", "plain"),  # each format's dequantization
  ("q4_1", "single"), ("q8_0", "several_slots"), ("q4_0", "several_slots"),
])
def test_formats_and_slot_layouts_at_non_tile_shapes(fmt, layout):
  # M=5, K=192 (64-row groups: 3 K steps), N=40 (padded to a 64-column tile)
  case = _case(5, 192, 40, fmt, layout)
  x, qk, bits, scales, slots, rows = case
  _check(_run(x, qk, bits, scales, slots, jnp.bfloat16), x, qk, bits, scales, rows, jnp.bfloat16)


@pytest.mark.parametrize("fmt,layout", [("q4_0", "base_rows"), ("q8_0", "no_delta_slot")])
def test_base_rows_only_and_a_slot_without_delta(fmt, layout):
  x, qk, bits, scales, slots, rows = _case(6, 192, 40, fmt, layout, seed=1)
  got = _check(_run(x, qk, bits, scales, slots, jnp.bfloat16), x, qk, bits, scales, rows,
               jnp.bfloat16)
  base = np.asarray(_run(x, qk, None, None, None, jnp.bfloat16), np.float64)
  for i, s in enumerate(slots):  # rows of slot 0 and of the empty slot: exactly the base
    if s in (0, 2):
      np.testing.assert_array_equal(got[i], base[i])


def test_two_m_tiles_f16():
  # 66 rows (two 64-row tiles) over a bank, f16 activations
  x, qk, bits, scales, slots, rows = _case(66, 192, 40, "q4_1", "several_slots", seed=2)
  _check(_run(x, qk, bits, scales, slots, jnp.float16), x, qk, bits, scales, rows, jnp.float16)


def test_api_path_and_reference_gradient():
  x, qk, bits, scales, _, rows = _case(3, 192, 40, "q4_1", "single", seed=3)
  qj = jax.tree.map(jnp.asarray, qk)
  xb = jnp.asarray(x, jnp.bfloat16)
  g = group_k_for(192, 128)

  def f(x, s):
    return api.quant_matmul(x, qj, jnp.asarray(bits), s, group_k=128, interpret=True,
                            implementation="mosaic_gpu", preferred_element_type=jnp.float32)

  y, vjp = jax.vjp(jax.jit(f), xb, jnp.asarray(scales))
  _check(y, x, qk, bits, scales, rows, jnp.bfloat16)
  ref = lambda x, s: api.quant_matmul(x, qj, jnp.asarray(bits), s, group_k=g,  # noqa: E731
                                      implementation="reference",
                                      preferred_element_type=jnp.float32)
  _, vjp_ref = jax.vjp(ref, xb, jnp.asarray(scales))
  ct = jnp.ones_like(y)
  for a, b in zip(vjp(ct), vjp_ref(ct), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- dispatch -------------------------------------------------------------------------------


def _abstract_qk(fmt, k, n):
  return blocks.abstract(fmt, (k, n))


def test_dispatch_reasons():
  sds = jax.ShapeDtypeStruct
  qk = _abstract_qk("q4_0", 576, 1536)
  x = sds((4, 576), jnp.bfloat16)
  if jax.default_backend() == "cpu":
    assert "mosaic_gpu" not in api.fallback_reasons(x, qk)
    assert "target platform is 'cpu'" in api.unavailable_reason("mosaic_gpu", x, qk)
    with pytest.raises(RuntimeError, match="Mosaic GPU kernels need a CUDA GPU"):
      api.quant_matmul(jnp.zeros((4, 576), jnp.bfloat16), blocks.quantize(
        np.zeros((576, 64), np.float32), "q4_0"), group_k=128, implementation="mosaic_gpu")
  with lowering_platform("cuda"):
    assert api.fallback_reasons(x, qk) == {"mosaic_gpu": None, "reference": None}
    assert "bfloat16 or float16" in api.fallback_reasons(sds((4, 576), jnp.float32), qk)[
      "mosaic_gpu"]
    bits = sds((96 // 8, 64), jnp.uint8)  # K=96: one 96-row group
    why = api.unavailable_reason("mosaic_gpu", sds((1, 96), jnp.bfloat16),
                                 _abstract_qk("q8_0", 96, 64), bits, 128)
    assert "multiple of 64" in why
  assert api.unavailable_reason("mosaic_gpu", x, qk, interpret=True) is None


def test_dispatch_picks_the_kernel_under_cuda_and_falls_back_for_f32():
  qk = _abstract_qk("q8_0", 576, 1536)
  sds = jax.ShapeDtypeStruct

  def lower(dtype):
    with lowering_platform("cuda"):
      return (jax.jit(lambda x, q: api.quant_matmul(x, q, group_k=128))
              .trace(sds((2, 576), dtype), qk).lower(lowering_platforms=("cuda",)).as_text())

  assert "bitdelta_quant_matmul" in lower(jnp.bfloat16)
  text = lower(jnp.float32)  # the reference: a dequantized copy, no kernel
  assert qmg.CUSTOM_CALL_TARGET not in text
  assert ql.dequantized_outside(text, {1536})


# --- lowering for CUDA without a GPU ----------------------------------------------------------


@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("m,k,n,layout", [
  (1, 576, 1536, "plain"),  # SmolLM2 q/gate/up at decode, base rows
  (8, 1536, 576, "bank"),  # SmolLM2 down, mixed variants
  (1, 4096, 4096, "single"),
  (512, 4096, 4096, "bank"),  # a prefill chunk
])
def test_kernels_lower_for_cuda_with_no_dequantized_weights(fmt, m, k, n, layout):
  sds = jax.ShapeDtypeStruct
  g = group_k_for(k, 128)
  args = [sds((m, k), jnp.bfloat16), _abstract_qk(fmt, k, n)]
  if layout == "single":
    args += [sds((k // 8, n), jnp.uint8), sds((n,), jnp.float32)]
  elif layout == "bank":
    args += [sds((3, k // 8, n), jnp.uint8), sds((3, n), jnp.float32), sds((m,), jnp.int32)]
  fn = lambda *a: qmg.quant_matmul_mosaic(*a, group_k=g)  # noqa: E731
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(f"stablehlo.custom_call @{qmg.CUSTOM_CALL_TARGET}(") == 1
  assert ql.dequantized_outside(text, {n}) == []


@pytest.fixture(scope="module")
def quant_runner():
  return ql.build_runner("q4_1")


@pytest.mark.slow  # builds a model and lowers whole steps (~10 s each)
@pytest.mark.parametrize("tokens,base_only", [(32, False), (1, True)])
def test_whole_step_of_a_gguf_model_lowers_for_cuda(quant_runner, tokens, base_only):
  runner, cfg = quant_runner
  (row,) = ql.report(runner, cfg, [(tokens, base_only)])
  kernels = " ".join(row["kernels"])
  assert row["custom_calls"].get(qmg.CUSTOM_CALL_TARGET, 0) >= 2, row
  assert "bitdelta_quant_matmul" in kernels  # the tied LM head over the blocks
  assert ("bitdelta_quant_bank_matmul" in kernels) != base_only
  assert row["dequantized"] == [], row["dequantized"][:5]
  assert not [c for c in row["custom_calls"] if c.startswith("bitdelta")], row["custom_calls"]


@pytest.mark.slow
def test_the_check_finds_the_reference_dequantizing(quant_runner, monkeypatch):
  runner, cfg = quant_runner
  monkeypatch.setitem(api._PREFERENCE, "cuda", ("reference",))
  (row,) = ql.report(runner, cfg, [(16, False)])  # a shape not traced before (jit's cache)
  assert qmg.KERNEL_NAMES[2] not in " ".join(row["kernels"])
  assert len(row["dequantized"]) >= 7  # every layer's q/k/v/o/gate/up/down and the head


@pytest.mark.mesh  # the session's 8-device worker
def test_whole_step_lowers_over_8_devices(mesh_worker):
  res = mesh_worker.call("kernels/quant_lowering.py:mesh_report", "data=1,model=8", "q8_0", [32])
  assert res["devices"] == 8
  for row in res["rows"]:
    assert row["partitions"] == ["8"], row
    assert row["custom_calls"].get(qmg.CUSTOM_CALL_TARGET, 0) >= 2, row
    assert "bitdelta_quant_bank_matmul" in " ".join(row["kernels"]), row
    assert row["dequantized"] == [], row["dequantized"][:5]
