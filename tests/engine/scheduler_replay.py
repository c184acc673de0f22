"""The scheduler's plans checked without JAX: a numpy runner replays every `PagedBatch`.

`ReplayRunner` stands in for the device. Its "KV cache" stores token ids: each step writes
every token's id at its ``write_page / write_offset``, then reads back the keys each query may
see through the plan alone (a decode lane: its page table up to ``lane_len``; a prompt token:
the step's prompt pages of its own sequence at positions ``<= its own``, within their fill).
Those keys must be exactly the sequence's tokens so far: a wrong page, offset, length, fork
copy, prefix-cache hit or preemption shows up as a wrong context. The "model" then draws each
output token as a hash of the context it read (`next_token`), so the generated text is also
wrong whenever a plan is.

`run_scenarios()` runs each scenario and checks the tokens against `expected`, computed from
the prompts alone. Run as a script, it first makes importing jax, jaxlib or flax fail, so the
scheduler is shown to plan without JAX (tests/engine/test_scheduler_plans.py runs both ways).
"""

from __future__ import annotations

import sys
import types

import numpy as np

VOCAB = 97
STOP = 5


def next_token(context) -> int:
  """The toy model: a deterministic hash of the whole context (order-sensitive)."""
  h = 17
  for t in context:
    h = (h * 31 + int(t) + 1) % 1_000_003
  return h % VOCAB


def expected(prompt, max_new: int, slot: int = 0, choice_salt: int = 0) -> list[int]:
  """What the replayed engine must generate for one choice, from its prompt alone."""
  ctx = list(prompt)
  out = []
  for _ in range(max_new):
    t = _draw(ctx, slot, choice_salt)
    out.append(t)
    ctx.append(t)
    if t == STOP:
      break
  return out


def key_salt(key) -> int:
  return int(key[0] ^ key[1]) % 11


def _draw(ctx, slot: int, salt: int) -> int:
  return (next_token(ctx) + 7 * slot + 13 * salt) % VOCAB


