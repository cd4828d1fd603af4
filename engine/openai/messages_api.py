"""The Anthropic Messages API (``POST /v1/messages``) as a translation onto chat completions.

A Messages request becomes a chat-completions body (:func:`chat_body`), which the server runs as any
chat turn; the chat.completion object becomes a message object (:func:`message_object`) and the
streamed chunks become Anthropic's events (:class:`MessageEvents`). Shapes follow the Anthropic API
reference (https://docs.anthropic.com/en/api/messages, .../messages-streaming) and the ``anthropic``
SDK's types. Usage follows Anthropic's split: ``input_tokens`` are the prompt tokens read this turn,
``cache_read_input_tokens`` those resumed from a prefix snapshot (their sum is the prompt).
A thinking block's ``signature`` is a SHA-256 digest of its text, not an attestation; thinking blocks
sent back are passed to the chat template as the assistant's reasoning whatever their signature.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from .requests import APIError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error", 529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
SAMPLING = ("temperature", "top_p", "top_k")
THINKING = ("enabled", "adaptive", "between_tools", "disabled")
REFUSED = ("mcp_servers", "container")
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
CHAT_FIELDS = ((re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
               (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
               (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
               (re.compile(r"^tool_choice\.function"), "tool_choice"))
"""The chat-completions fields a translated request's errors name, as the Messages fields they came from."""


def error_body(error: APIError) -> dict[str, Any]:
    """An :class:`APIError` in Anthropic's error shape ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An image block (base64 source) as a chat ``image_url`` part with a data: URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind != "base64":
        raise _bad(f"{where}.source: only base64 image sources are accepted (got {kind!r}); this server fetches "
                   "no URLs: send the image's bytes as {type: base64, media_type, data}", where + ".source")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise _bad(f"{where}.source needs a string media_type and data", where + ".source")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _block(block: Any, where: str, images: bool = True) -> dict[str, Any]:
    """A text (or image) block as a chat content part."""
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return {"type": "text", "text": block["text"]}
    if kind == "image" and images:
        return _image(block, where)
    raise _bad(f"{where}: expected a text{' or image' if images else ''} block, got {kind!r}", where)


def _parts(content: Any, where: str, images: bool = True) -> list[dict]:
    """Text (and image) blocks, or a plain string, as chat content parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content blocks", where)
    return [_block(block, f"{where}[{k}]", images) for k, block in enumerate(content)]


def _plain(parts: list[dict]) -> str | list[dict]:
    """Parts that are all text as one string (what the chat template shows most simply)."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id must be the id of a tool_use block", where + ".tool_use_id")
    content = block.get("content", "")
    parts = _parts(content, where + ".content") if content else []
    if block.get("is_error"):
        parts = [{"type": "text", "text": "Error: "}] + parts
    return {"role": "tool", "tool_call_id": call_id, "content": _plain(parts)}


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, Mapping):
        raise _bad(f"{where}: a tool_use block needs a string id and name and an object input", where)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user(content: Any, where: str, called: set[str]) -> list[dict]:
    """A user message: its tool results as ``tool`` messages first, then the rest as one user message; a
    result must answer one of the ``called`` tool_use ids."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad(f"{where} must be a string or a non-empty list of content blocks", where)
    results, rest = [], []
    for k, block in enumerate(content):
        if isinstance(block, Mapping) and block.get("type") == "tool_result":
            results.append(_tool_result(block, f"{where}[{k}]"))
            if results[-1]["tool_call_id"] not in called:
                raise _bad(f"{where}[{k}].tool_use_id {results[-1]['tool_call_id'][:100]!r} answers no tool_use block "
                           "of an earlier assistant message", f"{where}[{k}].tool_use_id")
        else:
            rest.append(_block(block, f"{where}[{k}]"))
    return results + ([{"role": "user", "content": _plain(rest)}] if rest else [])


