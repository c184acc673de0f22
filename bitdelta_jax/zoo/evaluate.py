"""Exact match and per-token NLL of a model on a task's held-out examples.

Exact match is computed in one teacher-forced pass: greedy decoding reproduces the answer (and
then stops on <eos>) exactly when the argmax at every answer position equals the answer token,
given the correct prefix; the first position where it does not is where greedy output diverges.
So ``all(argmax == target)`` over the answer and <eos> is greedy exact match, without decoding
(ties in the argmax aside). `tests/zoo/test_zoo.py` checks this against `Generator`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.zoo.data import batch_examples


@nnx.jit
def _scores(model, tokens, mask, slot_ids):
  logits = model(tokens, slot_ids=slot_ids)[:, :-1].astype(jnp.float32)
  tgt = tokens[:, 1:]
  m = mask[:, :-1]
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
  hit = (jnp.argmax(logits, -1) == tgt) | (m == 0)
  return jnp.all(hit, axis=1), jnp.sum(nll * m, axis=1), jnp.sum(m, axis=1)


def exact_match_and_nll(model, examples, *, slot: int | None = None, batch: int = 128,
                        seq: int = 40) -> tuple[float, float]:
  """→ (exact match in %, mean NLL per answer token)."""
  hits, nll, count = 0, 0.0, 0.0
  for i in range(0, len(examples), batch):
    chunk = examples[i:i + batch]
    n = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch - n)  # one shape, one compile
    toks, mask = batch_examples(chunk, seq)
    slots = None if slot is None else jnp.full((batch,), slot, jnp.int32)
    h, s, c = _scores(model, jnp.asarray(toks), jnp.asarray(mask), slots)
    hits += int(np.sum(np.asarray(h)[:n]))
    nll += float(np.sum(np.asarray(s)[:n]))
    count += float(np.sum(np.asarray(c)[:n]))
  return 100.0 * hits / len(examples), nll / max(count, 1.0)
