"""bitdelta-jax: 1-bit deltas of fine-tunes, served side by side on one base (JAX)."""

from importlib import metadata as _metadata

try:
  __version__ = _metadata.version("bitdelta-jax")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
  __version__ = "0.1.0"
