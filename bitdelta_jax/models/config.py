"""Model configuration: a frozen dataclass built from a Hugging Face ``config.json``.

`ModelConfig.from_hf_dict` accepts Llama, Mistral and Qwen2 configs in both the transformers
v4 spelling (``rope_theta`` + ``rope_scaling``) and the v5 one (``rope_parameters``), and
refuses anything whose numerics this decoder does not reproduce (other architectures,
activations, RoPE types, soft-capping, quantised checkpoints ...) with a `ConfigError`
naming the field, rather than loading a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Fields that change the numerics when set to anything but these neutral values.
_NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
  "attn_logit_softcapping": (None,),
  "final_logit_softcapping": (None,),
  "query_pre_attn_scalar": (None,),
  "use_qk_norm": (None, False),
  "qk_layernorm": (None, False),
  "partial_rotary_factor": (None, 1, 1.0),
  "num_experts": (None, 0),
  "num_local_experts": (None, 0),
  "quantization_config": (None,),
  "attention_chunk_size": (None,),
  "no_rope_layers": (None,),
}


class ConfigError(ValueError):
  """A config.json this decoder cannot reproduce exactly."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding parameters (``rope_type`` default | linear | llama3)."""

  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def inv_freq(self, head_dim: int):
    """Inverse frequencies ``[head_dim // 2]`` (float32, as transformers computes them)."""
    import numpy as np

    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(self.theta) ** exps)).astype(np.float32)
    if self.rope_type == "linear":
      inv = (inv / np.float32(self.factor)).astype(np.float32)
    elif self.rope_type == "llama3":
      old = self.original_max_position_embeddings
      low_wl, high_wl = old / self.low_freq_factor, old / self.high_freq_factor
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wl, inv / self.factor, inv)
      smooth = (old / wavelen - self.low_freq_factor) / (
        self.high_freq_factor - self.low_freq_factor
      )
      smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
      inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters plus the variant-slot layout.

  Attributes:
    layer_windows: per layer, the sliding-window size (a key ``j`` is visible from query ``i``
      when ``i - window < j <= i``) or None for full causal attention.
    qkv_bias / o_bias / mlp_bias: which projections carry biases (Qwen2: q/k/v; Llama:
      ``attention_bias`` sets q/k/v/o).
    num_slots: size of the variant bank in every delta-aware layer, slot 0 = the base alone.
      1 means no bank at all (the plain base model).
    lora_rank: give every linear layer per-slot LoRA factors up to this rank (0: none), so a
      slot can hold a PEFT LoRA adapter instead of a 1-bit delta.
    dense_embedding_slots: also give embeddings / LM head a per-slot dense f32 delta bank
      (``[S, V, D]``: large), so variants whose embeddings differ can share a batch.
    packed_embedding_slots: give embeddings / LM head per-slot 1-bit delta banks with a
      per-token α (``[S, D/8, V]`` uint8 + ``[S, V]``), for compact embedding deltas.
    extra_vocab: per-slot token rows beyond the base vocabulary, for variants that grew it
      (added tokens: their embedding and LM-head rows live in the slot; the logits are
      ``vocab_size + extra_vocab`` wide, a slot's unused extra ids are never sampled).
    delta_implementation: passed to ``pallas_kernels.delta_matmul.api.delta_matmul``
      (None = the best available for the backend).
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  layer_windows: tuple[int | None, ...] = ()
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  num_slots: int = 1
  dense_embedding_slots: bool = False
  lora_rank: int = 0
  extra_vocab: int = 0
  packed_embedding_slots: bool = False
  delta_implementation: str | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
        f"({self.num_kv_heads})"
      )
    if self.head_dim % 2:
      raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.num_slots < 1:
      raise ConfigError(f"num_slots must be >= 1 (slot 0 is the base), got {self.num_slots}")
    if self.extra_vocab < 0 or (self.extra_vocab and self.num_slots < 2):
      raise ConfigError(f"extra_vocab must be >= 0 and needs num_slots >= 2, got "
                        f"extra_vocab={self.extra_vocab}, num_slots={self.num_slots}")
    if not self.layer_windows:
      object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
    if len(self.layer_windows) != self.num_layers:
      raise ConfigError(
        f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
      )

  @property
  def num_params(self) -> int:
    """Base parameter count (embeddings and LM head included, counted once when tied)."""
    d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
    attn += (self.num_heads + 2 * self.num_kv_heads) * hd * self.qkv_bias + d * self.o_bias
    mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
    layer = attn + mlp + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.num_layers * layer + self.vocab_size * d + head + d

  @classmethod
  def from_hf_dict(
    cls, d: Mapping[str, Any], *, num_slots: int = 1, dense_embedding_slots: bool = False,
    lora_rank: int = 0, extra_vocab: int = 0, packed_embedding_slots: bool = False,
  ) -> ModelConfig:
    """Builds a config from a parsed HF ``config.json``; raises `ConfigError` if unsupported."""
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(
        f"unsupported model_type {model_type!r} (architectures {archs}); this decoder "
        f"supports {SUPPORTED_MODEL_TYPES}"
      )
    bad_archs = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if bad_archs:
      raise ConfigError(
        f"unsupported architectures {bad_archs}; supported: {SUPPORTED_ARCHITECTURES}"
      )
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ConfigError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")
    for key, neutral in _NEUTRAL_FIELDS.items():
      if d.get(key) not in neutral:
        raise ConfigError(f"unsupported config field {key}={d.get(key)!r}")

    num_layers = _req(d, "num_hidden_layers")
    num_heads = _req(d, "num_attention_heads")
    hidden = _req(d, "hidden_size")
    head_dim = d.get("head_dim") or hidden // num_heads
    num_kv = d.get("num_key_value_heads") or num_heads

    attention_bias = bool(d.get("attention_bias", False))
    if model_type == "qwen2":
      qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type == "llama":
      qkv_bias, o_bias, mlp_bias = attention_bias, attention_bias, bool(d.get("mlp_bias", False))
    else:  # mistral
      if attention_bias:
        raise ConfigError(
          "mistral config sets attention_bias=True, which MistralForCausalLM ignores"
        )
      qkv_bias = o_bias = mlp_bias = False

    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return cls(
      model_type=model_type,
      vocab_size=_req(d, "vocab_size"),
      hidden_size=hidden,
      intermediate_size=_req(d, "intermediate_size"),
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=num_kv,
      head_dim=head_dim,
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      rope=_rope_from_hf(d),
      max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      o_bias=o_bias,
      mlp_bias=mlp_bias,
      layer_windows=_windows_from_hf(d, model_type, num_layers),
      bos_token_id=d.get("bos_token_id"),
      eos_token_ids=eos_ids,
      num_slots=num_slots,
      dense_embedding_slots=dense_embedding_slots,
      lora_rank=lora_rank,
      extra_vocab=extra_vocab,
      packed_embedding_slots=packed_embedding_slots,
    )


