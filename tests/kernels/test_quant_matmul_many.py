"""Several products of one x in one call of the quantized CPU rows kernel (`cpu_rows.
rows_call_many`, a layer's q/k/v or gate/up): each result equals its own `rows_call` bit for
bit (int8 and f32 activations, every format, plain and with a slot bank, decode rows, 16-row
passes, strips and AMX tiles), matches float64 numpy, has the reference's gradients; the api
(`quant_matmul_many`) falls back to one call each where the kernel does not take them; a GGUF
model's step has one kernel call for q/k/v and one for gate/up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matmul_int8 import _case, _check, want_int8

from pallas_kernels.bits import group_k_for, packed_rows
from pallas_kernels.quant_matmul import api, blocks, cpu_rows

pytestmark = pytest.mark.skipif(cpu_rows.unavailable_reason() is not None,
                                reason=f"kernel: {cpu_rows.unavailable_reason()}")
K, NS = 576, (576, 192, 203)  # SmolLM2's q/k/v widths, and an odd one


def _products(fmt, m, s=3, seed=0):
  """x [m, K], three weights of one format, a bank of s slots per weight, the slot ids."""
  rng = np.random.default_rng(seed)
  qks, bits, scales = [], [], []
  for i, n in enumerate(NS):
    g, qk, x, b, sc = _case(fmt, m, K, n, s, seed=seed * 7 + i)
    qks.append(qk)
    bits.append(b)
    scales.append(sc)
  x = rng.standard_normal((m, K)).astype(np.float32)
  x[:, :32] *= 1e-3
  slots = (np.arange(m) % s).astype(np.int32)
  return group_k_for(K), x, qks, bits, scales, slots


@pytest.mark.parametrize("act", ["int8", "f32"])
@pytest.mark.parametrize("bank", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 130])
@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_each_result_is_its_own_calls_bits(fmt, m, bank, act):
  g, x, qks, bits, scales, slots = _products(fmt, m, seed=m)
  qj = [jax.tree.map(jnp.asarray, q) for q in qks]
  many = jax.jit(lambda x, q, b, s, i: cpu_rows.rows_call_many(
    x, q, b, s, i, group_k=g, activations=act))
  one = jax.jit(lambda x, q, *a: cpu_rows.rows_call(x, q, *a, group_k=g, activations=act))
  if bank:
    got = many(x, qj, bits, scales, jnp.asarray(slots))
    want = [one(x, q, b, s, jnp.asarray(slots)) for q, b, s in zip(qj, bits, scales)]
  else:
    got = many(x, qj, None, None, None)
    want = [one(x, q) for q in qj]
  assert len(got) == 3
  for a, b, n in zip(got, want, NS):
    assert a.shape == (m, n) and a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if act == "int8":  # and the arithmetic itself, against float64 numpy
    for a, qk, b, s in zip(got, qks, bits, scales):
      ref = want_int8(x, qk, b, s, slots, g) if bank else want_int8(x, qk)
      _check(a, *ref[:2])


def test_gradients_are_the_references():
  g, x, qks, bits, scales, slots = _products("q4_1", 4)
  qj = [jax.tree.map(jnp.asarray, q) for q in qks]
  ids = jnp.asarray(slots)
  w = [jnp.asarray(np.random.default_rng(i).standard_normal((4, n)), jnp.float32)
       for i, n in enumerate(NS)]

  def loss(fn, x, sc):
    return sum(jnp.sum(y * wi) for y, wi in zip(fn(x, sc), w))

  many = lambda x, sc: cpu_rows.rows_call_many(x, qj, bits, sc, ids, group_k=g,  # noqa: E731
                                               activations="f32")
  ref = lambda x, sc: [api.quant_matmul_reference(x, q, b, s, ids, group_k=g)  # noqa: E731
                       for q, b, s in zip(qj, bits, sc)]
  sc = [jnp.asarray(s) for s in scales]
  gx, gs = jax.grad(lambda x, sc: loss(many, x, sc), argnums=(0, 1))(jnp.asarray(x), sc)
  rx, rs = jax.grad(lambda x, sc: loss(ref, x, sc), argnums=(0, 1))(jnp.asarray(x), sc)
  np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
  for a, b in zip(gs, rs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_api_falls_back_to_one_call_each():
  g, x, qks, bits, scales, slots = _products("q4_0", 3)
  qj = [jax.tree.map(jnp.asarray, q) for q in qks]
  mixed = [qj[0], jax.tree.map(jnp.asarray, blocks.quantize(
    np.random.default_rng(5).standard_normal((K, 64)).astype(np.float32), "q8_0"))]
  assert "several formats" in cpu_rows.many_unavailable_reason(jnp.asarray(x), mixed)
  f = jax.jit(lambda x: api.quant_matmul_many(x, mixed, group_k=g))
  got = f(jnp.asarray(x))
  want = [api.quant_matmul(jnp.asarray(x), q, group_k=g) for q in mixed]
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = f.lower(jnp.asarray(x)).as_text()
  assert "bitdelta_quant_rows_many" not in text and text.count("bitdelta_quant_rows") == 2
  same = jax.jit(lambda x: api.quant_matmul_many(x, qj, group_k=g)).lower(jnp.asarray(x))
  assert same.as_text().count("bitdelta_quant_rows_many") == 1


def test_bad_operands_are_refused():
  g, x, qks, bits, scales, slots = _products("q4_0", 2)
  qj = [jax.tree.map(jnp.asarray, q) for q in qks]
  short = [b[:, : packed_rows(K, g) // 2] for b in bits]
  with pytest.raises(Exception, match="bits"):
    jax.block_until_ready(cpu_rows.rows_call_many(jnp.asarray(x), qj, short, scales,
                                                  jnp.asarray(slots), group_k=g))
