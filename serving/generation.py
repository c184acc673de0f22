"""`/v1/completions` and `/v1/chat/completions`: from a request body to choices on the wire.

    resp = await generate(server, request, chat=False)

1. Parse: the model and its tokenizer (a variant's own, else the base's), the prompt(s) (chat:
   the chat template; completions: a string, token ids, or a list of either), the options
   (`serving.protocol.options_of`) and the scoring / control fields
   (`serving.openai_params.controls_of`). ``response_format`` is compiled here, on an IO
   thread (`bitdelta_jax.engine.grammar.compile_grammar`), so a bad schema is a 400 before
   anything is queued.
2. One `SamplingParams` per prompt; each prompt becomes one engine group of ``n`` choices
   (`bitdelta_jax.engine.engine.Engine.submit_group`: one prefill, n streams). The variant's slot is leased
   once for the request and released when the last choice has let go of it.
   A forced ``tool_choice`` is a grammar too (`serving.tools`): the output becomes
   ``tool_calls``.
3. Events come back tagged with their choice index and are collected by
   `serving.choices.Choices`: a JSON body, or SSE chunks (per choice: its text and log
   probabilities as they come, then its finish_reason; usage once all are done; ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from aiohttp import web

from bitdelta_jax.engine.request import Event, Request
from serving import protocol as P
from serving.cache import LoadError
from serving.choices import Choices
from serving.openai_params import Controls, check_budget, controls_of
from serving.router import UnknownModel
from serving.tools import tool_plan

DISCONNECT_POLL_S = 0.25
# an engine error event's code -> the HTTP status of a non-streamed answer (others: 500)
# (engine_failed: the engine gave up after failed steps and the server is exiting;
# server_shutting_down: still running when the shutdown grace ran out, `Server.drain`)
ERROR_STATUS = {"worker_lost": 503, "variant_deleted": 410, "engine_failed": 503,
                "server_shutting_down": 503}


async def generate(server, request: web.Request, *, chat: bool) -> web.StreamResponse:
  """The whole request path; see the module docstring."""
  arrival = time.perf_counter()
  endpoint = "chat" if chat else "completions"
  body = await P.read_json(request, server.cfg.max_body_bytes, server.cfg.body_timeout_s)
  model = P.model_of(body)
  if not server.router.knows(model):
    raise unknown(model)
  variant = server.registry.get(model)  # None: the base
  tok = (variant.tokenizer if variant is not None else None) or server.tokenizer
  vocab = server.engine.vocab_size + (variant.added_tokens if variant is not None else 0)
  tools = tool_plan(body, chat=chat)
  if chat:
    msgs = P.messages_of(body)
    # the variant's own chat template; one whose tokenizer has none uses the base's
    templated = tok if tok.chat_template else server.tokenizer
    kw = {"tools": list(tools.tools)} if tools is not None else {}
    try:
      text = templated.apply_chat_template(msgs, add_generation_prompt=True, **kw)
    except Exception as e:  # noqa: BLE001  a template that rejects these messages
      raise P.invalid("messages", f"the chat template rejected them ({e})") from None
    prompts = [tok.encode(text, add_special_tokens=False)]  # the template holds its specials
  else:
    prompts = P.prompts_of(body, tok, vocab, server.engine.vocab_size)
  opts = P.options_of(body, chat=chat)
  ctl = controls_of(body, chat=chat, vocab_size=vocab, max_tokens=opts.max_tokens)
  if tools is not None and tools.forced is not None:  # the call is generated under its schema
    if ctl.response_format is not None:
      raise P.invalid("response_format", "cannot be combined with a forced tool_choice")
    ctl = dataclasses.replace(ctl, response_format=tools.response_format)
  else:
    tools = None
  cfg = server.cfg
  where = "messages" if chat else "prompt"
  for p in prompts:
    if len(p) > cfg.max_prompt_tokens:
      raise P.ApiError(
        400, f"the prompt is {len(p)} tokens; this model's context is {cfg.max_seq_len} "
        f"tokens, so prompts may have at most {cfg.max_prompt_tokens}",
        param=where, code="context_length_exceeded")
    # an explicit max_tokens is not cut to the context behind the client's back (OpenAI's and
    # vLLM's answer); without one, the default is cut to the room left (`_params`)
    if opts.max_tokens is not None and len(p) + opts.max_tokens > cfg.max_seq_len:
      key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens")
      raise P.ApiError(
        400, f"This model's maximum context length is {cfg.max_seq_len} tokens. However, you "
        f"requested {len(p) + opts.max_tokens} tokens ({len(p)} in the {where}, "
        f"{opts.max_tokens} in the completion). Please reduce the length of the {where} or "
        f"{key}.", param=key, code="context_length_exceeded")
  grammar = await _grammar(server, tok, ctl, "tools" if tools is not None else "response_format")
  plist = [_params(opts, ctl, tok, grammar, cfg, len(p), server.engine.vocab_size)
           for p in prompts]
  check_budget(ctl, [len(p) for p in prompts], [p.max_new_tokens for p in plist])
  if not server.engine.alive:
    raise P.ApiError(503, "the engine is not running", code="engine_unavailable")
  if server.engine.lost:
    raise P.ApiError(503, server.engine.lost, code="worker_lost")
  rows = len(prompts) * ctl.n
  server.admit(rows, model, endpoint)  # a 429 past max_batch + max_queued_requests sequences
  try:
    return await _admitted(server, request, model, endpoint, cfg, prompts, plist, ctl, tok, chat,
                           tools, arrival, opts)
  finally:
    server.admitted_rows -= rows


async def _admitted(server, request, model, endpoint, cfg, prompts, plist, ctl, tok, chat, tools,
                    arrival, opts):
  """The rest of `generate` for an admitted request: the variant's slot, the engine, the
  response."""
  try:
    lease = await server.router.acquire(model)
  except UnknownModel:  # deleted meanwhile
    raise unknown(model) from None
  except LoadError as e:
    server.metrics.requests.labels(model, endpoint, "503").inc()
    code = "worker_lost" if server.engine.lost else "variant_load_failed"
    raise P.ApiError(503, str(e), code=code,
                     headers={"Retry-After": str(max(1, int(cfg.load_retry_s)))}) from None
  if gone(request):  # the client left while its variant loaded: generate nothing
    lease.release()
    server.metrics.requests.labels(model, endpoint, "499").inc()
    return web.Response(status=499, text="the client disconnected")  # never sent

  loop = asyncio.get_running_loop()
  events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
  n = ctl.n
  left = [len(prompts) * n]

  def deliver(index: int, ev: Event) -> None:  # event loop
    if ev.kind in ("done", "error"):
      left[0] -= 1
      if left[0] == 0:
        lease.release()  # the engine has let go of every row, hence of the slot
    events.put_nowait((index, ev))

  groups = [[Request(prompt=list(p), slot=lease.slot, params=params, model=model,
                     emit=lambda ev, k=i * n + j: loop.call_soon_threadsafe(deliver, k, ev),
                     arrival=arrival, tokenizer=tok) for j in range(n)]
            for i, (p, params) in enumerate(zip(prompts, plist))]
  reqs = [r for g in groups for r in g]
  lease.attach(reqs)
  prompt_tokens = sum(len(p) for p in prompts)
  server.metrics.prompt_tokens.labels(model).inc(prompt_tokens)
  choices = Choices(tok, prompts, n, chat=chat, echo=ctl.echo, logprobs=ctl.logprobs,
                    as_ids=ctl.token_ids, tools=tools)
  finished = False
  try:
    for g in groups:
      server.engine.submit_group(g)
    rid, created = P.new_id(chat), P.now()
    if opts.stream:
      resp = await _stream(request, reqs, events, choices, rid, created, model, chat, opts,
                           prompt_tokens)
      finished = True
      server.metrics.requests.labels(model, endpoint, "200").inc()
      return resp
    while not choices.done:
      got = await _next_event(events, request)
      if got is None:  # the client went away: stop decoding (the engine frees the rows)
        finished = True
        _cancel(reqs)
        server.metrics.requests.labels(model, endpoint, "499").inc()
        return web.Response(status=499, text="the client disconnected")  # never sent
      index, ev = got
      if ev.kind == "error":
        finished = True
        _cancel(reqs)
        status = ERROR_STATUS.get(ev.code, 500)
        raise P.ApiError(status, f"generation failed: {ev.message}",
                         code=ev.code or "generation_failed")
      choices.update(index, ev)
    finished = True
    server.metrics.requests.labels(model, endpoint, "200").inc()
    return web.json_response(P.completion(
      rid, model, choices.final(), P.usage(prompt_tokens, choices.completion_tokens),
      chat=chat, created=created), dumps=P.dumps)  # never NaN / Infinity: strict JSON
  finally:
    if not finished:
      _cancel(reqs)  # the engine frees the rows at its next step, then releases


def _cancel(reqs) -> None:
  for r in reqs:
    r.cancelled = True


async def _grammar(server, tok, ctl: Controls, param: str):
  """The compiled ``response_format`` (None for none / text); a 400 naming ``param`` (the
  field it came from) when bad."""
  if ctl.response_format is None:
    return None
  from bitdelta_jax.engine.grammar import GrammarError, compile_grammar

  loop = asyncio.get_running_loop()
  try:
    return await loop.run_in_executor(server.io, compile_grammar, tok, ctl.response_format)
  except GrammarError as e:
    raise P.invalid(param, str(e)) from None
  except ImportError as e:  # llguidance missing: the server cannot do this at all
    raise P.ApiError(501, str(e), param=param, code="unsupported_parameter") from None


def _params(opts: P.Options, ctl: Controls, tok, grammar, cfg, prompt_len: int, vocab: int):
  from bitdelta_jax.engine.sampling import SamplingParams

  room = cfg.max_seq_len - prompt_len  # an explicit max_tokens fits (checked in `generate`)
  max_tokens = min(cfg.default_max_tokens if opts.max_tokens is None else opts.max_tokens, room)
  stops = (() if opts.ignore_eos else tuple(tok.stop_token_ids)) + ctl.stop_token_ids
  scored = ctl.echo and ctl.logprobs is not None
  return SamplingParams(
    temperature=opts.temperature, top_p=opts.top_p,
    top_k=opts.top_k if opts.top_k < vocab else 0, seed=opts.seed,  # >= vocab: no top-k
    max_new_tokens=max_tokens, stop_token_ids=tuple(dict.fromkeys(stops)),
    stop_strings=opts.stop, presence_penalty=ctl.presence_penalty,
    frequency_penalty=ctl.frequency_penalty, repetition_penalty=ctl.repetition_penalty,
    logit_bias=ctl.logit_bias, min_tokens=min(ctl.min_tokens, max_tokens),
    logprobs=ctl.logprobs, prompt_logprobs=ctl.logprobs if scored else None, grammar=grammar)


async def _stream(request, reqs, events, choices: Choices, rid, created, model, chat, opts,
                  prompt_tokens) -> web.StreamResponse:
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
  await resp.prepare(request)

  def sse(pieces=None, use=None) -> bytes:
    return P.sse(P.chunk(rid, model, chat=chat, created=created, choices=pieces, use=use))

  try:
    if chat:
      await resp.write(sse([P.role_choice(i) for i in range(len(choices))]))
    while not choices.done:
      got = await _next_event(events, request)
      if got is None:  # the client went away while nothing came (e.g. a long prefill)
        _cancel(reqs)
        return resp
      index, ev = got
      if ev.kind == "error":
        _cancel(reqs)
        await resp.write(P.sse(P.error_body(f"generation failed: {ev.message}", "server_error",
                                            code=ev.code or "generation_failed")))
        break
      piece = choices.update(index, ev)
      if piece is not None:
        await resp.write(sse([piece]))
      if ev.kind == "done":
        await resp.write(sse([choices.finish_piece(index)]))
    else:
      if opts.include_usage:
        await resp.write(sse(use=P.usage(prompt_tokens, choices.completion_tokens)))
    await resp.write(P.sse("[DONE]"))
    await resp.write_eof()
  except ConnectionError:  # the client went away: free the rows, nothing to answer
    _cancel(reqs)
  except asyncio.CancelledError:
    _cancel(reqs)
    raise
  return resp


async def _next_event(events: asyncio.Queue, request: web.Request):
  """The next engine event, or None once the client has disconnected (aiohttp does not
  cancel a handler when its client goes away, so a non-streaming handler polls)."""
  while True:
    try:
      return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
    except TimeoutError:
      if gone(request):
        return None


def gone(request: web.Request) -> bool:
  t = request.transport
  return t is None or t.is_closing()


def unknown(model) -> P.ApiError:
  return P.ApiError(404, f"the model {model!r} does not exist", param="model",
                    code="model_not_found")
