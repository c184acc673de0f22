"""The LM head's products: f32 logits (tied ``h · Eᵀ`` or ``h · W``) and a bank of 1-bit
embedding / LM-head deltas read packed."""

from .api import add_packed_products, fallback_reasons, logits, packed_fallback_reasons

__all__ = ["add_packed_products", "fallback_reasons", "logits", "packed_fallback_reasons"]
