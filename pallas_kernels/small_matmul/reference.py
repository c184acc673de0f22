"""Reference: the plain products the CPU kernels compute (f32 results)."""

import jax.numpy as jnp


def small_matmul_reference(x_MxK, w_KxN):
  """``x · W`` with f32 accumulation."""
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)


def small_matmul_bf16_reference(x_MxK, w_KxN):
  """``bf16(x) · W`` for bf16 W: every product exact in f32, f32 sums (`cpu_bf16`)."""
  x = x_MxK.astype(jnp.bfloat16).astype(jnp.float32)
  return jnp.dot(x, w_KxN.astype(jnp.float32), precision="highest")


def small_matmul_bf16_nt_reference(x_MxK, e_NxK):
  """``bf16(x) · Eᵀ`` for bf16 E ``[N, K]`` (a tied LM head), as above."""
  return small_matmul_bf16_reference(x_MxK, e_NxK.T)


def small_matmul_nt_reference(x_MxK, e_NxK):
  """``x · Eᵀ`` for ``E [N, K]`` (a tied LM head) with f32 accumulation."""
  return jnp.dot(x_MxK, e_NxK.T, preferred_element_type=jnp.float32)
