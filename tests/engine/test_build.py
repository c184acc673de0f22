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


def test_the_default_pool_is_sized_to_fit():
  # 4096 tokens (256 pages), fewer than 64 rows of 256 tokens would take
  assert kv_pages(cfg(kv_cache_mb=None, max_batch=64), MC) == 4096 // 16 + 1
  # at most what the rows need
  assert kv_pages(cfg(kv_cache_mb=None, max_batch=8), MC) == 8 * 16 + 1
  # two sequences when they are longer than 4096 tokens together
  assert kv_pages(cfg(kv_cache_mb=None, max_batch=64, max_seq_len=4096), MC) == 2 * 256 + 1
  # a 70B-shaped f32 KV cache (640 KiB a token): 1024 MiB, yet never less than one sequence
  big = types.SimpleNamespace(num_layers=80, num_kv_heads=8, head_dim=128)
  big_page = 16 * kv_token_bytes(big, 4)
  assert kv_pages(cfg(kv_cache_mb=None, max_batch=64, max_seq_len=512), big) == (
    (1024 << 20) // big_page + 1)
  assert kv_pages(cfg(kv_cache_mb=None, max_batch=64, max_seq_len=8192), big) == 8192 // 16 + 1
  # per data group
  assert kv_pages(cfg(kv_cache_mb=None, max_batch=64, mesh="data=2,model=4"), MC) == 256 + 1
