"""bench/common/harness.py: every candidate runs once per round after two warm calls, the rounds
walking every order of up to 4 candidates (a rotation beyond), and a budget stops the rounds early
only after the minimum."""

from __future__ import annotations

from bench.common import harness


def test_rounds_walk_every_order_and_every_call_is_timed():
  calls = []
  fns = {n: (lambda n=n: calls.append(n)) for n in "abc"}
  t = harness.interleaved(fns, rounds=7, block=lambda x: x)
  assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # compile, then warm
  assert calls[6:] == list("abc" "acb" "bac" "bca" "cab" "cba" "abc")
  # within a round each candidate comes right after each other one equally often
  rounds = ["".join(calls[6 + 3 * r: 9 + 3 * r]) for r in range(6)]
  pairs = [o[i:i + 2] for o in rounds for i in range(2)]
  assert {p: pairs.count(p) for p in set(pairs)} == {p: 2 for p in ("ab", "ac", "ba", "bc", "ca", "cb")}
  assert {n: len(v) for n, v in t.wall.items()} == {"a": 7, "b": 7, "c": 7}
  assert all(w >= 0 for v in t.wall.values() for w in v)


def test_more_than_four_candidates_rotate():
  calls = []
  fns = {n: (lambda n=n: calls.append(n)) for n in "abcde"}
  harness.interleaved(fns, rounds=2, block=lambda x: x)
  assert calls[10:] == list("abcde" "bcdea")


def test_budget_stops_after_the_minimum_rounds():
  t = harness.interleaved({"a": lambda: None}, rounds=100, budget_s=0.0, min_rounds=3,
                          block=lambda x: x)
  assert len(t.wall["a"]) == 3

