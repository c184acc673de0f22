"""Prefill and decode jitted with explicit in/out shardings; a sharded `Generator`.

* `ShardedModel`: ``prefill(ids, lengths, slot_ids)`` and ``decode(tokens, positions, slot_ids,
  k, v)`` of a sharded model; rows over ``data``, KV cache over kv heads on ``model``, logits
  replicated. One jitted function per batch size (the row sharding depends on divisibility).
* `ShardedGenerator`: `bitdelta_jax.models.generate.Generator` with its three jitted steps
  re-jitted with shardings: the parameter state as `shard_model` placed it, the decode state's
  KV cache ``[L, R, T, kv, hd]`` as ``P(None, data, None, model, None)`` (each axis only when
  it divides), per-row fields over ``data``, and sampled tokens replicated so that every
  process can read them. Variants load shard by shard (`load_variant_sharded`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bitdelta_jax.models.generate import (
  DecodeState,
  Generator,
  Prefix,
  RowParams,
  _insert_impl,
  _prefill_impl,
  _step_impl,
)
from bitdelta_jax.models.sampling import SamplingParams
from bitdelta_jax.sharding.rules import (
  PartitionRules,
  Plan,
  kv_cache_spec,
  on_mesh,
  place,
  rows_spec,
  shard_model,
  shardings_of,
)


class ShardedModel:
  """The model's ``prefill`` / ``decode`` jitted over ``mesh`` (shards the model if needed)."""

  def __init__(self, model, mesh: Mesh, rules: PartitionRules = PartitionRules()):
    self.mesh = mesh
    self.plan: Plan | None = None if on_mesh(model, mesh) else shard_model(model, mesh, rules)
    self.graphdef, self.state = nnx.split(model)
    self.cfg = model.config
    self._param_sh = shardings_of(self.state)
    self._fns: dict = {}

  def _s(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def _prefill_fn(self, b: int):
    if ("prefill", b) in self._fns:
      return self._fns["prefill", b]
    sizes = dict(self.mesh.shape)
    rows, kv = self._s(rows_spec(b, sizes)), self._s(kv_cache_spec(self.cfg, b, sizes))

    def f(state, ids, lengths, slot_ids):
      return nnx.merge(self.graphdef, state).prefill(ids, lengths, slot_ids)

    fn = jax.jit(f, in_shardings=(self._param_sh, self._s(rows_spec(b, sizes, 2)), rows, rows),
                 out_shardings=(self._s(P()), kv, kv))
    return self._fns.setdefault(("prefill", b), fn)

  def _decode_fn(self, b: int):
    if ("decode", b) in self._fns:
      return self._fns["decode", b]
    sizes = dict(self.mesh.shape)
    rows, kv = self._s(rows_spec(b, sizes)), self._s(kv_cache_spec(self.cfg, b, sizes))

    def f(state, tokens, positions, slot_ids, k, v):
      return nnx.merge(self.graphdef, state).decode(tokens, positions, slot_ids, k, v)

    fn = jax.jit(f, in_shardings=(self._param_sh, rows, rows, rows, kv, kv),
                 out_shardings=(self._s(P()), kv, kv), donate_argnums=(4, 5))
    return self._fns.setdefault(("decode", b), fn)

  def prefill(self, ids_BxT, lengths_B, slot_ids_B):
    """As `LlamaForCausalLM.prefill`; logits replicated, k/v in the cache layout."""
    return self._prefill_fn(int(ids_BxT.shape[0]))(self.state, ids_BxT, lengths_B, slot_ids_B)

  def decode(self, tokens_B, positions_B, slot_ids_B, k_cache, v_cache):
    """As `LlamaForCausalLM.decode`; the caches are donated."""
    fn = self._decode_fn(int(tokens_B.shape[0]))
    return fn(self.state, tokens_B, positions_B, slot_ids_B, k_cache, v_cache)

  def kv_sharding(self, rows: int) -> NamedSharding:
    return self._s(kv_cache_spec(self.cfg, rows, dict(self.mesh.shape)))


class ShardedGenerator(Generator):
  """`Generator` over a device mesh; same API (prefill → insert → step, `generate`).

  The model is sharded in place by `shard_model` unless it already lives on ``mesh``.
  """

  def __init__(self, model, mesh: Mesh, *, rules: PartitionRules = PartitionRules(), **kwargs):
    self.mesh = mesh
    self.plan = None if on_mesh(model, mesh) else shard_model(model, mesh, rules)
    super().__init__(model, **kwargs)
    sizes = dict(mesh.shape)
    cfg, r = model.config, self.max_rows
    s = functools.partial(NamedSharding, mesh)
    rep = s(P())
    self._param_sh = shardings_of(self.state)
    rows = s(rows_spec(r, sizes))
    self._state_sh = DecodeState(
      k=s(kv_cache_spec(cfg, r, sizes)), v=s(kv_cache_spec(cfg, r, sizes)), lengths=rows,
      tokens=rows, row=RowParams(rows, s(rows_spec(r, sizes, 2)), rows, rows, rows),
    )
    kv1 = s(kv_cache_spec(cfg, 1, sizes))
    self._prefix_sh = Prefix(k=kv1, v=kv1, lengths=rep, token=rep, logits=rep, row=rep)
    self._rep = rep
    self._prefill = jax.jit(
      functools.partial(_prefill_impl, self.graphdef),
      in_shardings=(self._param_sh, rep, rep, rep), out_shardings=self._prefix_sh,
    )
    self._insert = jax.jit(
      _insert_impl, donate_argnums=0, in_shardings=(self._state_sh, self._prefix_sh, rep),
      out_shardings=self._state_sh,
    )
    self._step = jax.jit(
      functools.partial(_step_impl, self.graphdef), donate_argnums=1,
      in_shardings=(self._param_sh, self._state_sh), out_shardings=(self._state_sh, rep),
    )

  def refresh(self) -> None:
    state = nnx.state(self.model)
    sh = getattr(self, "_param_sh", None)
    self.state = state if sh is None else jax.tree.map(place, state, sh)

  def load_variant(self, slot: int, delta) -> None:
    """``delta``: an in-memory delta dict or a delta directory; written shard by shard."""
    from bitdelta_jax.sharding.restore import load_variant_sharded

    load_variant_sharded(self.model, slot, delta)
    self.refresh()

  def clear_slot(self, slot: int) -> None:
    self.load_variant(slot, {})

  def init_state(self) -> DecodeState:
    """An empty decode state, born sharded (the KV cache never sits on one device)."""
    cfg, r = self.model.config, self.max_rows
    shape = (cfg.num_layers, r, self.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
    sh = self._state_sh
    zeros = jax.jit(lambda: jnp.zeros(shape, self.model.dtype), out_shardings=sh.k)
    row = RowParams.of([0] * r, [SamplingParams()] * r)
    return DecodeState(
      k=zeros(), v=zeros(), lengths=place(np.zeros(r, np.int32), sh.lengths),
      tokens=place(np.zeros(r, np.int32), sh.tokens), row=jax.tree.map(place, row, sh.row),
    )

  def prefill(self, prompt, slot: int = 0, params: SamplingParams = SamplingParams()):
    return super().prefill(prompt, slot, params)

  def insert(self, state: DecodeState, prefix: Prefix, row: int) -> DecodeState:
    return self._insert(state, prefix, place(np.asarray([row], np.int32), self._rep))
