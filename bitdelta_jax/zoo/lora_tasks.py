"""Related tasks for LoRA adapters on the real base (`bitdelta zoo build --real-loras`).

Ten tasks in four families whose members share their skill, so their adapters are candidates
for merging (K-Merge) where the built-in family's six nearly orthogonal tasks are not:

    arith    add "add 47 35" → "82" · sub "sub 83 27" → "56" · mul "mul 12 7" → "84"
    text     upper "upper cabbed" → "CABBED" · lower "lower CABBED" → "cabbed"
             · last "last red cat sun" → "sun"
    extract  recall "recall a=1 b=7 c=3 ?b" → "7" · count "count fig owl jam" → "3"
    format   json 'json {"name": "ana", "age": 31} age' → "31"
             · csv "csv ana,31,paris col 2" → "31"

Held-out prompts are the fixed 1/8 of each prompt space of `zoo.tasks` (never trained on).
"""

from __future__ import annotations

from bitdelta_jax.zoo.tasks import Task, _recall, _upper, _word

# Short, single-token-ish English words: the word-level tasks exercise structure, not spelling.
WORDS = ("red", "cat", "sun", "box", "pen", "dog", "cup", "map", "hat", "jam", "owl", "fig",
         "car", "bus", "tea", "ice", "sky", "key", "bed", "egg", "fox", "van", "oak", "pie")
NAMES = ("ana", "bob", "eva", "tom", "ivy", "max", "zoe", "sam", "lea", "kim")
CITIES = ("paris", "rome", "oslo", "lima", "cairo", "delhi", "quito", "tokyo", "berlin", "madrid")


def _add2(rng):
  a, b = rng.randint(10, 99), rng.randint(10, 99)
  return f"{a} {b}", str(a + b)


def _sub2(rng):
  a, b = rng.randint(10, 99), rng.randint(10, 99)
  a, b = max(a, b), min(a, b)
  return f"{a} {b}", str(a - b)


def _mul(rng):
  a, b = rng.randint(11, 99), rng.randint(2, 9)
  return f"{a} {b}", str(a * b)


def _lower(rng):
  w = _word(rng, 3, 7)
  return w.upper(), w


def _last_word(rng):
  ws = rng.sample(WORDS, rng.randint(3, 5))
  return " ".join(ws), ws[-1]


def _count(rng):
  ws = [rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
  return " ".join(ws), str(len(ws))


def _record(rng) -> tuple[str, int, str]:
  return rng.choice(NAMES), rng.randint(18, 89), rng.choice(CITIES)


def _json_field(rng):
  name, age, city = _record(rng)
  field = rng.choice(("name", "age", "city"))
  value = {"name": name, "age": str(age), "city": city}[field]
  return f'{{"name": "{name}", "age": {age}, "city": "{city}"}} {field}', value


def _csv_field(rng):
  name, age, city = _record(rng)
  col = rng.randint(1, 3)
  return f"{name},{age},{city} col {col}", (name, str(age), city)[col - 1]


FAMILIES: dict[str, tuple[str, ...]] = {
  "arith": ("lora-add", "lora-sub", "lora-mul"),
  "text": ("lora-upper", "lora-lower", "lora-last"),
  "extract": ("lora-recall", "lora-count"),
  "format": ("lora-json", "lora-csv"),
}

LORA_TASKS: dict[str, Task] = {t.name: t for t in (
  Task("lora-add", "add", _add2, "addition of two two-digit numbers"),
  Task("lora-sub", "sub", _sub2, "subtraction of two two-digit numbers (non-negative)"),
  Task("lora-mul", "mul", _mul, "a two-digit number times a digit"),
  Task("lora-upper", "upper", _upper, "upper-case a word"),
  Task("lora-lower", "lower", _lower, "lower-case a word"),
  Task("lora-last", "last", _last_word, "the last word of a list"),
  Task("lora-recall", "recall", _recall, "key-value recall"),
  Task("lora-count", "count", _count, "count the words of a list"),
  Task("lora-json", "json", _json_field, "a field of a JSON object"),
  Task("lora-csv", "csv", _csv_field, "a column of a CSV row (1-based)"),
)}


def family_of(task: str) -> str:
  for fam, members in FAMILIES.items():
    if task in members:
      return fam
  raise KeyError(f"{task!r} is in no family: {sorted(LORA_TASKS)}")


assert sorted(LORA_TASKS) == sorted(t for m in FAMILIES.values() for t in m)
