"""bench/common/harness.py: every candidate runs once per round in a rotating order after two warm
calls, and a budget stops the rounds early only after the minimum."""

from __future__ import annotations

from bench.common import harness


def test_rounds_rotate_and_every_call_is_timed():
  calls = []
  fns = {n: (lambda n=n: calls.append(n)) for n in "abc"}
  t = harness.interleaved(fns, rounds=4, block=lambda x: x)
  assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # compile, then warm
  assert calls[6:] == list("abc" "bca" "cab" "abc")
  assert {n: len(v) for n, v in t.wall.items()} == {"a": 4, "b": 4, "c": 4}
  assert all(w >= 0 for v in t.wall.values() for w in v)


def test_budget_stops_after_the_minimum_rounds():
  t = harness.interleaved({"a": lambda: None}, rounds=100, budget_s=0.0, min_rounds=3,
                          block=lambda x: x)
  assert len(t.wall["a"]) == 3

