"""Servers end to end: `bitdelta serve` against transformers, llama.cpp and itself under load."""
