"""Kernels own their choice: each `pallas_kernels` api picks its backend and names why it passed
over the ones before it; the model's layers call one api per op and run what the api picks."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bitdelta_jax.models.layers import DeltaDense, Embed, LMHead
from pallas_kernels.bits import group_k_for, packed_rows
from pallas_kernels.delta_matmul import api as delta_api
from pallas_kernels.delta_matmul import cpu as delta_cpu
from pallas_kernels.delta_matmul import cpu_rows
from pallas_kernels.delta_matmul.reference import delta_matmul_reference
from pallas_kernels.lm_head import api as head_api
from pallas_kernels.lm_head.reference import packed_products_reference
from pallas_kernels.platform import lowering_platform
from pallas_kernels.small_matmul import api as small_api

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS_OK = cpu_rows.usable(1, jnp.float32, jnp.float32)
needs_rows = pytest.mark.skipif(not ROWS_OK, reason="the CPU rows kernel cannot run here")


def _targets(fn, *args) -> set[str]:
  """The FFI targets a traced ``fn`` calls (both branches of every cond included)."""
  return set(re.findall(r"target_name=(\w+)", str(jax.make_jaxpr(fn)(*args))))


# --- every api says why it fell back -------------------------------------------------------------


def test_delta_matmul_names_why_it_passed_over_the_few_rows_kernel(monkeypatch):
  w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  many = jax.ShapeDtypeStruct((cpu_rows.MAX_ROWS + 1, 64), jnp.float32)
  assert "1 to 16" in delta_api.fallback_reasons(many, w)["cpu_rows"]
  ints = jax.ShapeDtypeStruct((1, 64), jnp.int8)
  assert "f32 or bf16" in delta_api.fallback_reasons(ints, w)["cpu_rows"]
  monkeypatch.setenv("BITDELTA_CPU_ROWS", "0")
  one = jax.ShapeDtypeStruct((1, 64), jnp.float32)
  assert "BITDELTA_CPU_ROWS=0" in delta_api.fallback_reasons(one, w)["cpu_rows"]
  with lowering_platform("cuda"):
    reasons = delta_api.fallback_reasons(one, w)
  assert "cpu_rows" not in reasons and list(reasons)[-1] == "xla"
  assert delta_api.unavailable_reason("cpu_rows") is None or "cpu" in delta_api.unavailable_reason(
    "cpu_rows").lower()


def test_small_matmul_names_why_it_fell_back(monkeypatch):
  reasons = small_api.fallback_reasons(1, jnp.float32, jnp.float32)
  assert "1 rows" in reasons["cpu"] and "bf16" in reasons["cpu_bf16"] and reasons["xla"] is None
  monkeypatch.setenv("BITDELTA_SMALL_MATMUL", "0")
  assert "BITDELTA_SMALL_MATMUL=0" in small_api.fallback_reasons(4, jnp.float32, jnp.float32)["cpu"]
  with lowering_platform("cuda"):
    assert "target platform is 'cuda'" in small_api.fallback_reasons(
      1, jnp.bfloat16, jnp.bfloat16)["cpu_bf16"]
  with pytest.raises(RuntimeError, match="cannot run"):
    small_api.small_matmul(jnp.ones((1, 8)), jnp.ones((8, 4)), implementation="cpu")


def test_lm_head_names_why_it_fell_back():
  untied = head_api.fallback_reasons(1, jnp.float32, jnp.float32, tied=False)
  assert "untied" in untied["cpu"] and untied["xla"] is None
  many = head_api.fallback_reasons(64, jnp.bfloat16, jnp.bfloat16, tied=True)
  assert "64 rows" in many["cpu_bf16"]
  with lowering_platform("cuda"):
    assert "target platform is 'cuda'" in head_api.packed_fallback_reasons()["cpu"]
    assert head_api.packed_fallback_reasons()["reference"] is None


def test_pallas_kernels_import_nothing_from_bitdelta_jax():
  code = ("import sys, pallas_kernels.delta_matmul.api, pallas_kernels.lm_head.api, "
          "pallas_kernels.small_matmul.api, pallas_kernels.paged_attention.api, "
          "pallas_kernels.native.build; "
          "bad = [m for m in sys.modules if m.startswith('bitdelta_jax')]; assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
  for path in (ROOT / "pallas_kernels").rglob("*.py"):
    assert not re.search(r"^\s*(from|import) bitdelta_jax", path.read_text(), re.M), path


def test_bit_layout_imports_without_jax():
  code = ("import sys, pallas_kernels.bits, bitdelta_jax.delta.entries; "
          "assert 'jax' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --- the layers run what the apis pick -----------------------------------------------------------


def _dense(k, n, slots, dtype, **kw):
  layer = DeltaDense(k, n, use_bias=False, num_slots=slots, dtype=dtype, rngs=nnx.Rngs(0), **kw)
  if slots > 1:
    rng = np.random.default_rng(k + n)
    layer.delta_bits[...] = jnp.asarray(
      rng.integers(0, 256, layer.delta_bits[...].shape), jnp.uint8).at[0].set(0)
    layer.delta_scale[...] = jnp.asarray(
      rng.uniform(0.01, 0.1, layer.delta_scale[...].shape), jnp.float32).at[0].set(0)
  return layer


@pytest.mark.parametrize("rows", [1, 4, 20])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("slots", [1, 3])
def test_delta_dense_runs_what_delta_matmul_picks(rows, dtype, slots):
  k, n = 96, 40
  layer = _dense(k, n, slots, dtype)
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1, k)), dtype)
  ids = jnp.asarray(np.arange(rows) % slots, jnp.int32) if slots > 1 else None
  bank = () if ids is None else (layer.delta_bits[...], layer.delta_scale[...], ids)

  def by_api(x):
    return delta_api.delta_matmul(x.reshape(rows, k), layer.kernel[...], *bank,
                                  group_k=layer.group_k).reshape(rows, 1, n)

  assert _targets(lambda x: layer(x, ids), x) == _targets(by_api, x)
  np.testing.assert_array_equal(np.asarray(layer(x, ids), np.float32),
                                np.asarray(by_api(x), np.float32))
  if ROWS_OK and rows <= cpu_rows.MAX_ROWS:
    assert _targets(by_api, x) == {"bitdelta_delta_rows"}


@pytest.mark.parametrize("rows", [1, 4, 40])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lm_heads_run_what_the_lm_head_api_picks(rows, dtype):
  d, v = 64, 48
  h = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1, d)), dtype)
  embed = Embed(v, d, num_slots=1, dense_slots=False, dtype=dtype, rngs=nnx.Rngs(0))
  head = LMHead(d, v, num_slots=1, dense_slots=False, dtype=dtype, rngs=nnx.Rngs(1))
  for layer_fn, w, tied in ((embed.attend, embed.weight[...], True),
                            (head, head.kernel[...], False)):
    api_fn = lambda h, w=w, tied=tied: head_api.logits(h, w, tied=tied)  # noqa: E731
    assert _targets(layer_fn, h) == _targets(api_fn, h)
    got = layer_fn(h)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, api_fn(h))


def test_sharded_callable_is_used_for_the_products_with_deltas():
  calls = []

  def fake(x, w, bits, scale, slot_ids=None, *, group_k):
    calls.append(group_k)
    return delta_matmul_reference(x, w, bits, scale, slot_ids, group_k=group_k)

  layer = _dense(96, 40, 3, jnp.float32, implementation=fake)
  plain = _dense(96, 40, 3, jnp.float32, implementation="reference")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 96)), jnp.float32)
  for ids in ([0, 2], [0, 0]):
    ids = jnp.asarray(ids, jnp.int32)
    np.testing.assert_allclose(layer(x, ids), plain(x, ids), rtol=1e-5, atol=1e-5)
  assert calls and set(calls) == {layer.group_k}


# --- the public delta_matmul at one row takes the few-rows kernel --------------------------------


@needs_rows
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_one_variant_takes_the_few_rows_kernel_in_place(wdtype, m):
  k, n = 300, 72
  g = group_k_for(k)
  rng = np.random.default_rng(m)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), wdtype)
  bits = jnp.asarray(rng.integers(0, 256, (packed_rows(k, g), n)), jnp.uint8)
  scale = jnp.asarray(rng.uniform(0.01, 0.1, (n,)), jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda x: delta_api.delta_matmul(x, w, bits, scale, group_k=g))(x))
  assert "bitdelta_delta_rows" in jaxpr and "np.int64(1)" in jaxpr  # first_slot=1: no bank copy
  assert "concatenate" not in jaxpr
  got = delta_api.delta_matmul(x, w, bits, scale, group_k=g)
  want = delta_matmul_reference(x, w.astype(jnp.float32), bits, scale, group_k=g)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)  # a linear loss: the VJP alone
  f = lambda fn: lambda x, s: jnp.sum(ct * fn(x, w.astype(jnp.float32), bits, s, group_k=g))  # noqa: E731
  got_g = jax.grad(f(delta_api.delta_matmul), argnums=(0, 1))(x, scale)
  want_g = jax.grad(f(delta_matmul_reference), argnums=(0, 1))(x, scale)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# --- the packed LM-head bank product -------------------------------------------------------------


def test_packed_products_gradient_is_the_references():
  if delta_cpu.unavailable_reason() is not None:
    pytest.skip(delta_cpu.unavailable_reason())
  from bitdelta_jax.delta.format import pack

  rng = np.random.default_rng(0)
  k, v = 40, 24
  pds = [pack(jnp.asarray(rng.standard_normal((k, v)), jnp.float32), "column") for _ in range(2)]
  bits = jnp.stack([jnp.zeros_like(pds[0].bits)] + [p.bits for p in pds])
  scale = jnp.stack([jnp.zeros((v,), jnp.float32)] + [p.scale for p in pds])
  h = jnp.asarray(rng.standard_normal((5, k)), jnp.float32)
  base = jnp.asarray(rng.standard_normal((5, v)), jnp.float32)
  slots = jnp.asarray([1, 0, 2, 1, 2], jnp.int32)
  w = jnp.asarray(rng.standard_normal((5, v)), jnp.float32)
  g = pds[0].group_k

  def loss(impl):
    return lambda b, x, a: jnp.sum(w * head_api.add_packed_products(
      b, x, bits, a, slots, group_k=g, implementation=impl))

  assert "bitdelta_delta_matmul" in _targets(loss("cpu"), base, h, scale)
  np.testing.assert_allclose(loss("cpu")(base, h, scale), loss("reference")(base, h, scale),
                             rtol=1e-5)
  got = jax.grad(loss("cpu"), argnums=(0, 1, 2))(base, h, scale)
  want = jax.grad(loss("reference"), argnums=(0, 1, 2))(base, h, scale)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  masked = jnp.where(slots > 0, slots, -1)
  np.testing.assert_allclose(
    head_api.add_packed_products(base, h, bits, scale, slots, group_k=g, implementation="cpu"),
    packed_products_reference(base, h, bits, scale, masked, g), rtol=1e-5, atol=1e-5)
