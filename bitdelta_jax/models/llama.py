"""A Llama-family decoder (Llama, Mistral, Qwen2) in Flax NNX with per-row variant slots.

The module tree mirrors the HF checkpoint: ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.{kernel,bias}``, ``model.layers.{i}.mlp.{gate,up,
down}_proj.kernel``, ``model.layers.{i}.{input,post_attention}_layernorm.weight``,
``model.norm.weight``, ``lm_head.kernel`` (absent when embeddings are tied). ``kernel`` is the
HF Linear ``weight`` transposed to ``[in, out]``; see `bitdelta_jax.models.loading`.

Public entry points on `LlamaForCausalLM`:

* ``__call__(input_ids [B,T], *, attention_mask=None, positions=None, slot_ids=None)``
  → f32 logits ``[B, T, V]``. ``attention_mask`` ``[B, T]`` marks real keys (1) vs padding.
* ``prefill(input_ids [B,T], lengths [B], slot_ids)`` → ``(last_logits [B,V], k, v)`` with
  ``k, v [L, B, T, kv_heads, head_dim]``: right-padded prompts, logits at ``lengths - 1``.
* ``decode(tokens [B], positions [B], slot_ids, k_cache, v_cache)`` → ``(logits [B,V], k, v)``:
  one token per row at its own position, written into the preallocated cache
  ``[L, B, max_len, kv_heads, head_dim]`` before attending over it.
* ``forward_paged(batch: PagedBatch, k_pool, v_pool)`` → ``(logits [N,V], k_pool, v_pool)``:
  the serving engine's one computation over a paged KV cache ``[L, pages, page_size,
  kv_heads, head_dim]`` (see `bitdelta_jax.engine.generator`): decode rows, prompt chunks and
  several prompts packed into one row alike. ``batch`` is read by its fields only (the engine's
  `PagedBatch`, which the engine registers as a pytree before it jits a step): its tokens,
  slots and K/V write positions, and ``batch.attention``, the
  `pallas_kernels.attention_inputs.AttentionInputs` (positions, page tables, lengths) that
  every layer's attention reads as one pytree. The model does not import the engine.

``slot_ids [B]`` picks each row's variant (0 = base); None runs the base for every row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bitdelta_jax.models.config import ModelConfig
from bitdelta_jax.models.layers import DeltaDense, Embed, LMHead, RMSNorm, dense_many

_NEG = float(np.finfo(np.float32).min)

# attend(layer_idx, q [B,T,H,hd], k [B,T,KV,hd], v) -> out [B,T,H,hd]
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def rope_cos_sin(inv_freq: np.ndarray, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  freqs = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BxTxHxD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF's rotate-half convention; cos/sin ``[B, T, hd]`` in f32, cast to x's dtype."""
  dtype = x_BxTxHxD.dtype
  cos, sin = cos[:, :, None].astype(dtype), sin[:, :, None].astype(dtype)
  half = x_BxTxHxD.shape[-1] // 2
  x1, x2 = x_BxTxHxD[..., :half], x_BxTxHxD[..., half:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxHxD * cos + rotated * sin


def attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS) -> jax.Array:
  """Grouped-query softmax attention; scores and softmax in f32."""
  b, t, h, d = q_BxTxHxD.shape
  kv = k_BxSxKxD.shape[2]
  q = q_BxTxHxD.reshape(b, t, kv, h // kv, d)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxD, preferred_element_type=jnp.float32)
  s = s * (d**-0.5)
  s = jnp.where(mask_BxTxS[:, None, None], s, _NEG)
  p = jax.nn.softmax(s, axis=-1).astype(v_BxSxKxD.dtype)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v_BxSxKxD)
  return o.reshape(b, t, h, d)


def causal_mask(q_pos_BxT, k_pos_BxS, window: int | None, key_valid_BxS=None) -> jax.Array:
  """``k <= q`` (and ``k > q - window``) over cache indices, plus key validity."""
  qp, kp = q_pos_BxT[:, :, None], k_pos_BxS[:, None, :]
  m = kp <= qp
  if window is not None:
    m = m & (kp > qp - window)
  if key_valid_BxS is not None:
    m = m & key_valid_BxS[:, None, :]
  return m


