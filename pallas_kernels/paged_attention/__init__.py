"""Attention of one ragged token batch over a paged KV cache (see `reference`)."""

from .reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
