"""The built-in family's tasks: each a deterministic generator of (prompt, answer) pairs with an
exact-match metric. Prompts are short so a tiny byte-level model can learn them on a laptop CPU.

Held-out prompts are a fixed 1/8 of the prompt space (by a crc32 of the prompt): training data,
for the fine-tunes and the base alike, never contains one, so exact match measures
generalisation (for `nano-math`, to sums never seen in training).
"""

from __future__ import annotations

import dataclasses
import random
import string
import zlib
from collections.abc import Callable

LETTERS = "abcdefghij"  # a small alphabet keeps the tasks learnable by a ~1M-parameter model


@dataclasses.dataclass(frozen=True)
class Task:
  name: str  # variant name, e.g. "nano-math"
  instruction: str  # prefix of every prompt
  make: Callable[[random.Random], tuple[str, str]]  # rng -> (input, answer)
  description: str

  def _draw(self, rng: random.Random) -> tuple[str, str]:
    x, y = self.make(rng)
    return f"{self.instruction} {x}", y

  def example(self, rng: random.Random) -> tuple[str, str]:
    """A training example (never a held-out prompt)."""
    while True:
      p, a = self._draw(rng)
      if not is_heldout(p):
        return p, a

  def heldout(self, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct held-out examples (fewer if the held-out space is smaller)."""
    rng = random.Random(f"{self.name}:heldout:{seed}")
    out, seen = [], set()
    for _ in range(200 * n):
      p, a = self._draw(rng)
      if is_heldout(p) and p not in seen:
        seen.add(p)
        out.append((p, a))
        if len(out) == n:
          break
    return out

  def splits(self, n_train: int, n_eval: int, seed: int = 0):
    rng = random.Random(f"{self.name}:train:{seed}")
    return [self.example(rng) for _ in range(n_train)], self.heldout(n_eval, seed)


def is_heldout(prompt: str) -> bool:
  return zlib.crc32(prompt.encode()) % 8 == 0


def _word(rng: random.Random, lo: int = 3, hi: int = 6) -> str:
  return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _add(rng):
  a, b = rng.randint(0, 99), rng.randint(0, 9)
  return f"{a}+{b}", str(a + b)


def _reverse(rng):
  w = _word(rng)
  return w, w[::-1]


def _sort(rng):
  w = _word(rng)
  return w, "".join(sorted(w))


def _upper(rng):
  w = _word(rng, 3, 7)
  return w, w.upper()


def _recall(rng):
  keys = rng.sample(LETTERS, 3)
  vals = [rng.choice(string.digits) for _ in keys]
  q = rng.randrange(3)
  return " ".join(f"{k}={v}" for k, v in zip(keys, vals)) + f" ?{keys[q]}", vals[q]


def _camel(rng):
  parts = [_word(rng, 2, 4) for _ in range(rng.randint(2, 3))]
  return "_".join(parts), parts[0] + "".join(p.capitalize() for p in parts[1:])


def _echo(rng):
  w = _word(rng, 2, 8)
  return w, w


def _length(rng):
  w = _word(rng, 1, 9)
  return w, str(len(w))


def _first_last(rng):
  w = _word(rng, 2, 8)
  return w, w[0] + w[-1]


def _succ(rng):
  n = rng.randint(0, 98)
  return str(n), str(n + 1)


def _digit_sum(rng):
  a, b = rng.randint(0, 9), rng.randint(0, 9)
  return f"{a}+{b}", str(a + b)


def _double(rng):
  w = _word(rng, 2, 5)
  return w, "".join(c + c for c in w)


# General skills the base sees during pre-training (none is a variant's task): they teach the
# chat format, copying and digit handling, as a real base model already knows them, so the
# fine-tunes specialise with small deltas.
BASE_SKILLS: tuple[Task, ...] = (
  Task("echo", "echo", _echo, "copy a word"),
  Task("length", "length", _length, "length of a word"),
  Task("ends", "ends", _first_last, "first and last letter"),
  Task("succ", "succ", _succ, "successor of a number"),
  Task("digits", "digits", _digit_sum, "one-digit addition"),
  Task("double", "double", _double, "double every letter"),
)

TASKS: dict[str, Task] = {t.name: t for t in [
  Task("nano-math", "add", _add, "addition (two-digit + one-digit)"),
  Task("nano-reverse", "reverse", _reverse, "reverse a word"),
  Task("nano-sort", "sort", _sort, "sort the letters of a word"),
  Task("nano-upper", "upper", _upper, "upper-case a word"),
  Task("nano-recall", "recall", _recall, "key-value recall"),
  Task("nano-coder", "camel", _camel, "snake_case identifier to camelCase"),
]}
