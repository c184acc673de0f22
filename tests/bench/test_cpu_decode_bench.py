"""bench/serving/cpu_decode.py's summary and writers on a tiny synthetic result (not the bench)."""

from __future__ import annotations

import json

import pytest

from bench.serving import cpu_decode as bench

pytestmark = pytest.mark.slow


def _round(scale: float) -> dict:
  one = lambda t: {"tok_s": t * scale, "ttft_ms": 50.0, "decode_tok_s": t * scale * 1.05}  # noqa: E731
  return {
    "load": 0.5,
    "srv_f32": one(20.0),
    "srv_bf16": one(32.0),
    "llama_f32": one(30.0),
    "llama_bf16": one(40.0),
    "hf_1": {"tok_s": 15.0 * scale},
    "srv_var": one(19.5),
    "ttft": {"base_ms": 100.0, "var_ms": 120.0},
    "srv_c8": {"tok_s": 80.0 * scale, "ttft_p50_ms": 90.0},
    "hf_b8": {"tok_s": 60.0 * scale},
    "srv_mix3": {"tok_s": 70.0 * scale, "ttft_p50_ms": 95.0},
    "srv_c16": {"tok_s": 100.0 * scale, "ttft_p50_ms": 99.0},
    "srv_mix14": {"tok_s": 85.0 * scale, "ttft_p50_ms": 120.0},
  }


def _synthetic() -> dict:
  return {
    "machine": {
      "cpu": "Test CPU",
      "cpu_flags": ["avx2"],
      "cores": 2,
      "caches": {"L3": "32768K"},
      "mem_gib": 8,
      "jax": "0",
    },
    "model": "tiny synthetic, not measured",
    "model_bytes": {"f32": 538e6, "bf16": 269e6, "slot": 15e6, "slot_embedding": 4e6},
    "config": {
      "argv": ["--quick"],
      "rounds": 3,
      "tokens": 16,
      "device_slots": 14,
      "shipped": ["a", "b", "c"],
      "names": [f"n{i}" for i in range(14)],
      "variant": "a",
      "smoke": True,
      "names_note": "3 deltas under 14 names",
    },
    "load": {"start": 1.0, "end": 1.5},
    "bandwidth": {
      "array_mib": 1024,
      "l3": "32768K",
      "reps": 3,
      "threads": 2,
      "copy_gbps": 10.0,
      "copy_gbps_median": 9.0,
      "triad_gbps": 11.0,
      "triad_gbps_median": 10.0,
      "read_gbps": 12.0,
      "read_gbps_median": 11.0,
      "read_model_f32_gbps": 13.0,
    },
    "kernels": [
      {"rows": r, "kernel": k, "ms": 40.0, "min_ms": 39.0, "mb": 425.0, "gbps": 10.6}
      for r in (1, 8)
      for k in ("xla_f32", "kernel_bf16", "delta (one)")
    ],
    "host": {
      "what": "synthetic",
      "rows1": {
        "steps": 10,
        "step_ms": 40.0,
        "run_ms": 1.0,
        "fetch_ms": 38.0,
        "host_ms": 1.0,
        "sampler_alone_ms": 0.3,
      },
    },
    "checks": {"llama.cpp prompt ids == ours": "16/16"},
    "ttft_prompt_tokens": 300,
    "rounds": [_round(s) for s in (1.0, 0.9, 1.1)],
  }


def test_summary_goals_and_files(tmp_path):
  res = bench.summarize(_synthetic())
  goals = {g["key"]: g for g in res["goals"]}
  assert set(goals) == {g[0] for g in bench.GOALS}
  assert goals["one_stream_vs_llamacpp"]["value"] == pytest.approx(20 / 30)
  assert not goals["one_stream_vs_llamacpp"]["met"]
  assert goals["c8_vs_hf"]["value"] == pytest.approx(80 / 60) and not goals["c8_vs_hf"]["met"]
  assert goals["variant_one_stream"]["met"] and goals["mix14"]["met"]
  assert goals["variant_ttft"]["value"] == pytest.approx(1.2) and not goals["variant_ttft"]["met"]
  assert "538 MB" in goals["one_stream_vs_llamacpp"]["reason"]
  assert res["ratios"]["llama_bf16/llama_f32"]["median"] == pytest.approx(40 / 30)
  out = tmp_path / "res" / "cpu_decode"
  bench.write(res, out)
  back = json.loads(out.with_suffix(".json").read_text())
  assert back["goals"][0]["key"] == "one_stream_vs_llamacpp"
  md = out.with_suffix(".md").read_text()
  assert md.count("**missed**") == sum(not g["met"] for g in res["goals"])
  assert "a smoke run, not a measurement" in md and "Memory bandwidth" in md
  assert "| 1 | xla_f32 |" in md and "sampler alone" in md
  pytest.importorskip("matplotlib")
  assert out.with_suffix(".png").stat().st_size > 0


def test_names_reuse_the_shipped_deltas_under_distinct_names():
  names = bench.names_for({"a": "A", "b": "B", "c": "C"}, 14)
  assert len(names) == 14 and list(names)[:4] == ["a", "b", "c", "a-2"]
  assert sorted(set(names.values())) == ["A", "B", "C"]
