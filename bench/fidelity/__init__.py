"""Fidelity of compressed real variants, over the f32 base and over a quantized base."""
