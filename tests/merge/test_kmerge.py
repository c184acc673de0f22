"""K-Merge pool: merge math against dense numpy, K and byte budget, routing, gate fallbacks,
K-Merge++, persistence."""

import json

import numpy as np
import pytest

from bitdelta_jax import kmerge as K
from bitdelta_jax.merge.lora import LoraAdapter, LoraModule, load_adapter

RNG = np.random.default_rng(5)
MODS = {"layers.0.q_proj": (16, 12), "layers.0.v_proj": (8, 12), "layers.1.q_proj": (16, 12)}


def adapter(r=2, direction=None, noise=1.0, mods=MODS, scale=0.5):
  """A random adapter; adapters sharing `direction` (a seed) are similar."""
  out = {}
  for name, (o, i) in mods.items():
    a = noise * RNG.normal(size=(r, i))
    b = noise * RNG.normal(size=(o, r))
    if direction is not None:
      g = np.random.default_rng([direction, hash(name) % 1000])
      a = a + 3 * g.normal(size=(r, i))
      b = b + 3 * g.normal(size=(o, r))
    out[name] = LoraModule(A=a.astype(np.float32), B=b.astype(np.float32), scale=scale)
  return LoraAdapter(out, {"r": r})


def dense(ad):
  return {n: m.delta(np.float64) for n, m in ad.modules.items()}


def np_cos_mean(x, y):
  names = set(x) | set(y)
  tot = 0.0
  for n in set(x) & set(y):
    tot += np.sum(x[n] * y[n]) / np.linalg.norm(x[n]) / np.linalg.norm(y[n])
  return tot / len(names)


def test_similarity_matches_dense():
  x, y = adapter(), adapter(r=3, mods={k: MODS[k] for k in list(MODS)[:2]})
  assert abs(K.similarity(K.canonical(x), K.canonical(y)) - np_cos_mean(dense(x), dense(y))) < 1e-9
  assert abs(K.similarity(K.canonical(x), K.canonical(x)) - 1) < 1e-9


def np_project(m, t, alpha, rtol=1e-6):
  u, s, vt = np.linalg.svd(m, full_matrices=False)
  split = int(np.argmax(np.cumsum(s) / s.sum() > alpha))
  idx = np.arange(len(s))
  remove = ((idx[:, None] < split) & (idx[None] < split)) | np.diag(s > rtol * s[0])
  c = u.T @ t @ vt.T
  return t - u @ np.where(remove, c, 0) @ vt


@pytest.mark.parametrize("mode", ["opcm", "average"])
def test_merge_pair_matches_dense(mode):
  cfg = K.PoolConfig(k=1, budget_bytes=10**9, merge=mode, alpha=0.5)
  first, second, third = K.canonical(adapter(2)), K.canonical(adapter(3)), K.canonical(adapter(2))
  member = K.Member("m1", first, ["a"], [K.adapter_norm(first)])
  merged, lam = K.merge_pair(member, second, K.adapter_norm(second), cfg, rank=5)
  member2 = K.Member("m1", merged, ["a", "b"], member.norms + [K.adapter_norm(second)], lam)
  merged2, _ = K.merge_pair(member2, third, K.adapter_norm(third), cfg, rank=7)
  d1, d2, d3 = dense(first), dense(second), dense(third)
  norm = lambda d: np.sqrt(sum(np.sum(v**2) for v in d.values()))
  if mode == "average":
    ref = {n: (d1[n] + d2[n] + d3[n]) / 3 for n in MODS}
  else:  # OPCM: S_t = S_{t-1} + P(S_{t-1}, τ_t), θ = S_t · mean‖τ‖ / ‖S_t‖
    s2 = {n: d1[n] + np_project(d1[n], d2[n], 0.5) for n in MODS}
    s3 = {n: s2[n] + np_project(s2[n], d3[n], 0.5) for n in MODS}
    mean = np.mean([norm(d1), norm(d2), norm(d3)])
    ref = {n: v * mean / norm(s3) for n, v in s3.items()}
  got = dense(merged2)
  for n in MODS:
    np.testing.assert_allclose(got[n], ref[n], atol=2e-4 * np.abs(ref[n]).max(), err_msg=n)


def check_invariants(pool, seen):
  assert len(pool.members) <= pool.config.k
  assert pool.nbytes <= pool.config.budget_bytes
  assert set(pool.routing) == set(seen)
  for t in seen:
    assert pool.route(t) in pool.members


@pytest.mark.parametrize("merge", ["opcm", "average"])
@pytest.mark.parametrize("k,budget_adapters", [(3, 100), (10, 2.5), (2, 2)])
def test_pool_never_exceeds_k_or_budget(merge, k, budget_adapters):
  one = adapter(2).nbytes
  pool = K.KMergePool(K.PoolConfig(k=k, budget_bytes=int(budget_adapters * one), merge=merge))
  seen = []
  for i in range(7):
    t = f"task{i}"
    pool.add(t, adapter(2 + i % 2 if budget_adapters > 10 else 2))
    seen.append(t)
    check_invariants(pool, seen)
  assert len(pool.members) == min(k, int(budget_adapters))


