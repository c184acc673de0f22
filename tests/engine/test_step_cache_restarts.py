"""Issue 35: a warm start in a fresh process runs every program, whatever caches it meets.

Each start here is its own process, as a user's restart is: a program saved and loaded within
one process keeps its code resident, so a test in one process cannot see a program that lost
its object code (`bitdelta_jax.engine.step_cache`). The worker builds the paged engine over a
tiny Llama checkpoint with JAX's persistent compilation cache and the step cache in one
directory, warms up (which runs each program once on a padding batch) and generates greedily
prompts that reach every token bucket; the tokens are checked against transformers.

* cold → warm: the warm process loads every program from the step cache (every native FFI
  target is registered before loading: none is recompiled) and gives the same tokens; then,
  as after an upgrade, the step files go and JAX's cache stays: the next start compiles (JAX's
  cache bypassed) and saves, and the start after it loads programs that run;
* the cache the old code left behind: programs that JAX's persistent cache returned,
  re-serialized into the step cache (``poison``). A fresh process loads them, their first run
  at warm-up fails, they are recompiled and their entries replaced; the next process loads them
  all and none fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from model_fixtures import hf_greedy, make_bpe_tokenizer, make_hf_model

pytestmark = pytest.mark.slow

WORKER = r"""
import json, sys
import jax
import jax.numpy as jnp
path, cache, mode, dtype = sys.argv[1:5]
jax.config.update("jax_compilation_cache_dir", cache + "/xla")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from bitdelta_jax.models import from_pretrained
from bitdelta_jax.engine import step_cache
# as in a server, something compiles before the warm-up: JAX decides once per process whether
# its persistent cache is used, at the first compile
jax.jit(lambda x: x + 1)(1.0)
from bitdelta_jax.engine.generator import Generator
from bitdelta_jax.engine.sampling import SamplingParams
steps = None if mode == "prime" else cache + "/steps"
gen = Generator(from_pretrained(path, getattr(jnp, dtype)), max_rows=2, max_seq_len=40,
                     page_size=4, prefill_chunk=6, step_cache_dir=steps)
r = gen.runner
if mode == "poison":  # what the old code saved: programs JAX's persistent cache returned
  for n in gen.shapes.buckets():
    compiled = r.lower_bucket(n, gen.base_only).compile()  # as the warm-up lowers it
    step_cache.save(steps, r._cache_key(n, gen.base_only), compiled)
  print("RESULT " + json.dumps({"saved": len(gen.shapes.buckets())}))
  sys.exit(0)
gen.warmup()
r.guard = True
prompts = [[1], [1, 5], [1, 5, 9, 13], [1] + list(range(20, 27)), [1] + list(range(30, 41))]
res = gen.generate(prompts, params=SamplingParams(max_new_tokens=5))
print("RESULT " + json.dumps({
  "programs": r.compiled_programs, "loaded": r.loaded_programs,
  "probe_failures": r.probe_failures, "probe_s": r.probe_s,
  "buckets": sorted(n for n, _ in gen.shapes_run), "all_buckets": list(gen.shapes.buckets()),
  "tokens": [g.tokens for g in res], "prompts": prompts}))
"""


def start(path, cache, mode: str, dtype: str = "float32") -> dict:
  """One process: a start of the engine (or ``prime`` / ``poison``, see the module doc)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.run([sys.executable, "-c", WORKER, str(path), str(cache), mode, dtype],
                     capture_output=True, text=True, timeout=600, env=env)
  lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
  assert p.returncode == 0 and lines, p.stderr[-4000:]
  return json.loads(lines[-1][len("RESULT "):])


def step_files(cache) -> list:
  return sorted((cache / "steps").glob("step-*.bin"))


@pytest.fixture(scope="module")
def llama(hf_models):  # noqa: F811
  return hf_models("llama")


def check_tokens(hf, run: dict) -> None:
  for p, toks in zip(run["prompts"], run["tokens"]):
    assert toks == hf_greedy(hf, p, 5), p


