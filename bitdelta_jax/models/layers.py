"""Delta-aware layers: the base parameters of the HF checkpoint plus a bank of variant slots.

Every layer keeps its base weights as `nnx.Param` under the HF tensor's name (``kernel`` is the
transposed HF ``weight`` of a Linear, ``[in, out]``). Variant state lives beside them in
`SlotBank` variables, one row per slot, so ``nnx.state(model, nnx.Param)`` is exactly the base
checkpoint and ``nnx.state(model, SlotBank)`` is the variant bank:

* `DeltaDense`: ``y[m] = x[m]·W + α[v]⊙(x[m]·S[v]) (+ b + Δb[v])`` with ``v`` the slot of row
  ``m``'s sequence; the matmul, with or without a bank, is one call of
  `pallas_kernels.delta_matmul.api.delta_matmul`, which picks the kernel. Bank: bits
  ``[S, K_pad/8, N]`` uint8, scale ``[S, N]`` f32 (a per-matrix α is broadcast to N).
  `dense_many`: layers that read one x (q/k/v, gate/up) over a GGUF base's blocks, in one
  `pallas_kernels.quant_matmul.api.quant_matmul_many` call (one CPU kernel call).
* `RMSNorm`: per-slot f32 weight delta ``[S, D]`` (norms are kept exactly by the compressor).
* `Embed` / `LMHead`: optional per-slot dense f32 deltas (``ModelConfig.dense_embedding_slots``)
  and a per-slot flag of whether the slot's delta is non-zero. The input side gathers only the
  batch's tokens; the output side adds ``h · ΔE[s]ᵀ`` once per slot that has rows in the batch
  and a non-zero delta (a ``lax.cond`` per slot), so a batch without such rows runs exactly the
  base's LM head, and never materialises a ``[rows, V, D]`` gather.
  With ``ModelConfig.packed_embedding_slots`` the delta is 1-bit with a per-token α instead
  (bits ``[S, D/8, V]`` + α ``[S, V]``: 1/32 of the dense bank), read packed on both sides.
  The base head is `pallas_kernels.lm_head.logits`, the packed bank product
  `pallas_kernels.lm_head.add_packed_products`: each picks its kernel.
  With ``ModelConfig.extra_vocab`` they also hold per-slot rows for tokens a variant added (a
  grown vocabulary); the logits are then ``V + extra_vocab`` wide.

Slot 0 is the base: its rows are always zero. All bank shapes are static, so loading a
variant (see `bitdelta_jax.models.slots`) is an array update that never recompiles.
A layer built with ``num_slots == 1`` has no bank and runs the plain base computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.bits import DEFAULT_GROUP_K, group_k_for, packed_rows, unpack_signs
from pallas_kernels.delta_matmul.api import delta_matmul
from pallas_kernels.lm_head.api import add_packed_products
from pallas_kernels.lm_head.api import logits as head_logits
from pallas_kernels.lm_head.api import packed_products_fused as _packed_products_fused  # noqa: F401
from pallas_kernels.lm_head.reference import (  # noqa: F401  (read here by an older test)
  packed_products_reference as _packed_products_reference,
)
from pallas_kernels.quant_matmul import QuantizedKernel, dequantize, quant_matmul, take_columns
from pallas_kernels.quant_matmul.api import quant_matmul_many

_init = nnx.initializers.normal(0.02)


def hf_array(value, transpose: bool) -> np.ndarray:
  """A parameter's value in its HF tensor's layout (numpy): ``transpose`` for a Linear kernel
  (``[in, out]`` → ``[out, in]``). A `QuantizedKernel` is always ``[K, N]`` column blocks of the
  file's rows (an embedding table too, as ``[D, V]``), so its HF layout is the transposed
  dequantization whatever the parameter."""
  if isinstance(value, QuantizedKernel):
    return dequantize(jax.tree.map(np.asarray, value)).T
  arr = np.asarray(value)
  return arr.T if transpose else arr


class SlotBank(nnx.Variable):
  """Per-variant-slot state kept beside the base parameters (row 0 = base, always zero)."""


def _rows(bank: jax.Array, slot_ids: jax.Array) -> jax.Array:
  return jnp.take(bank, slot_ids, axis=0)


def _add_slot_products(logits_BxTxV, h_BxTxD, bank, used_S, slot_ids_B, spec: str):
  """``logits[b] += h[b] · bank[slot[b]]`` computed once per slot present in the batch whose
  flag is set (slots skipped by ``lax.cond``), never per row."""
  h = h_BxTxD.astype(jnp.float32)
  for s in range(1, bank.shape[0]):
    rows = slot_ids_B == s
    add = lambda lg, s=s, rows=rows: lg + jnp.where(
      rows[:, None, None], jnp.einsum(spec, h, bank[s]), 0.0)
    logits_BxTxV = jax.lax.cond(jnp.any(rows) & (used_S[s] > 0), add, lambda lg: lg,
                                logits_BxTxV)
  return logits_BxTxV


def _add_packed_slot_products(logits_BxTxV, h_BxTxD, bits_SxRxV, scale_SxV, slot_ids_B,
                              group_k: int):
  """``logits[b] += α[s] ⊙ (h[b] · S[s])`` with ``s = slot[b]``: a 1-bit embedding / LM-head
  delta (per-token α) read packed (`pallas_kernels.lm_head.add_packed_products`)."""
  b, t, v = logits_BxTxV.shape
  out = add_packed_products(logits_BxTxV.reshape(b * t, v), h_BxTxD.reshape(b * t, -1),
                            bits_SxRxV, scale_SxV, jnp.repeat(slot_ids_B.astype(jnp.int32), t),
                            group_k=group_k)
  return out.reshape(b, t, v)


def _packed_columns(bits_SxRxV, scale_SxV, slot_ids_B, ids_BxT, k: int, group_k: int):
  """The 1-bit delta rows ``α[s, id] · S[s][:, id]`` of the given tokens, f32 ``[B, T, K]``.

  The batch's columns are gathered first (``[B·T, K/8]`` bytes) and only those are unpacked, on
  every platform: no kernel is needed, nothing of the table's ``[K/8, V]`` size is expanded
  (`tests/kernels/test_cuda_lowering.py` checks this in the CUDA step)."""
  b, t = ids_BxT.shape
  cols = bits_SxRxV[slot_ids_B[:, None], :, ids_BxT]  # [B, T, R]
  signs = unpack_signs(cols.reshape(b * t, -1, 1), (k, 1), group_k)[..., 0]  # [B*T, K]
  alpha = scale_SxV[slot_ids_B[:, None], ids_BxT].reshape(b * t, 1)
  return (alpha * signs).reshape(b, t, k)


_LORA_GATHER_MAX_ROWS = 64  # above: every slot's factors once, each row's own slot selected


def _lora_delta(x_BxTxK, a_SxKxR, b_SxRxN, slot_ids_B) -> jax.Array:
  """f32 ``x · A[s] · B[s]`` with each row's slot ``s``. Few rows gather their slot's factors;
  many rows (a ragged step has a row per token) multiply by every slot's and keep their own,
  which reads the factors once instead of once per row.

  Many rows: a row's ``x · A`` of the other slots is selected away (not multiplied by 0: a
  slot's NaN factor would survive as ``0 · NaN``), and the product with B, one contraction over
  every slot, reads a non-finite entry of B as 0, so one slot's corrupt B cannot reach the rows
  of the others (registration refuses such adapters; this keeps a slot that holds one apart)."""
  x = x_BxTxK.astype(jnp.float32)
  if x.shape[0] <= _LORA_GATHER_MAX_ROWS:
    xa = jnp.einsum("btk,bkr->btr", x, _rows(a_SxKxR, slot_ids_B))
    return jnp.einsum("btr,brn->btn", xa, _rows(b_SxRxN, slot_ids_B))
  own = slot_ids_B[:, None] == jnp.arange(a_SxKxR.shape[0])[None]  # [B, S]
  xa = jnp.where(own[:, None, :, None], jnp.einsum("btk,skr->btsr", x, a_SxKxR), 0.0)
  b = jnp.where(jnp.isfinite(b_SxRxN), b_SxRxN, 0.0)  # [S, r, N]: 1/B of the product's work
  return jnp.einsum("btsr,srn->btn", xa, b)


class DeltaDense(nnx.Module):
  """A Linear layer ``[in, out]`` with an optional bank of 1-bit variant deltas.

  Call with ``x [B, T, in]`` and ``slot_ids [B]`` (or None: base only).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool,
    num_slots: int,
    dtype,
    rngs: nnx.Rngs,
    implementation: str | None = None,
    lora_rank: int = 0,
  ):
    self.in_features, self.out_features = in_features, out_features
    self.implementation = implementation
    self.kernel = nnx.Param(_init(rngs.params(), (in_features, out_features), dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
    self.group_k = group_k_for(in_features, DEFAULT_GROUP_K)
    if num_slots > 1:
      kp = packed_rows(in_features, self.group_k)
      self.delta_bits = SlotBank(jnp.zeros((num_slots, kp, out_features), jnp.uint8))
      self.delta_scale = SlotBank(jnp.zeros((num_slots, out_features), jnp.float32))
      self.bias_delta = (
        SlotBank(jnp.zeros((num_slots, out_features), jnp.float32)) if use_bias else None
      )
    else:
      self.delta_bits = self.delta_scale = self.bias_delta = None
    if num_slots > 1 and lora_rank > 0:
      # LoRA slots: x·A_sᵀ·B_sᵀ·scale_s, stored as [S, in, r] and [S, r, out] (scale folded in).
      self.lora_a = SlotBank(jnp.zeros((num_slots, in_features, lora_rank), jnp.float32))
      self.lora_b = SlotBank(jnp.zeros((num_slots, lora_rank, out_features), jnp.float32))
    else:
      self.lora_a = self.lora_b = None

  @property
  def has_bank(self) -> bool:
    return self.delta_bits is not None

  def _bank(self, slot_ids, t: int) -> tuple:
    """(bits, scale, per-row slot ids) of this layer's bank, or () without one."""
    if self.has_bank and slot_ids is not None:
      ids = jnp.repeat(slot_ids.astype(jnp.int32), t)
      return (self.delta_bits[...], self.delta_scale[...], ids)
    return ()

  def __call__(self, x_BxTxK: jax.Array, slot_ids: jax.Array | None = None) -> jax.Array:
    b, t, k = x_BxTxK.shape
    x = x_BxTxK.reshape(b * t, k)
    bank = self._bank(slot_ids, t)
    # The kernel API picks the implementation (few-rows CPU kernel, base product, delta kernel,
    # or the sharded callable in `implementation`); f32 so a LoRA term adds to it as before.
    w = self.kernel.get_value()
    if isinstance(w, QuantizedKernel):  # a GGUF base, kept in its ggml blocks
      y = quant_matmul(x, w, *bank, group_k=self.group_k, preferred_element_type=jnp.float32)
    else:
      y = delta_matmul(x, w, *bank, group_k=self.group_k, implementation=self.implementation,
                       preferred_element_type=jnp.float32)
    return self._finish(y, x_BxTxK, slot_ids)

  def _finish(self, y: jax.Array, x_BxTxK: jax.Array, slot_ids) -> jax.Array:
    """The product ``y [B·T, out]`` (f32, base + delta) to the layer's output: LoRA, dtype,
    bias."""
    b, t, _ = x_BxTxK.shape
    y = y.reshape(b, t, self.out_features)
    if self.lora_a is not None and slot_ids is not None:
      y = jax.lax.cond(jnp.any(slot_ids > 0),
                       lambda y: y + _lora_delta(x_BxTxK, self.lora_a[...], self.lora_b[...],
                                                 slot_ids),
                       lambda y: y, y)
    y = y.astype(x_BxTxK.dtype)
    if self.bias is not None:
      bias = self.bias[...]
      if self.bias_delta is not None and slot_ids is not None:
        bias = bias.astype(jnp.float32)[None] + _rows(self.bias_delta[...], slot_ids)
        bias = bias.astype(self.bias.dtype)[:, None, :]
      y = y + bias
    return y


def dense_many(denses, x_BxTxK: jax.Array, slot_ids: jax.Array | None = None) -> list:
  """``[d(x, slot_ids) for d in denses]`` for layers that read one x (q/k/v, gate/up): over a
  GGUF base's blocks the products go through one call (`quant_matmul_many`: on the CPU one
  kernel call, x quantized once and one thread-pool run, the same numbers as separate calls);
  otherwise each layer is called."""
  ws = [d.kernel.get_value() for d in denses]
  banks = [d._bank(slot_ids, x_BxTxK.shape[1]) for d in denses]
  if not all(isinstance(w, QuantizedKernel) for w in ws) or len({len(bk) for bk in banks}) > 1:
    return [d(x_BxTxK, slot_ids) for d in denses]
  b, t, k = x_BxTxK.shape
  ys = quant_matmul_many(x_BxTxK.reshape(b * t, k), ws,
                         None if not banks[0] else [bk[:2] for bk in banks],
                         banks[0][2] if banks[0] else None, group_k=denses[0].group_k,
                         preferred_element_type=jnp.float32)
  return [d._finish(y, x_BxTxK, slot_ids) for d, y in zip(denses, ys)]


class RMSNorm(nnx.Module):
  """``w ⊙ x / rms(x)`` computed in f32 like transformers; per-slot f32 weight deltas."""

  def __init__(self, dim: int, *, eps: float, num_slots: int, dtype):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.weight_delta = (
      SlotBank(jnp.zeros((num_slots, dim), jnp.float32)) if num_slots > 1 else None
    )

  def __call__(self, x_BxTxD: jax.Array, slot_ids: jax.Array | None = None) -> jax.Array:
    dtype = x_BxTxD.dtype
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    w = self.weight[...]
    if self.weight_delta is not None and slot_ids is not None:
      w = w.astype(jnp.float32)[None] + _rows(self.weight_delta[...], slot_ids)
      w = w.astype(self.weight.dtype)[:, None, :]
    return w * x.astype(dtype)


class Embed(nnx.Module):
  """Token embedding ``[V, D]``; with tied embeddings it also produces the logits.

  With ``extra_vocab = X > 0`` each slot also holds up to X rows for tokens a variant added
  (ids ``V … V+X−1``, `SlotBank` ``extra_weight [S, X, D]``) and how many it uses
  (``extra_count [S]``); the tied logits are then ``V + X`` wide and a row's unused extra ids
  are ``-inf`` (never sampled; the base, slot 0, uses none).
  """

  def __init__(self, vocab: int, dim: int, *, num_slots: int, dense_slots: bool, dtype, rngs,
               extra_vocab: int = 0, packed_slots: bool = False):
    self.dtype = jnp.dtype(dtype)  # the activations' (a quantized table has none of its own)
    self.weight = nnx.Param(_init(rngs.params(), (vocab, dim), dtype))
    self.group_k = group_k_for(dim, DEFAULT_GROUP_K)
    packed = packed_slots and num_slots > 1  # 1-bit delta, per-token α: [S, D/8, V] + [S, V]
    self.weight_bits = (SlotBank(jnp.zeros((num_slots, packed_rows(dim, self.group_k), vocab),
                                           jnp.uint8)) if packed else None)
    self.weight_scale = SlotBank(jnp.zeros((num_slots, vocab), jnp.float32)) if packed else None
    banked = dense_slots and num_slots > 1
    self.weight_delta = SlotBank(jnp.zeros((num_slots, vocab, dim), jnp.float32)) if banked else None
    self.weight_delta_used = SlotBank(jnp.zeros((num_slots,), jnp.float32)) if banked else None
    grown = extra_vocab > 0 and num_slots > 1
    self.extra_weight = (SlotBank(jnp.zeros((num_slots, extra_vocab, dim), jnp.float32))
                         if grown else None)
    self.extra_count = SlotBank(jnp.zeros((num_slots,), jnp.float32)) if grown else None

  def __call__(self, ids_BxT: jax.Array, slot_ids: jax.Array | None = None) -> jax.Array:
    w = self.weight.get_value()
    quantized = isinstance(w, QuantizedKernel)  # a GGUF table: [D, V] in ggml blocks
    dim, vocab = w.shape if quantized else w.shape[::-1]
    dtype = self.dtype if quantized else w.dtype
    is_extra = ids_BxT >= vocab
    base_ids = jnp.where(is_extra, 0, ids_BxT) if self.extra_weight is not None else ids_BxT
    e = take_columns(w, base_ids).astype(dtype) if quantized else jnp.take(w, base_ids, axis=0)
    if self.weight_delta is not None and slot_ids is not None:
      d = self.weight_delta[...][slot_ids[:, None], base_ids]
      e = (e.astype(jnp.float32) + d).astype(dtype)
    if self.weight_bits is not None and slot_ids is not None:
      d = _packed_columns(self.weight_bits[...], self.weight_scale[...], slot_ids, base_ids,
                          dim, self.group_k)
      e = (e.astype(jnp.float32) + d).astype(dtype)
    if self.extra_weight is not None and slot_ids is not None:
      bank = self.extra_weight[...]
      x = bank[slot_ids[:, None], jnp.clip(ids_BxT - vocab, 0, bank.shape[1] - 1)]
      e = jnp.where(is_extra[..., None], x.astype(e.dtype), e)
    return e

  def attend(self, h_BxTxD: jax.Array, slot_ids: jax.Array | None = None) -> jax.Array:
    """Tied LM head: ``h · Eᵀ`` (+ per-slot ``h · ΔE[v]ᵀ``, + added tokens), f32 logits."""
    w = self.weight.get_value()  # a QuantizedKernel is [D, V]: `head_logits` knows
    logits = head_logits(h_BxTxD, w, tied=True)
    if self.weight_delta is not None and slot_ids is not None:
      logits = _add_slot_products(logits, h_BxTxD, self.weight_delta[...],
                                  self.weight_delta_used[...], slot_ids, "btd,vd->btv")
    if self.weight_bits is not None and slot_ids is not None:
      logits = _add_packed_slot_products(logits, h_BxTxD, self.weight_bits[...],
                                         self.weight_scale[...], slot_ids, self.group_k)
    if self.extra_weight is not None:
      logits = _with_extra_logits(logits, h_BxTxD, self.extra_weight[...], self.extra_count[...],
                                  slot_ids, "btd,bxd->btx")
    return logits


def _with_extra_logits(logits_BxTxV, h_BxTxD, bank, count_S, slot_ids_B, spec: str):
  """Appends the logits of each row's slot's added tokens (``-inf`` past the slot's count, and
  for every row when ``slot_ids`` is None: the base has no added tokens)."""
  b, t, _ = logits_BxTxV.shape
  x = bank.shape[1] if "bxd" in spec else bank.shape[2]
  if slot_ids_B is None:
    ext = jnp.full((b, t, x), -jnp.inf, jnp.float32)
  else:
    rows = jnp.take(bank, slot_ids_B, axis=0)  # [B, X, D] or [B, D, X]: X is small
    ext = jnp.einsum(spec, h_BxTxD.astype(jnp.float32), rows)
    n = jnp.take(count_S, slot_ids_B)
    valid = jnp.arange(x, dtype=jnp.float32)[None, :] < n[:, None]
    ext = jnp.where(valid[:, None, :], ext, -jnp.inf)
  return jnp.concatenate([logits_BxTxV, ext], axis=-1)


class LMHead(nnx.Module):
  """Untied LM head, kernel ``[D, V]`` (HF ``lm_head.weight`` transposed); f32 logits.
  ``extra_vocab``: per-slot columns ``extra_kernel [S, D, X]`` for added tokens, as in `Embed`."""

  def __init__(self, dim: int, vocab: int, *, num_slots: int, dense_slots: bool, dtype, rngs,
               extra_vocab: int = 0, packed_slots: bool = False):
    self.kernel = nnx.Param(_init(rngs.params(), (dim, vocab), dtype))
    self.group_k = group_k_for(dim, DEFAULT_GROUP_K)
    packed = packed_slots and num_slots > 1
    self.kernel_bits = (SlotBank(jnp.zeros((num_slots, packed_rows(dim, self.group_k), vocab),
                                           jnp.uint8)) if packed else None)
    self.kernel_scale = SlotBank(jnp.zeros((num_slots, vocab), jnp.float32)) if packed else None
    banked = dense_slots and num_slots > 1
    self.kernel_delta = SlotBank(jnp.zeros((num_slots, dim, vocab), jnp.float32)) if banked else None
    self.kernel_delta_used = SlotBank(jnp.zeros((num_slots,), jnp.float32)) if banked else None
    grown = extra_vocab > 0 and num_slots > 1
    self.extra_kernel = (SlotBank(jnp.zeros((num_slots, dim, extra_vocab), jnp.float32))
                         if grown else None)
    self.extra_count = SlotBank(jnp.zeros((num_slots,), jnp.float32)) if grown else None

  def __call__(self, h_BxTxD: jax.Array, slot_ids: jax.Array | None = None) -> jax.Array:
    logits = head_logits(h_BxTxD, self.kernel.get_value(), tied=False)
    if self.kernel_delta is not None and slot_ids is not None:
      logits = _add_slot_products(logits, h_BxTxD, self.kernel_delta[...],
                                  self.kernel_delta_used[...], slot_ids, "btd,dv->btv")
    if self.kernel_bits is not None and slot_ids is not None:
      logits = _add_packed_slot_products(logits, h_BxTxD, self.kernel_bits[...],
                                         self.kernel_scale[...], slot_ids, self.group_k)
    if self.extra_kernel is not None:
      logits = _with_extra_logits(logits, h_BxTxD, self.extra_kernel[...], self.extra_count[...],
                                  slot_ids, "btd,bdx->btx")
    return logits
