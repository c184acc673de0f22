"""ServerConfig validation, config files, and the `serve` command line (no server started)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import pytest

from serving.cli import add_demo_parser, add_serve_parsers, config_from_args, demo_config
from serving.config import ConfigError, ServerConfig


def parse(argv):
  p = argparse.ArgumentParser()
  sub = p.add_subparsers()
  add_serve_parsers(sub)
  add_demo_parser(sub)
  return p.parse_args(argv)


def test_defaults_and_derived():
  c = ServerConfig(base="/m/llama-base", max_seq_len=512)
  assert c.model_id == "llama-base"
  assert c.max_prompt_tokens == 511
  assert c.host_cache_bytes == 1 << 30
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.port = 1


@pytest.mark.parametrize("kw,field", [
  (dict(device_slots=0), "device_slots"), (dict(port=70000), "port"),
  (dict(max_batch=0), "max_batch"), (dict(variants=(("../x", "/d"),)), "variant name"),
  (dict(variants=(("a", "/d"), ("a", "/e"))), "variants"), (dict(pins=("zz",)), "pins"),
  (dict(variants=(("p", "/d"), ("q", "/e")), pins=("p", "q"), device_slots=1), "pins"),
  (dict(dtype="int8"), "dtype"),
  (dict(base_name="x", variants=(("x", "/d"),)), "variants"),
  (dict(shutdown_grace_s=-1), "shutdown_grace_s: must be >= 0, got -1"),
])
def test_invalid_values_name_the_field(kw, field):
  with pytest.raises(ConfigError, match=field):
    ServerConfig(base="/m/b", **kw)


def test_a_config_file_with_the_old_buckets_field_says_to_remove_it():
  with pytest.raises(ConfigError, match="buckets: no longer used.*remove it"):
    ServerConfig.from_dict({"base": "/m/b", "buckets": [32, 64]})


def test_config_file_relative_paths_and_overrides(tmp_path):
  f = tmp_path / "serve.json"
  f.write_text(json.dumps({"base": "models/base", "variants": {"math": "deltas/math"},
                           "device_slots": 2, "pins": ["math"], "port": 9001}))
  c = ServerConfig.from_file(f, port=9002)
  assert c.base == str(tmp_path / "models/base")
  assert c.variants == (("math", str(tmp_path / "deltas/math")),)
  assert c.pins == ("math",) and c.device_slots == 2 and c.port == 9002
  f.write_text(json.dumps({"base": "b", "device_slot": 2}))
  with pytest.raises(ConfigError, match="device_slot"):
    ServerConfig.from_file(f)
  f.write_text("{")
  with pytest.raises(ConfigError, match="invalid JSON"):
    ServerConfig.from_file(f)


def test_cli_flags(tmp_path):
  a = parse(["serve", "--base", "/m/b", "--variant", "x=/d/x", "--variant", "y=/d/y",
             "--port", "0", "--api-key", "k", "--device-slots", "3", "--host-cache-mb", "64",
             "--pin", "x", "--top-n-pin", "1", "--max-batch", "4", "--max-seq-len", "256"])
  assert a.func.__name__ == "cmd_serve"
  c = config_from_args(a)
  assert c.variants == (("x", "/d/x"), ("y", "/d/y")) and c.pins == ("x",)
  assert (c.port, c.api_key, c.device_slots, c.host_cache_mb, c.top_n_pin, c.max_batch,
          c.max_seq_len) == (0, "k", 3, 64.0, 1, 4, 256)
  assert c.shutdown_grace_s == 10.0
  assert c.background_compile and c.engine_config().background_compile  # the default
  assert not config_from_args(parse(["serve", "--base", "/m/b", "--compile-all-first"])
                              ).engine_config().background_compile
  assert config_from_args(parse(["serve", "--base", "/m/b", "--shutdown-grace", "2.5"])
                          ).shutdown_grace_s == 2.5
  with pytest.raises(ConfigError, match="shutdown_grace_s: must be >= 0"):
    config_from_args(parse(["serve", "--base", "/m/b", "--shutdown-grace", "-1"]))
  with pytest.raises(ConfigError, match="NAME=DELTA_DIR"):
    config_from_args(parse(["serve", "--base", "/m/b", "--variant", "nopath"]))
  with pytest.raises(ConfigError, match="base"):
    config_from_args(parse(["serve"]))


def test_admin_key_and_variant_roots(tmp_path, monkeypatch):
  from pathlib import Path

  from serving.cli import banner

  monkeypatch.setenv("BITDELTA_CACHE", str(tmp_path / "cache"))
  a = parse(["serve", "--base", "/m/b", "--variant", "x=/d/one/x", "--variant", "y=/d/two/y",
             "--api-key", "k", "--admin-key", "a"])
  c = config_from_args(a)
  assert (c.api_key, c.admin_key) == ("k", "a")
  assert c.to_dict()["admin_key"] == "***" and c.to_dict()["api_key"] == "***"
  # default: the configured variants' directories and the cache root
  assert c.variant_roots() == (Path("/d/one"), Path("/d/two"), tmp_path / "cache")
  assert "loads directories under: /d/one, /d/two" in banner(c, "http://h:1")
  c = config_from_args(parse(["serve", "--base", "/m/b", "--variant-root", "/srv/deltas",
                              "--variant-root", "/srv/more"]))
  assert c.variant_roots() == (Path("/srv/deltas"), Path("/srv/more"))
  assert "open (no --admin-key)" in banner(c, "http://h:1")
  c = config_from_args(parse(["serve", "--base", "/m/b", "--variant-root", "/"]))
  assert c.variant_roots() == (Path("/"),) and "any path" in banner(c, "http://h:1")
  c = config_from_args(parse(["serve", "--base", "/m/b", "--api-key", "k"]))
  assert "off (an API key without --admin-key" in banner(c, "http://h:1")
  monkeypatch.setenv("BITDELTA_ADMIN_KEY", "from-env")
  assert config_from_args(parse(["serve", "--base", "/m/b"])).admin_key == "from-env"
  with pytest.raises(ConfigError, match="admin_key: must differ from api_key"):
    ServerConfig(base="/m/b", api_key="same", admin_key="same")
  with pytest.raises(ConfigError, match="admin_key: must be a non-empty string"):
    ServerConfig(base="/m/b", admin_key=" a")


def test_cli_flags_override_config_file(tmp_path):
  f = tmp_path / "c.json"
  f.write_text(json.dumps({"base": "/m/b", "variants": {"x": "/d/x"}, "port": 7000,
                           "max_batch": 2}))
  c = config_from_args(parse(["serve", "--config", str(f), "--port", "7001",
                              "--variant", "y=/d/y"]))
  assert c.port == 7001 and c.max_batch == 2 and dict(c.variants) == {"x": "/d/x", "y": "/d/y"}


def test_demo_config_without_the_family(monkeypatch):
  import bitdelta_jax.zoo as zoo

  monkeypatch.delattr(zoo, "shipped_family", raising=False)
  monkeypatch.setitem(sys.modules, "bitdelta_jax.zoo", zoo)
  with pytest.raises(RuntimeError, match="built-in model family"):
    demo_config()


def test_demo_config_with_a_family(monkeypatch, tmp_path):
  import bitdelta_jax.zoo as zoo

  monkeypatch.setattr(zoo, "shipped_family",
                      lambda: (tmp_path / "base", {"b": tmp_path / "b", "a": tmp_path / "a"}),
                      raising=False)
  c = demo_config(port=0)
  assert c.base == str(tmp_path / "base") and [n for n, _ in c.variants] == ["a", "b"]
  assert c.port == 0 and c.device_slots == 2
  a = parse(["demo", "--port", "1234"])
  assert a.func.__name__ == "cmd_demo"
  c2 = config_from_args(a, base=c.base, variants=c.variants)
  assert c2.port == 1234 and c2.variants == c.variants


# -- issue 23: settings that cannot serve are refused before the model loads ---------------------
def _write_base(tmp_path, max_pos=512):
  from serving.testing import TINY

  d = tmp_path / "base"
  d.mkdir()
  hf = dict(TINY.hf_config(), max_position_embeddings=max_pos)
  (d / "config.json").write_text(json.dumps(hf))
  return d, TINY


def test_kv_cache_that_cannot_hold_one_sequence_is_refused(tmp_path):
  from serving.app import check_base_dir

  base, t = _write_base(tmp_path, max_pos=4096)
  token_bytes = 2 * t.num_hidden_layers * t.num_key_value_heads * (
    t.hidden_size // t.num_attention_heads) * 4
  need_mb = 4096 * token_bytes / (1 << 20)  # one sequence of 4096 tokens, pages of 16
  check_base_dir(ServerConfig(base=str(base), max_seq_len=4096, kv_cache_mb=need_mb))
  with pytest.raises(ConfigError, match=r"kv_cache_mb: .* less than one sequence of "
                                        r"max_seq_len 4096; raise --kv-cache-mb to at least"):
    check_base_dir(ServerConfig(base=str(base), max_seq_len=4096, kv_cache_mb=need_mb * 0.99))


def test_max_seq_len_beyond_the_bases_context_is_refused_and_the_default_fits(tmp_path):
  from serving.app import check_base_dir

  base, _ = _write_base(tmp_path, max_pos=512)
  with pytest.raises(ConfigError, match="max_seq_len: 1024 is longer than the base's context "
                                        r"\(max_position_embeddings 512"):
    check_base_dir(ServerConfig(base=str(base), max_seq_len=1024))
  c = config_from_args(parse(["serve", "--base", str(base)]))
  assert c.max_seq_len == 512  # the default: 2048, or the base's context if shorter
  check_base_dir(c)
  assert config_from_args(parse(["serve", "--base", str(base), "--max-seq-len", "100"])
                          ).max_seq_len == 100
  cfg_file = tmp_path / "serve.json"
  cfg_file.write_text(json.dumps({"base": str(base), "max_seq_len": 300}))
  assert config_from_args(parse(["serve", "--config", str(cfg_file)])).max_seq_len == 300


@pytest.mark.parametrize("what,expect", [
  ("missing", "is nothing; expected an HF model directory"),
  ("file", "is a regular file; expected an HF model directory"),
  ("empty", "is a directory without config.json"),
  ("delta", "is a bitdelta delta store; --base takes the base model"),
])
def test_a_base_that_is_not_a_model_is_named_for_what_it_is(tmp_path, what, expect):
  from serving.app import check_base_dir

  p = tmp_path / "b"
  if what == "file":
    p.write_text("x")
  elif what == "empty":
    p.mkdir()
  elif what == "delta":
    from serving.testing import synthetic_family

    p = synthetic_family(tmp_path / "fam", n=1)[1]["v0"]
  with pytest.raises(ConfigError, match=expect):
    check_base_dir(ServerConfig(base=str(p)))


def test_a_variant_name_given_twice_is_refused():
  with pytest.raises(ConfigError, match="--variant: the name 'm' is given twice"):
    config_from_args(parse(["serve", "--base", "/b", "--variant", "m=/a", "--variant", "m=/b"]))
