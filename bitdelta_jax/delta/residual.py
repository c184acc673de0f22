"""Delta modes beyond plain BitDelta: 1-bit + compensated low rank (D-QRELO), truncated SVD,
and mixed-precision singular vectors (Delta-CoMe-style), each at a byte budget.

Every mode maps one Flax-layout delta ``Δ [K, N]`` (in, out) to an entry the slot banks serve
exactly (`bitdelta_jax.models.slots`):

* ``dqrelo`` → `ResidualEntry` ``α ⊙ S + a·b`` (the layer's 1-bit bank and its LoRA bank);
* ``svd`` / ``delta-come`` → `LoraEntry` ``a·b`` (the LoRA bank alone);
* a budget too small for any low-rank part leaves ``dqrelo`` a plain `PackedDelta`.

The factors are `CodedLora` (a `LoraEntry` that also knows how each rank component is stored):
per component either 16-bit floats (bf16 or f16) or a ``w``-bit uniform code (w ∈ {8, 4, 2})
with one f32 step per vector. ``a``/``b`` hold the *decoded* f32 values, so what the bank
serves, what `apply` materialises and what the store writes are the same numbers.

D-QRELO (Li et al., arXiv:2604.16940) is described in its abstract as "coarse one-bit
quantization for the dominant structure, then a compensated residual low-rank approximation";
the paper's exact compensation was not available to us, so this is the natural version, stated
here so nobody mistakes it for the paper's: block-coordinate descent on ‖Δ − α⊙S − a·b‖²,

  1. S = sign(Δ), α = mean|Δ| (per column or per matrix);
  2. repeat ``iters`` times: a·b = best rank-r approximation (SVD, then coded) of Δ − α⊙S;
     S = sign(Δ − a·b); α = mean|Δ − a·b| (each the exact minimiser given the others);
  3. a final a·b of Δ − α⊙S.

With 16-bit factors every step cannot increase the error, so the fit is never worse than
BitDelta's (tested). Delta-CoMe (Ping et al., 2024) gives larger singular values more bits; here
the widths come from a greedy knapsack over per-component measured errors per byte (cross terms
between components' coding errors are ignored) instead of the paper's fixed schedule, and
round-to-nearest codes instead of GPTQ.

Bytes are counted as stored (`stored_nbytes`): bits, f32 α, codes, steps, one width byte per
component. A budget is a fraction of the bf16 bytes of the weight (``2·K·N``), per matrix.

Which to use: on the built-in family (128-wide layers) ``delta-come`` is the best at every
budget from 1/16 to 1/8, and at ≤ 1/15 D-QRELO has no room left beyond its sign plane
(bench/results/compress/delta_modes.md); on wide layers the low-rank part is relatively much cheaper.
"""

from __future__ import annotations

import contextlib
import dataclasses

import ml_dtypes
import numpy as np

from bitdelta_jax.delta.entries import LoraEntry, ResidualEntry
from bitdelta_jax.delta.format import DEFAULT_GROUP_K, PackedDelta, pack

MODES: tuple[str, ...] = ("bitdelta", "dqrelo", "svd", "delta-come")
CODE_WIDTHS: tuple[int, ...] = (2, 4, 8)
MIXED = 0  # a `ModeSpec.width` meaning "widths per component from the budget" (Delta-CoMe-style)
FLOAT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class CodedLora(LoraEntry):
  """Low-rank factors ``a [K, r]``, ``b [r, N]`` (decoded f32) plus how they are stored.

  Attributes:
    widths: per rank component, 16 (a 16-bit float, ``float_dtype``), a code width 8/4/2, or
      32 (f32, what a plain `LoraEntry` is stored as).
    a_step, b_step: f32 ``[r]``: the code step of each component's vector (0 for 16-bit).
    float_dtype: ``"bfloat16"`` or ``"float16"`` for the 16-bit components.
  """

  widths: tuple[int, ...] = ()
  a_step: np.ndarray | None = None
  b_step: np.ndarray | None = None
  float_dtype: str = "bfloat16"

  @property
  def rank(self) -> int:
    return int(self.a.shape[1])

  @property
  def stored_nbytes(self) -> int:
    k, n = self.a.shape[0], self.b.shape[1]
    return sum(component_bytes(k, n, w) for w in self.widths)


