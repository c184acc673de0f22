"""bf16 weights on CPU: the bf16 small-M kernel vs XLA (f32 and bf16 dots) and the f32 kernel.

    python -m bench cpu_bf16 [--rounds 30] [--model-rounds 8] [--no-model]
        → bench/results/kernels/cpu_bf16.{json,md}

Part 1, one SmolLM2-135M decoder layer's 7 linear layers (q, k, v, o, gate, up, down; [in, out]
kernels): for M in 1..128 rows, XLA's f32 dot, XLA's bf16 dot (f32 sums), the f32 small-M
kernel and the bf16 kernel (`pallas_kernels.small_matmul`), interleaved round by round (the
order rotating), medians; GB/s counts the weight bytes read (4 or 2 per weight).
Part 2, a whole SmolLM2-135M forward of one token per row (random weights, 2 slots), rows 1,
4 and 8, base rows (slot 0) and variant rows (slot 1, 1-bit deltas): the f32 model, the bf16
model as dispatched (bf16 kernel for <= 64 rows) and the bf16 model on XLA's dots alone
(``BITDELTA_SMALL_MATMUL=0`` at trace time); and the tied LM head alone (f32 vs bf16 einsum).
Part 3, a 4-layer bf16 model with its linear layers' matmul swapped (XLA bf16 dot with a bf16
result, XLA's dot with f32 sums, the NN kernel): the crossover inside a real program.
The machine is shared: the load average is recorded, and only ratios within a round compare.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from bench.common import report
from bench.common.paths import results_dir

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
SMOL = dict(
  model_type="llama",
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  head_dim=64,
  rms_norm_eps=1e-5,
  tie_word_embeddings=True,
)


def _interleaved(fns: dict, rounds: int) -> tuple[dict, dict]:
  """(median, min) seconds of each ``fn()`` (`harness.interleaved`). The min is the
  least-disturbed run (the machine is shared)."""
  from bench.common import harness

  t = harness.interleaved(fns, rounds, min_rounds=rounds)
  return t.medians(), {n: t.min(n) for n in t.wall}


def layer_bench(rounds: int) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.small_matmul.cpu import small_matmul
  from pallas_kernels.small_matmul.cpu_bf16 import small_matmul_bf16

  rng = np.random.default_rng(0)
  w32 = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in SHAPES]
  w16 = [w.astype(jnp.bfloat16) for w in w32]
  weights = sum(a * b for a, b in SHAPES)
  dots = {
    "xla_f32": jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)]),
    "xla_bf16": jax.jit(
      lambda xs, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32) for x, w in zip(xs, ws)]
    ),
    "kernel_f32": jax.jit(lambda xs, ws: [small_matmul(x, w) for x, w in zip(xs, ws)]),
    "kernel_bf16": jax.jit(lambda xs, ws: [small_matmul_bf16(x, w) for x, w in zip(xs, ws)]),
  }
  rows = []
  for m in ROWS:
    x32 = [jnp.asarray(rng.normal(size=(m, s[0])), jnp.float32) for s in SHAPES]
    x16 = [x.astype(jnp.bfloat16) for x in x32]
    args = {
      "xla_f32": (x32, w32),
      "xla_bf16": (x16, w16),
      "kernel_f32": (x32, w32),
      "kernel_bf16": (x16, w16),
    }
    med, best = _interleaved({n: (lambda n=n, a=args: dots[n](*a[n])) for n in dots}, rounds)
    row = {"rows": m, "load": os.getloadavg()[0]}
    for n, t in med.items():
      row[f"{n}_ms"] = 1e3 * t
      row[f"{n}_min_ms"] = 1e3 * best[n]
      row[f"{n}_gbps"] = weights * (4 if n.endswith("f32") else 2) / t / 1e9
    best_f32 = min(med["xla_f32"], med["kernel_f32"])
    row["bf16_kernel_over_best_f32"] = med["kernel_bf16"] / best_f32
    row["bf16_kernel_over_xla_bf16"] = med["kernel_bf16"] / med["xla_bf16"]
    row["min_bf16_kernel_over_best_f32"] = best["kernel_bf16"] / min(
      best["xla_f32"], best["kernel_f32"]
    )
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def model_bench(rounds: int) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from bitdelta_jax.models import LlamaForCausalLM, ModelConfig
  from bitdelta_jax.models.layers import DeltaDense

  cfg = ModelConfig(**SMOL, num_slots=2)
  models = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    m = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for _, mod in nnx.iter_graph(m):
      if isinstance(mod, DeltaDense):  # a variant in slot 1
        bits = rng.integers(0, 256, mod.delta_bits.shape, dtype=np.uint8)
        bits[0] = 0
        scale = np.full(mod.delta_scale.shape, 0.005, np.float32)
        scale[0] = 0
        mod.delta_bits[...] = jnp.asarray(bits)
        mod.delta_scale[...] = jnp.asarray(scale)
    models[jnp.dtype(dtype).name] = nnx.split(m)

  def program(name):
    graphdef, state = models[name]
    f = jax.jit(lambda st, ids, s: nnx.merge(graphdef, st)(ids, slot_ids=s))
    return f, state

  out = []
  for rows in (1, 4, 8):
    ids = jnp.asarray(np.arange(rows)[:, None] * 7 + 11, jnp.int32)
    progs = {"f32": program("float32"), "bf16": program("bfloat16")}
    # the bf16 model on XLA's dots alone: the dispatch is decided when tracing
    os.environ["BITDELTA_SMALL_MATMUL"] = "0"
    f, st = program("bfloat16")
    lowered = f.lower(st, ids, jnp.zeros((rows,), jnp.int32)).compile()
    del os.environ["BITDELTA_SMALL_MATMUL"]
    for slot in (0, 1):
      s = jnp.full((rows,), slot, jnp.int32)
      fns = {n: (lambda f=f, st=st, s=s, ids=ids: f(st, ids, s)) for n, (f, st) in progs.items()}
      fns["bf16_xla_only"] = lambda st=st, s=s, ids=ids, c=lowered: c(st, ids, s)
      med, best = _interleaved(fns, rounds)
      row = {
        "rows": rows,
        "slot": slot,
        "load": os.getloadavg()[0],
        **{f"{n}_ms": 1e3 * t for n, t in med.items()},
        "bf16_over_f32": med["bf16"] / med["f32"],
        "bf16_xla_only_over_f32": med["bf16_xla_only"] / med["f32"],
      }
      out.append(row)
      print(json.dumps(row), flush=True)
  # the tied LM head alone: XLA's einsum (f32, bf16 with f32 sums) and the NT kernel
  from pallas_kernels.small_matmul.cpu_bf16 import small_matmul_bf16_nt

  e32 = models["float32"][1]["model"]["embed_tokens"]["weight"][...]
  e16 = e32.astype(jnp.bfloat16)
  head = jax.jit(lambda h, e: jnp.einsum("md,vd->mv", h, e, preferred_element_type=jnp.float32))
  nt = jax.jit(small_matmul_bf16_nt)
  for rows in (1, 4, 8, 16, 64):
    h = jnp.asarray(
      np.random.default_rng(rows).normal(size=(rows, SMOL["hidden_size"])), jnp.float32
    )
    h16 = h.astype(jnp.bfloat16)
    med, _ = _interleaved(
      {
        "f32": lambda h=h: head(h, e32),
        "bf16": lambda h=h16: head(h, e16),
        "kernel_nt": lambda h=h16: nt(h, e16),
      },
      rounds,
    )
    row = {"rows": rows, "lm_head": True, **{f"{n}_ms": 1e3 * t for n, t in med.items()}}
    out.append(row)
    print(json.dumps(row), flush=True)
  return out


def dot_forms_bench(rounds: int) -> list[dict]:
  """A 4-layer SmolLM2-shaped bf16 model (tied LM head on the NT kernel throughout) with its
  linear layers' matmul swapped at trace time: XLA's bf16 dot with a bf16 result (the form a
  bf16 model had before), XLA's dot with f32 sums (`cpu_bf16.dense` above `MAX_ROWS`), and the
  NN kernel at every row count. Decides `cpu_bf16.MAX_ROWS` inside a real program."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from bitdelta_jax.models import LlamaForCausalLM, ModelConfig, layers
  from pallas_kernels.small_matmul.cpu_bf16 import small_matmul_bf16

  def as_product(f):
    """``DeltaDense``'s product (`layers.delta_matmul`, no bank in this model) as ``f``."""

    def product(x, w, *bank, preferred_element_type=None, **_):
      assert not bank, "the model has no variant slots"
      return f(x, w).astype(preferred_element_type or x.dtype)

    return product

  forms = {
    "xla_bf16_result": as_product(jnp.dot),
    "xla_f32_sums": as_product(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
    "kernel": as_product(small_matmul_bf16),
  }
  model = LlamaForCausalLM(
    ModelConfig(**{**SMOL, "num_layers": 4}), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
  )
  graphdef, state = nnx.split(model)
  original, out = layers.delta_matmul, []
  for rows in (1, 2, 4, 8, 16, 64):
    ids = jnp.asarray((np.arange(rows)[:, None] * 7 + 11), jnp.int32)
    progs = {}
    try:
      for name, form in forms.items():
        layers.delta_matmul = form
        f = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
        progs[name] = f.lower(state, ids).compile()
    finally:
      layers.delta_matmul = original
    med, best = _interleaved(
      {n: (lambda p=p, ids=ids: p(state, ids)) for n, p in progs.items()}, rounds
    )
    row = {
      "rows": rows,
      "load": os.getloadavg()[0],
      **{f"{n}_ms": 1e3 * t for n, t in med.items()},
      **{f"{n}_min_ms": 1e3 * t for n, t in best.items()},
    }
    out.append(row)
    print(json.dumps(row), flush=True)
  return out


def write_md(res: dict, path: pathlib.Path) -> None:
  m = res["machine"]
  lines = [
    "# bf16 weights on CPU: bf16 small-M kernel vs XLA and the f32 kernel (SmolLM2-135M)",
    "",
    f"`python -m bench cpu_bf16`; {m['cpu']} ({', '.join(m.get('cpu_flags', []))}), "
    f"{m['cores']} cores, jax {m.get('jax')}; bf16 kernel path: "
    f"{'vdpbf16ps' if res['bf16_isa'] == 1 else 'widen + FMA'}. Shared machine: load average "
    f"{res['load_before']:.1f} before, {res['load_after']:.1f} after (2 cores), so absolute "
    "times are noisy; the ratios come from the same interleaved rounds.",
    "",
    f"## One decoder layer's 7 linear layers (median of {res['rounds']} interleaved rounds)",
    "",
    "| rows | XLA f32 ms (GB/s) | XLA bf16 ms (GB/s) | f32 kernel ms (GB/s) | bf16 kernel ms (GB/s) "
    "| bf16 kernel / best f32 | bf16 kernel / XLA bf16 |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in res["layer"]:
    cells = " | ".join(
      f"{r[n + '_ms']:.3f} ({r[n + '_gbps']:.1f})"
      for n in ("xla_f32", "xla_bf16", "kernel_f32", "kernel_bf16")
    )
    lines.append(
      f"| {r['rows']} | {cells} | {r['bf16_kernel_over_best_f32']:.2f} | "
      f"{r['bf16_kernel_over_xla_bf16']:.2f} |"
    )
  if res.get("model"):
    lines += [
      "",
      f"## Whole SmolLM2-135M forward, one token per row (random weights; median of "
      f"{res['model_rounds']} interleaved rounds)",
      "",
      "| rows | rows' slot | f32 ms | bf16 ms | bf16 XLA-only ms | bf16 / f32 | "
      "bf16 XLA-only / f32 |",
      "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["model"]:
      if r.get("lm_head"):
        continue
      lines.append(
        f"| {r['rows']} | {'variant' if r['slot'] else 'base'} | {r['f32_ms']:.1f} | "
        f"{r['bf16_ms']:.1f} | {r['bf16_xla_only_ms']:.1f} | {r['bf16_over_f32']:.2f} "
        f"| {r['bf16_xla_only_over_f32']:.2f} |"
      )
    lines += [
      "",
      "Tied LM head alone (49152 x 576; median ms):",
      "",
      "| rows | XLA f32 | XLA bf16 (f32 sums) | NT kernel | XLA bf16 / f32 | "
      "NT kernel / XLA f32 | NT kernel / XLA bf16 |",
      "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
      f"| {r['rows']} | {r['f32_ms']:.2f} | {r['bf16_ms']:.2f} | {r['kernel_nt_ms']:.2f} | "
      f"{r['bf16_ms'] / r['f32_ms']:.2f} | {r['kernel_nt_ms'] / r['f32_ms']:.2f} | "
      f"{r['kernel_nt_ms'] / r['bf16_ms']:.2f} |"
      for r in res["model"]
      if r.get("lm_head")
    ]
  if res.get("dot_forms"):
    lines += [
      "",
      "## Inside a program: the linear layers' matmul of a 4-layer bf16 SmolLM2 "
      f"(median of {res['model_rounds']} interleaved rounds, ms)",
      "",
      "| rows | XLA bf16 dot, bf16 result | XLA dot, f32 sums | NN kernel | kernel / f32-sum dot |",
      "|---:|---:|---:|---:|---:|",
    ]
    lines += [
      f"| {r['rows']} | {r['xla_bf16_result_ms']:.1f} | {r['xla_f32_sums_ms']:.1f} | "
      f"{r['kernel_ms']:.1f} | {r['kernel_ms'] / r['xla_f32_sums_ms']:.2f} |"
      for r in res["dot_forms"]
    ]
  if res.get("notes"):
    lines += ["", "## Reading", "", *res["notes"]]
  path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--model-rounds", type=int, default=8)
  p.add_argument("--no-model", action="store_true")
  p.add_argument("--notes", type=pathlib.Path, help="markdown lines appended as the reading")
  args = p.parse_args(argv)
  from bench.common.machine import describe
  from pallas_kernels.small_matmul.cpu_bf16 import isa

  res = {
    "machine": describe(),
    "bf16_isa": isa(),
    "shapes": SHAPES,
    "rounds": args.rounds,
    "model_rounds": args.model_rounds,
    "load_before": os.getloadavg()[0],
  }
  res["layer"] = layer_bench(args.rounds)
  res["model"] = None if args.no_model else model_bench(args.model_rounds)
  res["dot_forms"] = None if args.no_model else dot_forms_bench(args.model_rounds)
  res["load_after"] = os.getloadavg()[0]
  if args.notes:
    res["notes"] = args.notes.read_text().splitlines()
  out = results_dir("kernels") / "cpu_bf16"
  report.write_json(out.with_suffix(".json"), res, indent=1)
  write_md(res, out.with_suffix(".md"))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
