"""Serving a K-Merge pool (``bitdelta serve --kmerge-pool``) on the nano base: each member from
one LoRA slot, each task name answered by its member; start-up errors for bad pools."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import requests

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kmerge_fixtures import NANO, random_adapter  # noqa: E402

from bitdelta_jax.engine import Generator
from bitdelta_jax.engine.sampling import SamplingParams  # noqa: E402
from bitdelta_jax.hf.safetensors_io import CheckpointReader  # noqa: E402
from bitdelta_jax.kmerge import KMergePool, PoolConfig, canonical  # noqa: E402
from bitdelta_jax.merge.lora import from_factors, save_adapter  # noqa: E402
from bitdelta_jax.models import from_tensors  # noqa: E402
from bitdelta_jax.models.banks import Banks  # noqa: E402
from bitdelta_jax.models.loading import load_config  # noqa: E402
from bitdelta_jax.models.tokenizer import Tokenizer  # noqa: E402
from serving.app import BadVariantsError, ServerThread  # noqa: E402
from serving.config import ConfigError, ServerConfig  # noqa: E402
from serving.registry import Registry, RegistryError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

PROMPTS = ["hello", "abc def", "1 2 3"]


def _near(adapter, seed, eps=0.05):
  """A small random change of ``adapter`` (a task close to its own: K-Merge merges them)."""
  rng = np.random.default_rng(seed)
  return from_factors({n: (m.A + eps * rng.standard_normal(m.A.shape).astype(np.float32), m.B)
                       for n, m in adapter.modules.items()})


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("kmerge_pool")
  a0 = random_adapter(0)
  pool = KMergePool(PoolConfig(k=2, budget_bytes=2 * canonical(a0).nbytes))
  assert pool.add("t0", a0).action == "slot"
  assert pool.add("t2", random_adapter(2)).action == "slot"
  r = pool.add("t1", _near(a0, 1))
  assert (r.action, r.member) == ("merged", "m1")
  return pool.save(root / "pool")


def _cfg(**kw):
  return ServerConfig(**{**dict(base=str(NANO), base_name="base", port=0, max_batch=4,
                                max_seq_len=64, device_slots=2), **kw})


@pytest.fixture(scope="module")
def server(pool_dir):
  with ServerThread(_cfg(kmerge_pool=str(pool_dir))) as h:
    yield h


def _member_weights(pool_dir, member):
  """base + B·A of the member's saved adapter, read from its safetensors with numpy alone."""
  with CheckpointReader(NANO) as r:
    w = {n: r.read(n).astype(np.float32) for n in r.names()}
  d = pool_dir / "members" / member
  cfg = json.loads((d / "adapter_config.json").read_text())
  assert cfg["lora_alpha"] == cfg["r"] and not cfg["rank_pattern"]  # scale 1
  with CheckpointReader(d / "adapter_model.safetensors") as r:
    ab = {n: r.read(n) for n in r.names()}
  for key, a in ab.items():
    if key.endswith(".lora_A.weight"):
      module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
      b = ab[key.replace("lora_A", "lora_B")]
      w[f"{module}.weight"] = w[f"{module}.weight"] + b.astype(np.float32) @ a.astype(np.float32)
  return w


def _greedy(weights, prompts, n=8):
  tok = Tokenizer.from_dir(NANO)
  model = from_tensors(load_config(NANO), weights, jnp.float32)
  gen = Generator(model, max_seq_len=64, max_rows=4, tokenizer=tok)
  outs = gen.generate([tok.encode(p) for p in prompts], 0, SamplingParams(max_new_tokens=n))
  return {p: tok.decode(o.tokens) for p, o in zip(prompts, outs)}


def _complete(h, model, prompt):
  r = requests.post(h.url + "/v1/completions", json={"model": model, "prompt": prompt,
                                                     "max_tokens": 8, "temperature": 0},
                    timeout=120)
  assert r.status_code == 200, r.text
  assert r.json()["model"] == model
  return r.json()["choices"][0]["text"]


def test_models_list_tasks_and_members(server):
  models = {m["id"]: m for m in requests.get(server.url + "/v1/models", timeout=30).json()["data"]}
  assert set(models) == {"base", "m1", "m2", "t0", "t1", "t2"}
  assert models["t0"]["kmerge_member"] == "m1" and models["t0"]["kmerge_tasks"] == ["t0", "t1"]
  assert models["t1"]["kmerge_member"] == "m1" and models["t2"]["kmerge_member"] == "m2"
  assert models["m1"]["kmerge_tasks"] == ["t0", "t1"] and "kmerge_member" not in models["m1"]
  assert all(models[n]["parent"] == "base" for n in ("m1", "t0", "t2"))
  one = requests.get(server.url + "/v1/models/t1", timeout=30).json()
  assert one["id"] == "t1" and one["kmerge_member"] == "m1"
  assert requests.get(server.url + "/v1/models/t9", timeout=30).status_code == 404


def test_tasks_are_answered_by_their_members_merged_adapter(server, pool_dir):
  jobs = [(m, p) for p in PROMPTS for m in ("base", "t0", "t1", "t2")]
  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:  # mixed batches
    got = dict(zip(jobs, ex.map(lambda j: _complete(server, *j), jobs)))
  routing = json.loads((pool_dir / "pool.json").read_text())["routing"]
  want = {m: _greedy(_member_weights(pool_dir, m), PROMPTS) for m in ("m1", "m2")}
  for (model, p), text in got.items():
    if model != "base":
      assert text == want[routing[model]][p], (model, p)
  assert any(got[("t0", p)] != got[("base", p)] for p in PROMPTS)
  assert any(got[("t0", p)] != got[("t2", p)] for p in PROMPTS)
  # one LoRA slot per member: t0 and t1 loaded m1 once; the tasks are not variants
  variants = {v["id"]: v for v in requests.get(server.url + "/v1/variants", timeout=30)
              .json()["data"]}
  assert set(variants) == {"m1", "m2"}
  assert variants["m1"]["loads"] == 1 and variants["m1"]["requests"] == 2 * len(PROMPTS)
  assert variants["m1"]["source"] == "kmerge"


def test_task_names_are_taken(server, pool_dir):
  r = requests.post(server.url + "/v1/variants",
                    json={"name": "t0", "path": str(pool_dir / "members" / "m2")}, timeout=30)
  assert r.status_code == 409 and "K-Merge task name" in r.text
  r = requests.delete(server.url + "/v1/variants/t0", timeout=30)  # a task deletes no member
  assert r.status_code == 404
  assert requests.get(server.url + "/v1/models/t0", timeout=30).status_code == 200


def test_startup_errors(pool_dir, tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ConfigError, match=r"kmerge_pool: .*empty: not a K-Merge pool \(no pool.json"):
    ServerThread(_cfg(kmerge_pool=str(empty))).start()
  bad = shutil.copytree(pool_dir, tmp_path / "bad")
  shutil.rmtree(bad / "members" / "m2")
  rng = np.random.default_rng(0)
  save_adapter(from_factors({"model.layers.0.self_attn.q_proj": (
    rng.standard_normal((2, 64)).astype(np.float32),
    rng.standard_normal((64, 2)).astype(np.float32))}), bad / "members" / "m2")
  with pytest.raises(BadVariantsError, match=r"'m2': member of the K-Merge pool .*another base"):
    ServerThread(_cfg(kmerge_pool=str(bad))).start()
  lora = str(pool_dir / "members" / "m2")
  with pytest.raises(ConfigError, match=r"task 't1' of .* cannot be served: a variant named 't1'"):
    ServerThread(_cfg(kmerge_pool=str(pool_dir), variants=(("t1", lora),))).start()
  with pytest.raises(ConfigError, match=r"member 'm1' of .* has the name of a configured variant"):
    ServerThread(_cfg(kmerge_pool=str(pool_dir), variants=(("m1", lora),))).start()


def test_registry_aliases(pool_dir):
  reg = Registry("base", banks=Banks(lora_rank=4))
  reg.add("m1", pool_dir / "members" / "m1", 10, source="kmerge")
  reg.add_alias("t0", "m1")
  assert reg.get("t0") is reg.get("m1") and "t0" in reg and reg.tasks_of("m1") == ["t0"]
  for name, msg in (("t0", "already a K-Merge task name"), ("m1", "already registered"),
                    ("base", "base model's name"), ("a/b", "not a valid model name")):
    with pytest.raises(RegistryError, match=msg):
      reg.add_alias(name, "m1")
  with pytest.raises(RegistryError, match="no variant 'm9'"):
    reg.add_alias("t5", "m9")
  with pytest.raises(RegistryError, match="already a K-Merge task name"):
    reg.check("t0", str(pool_dir), source="config")


def test_serve_flag_and_config_file(pool_dir, tmp_path):
  from bitdelta_jax.cli import build_parser
  from serving.cli import config_from_args

  args = build_parser().parse_args(["serve", "--base", str(NANO), "--kmerge-pool", str(pool_dir)])
  assert config_from_args(args).kmerge_pool == str(pool_dir)
  f = tmp_path / "serve.json"
  f.write_text(json.dumps({"base": str(NANO), "kmerge_pool": "pool"}))
  assert ServerConfig.from_file(f).kmerge_pool == str(tmp_path / "pool")
  with pytest.raises(ConfigError, match="kmerge_pool"):
    ServerConfig(base=str(NANO), kmerge_pool="")