class ReplayRunner:
  """A device stand-in that checks each plan (see the module docstring)."""

  def __init__(self, num_pages: int, page_size: int, scheduler_ref: list):
    self.kv = np.full((num_pages, page_size), -1, np.int64)
    self.ps = page_size
    self.sched = scheduler_ref  # [Generator], set after construction
    self.steps = []  # (num_tokens, base_only)
    self.copies = 0
    self.lost = None

  # the runner interface the scheduler uses
  def fetch(self, a):
    return np.asarray(a)

  def refresh(self):
    pass

  def copy_pages(self, src, dst):
    self.kv[dst] = self.kv[src]
    self.copies += len(src)

  def run(self, b, base_only: bool):
    n, a = b.tokens.shape[0], b.attention
    shapes = self.sched[0].shapes
    assert n in shapes.buckets(), f"{n} tokens is not a bucket of {shapes.buckets()}"
    assert a.lane_pages.shape == (shapes.lanes(n), shapes.lane_width)
    assert a.block_pages == shapes.block_pages
    assert base_only == (self.sched[0].model.config.num_slots == 1)  # one form per engine
    live = b.write_page > 0
    assert not np.any(b.write_page[~live]), "padding must write to the reserved page 0"
    self.kv[b.write_page[live], b.write_offset[live]] = b.tokens[live]
    bk = shapes.block_pages * self.ps
    assert int(a.blocks[0]) * bk >= int(a.lane_len.max(initial=0)), "decode loop too short"
    contexts = {}
    for r in np.nonzero(a.lane_len > 0)[0]:
      length = int(a.lane_len[r])
      pages = a.lane_pages[r, : -(-length // self.ps)]
      contexts[int(r)] = self.kv[pages].reshape(-1)[:length]
      assert a.positions[r] == length - 1
    u = int(a.blocks[1]) * shapes.block_pages
    assert np.all(a.page_seq[u:] == -2), "prompt pages beyond the prefill loop's bound"
    for i in np.nonzero(a.token_seq >= 0)[0]:
      mine = a.page_seq == a.token_seq[i]
      keys = []
      for pg, start, fill in zip(a.pages[mine], a.page_start[mine], a.page_fill[mine]):
        for off in range(int(fill)):
          if start + off <= a.positions[i]:
            keys.append((int(start + off), int(self.kv[pg, off])))
      keys.sort()
      assert [p for p, _ in keys] == list(range(int(a.positions[i]) + 1)), "missing keys"
      contexts[int(i)] = np.asarray([t for _, t in keys])
    # the outputs: each output row's token drawn from its token's context
    r_out = b.out_index.shape[0]
    tok = np.zeros((r_out,), np.int32)
    for j in range(r_out):
      i = int(b.out_index[j])
      if i in contexts:
        salt = key_salt(b.keys[j])  # choices differ by key (prng_key), as sampling would
        tok[j] = _draw(contexts[i], int(b.out_slot_ids[j]), salt)
    self.steps.append((n, base_only))
    zeros = np.zeros((r_out,), np.float32)
    return types.SimpleNamespace(tokens=tok, logprob=zeros, top_ids=None, top_logprobs=None,
                                 score=None, score_top_ids=None, score_top_logprobs=None)


def make(num_pages=64, page_size=4, max_rows=4, max_seq_len=64, prefill_chunk=8,
         num_slots=3, prefix_caching=True):
  from bitdelta_jax.engine.generator import Generator

  cfg = types.SimpleNamespace(vocab_size=VOCAB, extra_vocab=0, num_slots=num_slots)
  ref: list = []
  runner = ReplayRunner(num_pages, page_size, ref)
  gen = Generator(types.SimpleNamespace(config=cfg), max_rows=max_rows,
                       max_seq_len=max_seq_len, page_size=page_size, num_pages=num_pages,
                       prefill_chunk=prefill_chunk, prefix_caching=prefix_caching,
                       runner=runner)
  ref.append(gen)
  return gen, runner


def drive(gen, requests, max_steps=500):
  """requests: (prompt, slot, n, max_new). Runs to completion; returns each choice's tokens
  (keyed (request, choice)) and checks that every page is free again."""
  from bitdelta_jax.engine.sampling_params import SamplingParams
  from bitdelta_jax.engine.stops import check_stop

  out = {}
  for r, (prompt, slot, n, max_new) in enumerate(requests):
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(STOP,), seed=r)
    gen.add_n(prompt, slot, params, [(r, c) for c in range(n)])
  for _ in range(max_steps):
    if not gen.has_work:
      break
    res = gen.step()
    assert not res.errors, res.errors
    for s, _ in res.tokens:
      if check_stop(s, gen.max_seq_len) is not None:
        out[s.tag] = list(s.generated)
        gen.finish(s)
  assert not gen.has_work, "the scheduler left work undone (a stuck sequence)"
  assert gen.pool.used == 0 and not any(gen.pool.refs), "pages leaked"
  return out


def want(gen, requests):
  from bitdelta_jax.engine.batch import prng_key

  return {(r, c): expected(p, m, slot, key_salt(prng_key(r, c)))
          for r, (p, slot, n, m) in enumerate(requests) for c in range(n)}


def _prompt(seed, n):
  return list(np.random.default_rng(seed).integers(6, VOCAB, n))


SCENARIOS = {
  # n > 1 on a one-token prompt: every choice forks and ends (it once held its slot forever)
  "n_choices_one_token_prompt": dict(requests=[([9], 1, 4, 6), ([11], 2, 3, 5)]),
  # a prompt longer than a chunk while others decode; mixed slots in one batch
  "chunked_prefill_beside_decode": dict(
    requests=[(_prompt(1, 5), 0, 1, 12), (_prompt(2, 30), 1, 1, 6), (_prompt(3, 19), 2, 2, 8)]),
  # the same prompt twice per slot: the second takes the cached full pages (prefix hits)
  "prefix_cache_hits": dict(
    requests=[(_prompt(4, 17), 1, 1, 4), (_prompt(4, 17), 1, 2, 4), (_prompt(4, 17), 2, 1, 4)],
    kw=dict(max_rows=1)),
  # a pool too small for every sequence at once: the newest are preempted and recomputed
  "preemption": dict(
    requests=[(_prompt(5 + i, 9), i % 3, 1, 14) for i in range(6)],
    kw=dict(num_pages=16, max_rows=4)),
}


def run_scenario(name):
  sc = SCENARIOS[name]
  gen, runner = make(**sc.get("kw", {}))
  got = drive(gen, sc["requests"])
  assert got == want(gen, sc["requests"]), (got, want(gen, sc["requests"]))
  return gen, runner


def _block_jax():
  class Blocker:
    def find_spec(self, name, path=None, target=None):
      if name.split(".")[0] in ("jax", "jaxlib", "flax"):
        raise ImportError(f"{name} is blocked: the scheduler must plan without JAX")
      return None

  sys.meta_path.insert(0, Blocker())


if __name__ == "__main__":
  _block_jax()
  for name in SCENARIOS:
    gen, runner = run_scenario(name)
    print(name, "steps", len(runner.steps), "copies", runner.copies)
  assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax")]
  print("ok without jax")
