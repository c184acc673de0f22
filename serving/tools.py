"""Chat ``tools`` with a forced ``tool_choice``: the call is generated under a JSON-schema
grammar, so it always parses and matches the function's ``parameters`` (vLLM's approach for
``required`` and named tool choices), whatever the model's chat format.

    plan = tool_plan(body)            # None: no tools, or tool_choice "none"
    plan.response_format              # the grammar the output is generated under
    calls = plan.tool_calls(text)     # the output as OpenAI ``tool_calls``

* ``tool_choice: {"type": "function", "function": {"name": F}}``: the output is F's arguments
  (an object matching its ``parameters``); one call.
* ``tool_choice: "required"``: the output is a JSON array of one or more
  ``{"name": ..., "arguments": {...}}``, each for one of the tools; as many calls (one with
  ``parallel_tool_calls: false``).
* ``tool_choice: "none"``: the tools are shown to the chat template (if it uses them) and the
  answer is plain text.
* ``"auto"`` (the default when tools are sent) would need a parser for each model family's own
  tool-call syntax, which this server does not have: a 400 naming ``tool_choice`` that says what
  to send instead.

The tools are passed to the chat template as ``tools`` (the list as sent), as transformers does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from serving.protocol import invalid

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
  tools: tuple[dict, ...]  # as sent: {"type": "function", "function": {...}}
  forced: str | None  # the named function, "required", or None ("none": plain text)
  parallel: bool = True  # parallel_tool_calls: false allows one call only

  @property
  def response_format(self) -> dict | None:
    if self.forced is None:
      return None
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
              for t in self.tools}
    if self.forced != "required":
      schema = params[self.forced]
    else:
      schema = {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, "arguments": p},
         "required": ["name", "arguments"], "additionalProperties": False}
        for n, p in params.items()]}}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

  def tool_calls(self, text: str) -> list[dict] | None:
    """The output as ``tool_calls`` (None when it is not a complete call, e.g. cut by
    max_tokens)."""
    try:
      value = json.loads(text)
    except ValueError:
      return None
    calls = [(self.forced, value)] if self.forced != "required" else [
      (c["name"], c["arguments"]) for c in value]
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in calls]


def _tools(body: Mapping) -> tuple[dict, ...]:
  tools = body.get("tools")
  if tools is None or tools == []:
    return ()
  if not isinstance(tools, list):
    raise invalid("tools", "must be a list of function tools")
  names = set()
  for i, t in enumerate(tools):
    f = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
      raise invalid("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
      raise invalid("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
    if name in names:
      raise invalid("tools", f"two tools are named {name!r}")
    names.add(name)
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
      raise invalid("tools", f"tools[{i}].function.parameters must be a JSON Schema object")
  return tuple(tools)


def tool_plan(body: Mapping, *, chat: bool) -> ToolPlan | None:
  """The validated ``tools`` / ``tool_choice`` of ``body``; see the module docstring."""
  for legacy in ("functions", "function_call"):
    if body.get(legacy) not in (None, [], "none", "auto"):
      raise invalid(legacy, "the legacy function-calling fields are not supported; use tools "
                            "and tool_choice", code="unsupported_parameter")
  tools = _tools(body)
  choice: Any = body.get("tool_choice")
  if not tools:
    if choice not in (None, "none", "auto"):
      raise invalid("tool_choice", "needs tools")
    return None
  if not chat:
    raise invalid("tools", "tools are a /v1/chat/completions parameter",
                  code="unsupported_parameter")
  if choice == "none":
    return ToolPlan(tools, None)
  if choice in (None, "auto"):
    raise invalid("tool_choice", "'auto' (the default with tools) needs a parser for this "
                                 "model's own tool-call format, which this server does not "
                                 "have; send 'required', a named function "
                                 "({'type': 'function', 'function': {'name': ...}}) or 'none'",
                  code="unsupported_parameter")
  parallel = body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool):
    raise invalid("parallel_tool_calls", "must be a boolean")
  if choice == "required":
    return ToolPlan(tools, "required", parallel is not False)
  f = choice.get("function") if isinstance(choice, dict) else None
  name = f.get("name") if isinstance(f, dict) else None
  if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(
      name, str):
    raise invalid("tool_choice", "must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")
  if name not in {t["function"]["name"] for t in tools}:
    raise invalid("tool_choice", f"names a function that is not in tools: {name!r}")
  return ToolPlan(tools, name)