def component_bytes(k: int, n: int, width: int) -> int:
  """Stored bytes of one rank component of a ``[K, N]`` weight at ``width`` bits."""
  if width in (16, 32):
    return width // 8 * (k + n) + 1
  return -(-k * width // 8) + -(-n * width // 8) + 8 + 1  # codes, two f32 steps, width byte


def stored_nbytes(entry) -> int:
  """Bytes an entry of a linear weight takes in the delta store."""
  if isinstance(entry, PackedDelta):
    return entry.nbytes
  if isinstance(entry, ResidualEntry):
    return entry.packed.nbytes + stored_nbytes(entry.lora)
  if isinstance(entry, CodedLora):
    return entry.stored_nbytes
  if isinstance(entry, LoraEntry):
    return int(entry.a.nbytes + entry.b.nbytes)
  raise TypeError(f"not a linear-weight entry: {type(entry).__name__}")


def dense_of(entry) -> np.ndarray:
  """The ``[K, N]`` f32 delta an entry stands for (what the slot banks compute)."""
  from bitdelta_jax.delta.format import dense_delta

  if isinstance(entry, PackedDelta):
    return np.asarray(dense_delta(entry, np.float32))
  if isinstance(entry, ResidualEntry):
    return dense_of(entry.packed) + dense_of(entry.lora)
  if isinstance(entry, LoraEntry):
    return np.asarray(entry.a, np.float32) @ np.asarray(entry.b, np.float32)
  raise TypeError(f"not a linear-weight entry: {type(entry).__name__}")


# ----------------------------------------------------------------------------- coding vectors


def code_rows(v: np.ndarray, width: int, float_dtype: str = "bfloat16"
              ) -> tuple[np.ndarray, np.ndarray]:
  """``(decoded f32 [m, L], steps f32 [m])``: each row of ``v`` coded at ``width`` bits.

  16: rounded to ``float_dtype`` (step 0). w < 16: mid-rise uniform code
  ``(q + ½)·step``, ``q ∈ [−2^(w−1), 2^(w−1) − 1]``, each row's step chosen among 24
  candidates (a geometric grid below max|v|/(2^(w−1) − ½)) to minimise its squared error.
  """
  v = np.asarray(v, np.float32)
  if width == 16:
    return v.astype(FLOAT_DTYPES[float_dtype]).astype(np.float32), np.zeros(len(v), np.float32)
  if width not in CODE_WIDTHS:
    raise ValueError(f"code width must be 16 or one of {CODE_WIDTHS}, got {width}")
  half = 2 ** (width - 1)
  top = np.max(np.abs(v), axis=1)
  grid = np.geomspace(0.08, 1.0, 24).astype(np.float32)
  steps = (top[None, :] / np.float32(half - 0.5)) * grid[:, None]  # [24, m]
  steps = np.where(steps > 0, steps, np.float32(1.0)).astype(np.float32)
  q = np.clip(np.floor(v[None] / steps[..., None]), -half, half - 1)
  dec = ((q + np.float32(0.5)) * steps[..., None]).astype(np.float32)  # [24, m, L]
  best = np.argmin(np.sum(np.square(v[None] - dec), axis=-1), axis=0)  # [m]
  rows = np.arange(len(v))
  out, step = dec[best, rows], steps[best, rows].astype(np.float32)
  zero = top == 0
  out[zero], step[zero] = 0.0, 0.0
  return out, step


def code_vector(v: np.ndarray, width: int, float_dtype: str = "bfloat16"
                ) -> tuple[np.ndarray, float]:
  """One vector through `code_rows`: ``(decoded f32, step)``."""
  d, s = code_rows(np.asarray(v)[None], width, float_dtype)
  return d[0], float(s[0])


def codes_of(decoded: np.ndarray, step: float, width: int) -> np.ndarray:
  """The unsigned codes (``q + 2^(w−1)``, uint8) of a decoded vector; exact inverse of
  `code_vector`'s decoding (checked)."""
  half = 2 ** (width - 1)
  u = np.rint(decoded / np.float32(step) - 0.5).astype(np.int64) + half
  if u.min(initial=0) < 0 or u.max(initial=0) >= 2 * half:
    raise ValueError("decoded values are not on the code grid")
  u = u.astype(np.uint8)
  if not np.array_equal(decode(u, step, width), decoded):
    raise ValueError("decoded values are not on the code grid")
  return u


def decode(codes: np.ndarray, step: float, width: int) -> np.ndarray:
  half = 2 ** (width - 1)
  return ((codes.astype(np.float32) - half + np.float32(0.5)) * np.float32(step)).astype(np.float32)


def pack_codes(u: np.ndarray, width: int) -> np.ndarray:
  """uint8 codes ``[..., L]`` → ``[..., ceil(L·w/8)]``, code j of a byte in bits j·w.."""
  per = 8 // width
  lead, n = u.shape[:-1], u.shape[-1]
  pad = -n % per
  if pad:
    u = np.concatenate([u, np.zeros((*lead, pad), np.uint8)], axis=-1)
  u = u.reshape(*lead, -1, per).astype(np.uint8)
  shifts = (np.arange(per, dtype=np.uint8) * width).astype(np.uint8)
  return np.bitwise_or.reduce(u << shifts, axis=-1).astype(np.uint8)


def unpack_codes(p: np.ndarray, width: int, n: int) -> np.ndarray:
  per = 8 // width
  shifts = (np.arange(per, dtype=np.uint8) * width).astype(np.uint8)
  u = (p[..., None] >> shifts) & np.uint8((1 << width) - 1)
  return u.reshape(*p.shape[:-1], -1)[..., :n].astype(np.uint8)


# ----------------------------------------------------------------------------- low-rank fits


def _svd(t: np.ndarray):
  """SVD in float64. Small matrices run on one BLAS thread: on a busy machine a
  multi-threaded OpenBLAS SVD of a 128×352 matrix took 2 s instead of 20 ms (measured)."""
  t = np.asarray(t, np.float64)
  limit = contextlib.nullcontext()
  if t.size <= (1 << 22):
    try:
      from threadpoolctl import threadpool_limits

      limit = threadpool_limits(1, user_api="blas")
    except ImportError:
      pass
  with limit:
    return np.linalg.svd(t, full_matrices=False)


def _components(u, s, vt, idx, widths, float_dtype) -> CodedLora:
  k, n = u.shape[0], vt.shape[1]
  r = len(idx)
  a = np.zeros((k, r), np.float32)
  b = np.zeros((r, n), np.float32)
  a_step = np.zeros(r, np.float32)
  b_step = np.zeros(r, np.float32)
  idx, widths = np.asarray(idx, np.int64), np.asarray(widths, np.int64)
  for w in np.unique(widths):
    j = np.nonzero(widths == w)[0]
    root = np.sqrt(s[idx[j]])
    da, sa = code_rows((u[:, idx[j]] * root).T, int(w), float_dtype)
    db, sb = code_rows(vt[idx[j]] * root[:, None], int(w), float_dtype)
    a[:, j], a_step[j], b[j], b_step[j] = da.T, sa, db, sb
  return CodedLora(a=a, b=b, widths=tuple(int(w) for w in widths), a_step=a_step,
                   b_step=b_step, float_dtype=float_dtype)


def recode(entry: LoraEntry, a: np.ndarray, b: np.ndarray) -> CodedLora:
  """New factor values ``a [K, r]``, ``b [r, N]`` stored like ``entry``: each rank component
  at its own width (16: rounded to ``float_dtype``; 8/4/2: coded afresh by `code_rows`, a new
  step per vector; 32: f32). The bytes are the same; the values are what the store will hold
  (e.g. distilled factors, trained in f32, then re-quantised)."""
  e = entry if isinstance(entry, CodedLora) else CodedLora(
    a=entry.a, b=entry.b, widths=(32,) * int(np.shape(entry.a)[1]))
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  if a.shape != e.a.shape or b.shape != e.b.shape:
    raise ValueError(f"new factors {a.shape} / {b.shape} do not match the stored "
                     f"{e.a.shape} / {e.b.shape}")
  r = len(e.widths)
  out_a, out_b = np.zeros_like(a), np.zeros_like(b)
  a_step, b_step = np.zeros(r, np.float32), np.zeros(r, np.float32)
  widths = np.asarray(e.widths, np.int64)
  for w in np.unique(widths):
    j = np.nonzero(widths == w)[0]
    if w == 32:
      out_a[:, j], out_b[j] = a[:, j], b[j]
      continue
    da, sa = code_rows(a[:, j].T, int(w), e.float_dtype)
    db, sb = code_rows(b[j], int(w), e.float_dtype)
    out_a[:, j], a_step[j], out_b[j], b_step[j] = da.T, sa, db, sb
  return CodedLora(a=out_a, b=out_b, widths=tuple(e.widths), a_step=a_step, b_step=b_step,
                   float_dtype=e.float_dtype)


def low_rank(t: np.ndarray, rank: int, width: int = 16, float_dtype: str = "bfloat16"
             ) -> CodedLora:
  """Truncated SVD of ``t`` at ``rank``, ``√σ`` folded into both factors, coded at ``width``."""
  u, s, vt = _svd(t)
  r = min(rank, len(s))
  return _components(u, s, vt, list(range(r)), [width] * r, float_dtype)


def _component_error(a, b, qa, qb) -> np.ndarray:
  """‖aᵢ bᵢᵀ − qaᵢ qbᵢᵀ‖² for rows i, without forming the outer products."""
  def dot(x, y):
    return np.sum(np.asarray(x, np.float64) * y, axis=-1)
  return dot(a, a) * dot(b, b) + dot(qa, qa) * dot(qb, qb) - 2 * dot(a, qa) * dot(b, qb)


def mixed_low_rank(t: np.ndarray, budget_bytes: int, float_dtype: str = "bfloat16",
                   widths: tuple[int, ...] = (2, 4, 8, 16)) -> CodedLora:
  """Delta-CoMe-style: singular components of ``t`` at mixed widths within ``budget_bytes``.

  Greedy knapsack: start with no component; repeatedly take the upgrade (component i from its
  width to any wider one, or from absent) with the largest error reduction per extra byte
  that still fits. Component errors are measured exactly per component (σᵢ² when absent).
  """
  k, n = t.shape
  u, s, vt = _svd(t)
  cheapest = min(component_bytes(k, n, w) for w in widths)
  m = int(min(len(s), max(0, budget_bytes // cheapest)))
  if m == 0:
    return _components(u, s, vt, [], [], float_dtype)
  root = np.sqrt(s[:m])
  va, vb = (u[:, :m] * root).T, vt[:m] * root[:, None]
  err = np.zeros((m, len(widths) + 1))
  err[:, 0] = s[:m] ** 2
  for j, w in enumerate(widths):
    qa, _ = code_rows(va, w, float_dtype)
    qb, _ = code_rows(vb, w, float_dtype)
    err[:, j + 1] = _component_error(va, vb, qa, qb)
  cost = [0] + [component_bytes(k, n, w) for w in widths]
  level = np.zeros(m, np.int64)
  left = int(budget_bytes)
  while True:
    best = None
    for i in range(m):
      for j in range(level[i] + 1, len(cost)):
        extra = cost[j] - cost[level[i]]
        gain = err[i, level[i]] - err[i, j]
        if extra <= left and gain > 0 and (best is None or gain / extra > best[0]):
          best = (gain / extra, i, j, extra)
    if best is None:
      break
    _, i, j, extra = best
    level[i] = j
    left -= extra
  idx = [i for i in range(m) if level[i] > 0]
  return _components(u, s, vt, idx, [widths[level[i] - 1] for i in idx], float_dtype)


# ----------------------------------------------------------------------------- modes


@dataclasses.dataclass(frozen=True)
class ModeSpec:
  """How one linear delta is compressed beyond BitDelta.

  Attributes:
    mode: one of `MODES`; ``delta-come`` is ``svd`` with ``width=MIXED``.
    rank: rank of the low-rank part (``svd``/``dqrelo``); ignored when ``budget`` is set.
    budget: bytes as a fraction of the weight's bf16 bytes (e.g. 1/15), 1-bit part included;
      sets the rank, or with ``width=MIXED`` the components and their widths.
    width: of the factors: 16 (floats), a code width 8/4/2, or `MIXED` (needs ``budget``).
    float_dtype: ``"bfloat16"`` or ``"float16"`` for 16-bit factors.
    iters: D-QRELO alternations (low rank ↔ signs and α).
    granularity, group_k: of the 1-bit part (``dqrelo``).
  """

  mode: str = "dqrelo"
  rank: int = 0
  budget: float | None = None
  width: int = 16
  float_dtype: str = "bfloat16"
  iters: int = 2
  granularity: str = "column"
  group_k: int = DEFAULT_GROUP_K

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.width not in (16, MIXED, *CODE_WIDTHS):
      raise ValueError(f"factor width must be 16, {MIXED} (mixed) or one of {CODE_WIDTHS}, "
                       f"got {self.width}")
    if self.mode == "delta-come" and self.width != MIXED:
      object.__setattr__(self, "width", MIXED)
    if self.float_dtype not in FLOAT_DTYPES:
      raise ValueError(f"float_dtype must be one of {tuple(FLOAT_DTYPES)}, got {self.float_dtype!r}")
    if self.budget is not None and not 0 < self.budget <= 1:
      raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget}")
    if self.width == MIXED and self.budget is None:
      raise ValueError(f"mode {self.mode!r} with mixed factor widths needs a byte budget (--budget)")
    if self.mode != "bitdelta" and self.budget is None and self.rank <= 0:
      raise ValueError(f"mode {self.mode!r} needs --rank R > 0 or --budget")
    if self.iters < 0:
      raise ValueError(f"iters must be >= 0, got {self.iters}")


def budget_bytes(shape: tuple[int, int], budget: float) -> int:
  k, n = shape
  return int(np.floor(2 * k * n * budget))


def rank_for(shape: tuple[int, int], spec: ModeSpec, fixed_bytes: int = 0) -> int:
  """The rank a spec gives a ``[K, N]`` weight: ``spec.rank``, or the most components of
  ``spec.width`` that fit the budget after ``fixed_bytes`` (the 1-bit part)."""
  k, n = shape
  if spec.budget is None:
    return min(spec.rank, k, n)
  if spec.width == MIXED:
    raise ValueError("with mixed widths the budget sets the components; see mixed_low_rank")
  left = budget_bytes(shape, spec.budget) - fixed_bytes
  return int(max(0, min(k, n, left // component_bytes(k, n, spec.width))))


def _packed(signs_pos: np.ndarray, alpha: np.ndarray, spec: ModeSpec) -> PackedDelta:
  pd = pack(np.where(signs_pos, 1.0, -1.0).astype(np.float32), spec.granularity, spec.group_k)
  return dataclasses.replace(pd, scale=np.asarray(alpha, np.float32).reshape(pd.scale.shape))


def _alpha(t: np.ndarray, granularity: str) -> np.ndarray:
  a = np.abs(t, dtype=np.float32)
  return a.mean(axis=0) if granularity == "column" else a.mean().reshape(1)


def dqrelo(delta: np.ndarray, spec: ModeSpec) -> ResidualEntry | PackedDelta:
  """1-bit signs + compensated low-rank residual (see the module docstring)."""
  d = np.asarray(delta, np.float32)
  k, n = d.shape
  if spec.budget is not None:  # per-column α must fit too, else one α for the matrix
    fixed = pack(d[:, :1], spec.granularity, spec.group_k).bits.nbytes * n
    if fixed + 4 * n > budget_bytes((k, n), spec.budget) and spec.granularity == "column":
      spec = dataclasses.replace(spec, granularity="matrix")
  alpha = _alpha(d, spec.granularity)
  pos = d >= 0
  fixed = _packed(pos, alpha, spec).nbytes
  if spec.budget is not None and fixed > budget_bytes((k, n), spec.budget):
    raise ValueError(f"a [{k}, {n}] weight's 1-bit part ({fixed} bytes) exceeds the budget "
                     f"{spec.budget:.4g} ({budget_bytes((k, n), spec.budget)} bytes)")
  mixed_budget = None if spec.budget is None else budget_bytes((k, n), spec.budget) - fixed

  def fit(target):
    if spec.width == MIXED:
      return mixed_low_rank(target, mixed_budget, spec.float_dtype)
    return low_rank(target, rank_for((k, n), spec, fixed), spec.width, spec.float_dtype)

  def one_bit():
    return np.where(pos, 1.0, -1.0).astype(np.float32) * alpha[None, :]

  lr = fit(d - one_bit())
  if lr.rank == 0:
    return _packed(pos, alpha, spec)
  for _ in range(spec.iters):
    rest = d - lr.a @ lr.b
    pos = rest >= 0
    alpha = _alpha(rest, spec.granularity)
    lr = fit(d - one_bit())
  return ResidualEntry(packed=_packed(pos, alpha, spec), lora=lr)


def compress_linear(delta: np.ndarray, spec: ModeSpec):
  """One Flax-layout delta ``[K, N]`` → its entry under ``spec``."""
  d = np.asarray(delta, np.float32)
  if spec.mode == "bitdelta":
    return pack(d, spec.granularity, spec.group_k)
  if spec.mode == "dqrelo":
    return dqrelo(d, spec)
  if spec.width == MIXED:
    lr = mixed_low_rank(d, budget_bytes(d.shape, spec.budget), spec.float_dtype)
  else:
    lr = low_rank(d, rank_for(d.shape, spec), spec.width, spec.float_dtype)
  if lr.rank == 0:
    raise ValueError(f"a [{d.shape[0]}, {d.shape[1]}] weight gets no rank-1 component within "
                     f"the budget {spec.budget}; raise --budget")
  return lr


def lora_rank_of(entries) -> int:
  """The ``lora_rank`` a model needs to hold these entries in its LoRA banks (0: none)."""
  r = 0
  for e in entries:
    if isinstance(e, ResidualEntry):
      e = e.lora
    if isinstance(e, LoraEntry):
      r = max(r, int(np.shape(e.a)[1]))
  return r
