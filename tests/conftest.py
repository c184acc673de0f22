"""Shared test settings.

The suite is hermetic: no persistent XLA compilation cache (the engine turns one on under
``~/.cache/bitdelta_jax/xla`` by default; set before any test builds an engine, so servers and
the subprocesses they start compile for themselves and never write into the user's cache).
"""

import os

os.environ.setdefault("BITDELTA_COMPILE_CACHE", "0")
