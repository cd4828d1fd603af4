"""The agent-facing fields of a chat-completions body, checked: ``tools``, ``tool_choice``, the
conversation's ``tool_calls`` / ``tool`` messages, ``response_format``, ``logprobs``, ``logit_bias``,
``reasoning_effort`` and ``chat_template_kwargs``.

Shapes and limits follow the OpenAI API reference (Chat Completions: a function name matches
``^[a-zA-Z0-9_-]{1,64}$``, ``top_logprobs`` is 0..20, ``logit_bias`` values are in [-100, 100]);
bounds the reference leaves open are this server's (:data:`MAX_TOOLS`, :data:`MAX_DESCRIPTION`).
Every bad field is an :class:`~engine.openai.requests.APIError` (400) naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import jsonschema

from engine.sampling import MAX_TOP_LOGPROBS, SamplingParams

from .requests import APIError, TurnRequest

MAX_TOOLS = 128
"""Most tools one request may offer."""
MAX_DESCRIPTION = 64 << 10
"""Longest tool or parameter description, characters (an agent's longest run to a few thousand)."""
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_PARAM_NAME = re.compile(r"[^<>\n]{1,256}")
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
TEMPLATE_KWARGS = {"enable_thinking"}
"""The ``chat_template_kwargs`` passed on to the template (others are refused, not ignored)."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and lists in a schema (real ones stay under ten)."""
MAX_ARGUMENT_DEPTH = 64
"""Deepest nesting of objects and lists in a call's arguments in the conversation (the template renders them
recursively)."""
MAX_TOOLS_TEXT = 1 << 20
"""Largest ``tools`` list, characters of JSON (an agent's few dozen tools take a few hundred KiB at most)."""
EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}
"""``reasoning_effort`` -> thinking on or off (the template has no budget levels in between)."""


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _depth(value: Any) -> int:
    """How deeply objects and lists nest in ``value`` (walked without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (Mapping, list)):
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, Mapping) else item))
    return deepest


def check_schema(schema: Any, param: str) -> dict:
    """``schema`` when it is a valid JSON Schema (draft 2020-12 metaschema, by ``jsonschema``) nested at most
    :data:`MAX_SCHEMA_DEPTH` deep, else 400."""
    if not isinstance(schema, Mapping):
        raise _bad(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise _bad(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise _bad(f"{param} is not a valid JSON Schema: at {where}: {exc.message}", param,
                   "invalid_json_schema") from exc
    return dict(schema)


def _text(value: Any, param: str) -> None:
    if value is not None and not isinstance(value, str):
        raise _bad(f"{param} must be a string", param)
    if isinstance(value, str) and len(value) > MAX_DESCRIPTION:
        raise _bad(f"{param} is {len(value):,} characters; at most {MAX_DESCRIPTION:,}", param)


def _descriptions(schema: Any, param: str) -> None:
    """Bound every ``description`` inside a parameters schema."""
    if isinstance(schema, Mapping):
        for key, value in schema.items():
            if key == "description":
                _text(value, param + ".description")
            else:
                _descriptions(value, f"{param}.{key}")
    elif isinstance(schema, list):
        for k, value in enumerate(schema):
            _descriptions(value, f"{param}[{k}]")


def tools_of(value: Any) -> tuple[dict, ...]:  # noqa: C901
    """The request's ``tools``, checked (function tools with unique valid names, bounded descriptions and a
    valid JSON Schema of ``type: object`` as ``parameters``, or none) and kept as sent."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad("tools must be a list of {type: function, function: {...}} objects", "tools")
    if len(value) > MAX_TOOLS:
        raise _bad(f"tools holds {len(value)} tools; at most {MAX_TOOLS}", "tools")
    size = len(json.dumps(value, ensure_ascii=False))
    if size > MAX_TOOLS_TEXT:
        raise _bad(f"tools is {size:,} characters of JSON; at most {MAX_TOOLS_TEXT:,}", "tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                              Mapping):
            raise _bad(f"{where} must be {{type: 'function', function: {{name, description, parameters}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}"[:300],
                       where + ".function.name")
        if name in names:
            raise _bad(f"{where}.function.name {name!r} is offered twice", where + ".function.name")
        names.add(name)
        _text(fn.get("description"), where + ".function.description")
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else check_schema(
            params, where + ".function.parameters")
        if params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters must describe an object (type: object)",
                       where + ".function.parameters")
        for key in params.get("properties") or {}:
            if not _PARAM_NAME.fullmatch(key):
                raise _bad(f"{where}.function.parameters: property name {key!r} cannot be written in a call"[:300],
                           where + ".function.parameters")
        _descriptions(params, where + ".function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict must be true or false", where + ".function.strict")
        out.append(dict(tool))   # as sent: the template renders the client's own JSON (key order kept)
    return tuple(out)


def tool_choice_of(value: Any, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    """``(choice, name)``: "auto" / "none" / "required" / "function" and the forced function's name."""
    if value is None:
        return "auto", None
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools", "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, Mapping) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise _bad("tool_choice must be 'auto', 'none', 'required' or {type: 'function', function: {name}}",
                   "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise _bad(f"tool_choice names the function {name[:100]!r}, which is not among the tools",
                   "tool_choice.function.name")
    return "function", name


