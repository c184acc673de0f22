"""CI proves that the GPU path lowers for CUDA, without a GPU (`cuda_lowering` says how).

The one engine's whole serving step (the layers as one scan as on a GPU) is lowered with the
GPU kernels selected, with every bank kind a server can hold at once (`cuda_lowering.BANKS
["all"]`: 1-bit linear slots, packed and dense embedding / LM-head banks, LoRA factors, a grown
vocabulary), for SmolLM2-135M's config (tied head: `Embed.attend`) and a Llama-8B-like attention
shape (untied `LMHead`), on one device and over 1×8 and 2×4 meshes of forced host devices. Each
program must hold the Mosaic GPU kernels by name (the delta GEMM, the paged decode attention,
the in-place KV write, the packed head bank, and the prefill attention: `PREFILL_ATTENTION`),
no delta bits may be unpacked outside them (a packed embedding's lookup unpacks only the batch's
token columns, ``T × D`` elements, never an embedding-sized tensor), and no KV pool may be
gathered or sliced outside a kernel. The same check on a step whose delta matmuls run in XLA
(``delta_implementation="xla"``, which unpacks bit planes) must find the unpacking: the check
can fail.
"""

from __future__ import annotations

import cuda_lowering as cl
import pytest

pytestmark = pytest.mark.slow  # starts servers / subprocesses / the real model

MOSAIC = "mosaic_gpu_v2"  # the Mosaic GPU custom call (jax 0.10-0.11)
# The packed-prefill attention as a Mosaic GPU kernel (`paged_attention.mosaic_gpu_prefill`,
# taken by `ragged_paged_attention` for bf16/f16 pools): its kernel in every program with prompt
# tokens, and with it no KV pool read outside a kernel. False: both checks are expected to fail.
PREFILL_ATTENTION = True
DECODE, PREFILL = "ragged_paged_decode", "ragged_paged_prefill"
BANK_GEMM, KV_WRITE, HEAD_BANK = "bitdelta_bank_matmul", "bitdelta_kv_write", "bitdelta_head_bank"


def check_program(row: dict, embedding_elements: int, hidden: int) -> None:
  """The assertions every lowered step program of a model with variant rows must pass."""
  calls, kernels = row["custom_calls"], row["kernels"]
  assert calls.get(MOSAIC, 0) >= 5, calls
  # no CPU kernel (jax.ffi custom calls of the CPU build) in a CUDA program
  assert not [c for c in calls if c.startswith("bitdelta")], calls
  for name in (DECODE, KV_WRITE, BANK_GEMM, HEAD_BANK):
    assert name in kernels, (name, kernels)
  assert row["unpacked"] == [], row["unpacked"][:5]
  # the packed embedding's lookup: the token columns only, T x D, proportional to the tokens;
  # with a real vocabulary (V > 8 T) far below one slot's packed table
  assert row["token_columns"], "no packed embedding lookup found: the check saw nothing"
  assert max(row["token_columns"]) <= row["tokens"] * hidden, row["token_columns"]
  if embedding_elements > row["tokens"] * hidden:
    assert row["largest_8bit"] < embedding_elements, (row["largest_8bit"], embedding_elements)
  if PREFILL_ATTENTION:
    assert PREFILL in kernels, kernels
    assert row["pool_reads"] == [], row["pool_reads"][:5]


def check_prefill_expectation(row: dict) -> None:
  """With ``PREFILL_ATTENTION`` off, the prefill checks must fail (flip the constant then)."""
  if not PREFILL_ATTENTION:
    assert PREFILL not in row["kernels"] or row["pool_reads"], (
      "the prefill attention is a kernel now: set PREFILL_ATTENTION = True")


@pytest.fixture(scope="module")
def smollm2_runner():
  return cl.build_runner("smollm2", banks="all")


@pytest.mark.parametrize("tokens,base_only", [(32, False), (544, False), (1, True)])
def test_whole_step_lowers_for_cuda_with_the_gpu_kernels(smollm2_runner, tokens, base_only):
  runner, cfg = smollm2_runner
  (row,) = cl.report(runner, cfg, [(tokens, base_only)])
  if base_only:  # no variant rows: the base kernels only, still no dense detour
    assert {DECODE, KV_WRITE} <= set(row["kernels"]), row["kernels"]
    assert row["unpacked"] == [] and row["token_columns"] == [], row
    assert not [c for c in row["custom_calls"] if c.startswith("bitdelta")], row["custom_calls"]
    return
  check_program(row, cl.embedding_packed_elements(cfg), cfg.hidden_size)
  check_prefill_expectation(row)


def test_untied_head_and_grown_vocabulary_on_one_device():
  """The Llama-like config: an untied `LMHead` with packed and dense banks and added tokens."""
  runner, cfg = cl.build_runner("llama_heads", banks="all")
  (row,) = cl.report(runner, cfg, [(544, False)])
  check_program(row, cl.embedding_packed_elements(cfg), cfg.hidden_size)
  check_prefill_expectation(row)


def test_the_unpacking_check_finds_bits_unpacked_by_xla():
  runner, cfg = cl.build_runner("smollm2", delta_implementation="xla")
  (row,) = cl.report(runner, cfg, [(32, False)])
  assert len(row["unpacked"]) >= cfg.num_layers  # every layer's q/k/v/o/gate/up/down planes


def test_the_pool_check_finds_the_references_page_gather(monkeypatch):
  """The reference attention (the CPU platform with its C++ kernel off) gathers pages:
  `pool_reads` sees it."""
  monkeypatch.setenv("BITDELTA_PAGED_ATTENTION_CPU", "0")
  runner, cfg = cl.build_runner("llama_heads")
  text = runner.lower(runner.shapes.empty(32), False, platform="cpu").as_text()
  assert cl.pool_reads(text, runner.shapes.page_size, cfg.head_dim)


@pytest.mark.mesh
@pytest.mark.parametrize("mesh,config", [("data=1,model=8", "smollm2"),
                                         ("data=1,model=8", "llama_heads"),
                                         ("data=2,model=4", "llama_heads")])
def test_whole_step_lowers_for_cuda_over_a_device_mesh(mesh_worker, mesh, config):
  """SmolLM2's 3 KV heads do not split over 8 (the attention runs replicated, its matmuls
  column-parallel, the KV write the jnp scatter of the replicated pools); 8 KV heads of 128
  (Llama-8B's attention) split over ``model``, so the attention kernels and the in-place KV
  write run per device under ``shard_map`` on their own heads' pages."""
  res = mesh_worker.call("kernels/cuda_lowering.py:mesh_report", mesh, config, "all")
  assert res["devices"] == 8
  for row in res["rows"]:
    if config == "smollm2":  # replicated pools: the scatter writes them (see the docstring)
      row["kernels"].append(KV_WRITE)
    check_program(row, res["embedding_elements"], res["hidden"])
    check_prefill_expectation(row)
