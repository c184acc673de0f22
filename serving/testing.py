"""A synthetic model family for tests and benchmarks: a tiny Llama base with a byte-level
tokenizer and N compressed variants (each a different random fine-tune).

    base_dir, variants = synthetic_family(tmp, n=4)      # variants: {"v0": delta_dir, ...}
"""

from __future__ import annotations

from pathlib import Path

from bitdelta_jax.synthetic import SyntheticConfig

TINY = SyntheticConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def synthetic_family(root: str | Path, n: int = 4, config: SyntheticConfig = TINY, *,
                     rel: float = 0.3, prefix: str = "v", seed: int = 0,
                     keep_finetunes: bool = False) -> tuple[Path, dict[str, Path]]:
  """Writes ``root/base`` (+ tokenizer) and ``root/deltas/<prefix><i>``; reuses existing dirs."""
  from bitdelta_jax.delta.compress import CompressPolicy
  from bitdelta_jax.delta.stream import compress_checkpoints
  from bitdelta_jax.synthetic import make_base, make_finetune, write_checkpoint
  from bitdelta_jax.zoo.tokenizer_build import write_tokenizer

  root = Path(root)
  base = make_base(config, seed)
  base_dir = root / "base"
  if not (base_dir / "config.json").exists():
    write_checkpoint(base, base_dir, config.hf_config())
    write_tokenizer(base_dir)
  out = {}
  for i in range(n):
    name = f"{prefix}{i}"
    d = root / "deltas" / name
    if not (d / "manifest.json").exists():
      ft_dir = write_checkpoint(make_finetune(base, seed=seed + 100 + i, rel=rel),
                                root / "finetuned" / name, config.hf_config())
      compress_checkpoints(base_dir, ft_dir, d, CompressPolicy(), overwrite=True, progress=False)
      if not keep_finetunes:
        import shutil

        shutil.rmtree(ft_dir)
    out[name] = d
  return base_dir, out


def corrupt_arrays(delta_dir: str | Path) -> Path:
  """Flips every byte of the first stored ``bits`` chunk of a delta in place (its crc32 then
  fails on load); returns the directory."""
  d = Path(delta_dir)
  chunks = sorted(p for p in d.rglob("*") if p.is_file() and "bits" in p.parts
                  and not p.name.startswith("."))
  data = bytearray(chunks[0].read_bytes())
  for i in range(len(data)):
    data[i] ^= 0xFF
  chunks[0].write_bytes(bytes(data))
  return d


def poison_array(delta_dir: str | Path, tensor: str, field: str, value: float) -> Path:
  """Sets one element (the middle one) of a stored array of a delta to ``value`` (e.g. inf or
  NaN) in place and records the array's new crc32 in the manifest, so the checksums stay valid
  and only the values are hostile; returns the directory."""
  import json

  from bitdelta_jax.delta.store import MANIFEST, read_array, write_array

  d = Path(delta_dir)
  m = json.loads((d / MANIFEST).read_text())
  arrays = m["tensors"][tensor]["arrays"]
  path = d / "arrays" / tensor / field
  a = read_array(path, arrays[field]).copy()
  a.reshape(-1)[a.size // 2] = value
  arrays[field] = write_array(path, a)
  (d / MANIFEST).write_text(json.dumps(m, indent=1))
  return d


def wait_for(cond, what: str, timeout: float = 30.0, every: float = 0.02) -> None:
  """Polls ``cond()`` until it holds; fails (AssertionError naming ``what``) after ``timeout``
  seconds. For state a server settles a moment after a client has its response (the engine's
  gauges, the registry's in-flight counts, slots)."""
  import time

  t0 = time.monotonic()
  while not cond():
    assert time.monotonic() - t0 < timeout, what
    time.sleep(every)
