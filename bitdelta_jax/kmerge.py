"""K-Merge: a pool of at most K LoRA adapters within B bytes, fed one adapter at a time
(Shenaj et al., arXiv:2510.13537).

A new adapter (one task) takes a free slot; when the pool is full (K members, or the bytes
would pass B) it is merged into its most similar member, similarity being the mean over modules
of the cosine similarity of ΔW = B·A (modules present in only one adapter count 0). K-Merge++
(``plusplus=True``) opens a new slot only when the best similarity is below
``similarity_threshold``. Merging is OPCM (`bitdelta_jax.merge.opcm`) or a running average.

Everything is computed in the low-rank core space: with [B_m B_n] = Q_b R_b and
[A_m; A_n]ᵀ = Q_a R_a, both deltas are Q_b C Q_aᵀ with C of size (r_m + r_n)², so a merge never
forms an out × in matrix. The merged member is truncated back (SVD of its core) to
max(r_m, r_n), lowered further if the byte budget requires.

An optional quality gate ``gate(adapter, task) -> score`` scores the merged adapter on every
task the member serves plus the new one; the originals are replaced only when all scores reach
``gate_threshold``. Otherwise the fallback applies:

* ``"route_closest"`` (default): the member is kept unchanged, the new adapter is discarded and
  its task is routed to that closest member;
* ``"evict_least_used"``: the least-used member (fewest `adapter_for` calls; oldest on ties) is
  evicted, its tasks are routed to its most similar remaining member, and the new adapter takes
  the freed slot.

`route` / `adapter_for` serve every task seen so far. `save` / `KMergePool.load` persist the
pool: ``pool.json`` plus one PEFT adapter directory per member (loadable by PEFT itself).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import jax.numpy as jnp
import numpy as np

from bitdelta_jax.merge.lora import LoraAdapter, LoraModule, load_adapter, save_adapter
from bitdelta_jax.merge.opcm import project_task_vector

Gate = Callable[[LoraAdapter, str], float]
POOL_FILE = "pool.json"


@dataclass(frozen=True)
class PoolConfig:
  k: int
  budget_bytes: int
  merge: Literal["opcm", "average"] = "opcm"
  alpha: float = 0.5  # OPCM split threshold
  plusplus: bool = False
  similarity_threshold: float = 0.5  # K-Merge++ only
  gate_threshold: float = 0.0
  fallback: Literal["route_closest", "evict_least_used"] = "route_closest"

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"k must be >= 1, got {self.k}")
    if self.merge not in ("opcm", "average"):
      raise ValueError(f"merge must be 'opcm' or 'average', got {self.merge!r}")
    if self.fallback not in ("route_closest", "evict_least_used"):
      raise ValueError(f"unknown fallback {self.fallback!r}")


@dataclass
class Member:
  id: str
  adapter: LoraAdapter  # canonical: scale 1, [out, in] layout
  tasks: list[str]  # tasks merged into this member, in arrival order
  norms: list[float]  # ‖τ_i‖ (over all modules) of each adapter merged in; OPCM's mean norm
  lam: float = 1.0  # OPCM λ_t: the member's delta is S_t / λ_t
  uses: int = 0
  created: int = 0

  def meta(self) -> dict:
    return {
      "id": self.id,
      "tasks": self.tasks,
      "norms": self.norms,
      "lam": self.lam,
      "uses": self.uses,
      "created": self.created,
    }


@dataclass
class AddResult:
  action: Literal["slot", "merged", "routed", "evicted"]
  member: str
  similarity: float | None = None
  scores: dict[str, float] | None = None
  evicted: str | None = None


# ---------------------------------------------------------------- factor algebra


def canonical(adapter: LoraAdapter) -> LoraAdapter:
  """Scale folded into B, fan_in_fan_out layers turned into [out, in] ones."""
  mods = {}
  for name, m in adapter.modules.items():
    a, b = m.A, m.B * np.asarray(m.scale, m.B.dtype)
    if m.fan_in_fan_out:
      a, b = b.T, a.T
    mods[name] = LoraModule(A=np.ascontiguousarray(a), B=np.ascontiguousarray(b), scale=1.0)
  return LoraAdapter(mods, dict(adapter.config))


def _inner(x: LoraModule, y: LoraModule) -> float:
  """<B_x A_x, B_y A_y>_F without forming either product."""
  bx, ax = x.B.astype(np.float64), x.A.astype(np.float64)
  by, ay = y.B.astype(np.float64), y.A.astype(np.float64)
  return float(np.sum((bx.T @ by) * (ax @ ay.T)))


def adapter_norm(adapter: LoraAdapter) -> float:
  return float(np.sqrt(sum(_inner(m, m) for m in adapter.modules.values())))


def similarity(x: LoraAdapter, y: LoraAdapter) -> float:
  """Mean over the union of modules of cos(ΔW_x, ΔW_y) (canonical adapters)."""
  names = set(x.modules) | set(y.modules)
  if not names:
    return 0.0
  total = 0.0
  for n in names & set(y.modules) & set(x.modules):
    mx, my = x.modules[n], y.modules[n]
    den = np.sqrt(_inner(mx, mx) * _inner(my, my))
    total += _inner(mx, my) / den if den > 0 else 0.0
  return total / len(names)


def _factors(adapter: LoraAdapter, name: str, like: LoraModule) -> tuple[np.ndarray, np.ndarray]:
  m = adapter.modules.get(name)
  if m is None:  # a rank-0 factor pair of the right shape
    return np.zeros((0, like.A.shape[1])), np.zeros((like.B.shape[0], 0))
  return m.A.astype(np.float64), m.B.astype(np.float64)


def _core_space(member: LoraAdapter, new: LoraAdapter, name: str):
  """(Q_b, Q_a, C_member, C_new) with ΔW = Q_b C Q_aᵀ for both adapters."""
  like = member.modules.get(name) or new.modules[name]
  am, bm = _factors(member, name, like)
  an, bn = _factors(new, name, like)
  qb, rb = np.linalg.qr(np.concatenate([bm, bn], axis=1))
  qa, ra = np.linalg.qr(np.concatenate([am, an], axis=0).T)
  rm = am.shape[0]
  return qb, qa, rb[:, :rm] @ ra[:, :rm].T, rb[:, rm:] @ ra[:, rm:].T


def _truncate(qb, qa, core, rank: int, dtype) -> LoraModule:
  u, s, vt = np.linalg.svd(core, full_matrices=False)
  r = min(rank, s.shape[0])
  root = np.sqrt(s[:r])
  b = qb @ (u[:, :r] * root)
  a = (root[:, None] * vt[:r]) @ qa.T
  if r < rank:  # pad to a uniform rank so the adapter has one r
    b = np.pad(b, ((0, 0), (0, rank - r)))
    a = np.pad(a, ((0, rank - r), (0, 0)))
  return LoraModule(A=a.astype(dtype), B=b.astype(dtype), scale=1.0)


def _bytes_at_rank(names_shapes: dict[str, tuple[int, int]], rank: int, itemsize: int) -> int:
  return sum((o + i) * rank * itemsize for o, i in names_shapes.values())


def merge_pair(
  member: Member, new: LoraAdapter, new_norm: float, cfg: PoolConfig, rank: int
) -> tuple[LoraAdapter, float]:
  """The merged adapter (at `rank`) and its OPCM λ. `member` is not modified."""
  names = sorted(set(member.adapter.modules) | set(new.modules))
  spaces = {n: _core_space(member.adapter, new, n) for n in names}
  n_prev = len(member.tasks)
  cores, lam = {}, 1.0
  if cfg.merge == "average":
    for n, (_, _, cm, cn) in spaces.items():
      cores[n] = (n_prev * cm + cn) / (n_prev + 1)
  else:
    for n, (_, _, cm, cn) in spaces.items():
      cleaned = np.asarray(
        project_task_vector(jnp.asarray(cm, jnp.float32), jnp.asarray(cn, jnp.float32), cfg.alpha),
        np.float64,
      )
      cores[n] = member.lam * cm + cleaned  # S_t
    norms = member.norms + [new_norm]
    s_norm = np.sqrt(sum(np.sum(c**2) for c in cores.values()))
    lam = s_norm / (sum(norms) / len(norms)) if s_norm > 0 else 1.0
    cores = {n: c / lam for n, c in cores.items()}
  dtype = next(iter(member.adapter.modules.values())).A.dtype
  mods = {n: _truncate(spaces[n][0], spaces[n][1], cores[n], rank, dtype) for n in names}
  return LoraAdapter(mods, dict(member.adapter.config)), float(lam)


# ---------------------------------------------------------------- the pool


@dataclass
class KMergePool:
  config: PoolConfig
  gate: Gate | None = None
  members: dict[str, Member] = field(default_factory=dict)
  routing: dict[str, str] = field(default_factory=dict)
  events: list[dict] = field(default_factory=list)
  counter: int = 0

  @property
  def nbytes(self) -> int:
    return sum(m.adapter.nbytes for m in self.members.values())

  def tasks(self) -> list[str]:
    return list(self.routing)

  def route(self, task: str) -> str:
    """The id of the member serving `task`."""
    try:
      return self.routing[task]
    except KeyError:
      raise KeyError(f"task {task!r} was never added to the pool") from None

  def adapter_for(self, task: str) -> LoraAdapter:
    """The adapter serving `task` (counts as a use, for the least-used fallback)."""
    m = self.members[self.route(task)]
    m.uses += 1
    return m.adapter

  def _new_member(self, task: str, adapter: LoraAdapter, norm: float) -> Member:
    self.counter += 1
    m = Member(
      id=f"m{self.counter}", adapter=adapter, tasks=[task], norms=[norm], created=self.counter
    )
    self.members[m.id] = m
    self.routing[task] = m.id
    return m

  def _closest(self, adapter: LoraAdapter, exclude: str | None = None) -> tuple[str, float]:
    best, best_sim = None, -np.inf
    for mid, m in self.members.items():
      if mid == exclude:
        continue
      s = similarity(adapter, m.adapter)
      if s > best_sim:
        best, best_sim = mid, s
    return best, float(best_sim)

  def add(self, task: str, adapter: LoraAdapter | str | os.PathLike) -> AddResult:
    """Adds the adapter of `task` (a LoraAdapter or a PEFT directory)."""
    if not isinstance(adapter, LoraAdapter):
      adapter = load_adapter(adapter)
    new = canonical(adapter)
    cfg = self.config
    if new.nbytes > cfg.budget_bytes:
      raise ValueError(
        f"adapter for {task!r} is {new.nbytes} bytes, over the whole budget of {cfg.budget_bytes}"
      )
    norm = adapter_norm(new)
    closest, sim = self._closest(new) if self.members else (None, None)
    free = len(self.members) < cfg.k and self.nbytes + new.nbytes <= cfg.budget_bytes
    wants_merge = cfg.plusplus and closest is not None and sim >= cfg.similarity_threshold
    if free and not wants_merge:
      m = self._new_member(task, new, norm)
      return self._log(task, AddResult("slot", m.id, sim))
    if closest is None:  # empty pool, but the adapter cannot fit: impossible after the check
      raise ValueError("no room for the adapter")
    member = self.members[closest]
    merged, lam = self._merge_within_budget(member, new, norm)
    scores = None
    if self.gate is not None:
      scores = {t: float(self.gate(merged, t)) for t in [*member.tasks, task]}
      if min(scores.values()) < cfg.gate_threshold:
        return self._fallback(task, new, norm, member, sim, scores)
    member.adapter, member.lam = merged, lam
    member.tasks.append(task)
    member.norms.append(norm)
    self.routing[task] = member.id
    return self._log(task, AddResult("merged", member.id, sim, scores))

  def _merge_within_budget(self, member: Member, new: LoraAdapter, norm: float):
    rank = max(member.adapter.rank, new.rank)
    names = set(member.adapter.modules) | set(new.modules)
    shapes = {}
    for n in names:
      m = member.adapter.modules.get(n) or new.modules[n]
      shapes[n] = (m.B.shape[0], m.A.shape[1])
    itemsize = next(iter(member.adapter.modules.values())).A.dtype.itemsize
    others = self.nbytes - member.adapter.nbytes
    while rank > 0 and others + _bytes_at_rank(shapes, rank, itemsize) > self.config.budget_bytes:
      rank -= 1
    if rank == 0:
      raise ValueError(
        f"no rank of the merged adapter fits the budget of {self.config.budget_bytes} bytes"
      )
    return merge_pair(member, new, norm, self.config, rank)

  def _fallback(self, task, new, norm, member, sim, scores) -> AddResult:
    if self.config.fallback == "route_closest":
      self.routing[task] = member.id
      return self._log(task, AddResult("routed", member.id, sim, scores))
    evicted = []
    while self.members and (
      len(self.members) >= self.config.k or self.nbytes + new.nbytes > self.config.budget_bytes
    ):
      victim = min(self.members.values(), key=lambda m: (m.uses, m.created))
      del self.members[victim.id]
      evicted.append(victim)
    m = self._new_member(task, new, norm)
    for victim in evicted:
      target, _ = self._closest(victim.adapter)
      for t, mid in list(self.routing.items()):
        if mid == victim.id:
          self.routing[t] = target
    return self._log(task, AddResult("evicted", m.id, sim, scores, ",".join(v.id for v in evicted)))

  def _log(self, task: str, result: AddResult) -> AddResult:
    self.events.append({"task": task, **asdict(result)})
    assert len(self.members) <= self.config.k and self.nbytes <= self.config.budget_bytes
    return result

  # ---------------------------------------------------------------- persistence

  def save(self, path: str | os.PathLike) -> Path:
    """Writes the pool atomically (a temporary directory renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
      shutil.rmtree(tmp)
    (tmp / "members").mkdir(parents=True)
    for mid, m in self.members.items():
      save_adapter(m.adapter, tmp / "members" / mid)
    state = {
      "config": asdict(self.config),
      "members": [m.meta() for m in self.members.values()],
      "routing": self.routing,
      "events": self.events,
      "counter": self.counter,
    }
    (tmp / POOL_FILE).write_text(json.dumps(state, indent=2))
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
      path.rename(old)
    tmp.rename(path)
    if old.exists():
      shutil.rmtree(old)
    return path

  @classmethod
  def load(cls, path: str | os.PathLike, gate: Gate | None = None) -> KMergePool:
    path = Path(path)
    state = json.loads((path / POOL_FILE).read_text())
    pool = cls(
      PoolConfig(**state["config"]),
      gate=gate,
      routing=dict(state["routing"]),
      events=list(state["events"]),
      counter=int(state["counter"]),
    )
    for meta in state["members"]:
      adapter = canonical(load_adapter(path / "members" / meta["id"]))
      pool.members[meta["id"]] = Member(adapter=adapter, **meta)
    return pool
