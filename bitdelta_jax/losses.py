"""Training losses over the model's logits, shared by the example model makers (`zoo`), the
LoRA and soup trainers (`merge`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_xent(logits_BxTxV, tokens_BxT, mask_BxT):
  """Mean next-token cross-entropy over positions where ``mask`` is 1."""
  logp = jax.nn.log_softmax(logits_BxTxV[:, :-1].astype(jnp.float32))
  tgt = tokens_BxT[:, 1:]
  nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
  m = mask_BxT[:, :-1]
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
