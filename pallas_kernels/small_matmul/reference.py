"""Reference: the plain product the CPU kernel computes (f32)."""

import jax.numpy as jnp


def small_matmul_reference(x_MxK, w_KxN):
  """``x · W`` with f32 accumulation."""
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)
