"""`engine.build`: the KV pages of each data group, from ``kv_cache_mb`` split over the groups,
at most what the group's rows need, and a clear error when a group cannot hold one sequence."""

from __future__ import annotations

import types

import pytest

from bitdelta_jax.engine.build import data_size, kv_pages, kv_token_bytes

MC = types.SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=32)  # 2 KiB per f32 token


def cfg(**kw):
  d = dict(dtype="float32", mesh=None, max_batch=8, max_seq_len=256, page_size=16,
           kv_cache_mb=1.0, multi_process=False)
  d.update(kw)
  return types.SimpleNamespace(**d)


def test_pages_follow_the_budget_and_the_rows():
  assert kv_token_bytes(MC, 4) == 2 * 4 * 2 * 32 * 4
  page = 16 * kv_token_bytes(MC, 4)  # 32 KiB
  assert kv_pages(cfg(), MC) == (1 << 20) // page + 1  # 32 pages + the reserved one
  # plenty of memory: only what 8 rows of 256 tokens need
  assert kv_pages(cfg(kv_cache_mb=100), MC) == 8 * 16 + 1
  assert kv_pages(cfg(kv_cache_mb=100, dtype="bfloat16"), MC) == 8 * 16 + 1


def test_data_groups_split_the_budget_and_the_rows():
  assert data_size(cfg(mesh="data=2,model=4")) == 2 and data_size(cfg()) == 1
  page = 16 * kv_token_bytes(MC, 4)
  assert kv_pages(cfg(mesh="data=2,model=4"), MC) == (1 << 20) // 2 // page + 1
  assert kv_pages(cfg(mesh="data=2,model=4", kv_cache_mb=100), MC) == 4 * 16 + 1
  # several processes: one group (the rows repeat on every data row)
  assert kv_pages(cfg(mesh="data=2,model=4", multi_process=True), MC) == (1 << 20) // page + 1


def test_a_group_that_cannot_hold_one_sequence_is_refused():
  with pytest.raises(ValueError, match=r"per data group \(2\).*--kv-cache-mb to at least 1.0"):
    kv_pages(cfg(mesh="data=2,model=4", kv_cache_mb=0.75), MC)
  kv_pages(cfg(kv_cache_mb=0.5), MC)  # one group: 16 pages hold one 256-token sequence
