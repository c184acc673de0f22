"""Kernel micro-benches: the delta, small-M, LM-head, attention and quantized-base kernels against XLA."""
