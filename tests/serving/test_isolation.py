"""Tenants cannot touch each other (issue 35): a variant with non-finite weights is refused at
registration and at start, and one that reaches a slot anyway (written straight into the engine)
changes no other model's tokens or log probabilities, in shared batches (> 64-token prefill steps
with LoRA rows, decode steps), on recycled KV pages, with prefix-cache hits, and after it is
deleted. Every response body is strict JSON (no NaN / Infinity).

The isolation check runs one schedule on two servers of the same configuration: in one the
variant ``evil``'s slot holds finite weights, in the other the same tensors with inf / NaN.
Requests of a phase that must share batches are queued while the engine is held, so both
servers run the very same steps, and the base's answers must be equal to the last bit.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time

import numpy as np
import pytest
import requests

from bitdelta_jax.delta.entries import LoraEntry, ResidualEntry
from bitdelta_jax.delta.store import load_delta
from bitdelta_jax.merge.lora import CONFIG_FILE, from_factors, load_adapter, save_adapter
from bitdelta_jax.models.slots import lora_entries
from serving.app import BadVariantsError, ServerThread
from serving.config import ServerConfig
from serving.testing import poison_array, synthetic_family

Q0 = "model.layers.0.self_attn.q_proj.weight"
V0 = "model.layers.0.self_attn.v_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"
NORM1 = "model.layers.1.input_layernorm.weight"
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x page_size x kv heads x head_dim x f32


def strict_json(text: str):
  """``json.loads`` that refuses NaN, Infinity and -Infinity (as JS, Go and openai-node do)."""

  def refuse(constant):
    raise ValueError(f"not JSON: {constant}")

  return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  root = tmp_path_factory.mktemp("isolation")
  base, deltas = synthetic_family(root, n=1)
  rng = np.random.default_rng(0)
  lora_factors = {"model.layers.0.self_attn.v_proj": (
    0.1 * rng.standard_normal((4, 64)).astype(np.float32),
    0.1 * rng.standard_normal((32, 4)).astype(np.float32))}
  save_adapter(from_factors(lora_factors), root / "lora")
  hostile = {}
  for name, (tensor, field, value) in {
    "alpha_inf": (Q0, "scale", np.inf),
    "alpha_nan": (Q0, "scale", np.nan),
    "norm_nan": (NORM1, "value", np.nan),
    "alpha_big": (Q0, "scale", 1e30),  # finite: accepted, and kept to its own rows
  }.items():
    d = shutil.copytree(deltas["v0"], root / "hostile" / name)
    hostile[name] = poison_array(d, tensor, field, value)
  (a, b), = lora_factors.values()
  save_adapter(from_factors({"model.layers.0.self_attn.v_proj": (a, np.where(
    np.arange(b.size).reshape(b.shape) == 5, np.nan, b))}), root / "hostile" / "lora_nan")
  hostile["lora_nan"] = root / "hostile" / "lora_nan"
  r0 = shutil.copytree(root / "lora", root / "hostile" / "lora_r0")
  cfg = json.loads((r0 / CONFIG_FILE).read_text())
  (r0 / CONFIG_FILE).write_text(json.dumps(dict(cfg, r=0)))
  hostile["lora_r0"] = r0
  return base, deltas["v0"], root / "lora", hostile


def _config(family, **kw) -> ServerConfig:
  base, v0, lora, _ = family
  d = dict(base=str(base), base_name="base", port=0, device_slots=2, max_batch=8,
           max_seq_len=256, kv_cache_mb=26 * PAGE_BYTES / (1 << 20), warmup=False,
           variants=(("evil", str(v0)), ("lora", str(lora))), pins=("evil",))
  d.update(kw)
  return ServerConfig(**d)


def post(h, path, body):
  return requests.post(h.url + path, json=body, timeout=120)


# -- response bodies: strict JSON ---------------------------------------------------------------
class _Words:
  def decode(self, ids):
    return "".join(f" w{i}" for i in ids)


def test_non_finite_log_probabilities_are_null_in_both_formats():
  from serving.logprobs import chat_logprobs, completion_logprobs

  entries = [(3, float("nan"), [(3, float("nan")), (4, -1.5)]), (5, -0.25, [(6, float("-inf"))]),
             (7, float("inf"), None)]
  obj, _ = completion_logprobs(_Words(), entries)
  assert obj["token_logprobs"] == [None, -0.25, None]
  assert obj["top_logprobs"] == [{" w3": None, " w4": -1.5}, {" w6": None}, None]
  chat = chat_logprobs(_Words(), entries)
  assert [c["logprob"] for c in chat] == [None, -0.25, None]
  assert [a["logprob"] for a in chat[0]["top_logprobs"]] == [None, -1.5]
  assert strict_json(json.dumps({"a": obj, "b": chat}, allow_nan=False))


def test_bodies_never_carry_nan_or_infinity():
  from serving import protocol as P

  body = {"x": [1.5, float("nan"), {"y": float("-inf")}], "z": (float("inf"), 2), "s": "NaN"}
  want = {"x": [1.5, None, {"y": None}], "z": [None, 2], "s": "NaN"}
  assert strict_json(P.dumps(body)) == want
  assert strict_json(P.sse(body).decode()[len("data: "):]) == want
  assert P.dumps({"a": 1.0}, separators=(",", ":")) == '{"a":1.0}'


# -- refused: registration and start -----------------------------------------------------------
REFUSED = {  # variant -> what the 400 must name
  "alpha_inf": (Q0, "non-finite"),
  "alpha_nan": (Q0, "non-finite"),
  "norm_nan": (NORM1, "non-finite"),
  "lora_nan": ("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight", "non-finite"),
  "lora_r0": (CONFIG_FILE, "r is 0; a LoRA rank must be an integer >= 1"),
}


def test_hostile_variants_are_refused_at_registration(family):
  *_, hostile = family
  with ServerThread(_config(family, pins=())) as h:
    for name, (what, why) in REFUSED.items():
      r = post(h, "/v1/variants", {"name": name, "path": str(hostile[name])})
      assert r.status_code == 400, (name, r.status_code, r.text)
      err = strict_json(r.text)["error"]
      assert err["param"] == "path" and what in err["message"] and why in err["message"], err
    r = post(h, "/v1/variants", {"name": "alpha_big", "path": str(hostile["alpha_big"])})
    assert r.status_code == 201, r.text  # a huge α is a number: see the isolation test
    models = {m["id"] for m in strict_json(requests.get(h.url + "/v1/models", timeout=30).text)[
      "data"]}
    assert models == {"base", "evil", "lora", "alpha_big"}


def test_hostile_configured_variants_stop_the_start(family):
  *_, hostile = family
  bad = {n: str(hostile[n]) for n in REFUSED}
  t0 = time.perf_counter()
  with pytest.raises(BadVariantsError) as ei:
    ServerThread(_config(family, variants=tuple(bad.items()), pins=())).start()
  assert set(ei.value.bad) == set(REFUSED)
  for name, (what, why) in REFUSED.items():
    assert what in ei.value.bad[name] and why in ei.value.bad[name], ei.value.bad[name]
  assert time.perf_counter() - t0 < 60  # refused before the model was built


# -- isolation: a hostile slot changes nothing for the others ----------------------------------
def _slot_contents(family, *, hostile: bool) -> dict:
  """The tensors written into ``evil``'s slot: v0's 1-bit delta, a LoRA on layer 0's v_proj
  beside its 1-bit delta, a LoRA alone on layer 1's down_proj. Hostile: the same with q_proj's
  α inf, a NaN in v_proj's B and in down_proj's A."""
  _, v0, lora, _ = family
  delta = dict(load_delta(v0)[0])
  (v_lora,) = lora_entries(load_adapter(lora)).values()
  rng = np.random.default_rng(1)
  down_a = 0.1 * rng.standard_normal((128, 4)).astype(np.float32)
  down_b = 0.1 * rng.standard_normal((4, 64)).astype(np.float32)
  b = np.array(v_lora.b)
  if hostile:
    scale = np.array(delta[Q0].scale)
    scale.reshape(-1)[0] = np.inf
    delta[Q0] = dataclasses.replace(delta[Q0], scale=scale)
    b[1, 3] = np.nan
    down_a[7, 2] = np.nan
  delta[V0] = ResidualEntry(delta[V0], LoraEntry(np.array(v_lora.a), b))
  delta[DOWN1] = LoraEntry(down_a, down_b)
  return delta


def _completion(h, model, prompt, *, stream=False, max_tokens=6):
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
          "logprobs": 3, "ignore_eos": True, "return_tokens_as_token_ids": True,
          "stream": stream}
  r = requests.post(h.url + "/v1/completions", json=body, timeout=120, stream=stream)
  assert r.status_code == 200, r.text
  if not stream:
    return strict_json(r.text)["choices"][0]["logprobs"]
  chunks = []
  for line in r.iter_lines(decode_unicode=True):
    if line.startswith("data: ") and line != "data: [DONE]":
      chunks.append(strict_json(line[len("data: "):]))
  return [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]


def _held(h, jobs):
  """Runs ``jobs`` (functions making one HTTP request each) while the engine is held, each
  queued before the next starts, then lets the engine take them all in one iteration."""
  eng = h.server.engine
  gate, holding = threading.Event(), threading.Event()
  fut = eng.call(lambda gen: (holding.set(), gate.wait(60)))
  assert holding.wait(60)
  out, threads, depth = [None] * len(jobs), [], eng.queue_depth
  for i, job in enumerate(jobs):
    t = threading.Thread(target=lambda i=i, job=job: out.__setitem__(i, job()))
    t.start()
    threads.append(t)
    deadline = time.monotonic() + 60
    while eng.queue_depth < depth + i + 1:
      assert time.monotonic() < deadline, "a request did not reach the engine"
      time.sleep(0.01)
  gate.set()
  fut.result(60)
  for t in threads:
    t.join(180)
  assert all(o is not None for o in out)
  return out


def _nan_pages(gen):
  """Pages of the KV pools holding a non-finite K or V, and the pool's next free pages."""
  k, v = np.asarray(gen.runner.k_pool), np.asarray(gen.runner.v_pool)
  bad = ~(np.isfinite(k).all(axis=(0, 2, 3, 4)) & np.isfinite(v).all(axis=(0, 2, 3, 4)))
  return set(np.nonzero(bad)[0].tolist()), list(gen.pool.free)


