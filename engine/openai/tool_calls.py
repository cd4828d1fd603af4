"""Tool calls read from a Qwen model's answer, as it streams, in the two formats these models write.

XML (``<tool_call><function=NAME><parameter=P>...``; Qwen3.5/3.6, Qwen3-Coder) or JSON (Qwen2.5/3,
Hermes). A block that does not parse, or names a function not offered, is returned as content with a
log line; a call is sent whole once its ``</tool_call>`` is read.
Design: docs/design/tool-calls.md.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)(?:(?<=\n)</parameter>|</parameter>(?=\s*(?:<parameter=|\Z)))",
                        re.DOTALL)
"""A parameter ends at its first ``</parameter>`` that starts a line (as the template writes it; an enforced
value cannot hold one) or that the next parameter or the function's end follows, so a value may itself
hold ``</parameter>`` (HTML, a file about this format)."""


def call_format(template: str) -> str:
    """The call format a chat template teaches: "xml" when its text holds ``<function=``, else "json"."""
    return "xml" if "<function=" in template else "json"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``id`` (``call_`` + 24 hex digits), function ``name``, ``arguments`` as a JSON
    object text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as in ``message.tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, in its order (``type``, or the branches of
    ``anyOf`` / ``oneOf``); [] when it names none."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return ["string"] if all(isinstance(v, str) for v in values) else []
    branches = schema.get("anyOf") or schema.get("oneOf") or []
    return [t for b in branches if isinstance(b, Mapping) for t in _types(b)]


_INTEGER = re.compile(r"-?\d+")


def _as(kind: str, text: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` reads as JSON type ``kind``, else ``(False, None)``."""
    word = text.strip()
    if kind == "string":
        return True, text
    if kind == "integer":
        return (True, int(word)) if _INTEGER.fullmatch(word) else (False, None)
    if kind == "boolean":
        return (True, word.lower() == "true") if word.lower() in ("true", "false") else (False, None)
    if kind == "null":
        return (True, None) if word.lower() in ("null", "none") else (False, None)
    try:
        value = json.loads(word)
    except ValueError:
        return False, None
    wanted = {"number": (int, float), "object": dict, "array": list}.get(kind)
    if wanted is None or isinstance(value, bool) or not isinstance(value, wanted):
        return False, None
    return True, value


def convert(text: str, schema: Any) -> Any:
    """An XML parameter's text as the JSON value its schema's type asks for.

    ``"5"`` becomes 5 for an ``integer``, ``5.0`` for ``number`` keeps its JSON reading, ``true`` /
    ``false`` become booleans, ``object`` / ``array`` values are read as JSON; a ``string`` stays the
    text (even ``"5"``). A type list or ``anyOf`` is tried in order; a schema naming no type reads the
    text as JSON when it is JSON, else keeps it. Text that fits none of the types stays text (logged).
    """
    kinds = _types(schema)
    if not kinds:
        ok, value = _as("object", text)
        for kind in ("integer", "number", "boolean", "null", "array"):
            if not ok:
                ok, value = _as(kind, text)
        return value if ok else text
    for kind in kinds:
        ok, value = _as(kind, text)
        if ok:
            return value
    log.warning("tool-call parameter %r is not of type %s: kept as text", text[:80], "/".join(kinds))
    return text


def _strip_newline(text: str) -> str:
    """The value between ``<parameter=...>`` and ``</parameter>``: the template's one newline each side removed."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


class CallReader:
    """Reads one complete ``<tool_call>`` block's inside into a :class:`ToolCall`.

    Args:
        tools: the offered tools' ``function`` objects by name (``name``, ``parameters``).
        fmt: "xml" or "json" (:func:`call_format`).
    """

    def __init__(self, tools: Mapping[str, Mapping[str, Any]], fmt: str) -> None:
        self.tools, self.fmt = tools, fmt

    def read(self, inside: str) -> ToolCall | None:
        """The call ``inside`` holds, or None (logged) when it does not parse or names no offered function."""
        name, arguments = self._xml(inside) if self.fmt == "xml" else self._json(inside)
        if name is None:
            log.warning("a tool call that does not parse is returned as content: %r", inside[:200])
            return None
        if name not in self.tools:
            log.warning("a call to %r, a function not offered, is returned as content", name[:100])
            return None
        return ToolCall("call_" + uuid.uuid4().hex[:24], name, json.dumps(arguments, ensure_ascii=False))

    def _xml(self, inside: str) -> tuple[str | None, dict]:
        match = _FUNCTION.fullmatch(inside)
        if match is None:
            return None, {}
        name, body = match.group(1).strip(), match.group(2)
        properties = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        end = 0
        for param in _PARAMETER.finditer(body):
            if body[end:param.start()].strip():
                return None, {}
            key = param.group(1).strip()
            arguments[key] = convert(_strip_newline(param.group(2)), properties.get(key))
            end = param.end()
        if body[end:].strip():
            return None, {}
        return name, arguments

    @staticmethod
    def _json(inside: str) -> tuple[str | None, dict]:
        try:
            call = json.loads(inside)
        except ValueError:
            return None, {}
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None, {}
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None, {}
        return (call["name"], arguments) if isinstance(arguments, dict) else (None, {})


Piece = tuple[str, Any]
"""``("reasoning", text)``, ``("content", text)`` or ``("call", ToolCall)``."""


class ToolCallStream:
    """Reads the calls out of an answer's pieces (from :class:`~engine.openai.answer.AnswerSplitter`), as they
    stream: each ``tool_call`` piece is one whole block (the engine's channels, :mod:`engine.channels`).

    A block that reads as a call becomes ``("call", ToolCall)``; one that does not, or was cut short,
    is content (logged). Whitespace right before or after a call is dropped, so content's trailing
    whitespace is held while a call may still follow; feeding an answer token by token or whole gives
    the same pieces once joined.
    """

    def __init__(self, reader: CallReader) -> None:
        self.reader = reader
        self.calls = 0
        self._ws, self._after_call = "", False

    def push(self, pieces: list[tuple[str, str]]) -> list[Piece]:
        """The pieces that ``pieces`` complete."""
        out: list[Piece] = []
        for kind, text in pieces:
            if kind == "content":
                self._content(out, text, hold_ws=True)
                continue
            call = self._read(text) if kind == "tool_call" else None
            if call is not None:
                out.append(("call", call))
                self.calls += 1
                self._ws, self._after_call = "", True
            elif kind == "tool_call":
                self._content(out, text, hold_ws=False)
            else:
                out.append((kind, text))
        return out

    def close(self) -> list[Piece]:
        """The whitespace held at the end of the content (none when a call ended the answer)."""
        out: list[Piece] = [("content", self._ws)] if self._ws and not self._after_call else []
        self._ws = ""
        return out

    def _read(self, block: str) -> ToolCall | None:
        """The call a whole ``<tool_call>`` block holds, or None (logged) when it was cut short or does not read."""
        if not (block.startswith(OPEN) and block.endswith(CLOSE)):
            log.warning("a tool call cut short is returned as content: %r", block[:200])
            return None
        return self.reader.read(block[len(OPEN):len(block) - len(CLOSE)])

    def _content(self, out: list[Piece], text: str, hold_ws: bool) -> None:
        """Send content ``text`` (after the held whitespace); whitespace right after a call is dropped,
        trailing whitespace held (``hold_ws``) while a call may still follow."""
        text, self._ws = self._ws + text, ""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if hold_ws:
            body = text.rstrip()
            text, self._ws = body, text[len(body):]
        if text:
            out.append(("content", text))
