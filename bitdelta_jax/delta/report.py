"""Per-tensor and total compression report: bytes before/after, ratio, relative error."""

from __future__ import annotations

import dataclasses
import json
import math
import re


@dataclasses.dataclass(frozen=True)
class TensorReport:
  """One tensor. ``rel_error`` = ‖Δ − α·S‖_F / ‖Δ‖_F for packed tensors, 0 for exact ones."""

  name: str
  kind: str  # "packed" | "same" | "value" | "delta"
  shape: tuple[int, ...]
  dtype: str
  bytes_before: int
  bytes_after: int
  rel_error: float
  note: str = ""

  @property
  def ratio(self) -> float:
    return self.bytes_before / self.bytes_after if self.bytes_after else math.inf

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["shape"] = list(self.shape)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> TensorReport:
    return cls(**{**d, "shape": tuple(d["shape"])})


def natural_key(name: str) -> list:
  """Sort key that orders ``layers.2`` before ``layers.10`` (numbers compared as numbers)."""
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _ratio(a: int, b: int) -> float:
  return a / b if b else math.inf


@dataclasses.dataclass(frozen=True)
class Report:
  tensors: list[TensorReport]

  def _sum(self, kinds=None) -> tuple[int, int]:
    ts = [t for t in self.tensors if kinds is None or t.kind in kinds]
    return sum(t.bytes_before for t in ts), sum(t.bytes_after for t in ts)

  @property
  def totals(self) -> dict:
    before, after = self._sum()
    lb, la = self._sum(("packed",))
    packed = [t for t in self.tensors if t.kind == "packed"]
    # Error over all packed tensors, weighted by element count (an RMS of relative errors).
    n = sum(math.prod(t.shape) for t in packed)
    rms = math.sqrt(sum(t.rel_error**2 * math.prod(t.shape) for t in packed) / n) if n else 0.0
    return {
      "tensors": len(self.tensors),
      "packed_tensors": len(packed),
      "bytes_before": before,
      "bytes_after": after,
      "ratio": _ratio(before, after),
      "linear_bytes_before": lb,
      "linear_bytes_after": la,
      "linear_ratio": _ratio(lb, la),
      "linear_bf16_bytes": sum(2 * math.prod(t.shape) for t in packed),
      "linear_ratio_vs_bf16": _ratio(sum(2 * math.prod(t.shape) for t in packed), la),
      "linear_rel_error_rms": rms,
    }

  def to_dict(self) -> dict:
    return {"totals": self.totals, "tensors": [t.to_dict() for t in self.tensors]}

  @classmethod
  def from_dict(cls, d: dict) -> Report:
    return cls([TensorReport.from_dict(t) for t in d["tensors"]])

  def format(self, max_rows: int | None = 40) -> str:
    """A plain-text table for terminals."""
    rows = [f"{'tensor':<52} {'kind':<7} {'shape':<16} {'before':>10} {'after':>10} "
            f"{'ratio':>7} {'rel.err':>8}"]
    ordered = sorted(self.tensors, key=lambda t: natural_key(t.name))
    shown = ordered if max_rows is None else ordered[:max_rows]
    for t in shown:
      ratio = "inf" if math.isinf(t.ratio) else f"{t.ratio:.1f}x"
      rows.append(f"{t.name[-52:]:<52} {t.kind:<7} {'x'.join(map(str, t.shape)):<16} "
                  f"{_mb(t.bytes_before):>10} {_mb(t.bytes_after):>10} {ratio:>7} "
                  f"{t.rel_error:>8.4f}")
    if len(shown) < len(self.tensors):
      rows.append(f"... {len(self.tensors) - len(shown)} more tensors")
    rows.extend(self.summary_lines())
    return "\n".join(rows)

  def summary_lines(self) -> list[str]:
    """What the ratios compare, in words: the linear layers against bf16, and the checkpoint."""
    tot = self.totals
    dtypes = sorted({t.dtype for t in self.tensors if t.kind == "packed"})
    src = ""
    if dtypes and dtypes != ["bfloat16"]:
      src = (f"; against their stored {'/'.join(dtypes)}: "
             f"{_mb(tot['linear_bytes_before'])}, {tot['linear_ratio']:.1f}x")
    if tot["packed_tensors"]:
      linear = (f"linear layers ({tot['packed_tensors']} matrices, 1-bit): "
                f"{_mb(tot['linear_bytes_after'])} vs {_mb(tot['linear_bf16_bytes'])} in bf16 = "
                f"{tot['linear_ratio_vs_bf16']:.1f}x smaller{src}; relative error of the 1-bit "
                f"approximation ‖Δ−α·S‖/‖Δ‖ (RMS) {tot['linear_rel_error_rms']:.4f}")
    else:
      linear = "linear layers: no 1-bit matrices (none changed)"
    exact = [t for t in self.tensors if t.kind in ("value", "delta")]
    if not tot["bytes_after"]:
      return [linear, f"whole checkpoint ({tot['tensors']} tensors): nothing changed, the "
                      "delta stores no tensor"]
    kept = (f"{len(exact)} changed tensor(s) kept exactly: "
            f"{_short_names([t.name for t in exact])}" if exact
            else "every changed tensor is 1-bit")
    return [linear,
            f"whole checkpoint ({tot['tensors']} tensors, as stored): {_mb(tot['bytes_before'])} "
            f"-> {_mb(tot['bytes_after'])} = {tot['ratio']:.1f}x smaller (unchanged tensors cost "
            f"nothing; {kept})"]