def test_a_warm_start_in_a_fresh_process_loads_and_runs_every_program(llama, tmp_path):
  hf, path = llama
  cold = start(path, tmp_path, "normal")
  assert cold["loaded"] == 0 and cold["probe_failures"] == 0
  assert cold["programs"] == len(cold["all_buckets"]) == len(step_files(tmp_path))
  check_tokens(hf, cold)
  assert set(cold["buckets"]) == set(cold["all_buckets"])  # the prompts reach every bucket
  warm = start(path, tmp_path, "normal")
  # every program loaded: every FFI target its kernels call was registered before loading
  assert warm["loaded"] == warm["programs"] == cold["programs"]
  assert warm["probe_failures"] == 0
  assert warm["tokens"] == cold["tokens"]
  # as an upgrade does: the step files go (their key hashes the code), JAX's cache stays
  for f in step_files(tmp_path):
    f.unlink()
  upgraded = start(path, tmp_path, "normal")
  assert upgraded["loaded"] == 0 and upgraded["tokens"] == cold["tokens"]
  # what it saved runs in the next process (it was compiled there, not taken from JAX's
  # cache: before issue 35's fix every program of this start failed its first run)
  after = start(path, tmp_path, "normal")
  assert after["loaded"] == after["programs"] and after["probe_failures"] == 0
  assert after["tokens"] == cold["tokens"]


def test_bf16_programs_load_too(llama, tmp_path):
  """bf16 steps call other native kernels (the bf16 small matmuls) than f32 ones."""
  _, path = llama
  cold = start(path, tmp_path, "normal", "bfloat16")
  warm = start(path, tmp_path, "normal", "bfloat16")
  assert warm["loaded"] == warm["programs"] == cold["programs"] > 0
  assert warm["probe_failures"] == 0 and warm["tokens"] == cold["tokens"]



def test_gguf_programs_load_too(tmp_path):
  """A GGUF base's steps call the quantized-block kernel, whose FFI target was not registered
  before loading until issue 36's memory work: every warm start of a GGUF server ignored every
  step file ("No FFI handler registered for bitdelta_quant_rows") and recompiled."""
  from bitdelta_jax.hf.gguf_export import write_gguf

  make_hf_model("llama", tmp_path / "hf", vocab_size=320)
  make_bpe_tokenizer(tmp_path / "hf")
  path = write_gguf(tmp_path / "hf", tmp_path / "base.Q4_1.gguf", dtype="q4_1")
  cold = start(path, tmp_path, "normal")
  assert cold["loaded"] == 0 and cold["programs"] == len(step_files(tmp_path)) > 0
  warm = start(path, tmp_path, "normal")
  assert warm["loaded"] == warm["programs"] == cold["programs"]
  assert warm["probe_failures"] == 0 and warm["tokens"] == cold["tokens"]

def test_programs_from_jaxs_cache_in_the_step_cache_are_found_and_recompiled_at_start(
    llama, tmp_path):
  hf, path = llama
  start(path, tmp_path, "prime")  # JAX's persistent cache gets every step program
  poisoned = start(path, tmp_path, "poison")["saved"]
  sizes = {p.name: p.stat().st_size for p in step_files(tmp_path)}
  assert len(sizes) == poisoned
  first = start(path, tmp_path, "normal")
  assert first["loaded"] == first["programs"] == poisoned
  # they load, but cannot run: each is found by its first run at warm-up, never by a request
  assert first["probe_failures"] == poisoned
  check_tokens(hf, first)
  fixed = {p.name: p.stat().st_size for p in step_files(tmp_path)}
  assert fixed.keys() == sizes.keys()
  assert all(fixed[k] > sizes[k] for k in sizes)  # replaced: now with their object code
  again = start(path, tmp_path, "normal")
  assert again["loaded"] == again["programs"] == poisoned and again["probe_failures"] == 0
  assert again["tokens"] == first["tokens"]
