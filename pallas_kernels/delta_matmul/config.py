"""Block sizes for the Pallas GPU delta_matmul kernels, with a per-shape heuristic."""

from __future__ import annotations

import dataclasses

# Hopper H100/H200: 132 SMs. Decode (small M) is memory bound: aim for a couple of waves of
# programs over N so every SM streams weights.
_NUM_SMS = 132


def _pow2_floor(v: int) -> int:
  return 1 << (max(int(v), 1).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
  return 1 << (max(int(v), 1) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of ``y[M, N]`` for the Triton kernels; the K step is one bit-plane group.

  Attributes:
    block_m: rows of x per program (>= 16: the smallest `tl.dot` tile).
    block_n: output columns per program (power of two, >= 16).
    num_warps: Triton warps per program.
    num_stages: software-pipelining stages of the K loop.
  """

  block_m: int = 16
  block_n: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_m", "block_n"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {v}")

  @classmethod
  def heuristic(cls, m: int, k: int, n: int, itemsize: int = 2) -> Config:
    """Small M: one M tile, block_n small enough to fill the GPU; large M: 128x128 tiles."""
    del k
    if m <= 64:
      block_m = max(16, _pow2_ceil(m))
      block_n = min(128, max(32, _pow2_floor(n // (2 * _NUM_SMS))))
      return cls(block_m=block_m, block_n=block_n, num_warps=4, num_stages=3)
    block_n = 128 if n >= 128 else max(16, _pow2_floor(n))
    return cls(block_m=64 if itemsize >= 4 else 128, block_n=block_n, num_warps=8, num_stages=3)


_MOSAIC_SMEM_BUDGET = 200 * 1024  # of the 227 KiB a Hopper block may opt into: room for barriers


def _divisors(v: int) -> list[int]:
  return [d for d in range(1, v + 1) if v % d == 0]


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiling of ``y[M, N]`` for the Mosaic GPU (Hopper wgmma) kernels.

  One CTA (one warpgroup) computes a ``block_m x block_n`` tile of y over a slice of K; the K
  loop steps ``groups_per_step`` bit-plane groups at a time (``K_step = groups_per_step *
  group_k`` rows of W, ``K_step / 8`` rows of bits).

  Attributes:
    block_m: rows of x per CTA (wgmma M: 64 or 128; M is padded up to it).
    block_n: output columns per CTA (wgmma N: 32, 64, 128 or 256).
    groups_per_step: bit-plane groups per K step; must divide the number of groups.
    num_stages: K steps in flight (TMA prefetch depth, >= 1).
    split_k: CTAs sharing one output tile, each over ``1/split_k`` of the K steps; their f32
      partial sums are added by XLA. Must divide the number of K steps.
  """

  block_m: int = 64
  block_n: int = 64
  groups_per_step: int = 1
  num_stages: int = 3
  split_k: int = 1

  def __post_init__(self):
    if self.block_m not in (64, 128):
      raise ValueError(f"block_m must be 64 or 128 (the wgmma M), got {self.block_m}")
    if self.block_n not in (32, 64, 128, 256):
      raise ValueError(f"block_n must be one of 32, 64, 128, 256, got {self.block_n}")
    if self.block_m * self.block_n > 8192:
      raise ValueError(
        f"block_m * block_n = {self.block_m * self.block_n} > 8192: the two f32 accumulators "
        "would not fit in a warpgroup's registers"
      )
    for name in ("groups_per_step", "num_stages", "split_k"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

  def k_step(self, group_k: int) -> int:
    return self.groups_per_step * group_k

  def smem_bytes(self, group_k: int, itemsize: int, banked: bool = False) -> int:
    """Shared memory of the kernel's largest phase (bytes, without barriers)."""
    kt, bm, bn, st = self.k_step(group_k), self.block_m, self.block_n, self.num_stages
    x_tile = bm * kt * 2 * (3 if itemsize >= 4 else 1)  # bf16 (three pieces for f32)
    w_tile = kt * bn * itemsize
    b_tile = kt * bn  # the bits, each packed row copied to its 8 planes
    signs = kt * bn * 2
    w_pieces = 3 * kt * bn * 2 if itemsize >= 4 else 0
    out = bm * bn * 4
    fused = st * (x_tile + w_tile + (0 if banked else b_tile)) + w_pieces
    fused += 0 if banked else signs
    delta_only = st * (x_tile + b_tile) + signs if banked else 0
    return out + max(fused, delta_only)

  @classmethod
  def heuristic(cls, m: int, k: int, n: int, group_k: int, itemsize: int = 2) -> MosaicConfig:
    """Decode (small M) is memory bound: cut N (and K, by ``split_k``) so about two waves of
    CTAs stream the weights; larger M uses 128-row tiles (64 for f32). Not tuned on hardware."""
    n_groups = -(-k // group_k)
    block_m = 64 if m <= 64 or itemsize >= 4 else 128
    block_n = 64 if (n >= 1024 or block_m == 128) and itemsize < 4 else 32
    per_step = max(1, 128 // group_k) if itemsize < 4 else 1
    groups_per_step = max(d for d in _divisors(n_groups) if d <= per_step)
    steps = n_groups // groups_per_step
    tiles = -(-n // block_n) * -(-m // block_m)
    split_k = max(
      d for d in _divisors(steps) if d == 1 or (tiles * d <= 2 * _NUM_SMS and steps // d >= 2)
    )
    cfg = cls(block_m, block_n, groups_per_step, min(4, steps // split_k), split_k)
    while cfg.num_stages > 1 and cfg.smem_bytes(group_k, itemsize) > _MOSAIC_SMEM_BUDGET:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg
