"""The top-level API: `__all__`, `__version__`, a cheap import, and docs/API.md's example run
as written, checked against independent computations."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bitdelta_jax as bdj

DOC = Path(__file__).resolve().parents[1] / "docs" / "API.md"


def test_all_names_resolve_and_version():
  assert isinstance(bdj.__version__, str) and re.match(r"\d+\.\d+", bdj.__version__)
  for name in bdj.__all__:
    assert getattr(bdj, name) is not None, name
  with pytest.raises(AttributeError):
    bdj.no_such_name  # noqa: B018


def test_import_does_not_import_jax():
  r = subprocess.run([sys.executable, "-c", "import sys, bitdelta_jax; print('jax' in sys.modules)"],
                     capture_output=True, text=True, check=True)
  assert r.stdout.strip() == "False"


def _example() -> str:
  text = DOC.read_text()
  block = text.split("<!-- api-example -->", 1)[1]
  return re.search(r"```python\n(.*?)```", block, re.S).group(1)


@pytest.mark.slow
def test_api_md_example_runs_and_is_right(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  ns: dict = {}
  exec(compile(_example(), str(DOC), "exec"), ns)
  printed = capsys.readouterr().out
  assert printed.count("slot ") == 3 and "d loss / d α" in printed

  # Independent check of the mixed batch: each row equals greedy decoding of its own model,
  # built from the materialised tensors (base + α·sign(Δ) in f32) and run alone.
  out = ns["out"]
  base_t = {n: np.asarray(v, np.float32) for n, v in ns["base"].items()}
  cfg = bdj.from_pretrained("work/base", dtype=jnp.float32).config
  for slot, name in [(0, None), (1, "math"), (2, "code")]:
    tensors = base_t if name is None else bdj.apply_delta(
      base_t, bdj.load_delta(f"work/{name}.delta")[0], hf_layout=True)
    alone = bdj.Generator(bdj.from_tensors(cfg, tensors, jnp.float32), max_rows=1, max_seq_len=512)
    want = alone.generate([ns["prompts"][slot]], params=bdj.SamplingParams(max_new_tokens=8))
    assert out[slot].tokens == want[0].tokens, (slot, out[slot].tokens, want[0].tokens)
  assert out[1].tokens != out[0].tokens or out[2].tokens != out[0].tokens  # variants matter

  # The gradient: a directional finite difference, and only slot 1's scales enter the loss.
  scales, grads, loss = ns["scales"], ns["grads"], ns["loss"]
  assert set(grads) == set(scales) and len(grads) == 7 * 2
  rng = np.random.default_rng(0)
  v = {n: jnp.asarray(rng.standard_normal(s.shape), jnp.float32) * jnp.abs(s).mean()
       for n, s in scales.items()}
  eps = 1e-2

  def shifted(sign):
    return jax.tree.map(lambda s, d: s + sign * eps * d, scales, v)

  state = ns["with_scales"].state
  fd = (float(loss(shifted(1), state)) - float(loss(shifted(-1), state))) / (2 * eps)
  analytic = sum(float(jnp.vdot(grads[n], v[n])) for n in scales)
  assert abs(fd - analytic) <= 2e-2 * abs(analytic) + 1e-9, (fd, analytic)

  # Issue 23: the jitted pattern takes the weights as arguments; none is folded into the
  # executable as a constant (on the 135M model, closing over them cost 44 s and 6 GB to compile).
  largest_weight = max(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
  assert _largest_constant(loss.lower(scales, state).as_text()) < largest_weight
  closed = jax.jit(lambda s: jnp.sum(ns["with_scales"](s)(ns["tokens"],
                                                         slot_ids=jnp.ones((1,), jnp.int32))))
  assert _largest_constant(closed.lower(scales).as_text()) >= largest_weight  # the check bites


def _largest_constant(stablehlo: str) -> int:
  """The element count of the largest constant in a lowered module's StableHLO text."""
  sizes = [int(np.prod([int(d) for d in m.group(1).split("x") if d]))
           for m in re.finditer(r"constant dense<[^>]*> : tensor<((?:\d+x)*)\w+>", stablehlo)]
  return max(sizes, default=0)


@pytest.mark.slow
def test_from_pretrained_sizes_its_banks_for_the_variants_it_is_given(tmp_path):
  """Issue 23: a delta with 1-bit embeddings (what the shipped real variants are) failed to
  load until the user knew to pass packed_embedding_slots=True."""
  from bitdelta_jax.synthetic import SyntheticConfig, make_base, make_finetune, write_checkpoint

  cfg = SyntheticConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
  base = make_base(cfg, 0)
  ft = make_finetune(base, 1)
  ft["model.embed_tokens.weight"] = ft["model.embed_tokens.weight"] + np.float32(0.02)
  write_checkpoint(base, tmp_path / "base", cfg.hf_config())
  write_checkpoint(ft, tmp_path / "ft", cfg.hf_config())
  bdj.compress_checkpoints(tmp_path / "base", tmp_path / "ft", tmp_path / "d",
                           bdj.CompressPolicy(), embeddings="1bit", progress=False)
  delta = bdj.load_delta(tmp_path / "d")[0]
  plain = bdj.from_pretrained(tmp_path / "base", jnp.float32, num_slots=2)
  with pytest.raises(ValueError, match="packed_embedding_slots=True"):
    bdj.load_variant(plain, 1, delta)
  model = bdj.from_pretrained(tmp_path / "base", jnp.float32, num_slots=2,
                              variants=[tmp_path / "d"])
  bdj.load_variant(model, 1, delta)
  tokens = jnp.asarray([[1, 5, 7, 9, 11]], jnp.int32)
  got = model(tokens, slot_ids=jnp.ones((1,), jnp.int32))
  base_t = {n: np.asarray(v, np.float32) for n, v in base.items()}
  applied = bdj.from_tensors(plain.config, bdj.apply_delta(base_t, delta, hf_layout=True),
                             jnp.float32)  # slot 0 of it: the materialised variant
  np.testing.assert_allclose(np.asarray(got), np.asarray(applied(tokens)), rtol=2e-5, atol=2e-5)