def _dense_factory(cfg: ModelConfig, *, dtype, rngs: nnx.Rngs) -> Callable[..., DeltaDense]:
  """DeltaDense with this config's slot, LoRA and kernel settings: ``make(in, out, bias)``."""
  return lambda k, n, use_bias: DeltaDense(
    k, n, use_bias=use_bias, num_slots=cfg.num_slots, dtype=dtype, rngs=rngs,
    implementation=cfg.delta_implementation, lora_rank=cfg.lora_rank,
  )


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
    make = _dense_factory(cfg, dtype=dtype, rngs=rngs)
    self.q_proj = make(d, cfg.num_heads * hd, cfg.qkv_bias)
    self.k_proj = make(d, cfg.num_kv_heads * hd, cfg.qkv_bias)
    self.v_proj = make(d, cfg.num_kv_heads * hd, cfg.qkv_bias)
    self.o_proj = make(cfg.num_heads * hd, d, cfg.o_bias)

  def __call__(self, x, cos, sin, slot_ids, attend: Callable) -> jax.Array:
    b, t, _ = x.shape
    q, k, v = dense_many((self.q_proj, self.k_proj, self.v_proj), x, slot_ids)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = attend(q, k, v)
    return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim), slot_ids)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
    make = _dense_factory(cfg, dtype=dtype, rngs=rngs)
    self.gate_proj = make(d, f, bias)
    self.up_proj = make(d, f, bias)
    self.down_proj = make(f, d, bias)

  def __call__(self, x, slot_ids):
    gate, up = dense_many((self.gate_proj, self.up_proj), x, slot_ids)
    h = jax.nn.silu(gate) * up
    return self.down_proj(h, slot_ids)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    kw = dict(eps=cfg.rms_norm_eps, num_slots=cfg.num_slots, dtype=dtype)
    self.input_layernorm = RMSNorm(cfg.hidden_size, **kw)
    self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **kw)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

  def __call__(self, x, cos, sin, slot_ids, attend: Callable):
    x = x + self.self_attn(self.input_layernorm(x, slot_ids), cos, sin, slot_ids, attend)
    return x + self.mlp(self.post_attention_layernorm(x, slot_ids), slot_ids)


