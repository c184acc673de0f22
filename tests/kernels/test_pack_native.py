"""The native compression packer agrees with the jitted XLA path and with numpy."""

import ml_dtypes
import numpy as np
import pytest

from bitdelta_jax.delta import pack_native
from bitdelta_jax.delta.format import group_k_for, pack
from bitdelta_jax.delta.stream import _linear_chunk


@pytest.mark.parametrize("rows,k,group_k,dt", [(37, 200, 128, np.float32), (64, 256, 128, "bf16"),
                                               (5, 13, 8, "bf16"), (9, 72, 16, "mixed")])
def test_native_matches_xla_and_numpy(rows, k, group_k, dt):
  if pack_native.unavailable_reason(np.zeros(1, np.float32), np.zeros(1, np.float32)):
    pytest.skip("no compiler for the native packer")
  r = np.random.default_rng(0)
  b = r.standard_normal((rows, k)).astype(np.float32)
  f = b + 0.01 * r.standard_normal((rows, k)).astype(np.float32)
  f[0, :3] = b[0, :3]  # Δ = 0 → sign +1
  if dt == "bf16":
    b, f = b.astype(ml_dtypes.bfloat16), f.astype(ml_dtypes.bfloat16)
  elif dt == "mixed":
    b = b.astype(ml_dtypes.bfloat16)
  group_k = group_k_for(k, group_k)  # as the streamer passes it: the size fitted to K
  bits, a, s, changed = pack_native.pack_rows(b, f, group_k)
  xb, xa, xs, xc = (np.asarray(v) for v in _linear_chunk(b, f, group_k=group_k))
  np.testing.assert_array_equal(bits.T, xb)
  d = f.astype(np.float32) - b.astype(np.float32)
  np.testing.assert_array_equal(bits.T, pack(d.T, "column", group_k).bits)  # numpy oracle
  np.testing.assert_allclose(a, np.abs(d).sum(1), rtol=1e-5)
  np.testing.assert_allclose(s, (d.astype(np.float64) ** 2).sum(1), rtol=1e-5)
  np.testing.assert_allclose(xa, a, rtol=1e-5)
  assert changed and bool(xc)
  _, _, _, same = pack_native.pack_rows(b, b, group_k)
  assert not same