def test_new_adapter_merges_into_most_similar_member():
  pool = K.KMergePool(K.PoolConfig(k=2, budget_bytes=10**6))
  pool.add("math", adapter(direction=1, noise=0.3))
  pool.add("code", adapter(direction=2, noise=0.3))
  res = pool.add("algebra", adapter(direction=1, noise=0.3))
  assert res.action == "merged" and res.member == pool.route("math")
  assert pool.members[res.member].tasks == ["math", "algebra"]
  assert pool.route("code") != res.member
  assert res.similarity > 0.5


def test_plusplus_merges_similar_even_with_free_slots():
  cfg = K.PoolConfig(k=4, budget_bytes=10**6, plusplus=True, similarity_threshold=0.5)
  pool = K.KMergePool(cfg)
  pool.add("math", adapter(direction=1, noise=0.3))
  assert pool.add("algebra", adapter(direction=1, noise=0.3)).action == "merged"
  assert pool.add("code", adapter(direction=2, noise=0.3)).action == "slot"
  assert len(pool.members) == 2
  plain = K.KMergePool(K.PoolConfig(k=4, budget_bytes=10**6))
  plain.add("math", adapter(direction=1, noise=0.3))
  assert plain.add("algebra", adapter(direction=1, noise=0.3)).action == "slot"


def test_gate_pass_and_route_closest_fallback():
  calls = []

  def gate(ad, task):
    calls.append(task)
    return 0.0 if task == "picky" else 1.0

  pool = K.KMergePool(K.PoolConfig(k=1, budget_bytes=10**6, gate_threshold=0.5), gate=gate)
  pool.add("a", adapter())
  assert pool.add("b", adapter()).action == "merged"
  assert calls == ["a", "b"]
  before = {n: m.A.copy() for n, m in pool.members["m1"].adapter.modules.items()}
  res = pool.add("picky", adapter())
  assert res.action == "routed" and res.scores["picky"] == 0.0
  assert pool.route("picky") == "m1" and pool.members["m1"].tasks == ["a", "b"]
  for n, m in pool.members["m1"].adapter.modules.items():
    np.testing.assert_array_equal(m.A, before[n])  # originals kept


def test_evict_least_used_fallback():
  cfg = K.PoolConfig(k=2, budget_bytes=10**6, gate_threshold=0.5, fallback="evict_least_used")
  pool = K.KMergePool(cfg, gate=lambda ad, t: 0.0)
  pool.add("a", adapter(direction=1, noise=0.3))
  pool.add("b", adapter(direction=2, noise=0.3))
  for _ in range(3):
    pool.adapter_for("a")
  res = pool.add("c", adapter(direction=1, noise=0.3))
  assert res.action == "evicted" and res.evicted == "m2"
  assert set(pool.members) == {"m1", res.member}
  check_invariants(pool, ["a", "b", "c"])
  assert pool.route("b") in pool.members


def test_persistence_round_trip(tmp_path):
  pool = K.KMergePool(K.PoolConfig(k=2, budget_bytes=10**6, merge="opcm"))
  for i in range(4):
    pool.add(f"t{i}", adapter(direction=i % 2, noise=0.5))
  pool.adapter_for("t0")
  pool.save(tmp_path / "pool")
  again = K.KMergePool.load(tmp_path / "pool")
  assert again.routing == pool.routing and again.config == pool.config
  assert [m.meta() for m in again.members.values()] == [m.meta() for m in pool.members.values()]
  for mid, m in pool.members.items():
    for n, mod in m.adapter.modules.items():
      np.testing.assert_array_equal(again.members[mid].adapter.modules[n].delta(), mod.delta())
  # members are plain PEFT adapter directories
  loaded = load_adapter(tmp_path / "pool" / "members" / "m1")
  assert (
    json.loads((tmp_path / "pool" / "members" / "m1" / "adapter_config.json").read_text())[
      "peft_type"
    ]
    == "LORA"
  )
  assert set(loaded.modules) == set(MODS)
  # the reloaded pool continues exactly like the original
  nxt = adapter(direction=1, noise=0.5)
  r1, r2 = pool.add("t4", nxt), again.add("t4", nxt)
  assert (r1.action, r1.member) == (r2.action, r2.member)
  for n, mod in pool.members[r1.member].adapter.modules.items():
    np.testing.assert_allclose(
      again.members[r1.member].adapter.modules[n].delta(), mod.delta(), atol=1e-6
    )
  pool.save(tmp_path / "pool")  # overwrite in place
  assert K.KMergePool.load(tmp_path / "pool").routing == pool.routing


def test_adapter_from_directory_and_budget_errors(tmp_path):
  from bitdelta_jax.merge.lora import save_adapter

  ad = adapter()
  save_adapter(ad, tmp_path / "ad")
  pool = K.KMergePool(K.PoolConfig(k=1, budget_bytes=ad.nbytes))
  assert pool.add("x", tmp_path / "ad").action == "slot"
  with pytest.raises(ValueError, match="budget"):
    K.KMergePool(K.PoolConfig(k=1, budget_bytes=10)).add("x", ad)
  with pytest.raises(KeyError):
    pool.route("never-seen")
