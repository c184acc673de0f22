"""Fused 1-bit delta GEMM: ``y = x·W_base + α ⊙ (x·sign(Δ))``, one variant or a bank of slots."""

from .api import IMPLEMENTATIONS, delta_matmul, unavailable_reason
from .config import Config
from .reference import delta_matmul_reference

__all__ = [
  "IMPLEMENTATIONS",
  "Config",
  "delta_matmul",
  "delta_matmul_reference",
  "unavailable_reason",
]