def tool_calls_of(value: Any, param: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as the template reads them (``function.arguments`` an object)."""
    if not isinstance(value, list):
        raise _bad(f"{param} must be a list of tool calls", param)
    out = []
    for k, call in enumerate(value):
        where = f"{param}[{k}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str):
            raise _bad(f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}", where)
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise _bad(f"{where}.function.arguments is not JSON: {exc}", where + ".function.arguments") from exc
        if not isinstance(arguments, Mapping):
            raise _bad(f"{where}.function.arguments must be a JSON object", where + ".function.arguments")
        if _depth(arguments) > MAX_ARGUMENT_DEPTH:
            raise _bad(f"{where}.function.arguments nests deeper than {MAX_ARGUMENT_DEPTH} levels",
                       where + ".function.arguments")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def link_tool_messages(raw: list, messages: list[dict]) -> None:
    """Carry the assistants' ``tool_calls`` and the tool messages' ``tool_call_id`` over to the engine's
    messages; a tool message must answer a call made earlier in the conversation."""
    called: set[str] = set()
    for i, (m, message) in enumerate(zip(raw, messages)):
        if message["role"] == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = tool_calls_of(m["tool_calls"], f"messages[{i}].tool_calls")
            called.update(c["id"] for c in message["tool_calls"])
        elif message["role"] == "tool":
            ident = m.get("tool_call_id")
            if not isinstance(ident, str) or ident not in called:
                raise _bad(f"messages[{i}].tool_call_id {ident!r} answers no tool call made before it"[:300],
                           f"messages[{i}].tool_call_id")
            message["tool_call_id"] = ident


def response_format_of(value: Any) -> dict | None:
    """``response_format``: None for text, ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "name", "schema", "strict"}`` with a valid schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _bad("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise _bad("response_format.json_schema must be {name, schema, strict}", "response_format.json_schema")
    schema = check_schema(spec.get("schema", {}), "response_format.json_schema.schema")
    return {"type": "json_schema", "name": spec["name"], "schema": schema, "strict": spec.get("strict") is True}


def top_logprobs_of(body: Mapping[str, Any]) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, only with logprobs) -> None or the count."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise _bad("logprobs must be true or false", "logprobs")
    if top is None:
        return 0 if on else None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}", "top_logprobs")
    if not on:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return top


def completion_logprobs_of(body: Mapping[str, Any]) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives (0..20), or None."""
    value = body.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise _bad(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", "logprobs")
    return value


def logit_bias_of(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` ({token id: bias}) checked against a vocabulary of ``vocab`` ids and [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise _bad("logit_bias must be an object of token id -> bias", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key) and int(key) < vocab):
            raise _bad(f"logit_bias: {key[:40]!r} is not a token id of this model (0 to {vocab - 1})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _bad(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def thinking_of(body: Mapping[str, Any], kwargs: Mapping[str, Any]) -> bool:
    """``enable_thinking`` from ``chat_template_kwargs`` and ``reasoning_effort`` ("none" / "minimal": off;
    "low" / "medium" / "high": on); the two must not disagree."""
    unknown = sorted(set(kwargs) - TEMPLATE_KWARGS)
    if unknown:
        raise _bad(f"chat_template_kwargs: {', '.join(map(repr, unknown))[:200]} not supported (this server "
                   f"passes {', '.join(sorted(TEMPLATE_KWARGS))} to the template)", "chat_template_kwargs")
    for key in kwargs:
        if not isinstance(kwargs[key], bool):
            raise _bad(f"chat_template_kwargs.{key} must be true or false", f"chat_template_kwargs.{key}")
    thinking = kwargs.get("enable_thinking")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORT:
            raise _bad(f"reasoning_effort must be one of {', '.join(EFFORT)}, got {effort!r}"[:200], "reasoning_effort")
        if thinking is not None and thinking != EFFORT[effort]:
            raise _bad(f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking",
                       "reasoning_effort")
        thinking = EFFORT[effort]
    return bool(thinking)


def agent_request(body: Mapping[str, Any], req: TurnRequest, vocab: int) -> TurnRequest:
    """``req`` (from :func:`~engine.openai.requests.chat_request`) with the agent fields of ``body``: tools,
    tool choice, tool messages, response format, logprobs, logit bias, frequency penalty and thinking."""
    tools = tools_of(body.get("tools"))
    choice, name = tool_choice_of(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    link_tool_messages(body["messages"], req.messages or [])
    return replace(req, tools=tools, tool_choice=choice, tool_name=name, parallel_tool_calls=parallel,
                   response_format=response_format_of(body.get("response_format")),
                   enable_thinking=thinking_of(body, _kwargs(body)),
                   sampling=_sampling(body, req.sampling, vocab, top_logprobs_of(body)))


def completion_fields(body: Mapping[str, Any], req: TurnRequest, vocab: int) -> TurnRequest:
    """``req`` (a completion) with ``logprobs``, ``logit_bias`` and ``frequency_penalty`` of ``body``."""
    return replace(req, sampling=_sampling(body, req.sampling, vocab, completion_logprobs_of(body)))


def _kwargs(body: Mapping[str, Any]) -> Mapping[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    return kwargs or {}


def _sampling(body: Mapping[str, Any], sampling: SamplingParams, vocab: int, top: int | None) -> SamplingParams:
    penalty = body.get("frequency_penalty")
    if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float))
                                or not -2.0 <= penalty <= 2.0):
        raise _bad(f"frequency_penalty must be a number in [-2, 2], got {penalty!r}", "frequency_penalty")
    return replace(sampling, frequency_penalty=float(penalty or 0.0), top_logprobs=top,
                   logit_bias=logit_bias_of(body.get("logit_bias"), vocab))