def _req(d: Mapping[str, Any], key: str):
  if d.get(key) is None:
    raise ConfigError(f"config.json lacks required field {key!r}")
  return int(d[key])


def _rope_from_hf(d: Mapping[str, Any]) -> RopeConfig:
  params = d.get("rope_parameters")
  if (
    isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values())
  ):
    raise ConfigError("per-layer-type rope_parameters are not supported")
  if params is None:  # transformers v4 spelling
    params = dict(d.get("rope_scaling") or {})
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
  params = dict(params)
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ConfigError(
      f"unsupported rope type {rope_type!r} (rope_scaling / rope_parameters); supported: "
      f"{SUPPORTED_ROPE_TYPES}"
    )
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConfigError(f"unsupported partial_rotary_factor={params['partial_rotary_factor']}")
  theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
  if rope_type == "default":
    return RopeConfig(theta=theta)
  if rope_type == "linear":
    return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
  try:
    return RopeConfig(
      theta=theta,
      rope_type="llama3",
      factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
  except KeyError as e:
    raise ConfigError(f"llama3 rope scaling lacks field {e}") from None


def _windows_from_hf(d: Mapping[str, Any], model_type: str, n: int) -> tuple[int | None, ...]:
  window = d.get("sliding_window")
  if model_type == "llama":
    return (None,) * n  # LlamaForCausalLM has no sliding window, whatever the config says
  if model_type == "mistral":
    return (None if window is None else int(window),) * n
  # qwen2: v5 writes layer_types; v4 derives them from use_sliding_window / max_window_layers.
  if not d.get("use_sliding_window", False):
    window = None
  layer_types = d.get("layer_types")
  if layer_types is None:
    mwl = d.get("max_window_layers", n)
    layer_types = [
      "sliding_attention" if window is not None and i >= mwl else "full_attention" for i in range(n)
    ]
  if len(layer_types) != n:
    raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
  out = []
  for t in layer_types:
    if t == "full_attention":
      out.append(None)
    elif t == "sliding_attention":
      out.append(None if window is None else int(window))
    else:
      raise ConfigError(f"unsupported layer type {t!r} in layer_types")
  return tuple(out)
