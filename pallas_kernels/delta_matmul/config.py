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