class Decoder(nnx.Module):
  """HF's ``model``: embeddings, layers, final norm."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    self.embed_tokens = Embed(
      cfg.vocab_size,
      cfg.hidden_size,
      num_slots=cfg.num_slots,
      dense_slots=cfg.dense_embedding_slots,
      extra_vocab=cfg.extra_vocab,
      packed_slots=cfg.packed_embedding_slots,
      dtype=dtype,
      rngs=rngs,
    )
    self.layers = nnx.List(
      [DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)]
    )
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, num_slots=cfg.num_slots, dtype=dtype)


class LlamaForCausalLM(nnx.Module):
  """The causal LM; see the module docstring for the call signatures."""

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.config = cfg
    self.dtype = jnp.dtype(dtype)
    self.model = Decoder(cfg, dtype=dtype, rngs=rngs)
    self.lm_head = (
      None
      if cfg.tie_word_embeddings
      else LMHead(
        cfg.hidden_size,
        cfg.vocab_size,
        num_slots=cfg.num_slots,
        dense_slots=cfg.dense_embedding_slots,
        extra_vocab=cfg.extra_vocab,
        packed_slots=cfg.packed_embedding_slots,
        dtype=dtype,
        rngs=rngs,
      )
    )

  # -- internals ---------------------------------------------------------------------------
  def _hidden(self, ids_BxT, positions_BxT, slot_ids, attend: AttendFn) -> jax.Array:
    x = self.model.embed_tokens(ids_BxT, slot_ids)
    inv_freq = self.config.rope.inv_freq(self.config.head_dim)
    cos, sin = rope_cos_sin(inv_freq, positions_BxT)
    for i, layer in enumerate(self.model.layers):
      x = layer(x, cos, sin, slot_ids, lambda q, k, v, i=i: attend(i, q, k, v))
    return x

  def _logits(self, h_BxTxD, slot_ids) -> jax.Array:
    h = self.model.norm(h_BxTxD, slot_ids)
    if self.lm_head is None:
      return self.model.embed_tokens.attend(h, slot_ids)
    return self.lm_head(h, slot_ids)

  def _self_attend(self, ids_BxT, key_valid_BxT, kv_out: list | None) -> AttendFn:
    b, t = ids_BxT.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    masks = {w: causal_mask(idx, idx, w, key_valid_BxT) for w in set(self.config.layer_windows)}

    def attend(i, q, k, v):
      if kv_out is not None:
        kv_out.append((k, v))
      return attention(q, k, v, masks[self.config.layer_windows[i]])

    return attend

  # -- public ------------------------------------------------------------------------------
  def __call__(
    self,
    input_ids: jax.Array,
    *,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    slot_ids: jax.Array | None = None,
  ) -> jax.Array:
    """Full-sequence forward: f32 logits ``[B, T, V]``."""
    ids = jnp.asarray(input_ids, jnp.int32)
    b, t = ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    valid = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
    h = self._hidden(ids, positions, slot_ids, self._self_attend(ids, valid, None))
    return self._logits(h, slot_ids)

  def logits(self, h_MxD: jax.Array, slot_ids=None) -> jax.Array:
    """f32 logits ``[M, V]`` of final hidden states ``[M, D]`` (before the norm)."""
    return self._logits(h_MxD[:, None], slot_ids)[:, 0]

  def forward_paged(self, batch, k_pool: jax.Array, v_pool: jax.Array, *, base_only: bool = False,
                    kv_sharding=None, layers=None):
    """One ragged token batch over a paged KV cache; see `bitdelta_jax.engine.batch`.

    Every token is a row of its own (``[N, 1, D]`` through the layers, with its own variant
    slot). Each layer writes the new tokens' K/V to their (page, offset) first, then attends
    with `pallas_kernels.paged_attention.ragged_paged_attention` (decode lanes and packed prompt
    chunks, each pass bounded by the live lengths). Returns the final hidden states ``[N, D]``
    (`logits` turns them into logits) and the pools. ``layers``: ``(layer graphdef, stacked
    layer states)`` runs the layers as one ``lax.scan`` (one layer's program, not L copies;
    `stack_layers`); None unrolls ``self.model.layers``. ``kv_sharding`` (on a mesh): the
    sharding of the new K/V ``[N, kv, hd]`` the pools' layout needs before they are written.
    """
    from pallas_kernels.paged_attention import ragged_paged_attention, write_kv

    cfg = self.config
    n = batch.tokens.shape[0]
    slot_ids = None if base_only else batch.slot_ids
    x = self.model.embed_tokens(batch.tokens[:, None].astype(jnp.int32), slot_ids)
    tables = batch.attention
    cos, sin = rope_cos_sin(cfg.rope.inv_freq(cfg.head_dim), tables.positions[:, None])
    wp, wo = batch.write_page, batch.write_offset

    def attention(q, k_pool, v_pool, i, window, tables):
      return ragged_paged_attention(q, k_pool, v_pool, i, tables, window=window)

    heads = None if kv_sharding is None else kv_sharding.spec[1]
    # in place (the C++ write on CPU for bf16, the GPU kernel under CUDA); a pool sharded over
    # the mesh but not split by heads takes the jnp scatter (a custom call cannot be partitioned)
    write = functools.partial(write_kv, implementation=None if kv_sharding is None else "reference")
    if heads is not None:
      # KV heads split over `model`: each device attends with its own heads (and the query heads
      # that share them), so a kernel (a custom call XLA cannot partition) reads only local
      # pages instead of all-gathered pools. Page tables and the batch are replicated.
      from jax.sharding import PartitionSpec as P

      q_spec, pool_spec = P(None, heads, None), P(None, None, None, heads, None)
      attention = jax.shard_map(attention, mesh=kv_sharding.mesh,
                                in_specs=(q_spec, pool_spec, pool_spec, P(), P(), P()),
                                out_specs=q_spec, check_vma=False)
      # the write too: each device stores its own heads' rows in place (the GPU kernel; a
      # custom call XLA cannot partition), or the jnp scatter on its shard elsewhere
      local_write = jax.shard_map(
        functools.partial(write_kv, implementation=_sharded_write_implementation()),
        mesh=kv_sharding.mesh, in_specs=(pool_spec, P(), P(), P(), P(None, heads, None)),
        out_specs=pool_spec, check_vma=False)
      write = lambda pool, i, *rest: local_write(pool, jnp.asarray(i, jnp.int32), *rest)  # noqa: E731
      # the layer index and window go in as (replicated) arrays; None means no window
      scalars = lambda i, w: (jnp.asarray(i, jnp.int32),  # noqa: E731
                              jnp.asarray(_NO_WINDOW if w is None else w, jnp.int32))
    else:
      scalars = lambda i, w: (i, w)  # noqa: E731

    def run_layer(layer, x, k_pool, v_pool, i, window):
      pools = {"k": k_pool, "v": v_pool}

      def attend(q, k, v):  # [N, 1, heads, hd]
        for name, new in (("k", k[:, 0]), ("v", v[:, 0])):
          if kv_sharding is not None:
            new = jax.lax.with_sharding_constraint(new, kv_sharding)
          pools[name] = write(pools[name], i, wp, wo, new)
        o = attention(q[:, 0], pools["k"], pools["v"], *scalars(i, window), tables)
        return o[:, None]

      x = layer(x, cos, sin, slot_ids, attend)
      return x, pools["k"], pools["v"]

    if layers is None:
      for i, layer in enumerate(self.model.layers):
        x, k_pool, v_pool = run_layer(layer, x, k_pool, v_pool, i, cfg.layer_windows[i])
    else:
      layer_def, stacked = layers
      windows = jnp.asarray([w or _NO_WINDOW for w in cfg.layer_windows], jnp.int32)

      def body(carry, xs):
        i, state = xs
        return run_layer(nnx.merge(layer_def, state), *carry, i, windows[i]), None

      steps = (jnp.arange(cfg.num_layers, dtype=jnp.int32), stacked)
      (x, k_pool, v_pool), _ = jax.lax.scan(body, (x, k_pool, v_pool), steps)
    return x.reshape(n, -1), k_pool, v_pool


_NO_WINDOW = 1 << 30


def _sharded_write_implementation() -> str | None:
  """The KV write inside ``shard_map``: `write_kv`'s own choice when the target is CUDA (the GPU
  kernel where it takes the rows), the jnp scatter on other platforms (as before the kernel)."""
  from pallas_kernels.platform import target_platform

  return None if target_platform() == "cuda" else "reference"


def stack_layers(model: LlamaForCausalLM, previous=None):
  """``(layer graphdef, states stacked on a leading layer axis)`` for
  ``forward_paged(layers=...)``, or None when the layers differ in structure (then they
  unroll). ``previous`` (an earlier result): leaves whose per-layer arrays are the same objects
  as then are reused, not stacked again, so re-stacking after a slot load copies only banks."""
  layers = list(model.model.layers)
  defs = [nnx.graphdef(layer) for layer in layers]
  if any(d != defs[0] for d in defs[1:]):
    return None
  states = [nnx.state(layer) for layer in layers]
  flat = [jax.tree_util.tree_flatten(st) for st in states]
  leaves_by_layer = [f[0] for f in flat]
  treedef = flat[0][1]
  if any(f[1] != treedef for f in flat[1:]):  # e.g. a GGUF whose layers mix ggml formats
    return None
  old = previous[2] if previous is not None else {}
  stacked, memo = [], {}
  for j, per_layer in enumerate(zip(*leaves_by_layer)):
    ids = tuple(id(a) for a in per_layer)
    hit = old.get(j)
    if hit is not None and hit[0] == ids:
      arr = hit[1]
    else:
      arr = jnp.stack(per_layer)
    memo[j] = (ids, arr, per_layer)  # per_layer kept so the ids stay valid
    stacked.append(arr)
  return defs[0], jax.tree_util.tree_unflatten(treedef, stacked), memo


def rekey_stacked(model: LlamaForCausalLM, stacked):
  """``stacked`` (a `stack_layers` result) with its memo keyed by the layers' leaves as they
  are now: after per-layer leaves were replaced by placeholders whose stacked arrays stay
  valid (`PagedRunner` drops the layers' own kernels), so a later `stack_layers` reuses them."""
  layer_def, tree, memo = stacked
  leaves_by_layer = [jax.tree_util.tree_leaves(nnx.state(layer)) for layer in model.model.layers]
  new = {j: (tuple(id(a) for a in per_layer), memo[j][1], per_layer)
         for j, per_layer in enumerate(zip(*leaves_by_layer))}
  return layer_def, tree, new