def _assistant(content: Any, where: str) -> dict[str, Any]:
    """An assistant message: text, ``thinking`` as reasoning, ``tool_use`` blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content blocks", where)
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for k, block in enumerate(content):
        at = f"{where}[{k}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            message["content"] += block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            message.setdefault("tool_calls", []).append(_tool_use(block, at))
        else:
            raise _bad(f"{at}: an assistant block must be text, thinking or tool_use, got {kind!r}", at)
    return message


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict] = []
    called: set[str] = set()
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, Mapping) else None
        if role == "user":
            out += _user(m.get("content"), where + ".content", called)
        elif role == "assistant":
            out.append(_assistant(m.get("content"), where + ".content"))
            called.update(call["id"] for call in out[-1].get("tool_calls", ()))
        else:
            raise _bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", where + ".role")
    if out[-1]["role"] == "assistant":
        last = f"messages[{len(value) - 1}]"
        raise _bad(f"{last}: a conversation ending with an assistant message (a prefilled answer to continue) is "
                   "not supported: the model would start a new answer after it; end with a user message", last)
    return out


def _system(value: Any) -> str:
    return "\n".join(p["text"] for p in _parts(value, "system", images=False))


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _bad("tools must be a list of {name, description, input_schema}", "tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") not in (None, "custom") or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise _bad(f"{where}: only client tools with an input_schema are supported (got type {kind!r}); "
                       "server tools run on Anthropic's side", where)
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    kind = value.get("type") if isinstance(value, Mapping) else None
    choices = {"auto": "auto", "any": "required", "none": "none"}
    if kind in choices:
        chat["tool_choice"] = choices[kind]
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": value.get("name")}}
    else:
        raise _bad(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")
    if value.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _thinking(value: Any) -> bool:
    """Whether ``thinking`` turns thinking on: ``enabled`` (its ``budget_tokens`` checked), ``adaptive`` and
    ``between_tools`` (this model thinks before each answer, tool calls included) do; ``disabled`` does not."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind not in THINKING:
        raise _bad(f"thinking.type must be one of {', '.join(THINKING)}, got {kind!r}", "thinking.type")
    budget = value.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise _bad(f"thinking.budget_tokens must be a positive integer, got {budget!r}", "thinking.budget_tokens")
    return kind != "disabled"


def _output_config(value: Any, chat: dict[str, Any]) -> None:
    """``output_config``: ``format`` (a JSON schema) as the chat ``response_format``; ``effort``, when no
    ``thinking`` is given (which then decides), as ``reasoning_effort`` (``xhigh`` and ``max`` as ``high``:
    the template's thinking is on or off, with no levels in between)."""
    if not isinstance(value, Mapping):
        raise _bad("output_config must be an object", "output_config")
    fmt = value.get("format")
    if fmt is not None:
        if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"),
                                                                                               Mapping):
            raise _bad("output_config.format must be {type: json_schema, schema: {...}}", "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                                          "strict": True}}
    effort = value.get("effort")
    if effort is not None and effort not in EFFORT:
        raise _bad(f"output_config.effort must be one of {', '.join(EFFORT)}, got {effort!r}", "output_config.effort")
    if effort is not None and "chat_template_kwargs" not in chat:
        chat["reasoning_effort"] = EFFORT[effort]


def chat_body(body: Any) -> dict[str, Any]:  # noqa: C901
    """A Messages request as a chat-completions body.

    ``max_tokens`` is required (as in Anthropic's API); ``thinking`` turns the template's thinking on
    (its ``budget_tokens`` is checked, not enforced: the answer as a whole stops at ``max_tokens``);
    ``temperature``, ``top_p`` and ``top_k`` are passed on (newer ``anthropic`` SDKs send them through
    ``extra_body``).

    Raises:
        APIError: a missing or bad field (400, naming it).
    """
    if not isinstance(body, Mapping):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for name in REFUSED:
        if body.get(name):
            raise _bad(f"{name} is not supported by this server (its tools run on Anthropic's side)", name)
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise _bad("max_tokens: Field required (a positive integer)" if limit is None
                   else f"max_tokens must be a positive integer, got {limit!r}", "max_tokens")
    chat: dict[str, Any] = {"model": body.get("model"), "max_tokens": limit,
                            "messages": _messages(body.get("messages"))}
    if body.get("system"):
        chat["messages"].insert(0, {"role": "system", "content": _system(body["system"])})
    chat.update({name: body[name] for name in SAMPLING if body.get(name) is not None})
    stop = body.get("stop_sequences")
    if stop:
        chat["stop"] = stop
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": _thinking(body["thinking"])}
    if body.get("output_config") is not None:
        _output_config(body["output_config"], chat)
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]          # the chat route refuses a value other than true / false
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    return chat


