"""The demo banner's example prompts: for each built-in variant, a held-out prompt that its
*compressed* delta answers correctly (greedy, through the base's chat template, as the banner's
curl line sends it), so that the first thing a user tries works.

    examples = pick_banner_examples(base_dir, {"nano-math": delta_dir, ...})
    answers = answer_chat(base_dir, variants, {name: prompt})      # {name: generated text}

`bitdelta zoo build --ship` records them in ``family.json`` (``"examples"``).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp


def answer_chat(base_dir: Path, variants: dict[str, Path], prompts: dict[str, list[str]],
                max_new_tokens: int = 24) -> dict[str, list[str]]:
  """Greedy answers of each variant (its delta in its own slot, all in one engine) to its
  prompts sent as one user chat message each."""
  from bitdelta_jax.delta.store import load_delta
  from bitdelta_jax.engine.generator import Generator
  from bitdelta_jax.engine.sampling import SamplingParams
  from bitdelta_jax.models import from_pretrained
  from bitdelta_jax.models.tokenizer import Tokenizer

  names = list(prompts)
  tok = Tokenizer.from_dir(base_dir)
  model = from_pretrained(base_dir, jnp.float32, num_slots=len(names) + 1)
  gen = Generator(model, max_rows=32, max_seq_len=256, tokenizer=tok)
  for slot, n in enumerate(names, start=1):
    gen.load_variant(slot, load_delta(variants[n])[0])
  ids, slots = [], []
  for slot, n in enumerate(names, start=1):
    for p in prompts[n]:
      text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
      ids.append(tok.encode(text, add_special_tokens=False))
      slots.append(slot)
  params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                          stop_token_ids=tuple(tok.stop_token_ids))
  res = iter(gen.generate(ids, slot_ids=slots, params=params))
  return {n: [next(res).text.strip() for _ in prompts[n]] for n in names}


def pick_banner_examples(base_dir: Path, variants: dict[str, Path], tries: int = 16,
                         seed: int = 0) -> dict[str, str]:
  """The first of ``tries`` held-out prompts per variant that its delta answers correctly
  (a variant answering none of them is left out)."""
  from bitdelta_jax.zoo.tasks import TASKS

  held = {n: TASKS[n].heldout(tries, seed) for n in variants}
  got = answer_chat(base_dir, variants, {n: [p for p, _ in held[n]] for n in variants})
  out = {}
  for n in variants:
    for (p, a), g in zip(held[n], got[n]):
      if g == a.strip():
        out[n] = p
        break
  return out