def _schedule(family, *, hostile: bool) -> dict:
  rng = np.random.default_rng(7)
  ids = lambda n: rng.integers(3, 250, n).tolist()  # noqa: E731
  long_a, long_b, long_c, long_d, long_e = (ids(n) for n in (100, 90, 100, 100, 80))
  short = [ids(5) for _ in range(4)]
  out = {}
  with ServerThread(_config(family)) as h:
    slot = h.server.registry.get("evil").slot
    assert slot is not None  # pinned: loaded at start
    delta = _slot_contents(family, hostile=hostile)
    h.server.engine.call(lambda gen: gen.load_variant(slot, delta)).result(120)
    # 0: the base alone (its full pages are cached for phase 2)
    out["base_a"] = _completion(h, "base", long_a)
    # 1: the hostile variant alone: its pages are released (the partial ones to the free list)
    out["evil_d"] = _completion(h, "evil", long_d)
    out["evil_s"] = _completion(h, "evil", short[0])
    pages, free = h.server.engine.call(_nan_pages).result(60)
    out["nan_pages"] = len(pages)
    if hostile:  # the next page handed out was written NaN by the hostile variant
      assert pages and free[-1] in pages, (sorted(pages), free[-4:])
    # 2: one iteration takes them all: base long_a again (prefix hit), the packed prefill of
    # base long_b and evil long_c (> 64 rows, LoRA rows among them), then decode steps
    jobs = [lambda: _completion(h, "base", long_a), lambda: _completion(h, "base", long_b),
            lambda: _completion(h, "evil", long_c), lambda: _completion(h, "base", short[1]),
            lambda: _completion(h, "evil", short[2], stream=True)]
    for key, got in zip(("base_a2", "base_b", "evil_c", "base_s", "evil_s2"), _held(h, jobs)):
      out[key] = got
    # 3: after DELETE, the base on whatever pages the pool hands out
    r = requests.delete(h.url + "/v1/variants/evil", timeout=60)
    assert r.status_code == 200, r.text
    strict_json(r.text)
    out["base_e"] = _completion(h, "base", long_e)
    out["base_s3"] = _completion(h, "base", short[3], max_tokens=12)
  return out


def _logprob_values(lp) -> list:
  """Every log probability of a completions logprobs object (or a list of streamed ones)."""
  if isinstance(lp, list):
    return [x for piece in lp if piece for x in _logprob_values(piece)]
  return list(lp["token_logprobs"]) + [x for top in lp["top_logprobs"] for x in top.values()]


@pytest.mark.slow
def test_a_hostile_slot_changes_nothing_for_the_base(family):
  clean = _schedule(family, hostile=False)
  hostile = _schedule(family, hostile=True)
  assert clean["nan_pages"] == 0 and hostile["nan_pages"] > 0
  base_keys = [k for k in clean if k.startswith("base_")]
  for key in base_keys:
    assert hostile[key] == clean[key], key  # token ids and log probabilities, to the last bit
    assert all(x is not None for x in _logprob_values(hostile[key])), key
  # the hostile variant's own answers are broken, and still strict JSON: null log probabilities
  for key in ("evil_d", "evil_c", "evil_s2"):
    assert None in _logprob_values(hostile[key]), key
    assert None not in _logprob_values(clean[key]), key
