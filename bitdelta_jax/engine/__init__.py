"""The engine: everything between a tokenized request and its tokens, on one device, a mesh or
several processes. `serving/` wraps it in HTTP; a Python program uses it directly.

    from bitdelta_jax.engine import Generator, SamplingParams
    gen = Generator(model, max_rows=8, max_seq_len=1024, tokenizer=tok)   # offline
    gen.generate([[1, 2, 3]], slot_ids=[1], params=SamplingParams(max_new_tokens=16))

    engine = Engine(EngineConfig(base=dir), tokenizer=tok); engine.start().result()  # device thread
    engine.generate([[1, 2, 3]], params=SamplingParams(max_new_tokens=16))  # offline, or
    engine.submit(Request(prompt, slot, params, model="name", emit=callback))  # streaming

`EngineConfig` (`config`): base, mesh, rows, KV cache, timeouts; a server builds it from its own
(`serving.config.ServerConfig.engine_config`), and the engine never imports `serving`.
On a mesh with ``data > 1`` the `Generator` runs one scheduler per data group; across
processes `Engine` (process 0) leads and the others run `multihost.leader.run_follower`.

Modules, in the order a request meets them:
  `request` (`Request`: one choice of one prompt, the scheduler's and the engine's state;
  `Event`), `sampling_params`, `stops` (the one stop check and the incremental detokenizer),
  `scheduler` (host, numpy only: admission, KV pages, prefix hits, preemption, forks; builds
  one `batch.PagedBatch` per step), `kv_pages`, `controls` / `logit_controls` / `grammar`
  (per-output logit controls), `runner` (device: the jitted step over a mesh, the step cache),
  `mesh_layout`, `sampling`, `generator` (`Generator`: one scheduler and runner per data
  group, the offline ``generate``), `build` (model load, bank options, KV sizing: once),
  `engine` (`Engine`: the device thread, its inbox and sweep), `multihost/` (plan codec,
  channel, leader and followers, the `jax.distributed` runtime).
"""

import importlib

# Public name -> module that defines it, imported on first use (the scheduler's modules import
# without JAX).
_EXPORTS = {
  "Generator": "generator",
  "Generation": "request",
  "Request": "request",
  "Event": "request",
  "SamplingParams": "sampling_params",
  "Engine": "engine",
  "EngineConfig": "config",
}

__all__ = [*_EXPORTS]


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__():
  return sorted(__all__)
