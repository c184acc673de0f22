"""The packed 1-bit embedding / LM-head bank on GPU (`pallas_kernels.lm_head.mosaic_gpu`), without
a GPU: the bank product ``base + α[s] ⊙ (h · S[s])`` in the Mosaic GPU interpreter against a
float64 numpy evaluation and the reference, in every slot layout (base rows, rows of several
slots, a slot without a delta, all rows base); its gradient (the reference's); the dispatch
under ``lowering_platform("cuda")``; and its CUDA lowering at SmolLM2's head (V = 49152): one
Mosaic GPU call, no sign matrix unpacked outside it.

f32 tolerance (as the delta GEMM's, `test_delta_matmul_mosaic_gpu`): h is split into three bf16
pieces and multiplied by the exact ±1 signs with f32 sums, so ``|y − y64| ≤ 1e-5 · Σ_k |h_k| ·
|α_n|``; silent TF32 (``2^-11`` per product) or a dropped piece (``2^-9``) is far over.
"""

from __future__ import annotations

import cuda_lowering as cl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bits import group_k_for, pack_bits, unpack_signs
from pallas_kernels.lm_head import api
from pallas_kernels.lm_head import mosaic_gpu as head_gpu
from pallas_kernels.platform import lowering_platform

pytestmark = pytest.mark.skipif(head_gpu.unavailable_reason(interpret=True) is not None,
                                reason=str(head_gpu.unavailable_reason(interpret=True)))

F32_REL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """An exception inside an interpreted kernel leaves the interpreter's state behind."""
  yield
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  interpret_pallas_call.reset_gpu_interpret_mode_state()


