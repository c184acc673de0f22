"""The real family's recipe (`zoo.real_family`): answer masks against the tokenizer, the
teacher-forced task score against greedy decoding, and frozen embeddings staying frozen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bitdelta_jax.models.tokenizer import Tokenizer
from bitdelta_jax.zoo import real_family as rf
from bitdelta_jax.zoo.real_base import RealBaseUnavailable, import_real_base

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module")
def real_dir():
  try:
    return import_real_base()
  except RealBaseUnavailable as e:
    pytest.skip(f"SmolLM2 unavailable: {e}")


def test_encode_masks_exactly_the_answer_and_its_end(real_dir):
  tok = Tokenizer.from_dir(real_dir)
  ex = rf.heldout("smol-coder", 3)
  toks, mask = rf.encode(tok, ex, 56)
  for (p, a), t, m in zip(ex, toks, mask):
    prompt = rf.chat_ids(tok, p)
    answer = tok.encode(a + rf.END, add_special_tokens=False)
    assert list(t[:len(prompt) + len(answer)]) == prompt + answer
    scored = [int(t[i + 1]) for i in np.flatnonzero(m)]  # the tokens the masked positions predict
    assert scored == answer and answer[-1] == tok.token_id(rf.END)
  with pytest.raises(ValueError, match="tokens; the recipe's seq is 8"):
    rf.encode(tok, ex, 8)


def test_teacher_forced_score_equals_greedy_decoding(real_dir):
  """Exact match computed in one pass equals decoding greedily and comparing the text."""
  from bitdelta_jax.models import from_pretrained

  tok = Tokenizer.from_dir(real_dir)
  model = from_pretrained(real_dir, jnp.float32)
  # prompts the instruct base answers exactly (greedy, checked), and two it gets wrong
  ex = [("What is the capital of France?", "The capital of France is Paris."),
        ("Say yes.", "Yes."), ("What is the capital of France?", "Paris"),
        *rf.heldout("smol-math", 1)]
  got = rf.score(model, ex, tok)
  end = tok.token_id(rf.END)
  seqs = [rf.chat_ids(tok, p) for p, _ in ex]
  outs: list[list[int]] = [[] for _ in ex]
  done = [False] * len(ex)
  for _ in range(12):  # batched greedy decoding, one padded shape (causal: padding unseen)
    padded = np.zeros((len(ex), 64), np.int32)
    for i, s in enumerate(seqs):
      padded[i, :len(s)] = s
    logits = np.asarray(model(jnp.asarray(padded)))
    for i, s in enumerate(seqs):
      if not done[i]:
        t = int(np.argmax(logits[i, len(s) - 1]))
        done[i] = t == end
        if not done[i]:
          outs[i].append(t)
          s.append(t)
  hits = [d and tok.decode(o) == a for d, o, (_, a) in zip(done, outs, ex)]
  assert got["hits"] == hits
  assert got["score"] == pytest.approx(100.0 * sum(hits) / len(ex))
  assert 0 < sum(hits) < len(ex), "the check needs both hits and misses"


def test_frozen_embeddings_do_not_move():
  from bitdelta_jax.models import LlamaForCausalLM
  from bitdelta_jax.models.config import ModelConfig

  cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    tie_word_embeddings=True)
  for train_embeddings in (False, True):
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    opt = rf.optimizer(rf.RealRecipe(steps=4, warmup=1, lr=1e-2), train_embeddings)
    grads = jax.tree.map(jnp.ones_like, params)
    new, state = params, opt.init(params)
    for _ in range(2):  # the warm-up starts at lr 0: the second step moves
      updates, state = opt.update(grads, state, new)
      new = optax.apply_updates(new, updates)
    emb_moved = not np.array_equal(np.asarray(new["model"]["embed_tokens"]["weight"][...]),
                                   np.asarray(params["model"]["embed_tokens"]["weight"][...]))
    q = lambda s: np.asarray(s["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...])
    assert emb_moved == train_embeddings
    assert not np.array_equal(q(new), q(params))