def _short_names(names: list[str], most: int = 4) -> str:
  names = sorted(names, key=natural_key)
  return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most
                                    else "")


def describe_policy(policy: dict, embeddings: str = "exact", names=None) -> str:
  """A manifest's compression policy in words (``embeddings``: the manifest's field;
  ``names``: its tensors, so that only the exact-kept patterns that name one are listed)."""
  gran = {"matrix": "one α per matrix", "column": "one α per output column"}.get(
    policy.get("granularity"), str(policy.get("granularity")))
  dense = {"value": "as fine-tuned values", "delta": "as dense deltas"}.get(
    policy.get("dense"), str(policy.get("dense")))
  pats = [p.replace("\\b", "") for p in policy.get("exact_patterns", [])]
  if embeddings == "1bit":
    pats = [p for p in pats if p not in ("embed", "lm_head", "wte")]
  if names is not None:  # e.g. GPT-2's "wpe" says nothing about a Llama
    raw = [p for p in policy.get("exact_patterns", []) if p.replace("\\b", "") in pats]
    pats = [p.replace("\\b", "") for p in raw if any(re.search(p, n) for n in names)]
  kept = ", ".join(pats) or "none"
  mode = policy.get("mode", "bitdelta")
  head = (f"1-bit sign(Δ) of linear layers with {gran}" if mode == "bitdelta" else
          f"linear layers in mode {mode} (budget {policy.get('budget')}, rank "
          f"{policy.get('rank')}; 1-bit part with {gran})")
  text = (f"{head}, bit-plane groups of up to {policy.get('group_k')} rows (fitted to each "
          f"matrix's K); other changed tensors "
          f"({kept}) kept exactly, {dense}")
  if embeddings == "1bit":
    text += "; changed embeddings / LM head 1-bit with one α per token"
  return text


def describe_embeddings(manifest: dict) -> list[str]:
  """One line per changed embedding / LM head: how it is stored and why (``embeddings``
  auto), from the manifest's ``embeddings_choice``."""
  out = []
  for name, c in sorted(manifest.get("embeddings_choice", {}).items()):
    err = c.get("rel_error_1bit")
    how = "1-bit, one α per token" if c["stored"] == "1bit" else "exact"
    mode = c.get("mode", "bitdelta")  # absent in manifests written before the one compressor
    if mode != "bitdelta":
      why = f"mode {mode} keeps embeddings exactly" + (
        "" if err is None else f"; 1-bit would err {err:.2%} of |W|")
    elif err is None:
      why = f"{c.get('chosen_by')}: the base matrix is zero, so no relative error"
    elif c.get("chosen_by") == "auto":
      limit = c.get("limit", 0.01)
      why = (f"auto: 1-bit reconstructs it within {err:.2%} of |W| (limit {limit:.0%})"
             if c["stored"] == "1bit" else
             f"auto: 1-bit would err {err:.2%} of |W|, over the {limit:.0%} limit")
    else:
      why = f"--embeddings {c.get('chosen_by')}; 1-bit error {err:.2%} of |W|"
    out.append(f"{name}: {how} ({why})")
  return out


def describe_scales(scales: dict) -> str:
  """How a manifest's α were obtained, in words."""
  if scales.get("method") == "distilled":
    def num(k):
      v = scales.get(k)
      return "?" if v is None else f"{v:.3e}"
    return (f"distilled ({scales.get('steps')} steps of {scales.get('optimizer', 'adamw')}, "
            f"lr {scales.get('lr')}, on {scales.get('calibration')}; logit MSE on held-out "
            f"batches {num('held_mse_before')} -> {num('held_mse_after')})")
  if scales.get("method") == "mean_abs":
    return "α = mean|Δ| (the L2-optimal scale of sign(Δ), not distilled)"
  return json.dumps(scales)


def _mb(n: int) -> str:
  if n >= 1 << 30:
    return f"{n / (1 << 30):.2f}G"
  if n >= 1 << 20:
    return f"{n / (1 << 20):.2f}M"
  if n >= 1 << 10:
    return f"{n / (1 << 10):.1f}K"
  return f"{n}B"
