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
