"""Shared test settings.

The suite is hermetic: no persistent XLA compilation cache (the engine turns one on under
``~/.cache/bitdelta_jax/xla`` by default; set before any test builds an engine, so servers and
the subprocesses they start compile for themselves and never write into the user's cache).

Each module's compiled programs are dropped when the module ends. XLA's CPU backend maps every
compiled program's code into its own memory mappings, and one pytest process that keeps all of
the suite's programs alive passes Linux's limit on mappings per process (``vm.max_map_count``,
65530 by default) at about 87% of the suite; the next compile then fails to map its code and
the process dies with a segmentation fault inside XLA (what CI saw). ``BITDELTA_TEST_MAPS=path``
appends each module's mapping count before and after the cleanup to ``path``.

``slow`` marks what a developer can leave out for a quick run (``pytest -m "not slow"``, about
3 minutes on a 2-core machine against about 28 for everything): every test of the modules that
start servers, subprocesses or the real model, and the tests that took 4 s or more in a full
run (``--durations``). The lists are here, in one place, and CI runs everything.
"""

import gc
import os

import pytest

os.environ.setdefault("BITDELTA_COMPILE_CACHE", "0")

SLOW_MODULES = frozenset({
  "test_cuda_lowering", "test_demo_real", "test_kmerge_gate", "test_paged_mesh", "test_real_base", "test_serving_fuzz", "test_serving_http",
  "test_serving_kmerge", "test_serving_liveness", "test_serving_lora", "test_serving_multihost",
  "test_serving_openai_api", "test_serving_openai_lm_eval", "test_serving_variant_vocab",
  "test_sharding", "test_sharding_distributed", "test_zoo", "test_zoo_real_family",
})
SLOW_TESTS = frozenset({
  "test_api::test_api_md_example_runs_and_is_right",
  "test_api::test_from_pretrained_sizes_its_banks_for_the_variants_it_is_given",
  "test_cli::test_closed_pipe_ends_quietly",
  "test_compress_embeddings::test_distilling_a_delta_with_one_bit_embeddings",
  "test_compress_embeddings::test_one_bit_embeddings_apply_and_serve_from_packed_banks",
  "test_compress_embeddings::test_served_one_bit_embedding_variant_equals_its_applied_model",
  "test_delta_residual::test_streamed_compress_and_served_variant",
  "test_distill::test_cli_distill_on_changed_embeddings",
  "test_distill::test_distill_trains_only_scales_and_keeps_finetuned_embeddings",
  "test_hf_pipeline::test_console_script_inspect",
  "test_lora_train::test_real_lora_is_cached_and_records_scores",
  "test_merge_baselines::test_dare",
  "test_merge_bench::test_micro_bench_writes_both_tables",
  "test_merge_cli::test_method_matches_tree_function",
  "test_merge_cli::test_rescale_options_match_the_tree_function",
  "test_models_generate::test_rows_on_different_variants",
  "test_models_grown_vocab::test_added_tokens_only_need_no_dense_bank",
  "test_models_grown_vocab::test_grown_vocab_slot_matches_the_finetune",
  "test_models_grown_vocab::test_packed_embedding_delta_served_from_one_bit_banks",
  "test_models_grown_vocab::test_packed_embedding_products_gradient_equals_the_reference",
  "test_models_lora_slots::test_lora_slot_matches_peft_and_mixes_with_bitdelta",
  "test_models_paged::test_grammar_mask_constrains_each_row_and_stops_it",
  "test_models_paged::test_greedy_matches_transformers_with_chunks_and_pages",
  "test_models_paged::test_logprobs_and_prompt_logprobs_equal_a_full_forward",
  "test_models_paged::test_long_prompt_is_chunked_and_decode_rows_keep_stepping",
  "test_models_paged::test_mixed_variants_in_one_batch_equal_their_applied_models",
  "test_models_paged::test_n_choices_fork_whatever_call_computes_the_leaders_last_prompt_token",
  "test_models_paged::test_n_choices_share_the_prefill_and_equal_separate_runs",
  "test_models_paged::test_penalties_bias_and_min_tokens_follow_numpy_over_a_generation",
  "test_models_paged::test_preemption_when_pages_run_out_keeps_outputs",
  "test_models_paged::test_prefix_reuse_gives_the_same_tokens_and_skips_pages",
  "test_models_paged::test_row_and_length_buckets_bound_the_shapes",
  "test_models_paged::test_seeded_sampling_is_per_request",
  "test_models_sampling::test_controls_equal_numpy_and_fast_sampler_equals_reference",
  "test_models_sampling::test_fast_sampler_equals_the_reference",
  "test_models_sampling::test_greedy_top_k_top_p_supports",
  "test_models_sampling::test_neutral_controls_change_nothing",
  "test_models_slots::test_dense_embedding_slots_are_exact",
  "test_serving_hardening::test_implemented_parameters_are_accepted",
  "test_serving_hardening::test_skipped_variants_are_not_served_and_health_is_degraded",
})


def pytest_collection_modifyitems(config, items):
  for item in items:
    module = item.module.__name__.rsplit(".", 1)[-1]
    name = getattr(item, "originalname", None) or item.name
    if module in SLOW_MODULES or f"{module}::{name}" in SLOW_TESTS:
      item.add_marker(pytest.mark.slow)


def _mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return -1


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs(request):
  yield
  import sys

  if "jax" not in sys.modules:
    return
  import jax

  before = _mappings()
  gc.collect()
  jax.clear_caches()
  gc.collect()
  log = os.environ.get("BITDELTA_TEST_MAPS")
  if log:
    with open(log, "a") as f:
      f.write(f"{request.module.__name__} {before} {_mappings()}\n")

# servers that warmed up refuse to compile afterwards: a step shape the warm-up missed fails the
# test instead of compiling silently (ServerConfig.forbid_compile_after_warmup's default)
os.environ.setdefault("BITDELTA_FORBID_COMPILE_AFTER_WARMUP", "1")