def _signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


def usage_of(chat_usage: Mapping[str, Any] | None) -> dict[str, int]:
    """A chat ``usage`` in Anthropic's split (prompt = ``input_tokens`` + ``cache_read_input_tokens``)."""
    usage = chat_usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "output_tokens": usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's JSON arguments as a tool_use block's ``input`` object.

    Raises:
        APIError: the arguments are not a JSON object (500: the chat turn promised a parsed call).
    """
    try:
        value = json.loads(arguments or "{}")
    except ValueError as exc:
        raise APIError(500, f"a tool call's arguments are not JSON: {exc}", type="server_error") from exc
    if not isinstance(value, dict):
        raise APIError(500, f"a tool call's arguments are not a JSON object: {arguments!r}", type="server_error")
    return value


def stop_of(choice: Mapping[str, Any], stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice: the matched stop string is the choice's
    ``stop_reason`` (vLLM's field), one of the request's ``stop_sequences``."""
    matched = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def message_object(completion: Mapping[str, Any], stops: tuple[str, ...] = ()) -> dict[str, Any]:
    """A chat.completion object as an Anthropic message object."""
    choice = completion["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": _signature(message["reasoning_content"])})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    reason, sequence = stop_of(choice, stops)
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": completion["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_of(completion.get("usage"))}


class MessageEvents:
    """Chat-completion chunks -> Anthropic's stream events: ``message_start``, ``ping``, per content
    block ``content_block_start`` / ``content_block_delta`` (``thinking_delta`` then a ``signature_delta``,
    ``text_delta``, ``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason
    and usage) and ``message_stop``; an error mid-stream is an ``error`` event. Tool calls are expected
    one after another (a call's pieces end before the next call's start), as the chat stream sends them.
    """

    def __init__(self, model: str, stops: tuple[str, ...] = ()) -> None:
        self.model, self.stops = model, stops
        self.index = -1
        self.open: dict | None = None
        self.calls: dict[int, int] = {}
        self.choice: dict[str, Any] = {}
        self.usage: dict | None = None

    def start(self) -> list[dict]:
        """The stream's opening events: ``message_start`` with an empty assistant message."""
        message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage_of(None)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _begin(self, block: dict) -> list[dict]:
        out = self._close()
        self.index += 1
        self.open = dict(block)
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        out = []
        if self.open["type"] == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature(self.open["thinking"])}))
        self.open = None
        return out + [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _text(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            out += self._begin({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                               else {"type": "text", "text": ""})
        self.open[kind if kind == "thinking" else "text"] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        return out + [self._delta(delta)]

    def _call(self, piece: Mapping[str, Any]) -> list[dict]:
        out: list[dict] = []
        function = piece.get("function") or {}
        if piece.get("index", 0) not in self.calls:
            out += self._begin({"type": "tool_use", "id": piece.get("id") or "toolu_" + uuid.uuid4().hex,
                                "name": function.get("name") or "", "input": {}})
            self.calls[piece.get("index", 0)] = self.index
        if function.get("arguments"):
            out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def feed(self, chunk: Mapping[str, Any]) -> list[dict]:
        """The events one chat.completion.chunk makes (none for the role chunk)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("text", delta["content"])
            for piece in delta.get("tool_calls") or ():
                out += self._call(piece)
            if choice.get("finish_reason"):
                self.choice = dict(choice)
        return out

    def end(self) -> list[dict]:
        """The closing events: the open block's stop, ``message_delta`` with the stop reason and the usage
        (all of it: the prompt's count is known only once the turn has run), ``message_stop``."""
        reason, sequence = stop_of(self.choice, self.stops)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": usage_of(self.usage)},
            {"type": "message_stop"}]

    def fail(self, error: APIError) -> list[dict]:
        """The event of a stream that failed."""
        return [error_body(error)]