def _bank(rng, d, v, n_slots, *, empty=(1,)):
  """bits [S, D_pad/8, V], α [S, V]: slot 0 and the ``empty`` slots all zero (no delta)."""
  g = group_k_for(d)
  bits = np.zeros((n_slots, -(-d // g) * g // 8, v), np.uint8)
  scale = np.zeros((n_slots, v), np.float32)
  for s in range(1, n_slots):
    if s in empty:
      continue
    bits[s] = np.asarray(pack_bits(rng.random((d, v)) < 0.5, d, g))
    scale[s] = rng.uniform(0.001, 0.05, v)
  return bits, scale, g


def _exact(base, h, bits, scale, slots, g):
  """float64: base + α[s] · (h · S[s]) for rows with s > 0 and a delta; and the error bound."""
  d, v = h.shape[1], base.shape[1]
  out = np.array(base, np.float64)
  bound = np.zeros_like(out)
  for m, s in enumerate(slots):
    if s <= 0 or s >= bits.shape[0] or not np.any(scale[s]):
      continue
    signs = np.asarray(unpack_signs(bits[s], (d, v), g), np.float64)
    out[m] += scale[s] * (np.asarray(h[m], np.float64) @ signs)
    bound[m] = F32_REL * np.abs(h[m]).sum() * np.abs(scale[s])
  return out, bound


LAYOUTS = {
  "base_and_slots": [0, 2, 2, 3, 0, 1, 3],  # slot 1 holds no delta
  "one_slot": [3, 3, 3],
  "all_base": [0, 0, 1, 0],  # the kernel is skipped by the api's lax.cond
  "unsorted_many": [2, 0, 3, 1, 2, 3, 0, 2, 1, 3, 2],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("d,v", [(64, 40), (128, 72)])
def test_bank_matches_float64_and_the_reference(layout, d, v):
  rng = np.random.default_rng(d + v)
  slots = np.asarray(LAYOUTS[layout], np.int32)
  bits, scale, g = _bank(rng, d, v, 4)
  h = rng.standard_normal((len(slots), d)).astype(np.float32)
  base = rng.standard_normal((len(slots), v)).astype(np.float32)
  got = api.add_packed_products(jnp.asarray(base), jnp.asarray(h), jnp.asarray(bits),
                                jnp.asarray(scale), jnp.asarray(slots), group_k=g,
                                implementation="mosaic_gpu", interpret=True)
  want, bound = _exact(base, h, bits, scale, slots, g)
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= bound + 1e-6), (err - bound).max()
  ref = api.add_packed_products(jnp.asarray(base), jnp.asarray(h), jnp.asarray(bits),
                                jnp.asarray(scale), jnp.asarray(slots), group_k=g,
                                implementation="reference")
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  # base rows (slot 0, a slot without a delta) are the base logits exactly
  plain = np.isin(slots, [0, 1])
  np.testing.assert_array_equal(np.asarray(got)[plain], base[plain])


def test_kernel_entry_without_the_api_and_out_of_range_slots():
  """`mosaic_gpu.packed_products` straight: negative ids and ids past the bank are base rows."""
  rng = np.random.default_rng(5)
  bits, scale, g = _bank(rng, 64, 33, 3, empty=())
  slots = np.asarray([2, -1, 1, 7, 2], np.int32)
  h = rng.standard_normal((5, 64)).astype(np.float32)
  base = rng.standard_normal((5, 33)).astype(np.float32)
  got = head_gpu.packed_products(jnp.asarray(base), jnp.asarray(h), jnp.asarray(bits),
                                 jnp.asarray(scale), jnp.asarray(slots), group_k=g, interpret=True)
  want, bound = _exact(base, h, bits, scale, np.where(slots >= 3, 0, slots), g)
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-6)


def test_gradient_is_the_references():
  rng = np.random.default_rng(2)
  bits, scale, g = _bank(rng, 64, 40, 3, empty=())
  h = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
  base = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
  slots = jnp.asarray([1, 0, 2, 1], jnp.int32)

  def loss(impl, **kw):
    return lambda b, x, a: jnp.sum(w * api.add_packed_products(
      b, x, jnp.asarray(bits), a, slots, group_k=g, implementation=impl, **kw))

  got = jax.grad(loss("mosaic_gpu", interpret=True), argnums=(0, 1, 2))(base, h,
                                                                         jnp.asarray(scale))
  want = jax.grad(loss("reference"), argnums=(0, 1, 2))(base, h, jnp.asarray(scale))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dispatch_names_its_reasons():
  h, bits = (8, 576), (3, 72, 49152)
  cpu_reasons = api.packed_fallback_reasons(h, bits, 64)
  assert "target platform is 'cpu'" in cpu_reasons["mosaic_gpu"]
  with lowering_platform("cuda"):
    reasons = api.packed_fallback_reasons(h, bits, 64)
    assert reasons["mosaic_gpu"] is None
    assert "target platform is 'cuda'" in reasons["cpu"]
    # a group size the kernel cannot expand: the reference, with the reason
    odd = api.packed_fallback_reasons((8, 96), (3, 12, 100), 96)
    assert "multiple of 64" in odd["mosaic_gpu"] and odd["reference"] is None
  with pytest.raises(RuntimeError, match="cannot run"):
    api.add_packed_products(jnp.zeros((1, 40)), jnp.zeros((1, 64)),
                            jnp.zeros((2, 8, 40), jnp.uint8), jnp.zeros((2, 40)),
                            jnp.zeros((1,), jnp.int32), group_k=64, implementation="mosaic_gpu")


def test_lowers_for_cuda_at_smollm2s_head_without_unpacking():
  m, d, v, s = 32, 576, 49152, 3
  args = (jax.ShapeDtypeStruct((m, v), jnp.float32), jax.ShapeDtypeStruct((m, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((s, d // 8, v), jnp.uint8), jax.ShapeDtypeStruct((s, v), jnp.float32),
          jax.ShapeDtypeStruct((m,), jnp.int32))
  fn = lambda *a: api.add_packed_products(*a, group_k=group_k_for(d))  # noqa: E731
  with lowering_platform("cuda"):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert cl.custom_calls(text) == {"mosaic_gpu_v2": 1}
  assert head_gpu.KERNEL_NAME in text
  assert cl.unpacked_bits(text, d // 8 * 64) == []  # not even 64 columns' signs
  # the check finds the reference's unpacking of the same call
  ref = jax.jit(lambda *a: api.add_packed_products(*a, group_k=64, implementation="reference"))
  assert cl.unpacked_bits(ref.trace(*args).lower().as_text(), d // 8 * v)
