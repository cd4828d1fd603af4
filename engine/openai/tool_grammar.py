"""Lark grammars (llguidance's dialect) that enforce tool calls in the chat template's own call format.

:func:`call_grammar` writes a request's answer grammar from ``tool_choice``, ``parallel_tool_calls``,
``response_format`` and ``strict`` tools; each call is written as the template teaches it
(:func:`engine.openai.tool_calls.call_format`). In the XML form a string parameter's ``pattern`` and
``format`` are not enforced. Design: docs/design/grammar.md (what each choice allows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engine.turn.grammar import GrammarError, json_options

_NOT_VALUE = r"~/(<\/parameter>|(?s:.*)(\n<\/parameter>|<\/tool_call>))(?s:.*)/"
"""What a text value cannot be: one that holds its own end or the end of the call block, or starts with
``</parameter>`` (after the opening's newline, the reader would take it for the end)."""
_TEXT = r"/(?s:.*)/"
_CLOSE = '"\\n</parameter>\\n"'
"""A parameter's closing tag. A text value's terminal ends with it: a lexeme of free text cannot end where
the tag begins (the lexer looks no further ahead than the next byte), so value and tag are one lexeme."""


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(schema: Any, defs: Mapping[str, Any]) -> str:
    """``%json {schema}`` in one fixed layout (the engine's JSON options), the root's ``$defs`` carried along."""
    body = dict(schema) if isinstance(schema, Mapping) else {}
    body.update(defs)
    body["x-guidance"] = json_options(body)
    return "%json " + json.dumps(body, ensure_ascii=False)


def _string_value(schema: Mapping[str, Any], rule: str, lines: list[str]) -> str:
    """The grammar of an XML string value and its closing tag: its enum / const strings, or text free of
    ``\\n</parameter>`` and ``</tool_call>``.

    Raises:
        GrammarError: an ``enum`` / ``const`` that holds no string (no value could be written).
    """
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        choices = [c for c in values if isinstance(c, str)] if isinstance(values, list) else []
        if not choices:
            raise GrammarError(f"a string parameter's enum / const holds no string, so no call could be written "
                               f"(got {json.dumps(values)[:100]})")
        return "(" + " | ".join(_literal(c) for c in choices) + ") " + _CLOSE
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    count = f"{{{int(low)},{int(high)}}}" if isinstance(high, int) else (f"{{{int(low)},}}" if low else "*")
    name = rule.upper()
    lines.append(f"{name}: (/(?s:.{count})/ & {_NOT_VALUE}) {_CLOSE}")
    return name


def _xml_body(fn: Mapping[str, Any], rule: str, strict: bool, lines: list[str]) -> str:
    """The rule of ``<function=NAME>\\n`` ... ``</function>`` for one function."""
    params = fn.get("parameters") or {}
    properties = params.get("properties") or {}
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    head = _literal(f"<function={fn['name']}>\n")
    if not strict or not properties:
        lines.append(f"{rule}: {head} any_parameter* \"</function>\"")
        return rule
    required = set(params.get("required") or [])
    parts = []
    for j, (key, schema) in enumerate(properties.items()):
        schema = schema if isinstance(schema, Mapping) else {}
        kinds = schema.get("type")
        textual = kinds == "string" or (kinds is None and ("enum" in schema or "const" in schema)
                                        and all(isinstance(c, str) for c in schema.get("enum", [schema.get("const")])))
        value = _string_value(schema, f"{rule}_v{j}", lines) if textual else f"{_json(schema, defs)} {_CLOSE}"
        opening = _literal(f"<parameter={key}>" + "\n")
        lines.append(f"{rule}_p{j}: {opening} {value}")
        parts.append(f"{rule}_p{j}" + ("" if key in required else "?"))
    lines.append(f"{rule}: {head} {' '.join(parts)} \"</function>\"")
    return rule


def _json_body(fn: Mapping[str, Any], rule: str, strict: bool, lines: list[str]) -> str:
    """The rule of ``{"name": NAME, "arguments": {...}}`` for one function."""
    params = (fn.get("parameters") or {}) if strict else {"type": "object"}
    if strict and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}   # only the declared arguments, as OpenAI's strict mode
    opening = _literal(json.dumps({"name": fn["name"]})[:-1] + ', "arguments": ')
    lines.append(f"{rule}: {opening} {_json(params, {})} \"}}\"")
    return rule


def call_grammar(tools: Sequence[Mapping[str, Any]], fmt: str, choice: str, name: str | None, parallel: bool,
                 answer: Mapping[str, Any] | None) -> str | None:
    """The lark grammar of the answer, or None when nothing is enforced.

    Args:
        tools: the request's function tools (``{"type": "function", "function": {...}}``), checked.
        fmt: "xml" or "json", the template's call format.
        choice: ``tool_choice`` ("auto", "none", "required", "function"); ``name``: the forced function.
        parallel: ``parallel_tool_calls``: more than one call allowed.
        answer: the ``response_format`` (json_object / json_schema) the text answer must follow, or None.
    """
    functions = [t["function"] for t in tools]
    if choice == "function":
        functions = [f for f in functions if f["name"] == name]
    forced = choice in ("required", "function")
    strict = any(f.get("strict") for f in functions)
    if choice == "none" or not functions or not (forced or answer is not None or strict):
        return None
    lines: list[str] = []
    body = _xml_body if fmt == "xml" else _json_body
    names = [body(f, f"fn{i}", forced or bool(f.get("strict")), lines) for i, f in enumerate(functions)]
    lines.append(f"call: <tool_call> \"\\n\" ({' | '.join(names)}) \"\\n\" </tool_call>")
    calls = "call" if choice == "function" or not parallel else "call (\"\\n\" call)*"
    if forced:
        top = calls
    elif answer is not None:
        schema = answer.get("schema", {"type": "object"}) if answer["type"] == "json_schema" else {"type": "object"}
        top = f"{_json(schema, {})} | {calls}"
    else:
        top = f"{_TEXT} ({calls})?"
    lines.append("any_parameter: \"<parameter=\" /[^<>\\n]+/ \">\\n\" ANY_VALUE")
    lines.append(f"ANY_VALUE: ({_TEXT} & {_NOT_VALUE}) {_CLOSE}")
    return "\n".join([f"start: {top}"] + lines)
