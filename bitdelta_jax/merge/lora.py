"""PEFT LoRA adapters: read, write, and turn into weight deltas.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r). The delta
of the weight ``<module>.weight`` (torch layout [out, in]) is

    ΔW = scale · B · A,   scale = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora)

with per-module r and alpha from ``rank_pattern`` / ``alpha_pattern`` as PEFT resolves them, and
ΔWᵀ for ``fan_in_fan_out`` layers (GPT-2 Conv1D). DoRA and embedding LoRA are not supported.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bitdelta_jax.hf.safetensors_io import CheckpointError, CheckpointReader, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
  r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class LoraModule:
  """One adapted linear layer. A ``[r, in]``, B ``[out, r]``."""

  A: np.ndarray
  B: np.ndarray
  scale: float
  fan_in_fan_out: bool = False

  @property
  def rank(self) -> int:
    return self.A.shape[0]

  @property
  def nbytes(self) -> int:
    return self.A.nbytes + self.B.nbytes

  def delta(self, dtype=np.float32) -> np.ndarray:
    """scale · B · A in the torch weight layout [out, in]."""
    d = self.scale * (self.B.astype(dtype) @ self.A.astype(dtype))
    return d.T if self.fan_in_fan_out else d


@dataclass
class LoraAdapter:
  modules: dict[str, LoraModule]
  config: dict = field(default_factory=dict)

  @property
  def nbytes(self) -> int:
    return sum(m.nbytes for m in self.modules.values())

  @property
  def rank(self) -> int:
    return max((m.rank for m in self.modules.values()), default=0)

  def deltas(self, dtype=np.float32) -> dict[str, np.ndarray]:
    """{weight name ('<module>.weight'): ΔW}."""
    return {f"{name}.weight": m.delta(dtype) for name, m in self.modules.items()}


def _pattern_value(pattern: dict, module: str, default):
  # PEFT's get_pattern_key: a key matches a module name that ends with it at a '.' boundary.
  for key, value in (pattern or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def _check_finite(a: np.ndarray, where: str) -> None:
  """A factor with inf or NaN is a `CheckpointError` (served beside other variants, it would
  make its own rows NaN; nothing has a use for one)."""
  if a.dtype.kind in "biu":
    return
  bad = ~np.isfinite(a)
  if bad.any():
    raise CheckpointError(f"{where}: {int(bad.sum())} non-finite value(s) (inf or NaN): a "
                          "LoRA adapter's factors must be finite")


def _check_ranks(path: Path, config: dict) -> None:
  """``r`` and ``rank_pattern`` in adapter_config.json must be positive integers (PEFT divides
  lora_alpha by them)."""
  ranks = {"r": config.get("r", 8)}
  ranks.update({f"rank_pattern[{k!r}]": v for k, v in (config.get("rank_pattern") or {}).items()})
  for key, r in ranks.items():
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
      raise CheckpointError(f"{path / CONFIG_FILE}: {key} is {r!r}; a LoRA rank must be an "
                            "integer >= 1")


def load_adapter(path: str | Path) -> LoraAdapter:
  """Reads a PEFT LoRA adapter directory. Refuses (`CheckpointError`, naming the file and the
  tensor or field) factors that are not finite and ranks below 1."""
  path = Path(path)
  cfg_path = path / CONFIG_FILE
  if not cfg_path.exists():
    raise CheckpointError(f"{path}: no {CONFIG_FILE}")
  config = json.loads(cfg_path.read_text())
  if config.get("peft_type", "LORA").upper() != "LORA":
    raise NotImplementedError(f"{path}: peft_type {config.get('peft_type')!r} is not LoRA")
  if config.get("use_dora"):
    raise NotImplementedError(f"{path}: DoRA adapters are not supported")
  weights = path / WEIGHTS_FILE
  if not weights.exists():
    raise CheckpointError(f"{path}: no {WEIGHTS_FILE} (only safetensors adapters are read)")
  parts: dict[str, dict[str, np.ndarray]] = {}
  with CheckpointReader(weights) as reader:
    for name in reader.names():
      m = _KEY.match(name)
      if m is None:
        if "lora_embedding" in name or "lora_magnitude" in name:
          raise NotImplementedError(f"{path}: tensor {name!r} (embedding LoRA / DoRA)")
        continue  # e.g. modules_to_save copies; not part of the low-rank delta
      a = reader.read(name)
      _check_finite(a, f"{weights}: tensor {name!r}")
      parts.setdefault(m["module"], {})[m["ab"]] = a
  _check_ranks(path, config)
  alpha0 = config.get("lora_alpha", config.get("r", 8))
  rslora = bool(config.get("use_rslora", False))
  fan = bool(config.get("fan_in_fan_out", False))
  modules = {}
  for module, ab in parts.items():
    if set(ab) != {"A", "B"}:
      raise CheckpointError(f"{path}: module {module!r} lacks lora_{'AB'[('A' in ab)]}")
    a, b = ab["A"], ab["B"]
    r = a.shape[0]
    if b.shape[1] != r:
      raise CheckpointError(f"{path}: {module}: lora_A {a.shape} and lora_B {b.shape} disagree")
    if r == 0:
      raise CheckpointError(f"{path}: {module}: lora_A {a.shape} has rank 0 (a LoRA module "
                            "needs rank >= 1)")
    alpha = _pattern_value(config.get("alpha_pattern"), module, alpha0)
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    modules[module] = LoraModule(A=a, B=b, scale=float(scale), fan_in_fan_out=fan)
  return LoraAdapter(modules=modules, config=config)


def save_adapter(
  adapter: LoraAdapter, path: str | Path, base_model_name_or_path: str | None = None
) -> Path:
  """Writes a PEFT-loadable directory. The scale is folded into B and written as
  lora_alpha = r (so PEFT's scale is 1) with per-module ranks in rank_pattern/alpha_pattern."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  if not adapter.modules:
    raise ValueError("cannot save an adapter with no modules")
  r = adapter.rank
  tensors, rank_pattern = {}, {}
  for name, m in sorted(adapter.modules.items()):
    a, b = m.A, m.B * np.asarray(m.scale, m.B.dtype)
    if m.fan_in_fan_out:  # write the transposed delta as a plain [out, in] layer
      a, b = b.T, a.T
    tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a)
    tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b)
    if a.shape[0] != r:
      rank_pattern[re.escape(name)] = int(a.shape[0])
  save_file(tensors, path / WEIGHTS_FILE, {"format": "pt"})
  cfg = {
    "peft_type": "LORA",
    "task_type": adapter.config.get("task_type", "CAUSAL_LM"),
    "base_model_name_or_path": base_model_name_or_path
    or adapter.config.get("base_model_name_or_path"),
    "r": r,
    "lora_alpha": r,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "lora_dropout": 0.0,
    "bias": "none",
    "inference_mode": True,
    "target_modules": sorted({n.rsplit(".", 1)[-1] for n in adapter.modules}),
    "rank_pattern": rank_pattern,
    "alpha_pattern": {k: v for k, v in rank_pattern.items()},
  }
  (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
  return path


def from_factors(
  factors: dict[str, tuple[np.ndarray, np.ndarray]], config: dict | None = None
) -> LoraAdapter:
  """An adapter from {module: (A [r, in], B [out, r])} with scale 1."""
  return LoraAdapter(
    {k: LoraModule(A=a, B=b, scale=1.0) for k, (a, b) in factors.items()}, dict(config or {})
  )


def apply_adapter(params: dict[str, np.ndarray], adapter: LoraAdapter) -> dict[str, np.ndarray]:
  """params + ΔW for every adapted weight (flat HF names); other entries unchanged."""
  out = dict(params)
  for name, d in adapter.deltas().items():
    if name not in out:
      raise KeyError(f"adapter targets {name!r}, which the parameters lack")
    w = out[name]
    if w.shape != d.shape:
      raise ValueError(f"{name}: weight {w.shape} but LoRA delta {d.shape}")
    out[name] = (w.astype(np.float32) + d).astype(w.dtype)
  return out
