"""The scheduler (`bitdelta_jax.engine.scheduler.Scheduler`) plans without JAX, and its plans
are right: `scheduler_replay` replays them on a numpy stand-in for the device whose cache holds
token ids, so every query must read exactly its own sequence's tokens (see that module)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import scheduler_replay as replay


@pytest.mark.parametrize("name", sorted(replay.SCENARIOS))
def test_plans_give_every_query_its_own_context(name, monkeypatch):
  from bitdelta_jax.engine.scheduler import Scheduler

  preempted = []
  orig = Scheduler._preempt_newest
  monkeypatch.setattr(Scheduler, "_preempt_newest",
                      lambda self: preempted.append(1) or orig(self))
  gen, runner = replay.run_scenario(name)
  # each scenario exercises what it is named for
  if name == "prefix_cache_hits":
    # the second prompt of slot 1 reuses its 4 full pages (its last token is always computed);
    # slot 2's identical prompt reuses nothing: one variant never reads another's pages
    assert gen.pool.hits == (17 - 1) // 4
  if name == "preemption":
    assert preempted
  if name == "chunked_prefill_beside_decode":
    assert runner.copies >= 1  # the forked choice's partly filled last page
  assert len({n for n, _ in runner.steps}) >= 2  # several token buckets


def test_scheduler_imports_and_plans_with_jax_blocked():
  script = pathlib.Path(replay.__file__)
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=120, cwd=script.parent.parent)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "ok without jax" in proc.stdout


def test_a_short_prompt_does_not_wait_behind_a_long_ones_chunks():
  """A 60-token prompt is chunked 8 tokens an iteration; a 3-token prompt that arrives after
  its first chunk is computed in the next iteration (first come, first served, it waited for
  all of the long prompt's chunks), and the long prompt keeps moving (at least a quarter of
  each iteration's budget). The replayed contexts are each sequence's own
  (`scheduler_replay`)."""
  from bitdelta_jax.engine.sampling_params import SamplingParams

  gen, runner = replay.make(max_rows=4, max_seq_len=96, prefill_chunk=8)
  long_p, short_p = replay._prompt(21, 60), replay._prompt(22, 3)
  first_token: dict = {}
  prefilled: list[int] = []  # the long prompt's tokens computed per iteration

  def params(r):
    return SamplingParams(max_new_tokens=2, stop_token_ids=(replay.STOP,), seed=r)

  gen.add_n(long_p, 1, params(0), ["long"])
  for step in range(40):
    if step == 1:
      gen.add_n(short_p, 1, params(1), ["short"])
    if not gen.has_work:
      break
    res = gen.step()
    prefilled.append(res.prefill_tokens)
    for s, _ in res.tokens:
      first_token.setdefault(s.tag, step)
      if len(s.generated) >= 2:
        gen.finish(s)
  assert first_token["short"] == 1, (first_token, prefilled)
  # every iteration until the long prompt's first token computed prompt tokens, all 63 of them
  assert sum(prefilled[: first_token["long"] + 1]) == 63
  assert min(prefilled[: first_token["long"] + 1]) >= 2
  assert gen.pool.used == 0
