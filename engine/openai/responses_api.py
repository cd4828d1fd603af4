"""The OpenAI Responses API (``POST /v1/responses``) as a translation onto chat completions.

A Responses request becomes a chat-completions body (:func:`chat_body`), which the server runs as any
chat turn; the chat.completion object becomes a response object (:func:`response_object`) and the
streamed chunks become the Responses events (:mod:`.responses_stream`). Field names, item shapes and
the event sequence follow the OpenAI API reference (https://platform.openai.com/docs/api-reference/responses)
and the ``openai`` SDK's types (``openai.types.responses``). ``previous_response_id`` names a response
kept by :class:`ResponseStore` (this server's lifetime, least recently used dropped first): its input
and output are the conversation the new input continues; its ``instructions`` and ``tools`` are not
carried over, as in the OpenAI API.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .requests import APIError

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "parallel_tool_calls")
"""Fields passed on to the chat body as they are (the last five are extensions, as llama.cpp's server takes)."""
REFUSED = {"background": False, "conversation": None, "prompt": None, "top_logprobs": 0}
"""Fields this server cannot honour, refused unless set to their harmless value (or null)."""
ROLES = ("user", "system", "developer", "assistant")
CHAT_FIELDS = ((re.compile(r"^response_format\.json_schema"), "text.format"),
               (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
               (re.compile(r"^tool_choice\.function"), "tool_choice"))
"""The chat-completions fields a translated request's errors name, as the Responses fields they came from."""


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _text_of(parts: Any, param: str, kinds: tuple[str, ...]) -> str:
    """The text of a list of ``{type: input_text|output_text, text}`` parts, or of a plain string."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(f"{param} must be a string or a list of text parts", param)
    texts = []
    for k, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{k}] must be a text part ({' or '.join(kinds)} with a string 'text')",
                       f"{param}[{k}]")
        texts.append(part["text"])
    return "".join(texts)


def _content(content: Any, param: str) -> str | list[dict]:
    """A message item's content as chat-completions content (text and ``image_url`` parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of content parts", param)
    parts: list[dict] = []
    for k, part in enumerate(content):
        where = f"{param}[{k}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise _bad(f"{where}.text must be a string", where + ".text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise _bad(f"{where}: an input_image needs 'image_url' (a data: URL); file_id is not supported",
                           where + ".image_url")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise _bad(f"{where}: part type {kind!r} is not supported (expected input_text, output_text or "
                       "input_image)", where)
    return parts


class _Conversation:
    """Chat messages built from Responses input items, in order."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages = messages
        self.reasoning: str | None = None
        self.called = {call["id"] for m in messages for call in m.get("tool_calls", ())}

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, Mapping):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{where}.call_id must be the call_id of a function_call", where + ".call_id")
            if call_id not in self.called:
                raise _bad(f"{where}.call_id {call_id[:100]!r} answers no function_call before it (in the input or "
                           "the previous response)", where + ".call_id")
            output = _text_of(item.get("output"), where + ".output", ("input_text", "output_text"))
            self.reasoning = None
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            texts = [p.get("text") for p in (item.get("content") or item.get("summary") or [])
                     if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
            self.reasoning = "".join(texts) or None
        else:
            raise _bad(f"{where}: input item type {kind!r} is not supported (expected message, function_call, "
                       "function_call_output or reasoning)", where + ".type")

    def _message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", where + ".role")
        message: dict[str, Any] = {"role": role, "content": _content(item.get("content"), where + ".content")}
        self._take_reasoning(message)
        self.messages.append(message)

    def _call(self, item: Mapping[str, Any], where: str) -> None:
        name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "")
        if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
            raise _bad(f"{where}: a function_call needs a string 'name' and 'call_id'", where)
        if not isinstance(arguments, str):
            raise _bad(f"{where}.arguments must be a JSON string", where + ".arguments")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        self.called.add(call_id)
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.reasoning is None:
            last.setdefault("tool_calls", []).append(call)
            return
        message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        self._take_reasoning(message)
        self.messages.append(message)

    def _take_reasoning(self, message: dict[str, Any]) -> None:
        """Give ``message`` the reasoning item before it when it is the assistant's (a reasoning item
        followed by anything else belongs to no answer and is dropped)."""
        if self.reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = self.reasoning
        self.reasoning = None


def input_messages(value: Any, before: list[dict] | None = None) -> list[dict]:
    """The request's ``input`` (a string, or a list of items) as chat messages, after the conversation
    ``before`` (a previous response's, whose calls its ``function_call_output`` items may answer).

    Raises:
        APIError: an item of an unknown type or with a bad field (400, naming ``input[i]...``).
    """
    if isinstance(value, str):
        return list(before or ()) + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a non-empty list of input items", "input")
    conversation = _Conversation(list(before or ()))
    for i, item in enumerate(value):
        conversation.add(item, f"input[{i}]")
    return conversation.messages


def _tools(value: Any) -> list[dict]:
    """Responses' flat function tools (``{type, name, description, parameters, strict}``) in the chat shape."""
    if not isinstance(value, list):
        raise _bad("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise _bad(f"tools[{i}]: only function tools are supported here, got {kind!r}", f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                            "strict") if k in tool}})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, Mapping) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if isinstance(value, str) or value is None:
        return value
    raise _bad(f"tool_choice must be 'auto', 'none', 'required' or {{type: function, name}}, got {value!r}",
               "tool_choice")


def _text_format(text: Any) -> dict | None:
    """``text.format`` as a chat ``response_format`` (None for plain text)."""
    if text is not None and not isinstance(text, Mapping):
        raise _bad("text must be an object ({format: {...}})", "text")
    fmt = text.get("format") if text is not None else None
    if fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_object", "json_schema"):
        raise _bad(f"text.format must be text, json_object or json_schema, got {fmt!r}", "text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def chat_body(body: Any, store: ResponseStore) -> dict[str, Any]:  # noqa: C901
    """A Responses request as a chat-completions body (``stream_options.include_usage`` on when streamed).

    Raises:
        APIError: a bad or unsupported field (400), or a ``previous_response_id`` this server does not
            hold (400, code ``previous_response_not_found``).
    """
    if not isinstance(body, Mapping):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, harmless in REFUSED.items():
        if body.get(name) not in (None, harmless):
            raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _bad(f"include must be a list of strings, got {include!r}", "include")
    if "message.output_text.logprobs" in include:
        raise _bad("include: message.output_text.logprobs is not supported by this server (the chat completions "
                   "route returns logprobs)", "include", "unsupported_parameter")
    messages = store.conversation(body["previous_response_id"]) if body.get("previous_response_id") else []
    messages = input_messages(body.get("input"), messages)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if instructions:
        chat["messages"] = [{"role": "system", "content": instructions}] + messages
    chat.update({name: body[name] for name in SAMPLING if body.get(name) is not None})
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise _bad(f"max_output_tokens must be a positive integer, got {limit!r}", "max_output_tokens")
    if limit is not None:
        chat["max_completion_tokens"] = limit
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if (response_format := _text_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise _bad("reasoning must be an object ({effort, summary})", "reasoning")
    if reasoning and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = "high" if reasoning["effort"] == "xhigh" else reasoning["effort"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]          # the chat route refuses a value other than true / false
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    return chat


def new_id(prefix: str) -> str:
    """A fresh Responses API object id: ``prefix`` + ``_`` + 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A chat ``usage`` object in the Responses shape (``input_tokens``, ``output_tokens``, details):
    ``cached_tokens`` are the prompt tokens resumed from a prefix snapshot; ``cache_write_tokens`` (explicit
    cache writes, billed apart by OpenAI) is 0, the snapshot cache being implicit."""
    if not chat_usage:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item holding ``text``."""
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: Mapping[str, Any], item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` output item for one chat-completions tool call."""
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def output_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat ``message`` as Responses output items: reasoning, the message's text, one ``function_call``
    per tool call, each when there is one (an empty message when there is none of them)."""
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content"):
        items.append(message_item(message["content"]))
    items += [call_item(call) for call in message.get("tool_calls") or ()]
    return items or [message_item("")]


class Shell:
    """What a response object repeats of its request (echoed fields), its id and creation time."""

    def __init__(self, body: Mapping[str, Any], chat: Mapping[str, Any]) -> None:
        self.id, self.created_at = new_id("resp"), int(time.time())
        text = body.get("text") if isinstance(body.get("text"), Mapping) else {}
        reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), Mapping) else {}
        self.fields = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": chat.get("model"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": None}, "store": body.get("store", True),
            "temperature": body.get("temperature"), "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p"), "truncation": "disabled", "metadata": body.get("metadata") or {},
            "user": None}

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict[str, Any]:
        """The response object; ``status`` "incomplete" means the answer reached ``max_output_tokens``."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, **self.fields, "output": output, "usage": usage}


def status_of(finish_reason: str | None) -> str:
    """A response's status for a chat finish reason: a length stop is "incomplete"."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(shell: Shell, completion: Mapping[str, Any]) -> dict[str, Any]:
    """A chat.completion object as the response object."""
    choice = completion["choices"][0]
    return shell.response(status_of(choice.get("finish_reason")), output_items(choice["message"]),
                          usage_of(completion.get("usage")))


def assistant_message(output: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Output items back as the chat assistant message they came from (for :class:`ResponseStore`)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return message


class ResponseStore:
    """The conversations of recent responses, for ``previous_response_id``: at most ``max_responses`` and
    about ``max_bytes`` of JSON in all, the least recently used dropped first; thread-safe.

    A response's conversation is its chat messages without the system message of its ``instructions``
    (the next request sends its own), its answer included.
    """

    def __init__(self, max_responses: int = 256, max_bytes: int = 256 << 20) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        """Keep ``messages`` (as JSON text: a copy no caller can change) under ``response_id``."""
        text = json.dumps(messages, ensure_ascii=False)
        with self._lock:
            self._items[response_id] = text
            self._bytes += len(text)
            while self._items and (len(self._items) > self.max_responses or self._bytes > self.max_bytes):
                self._bytes -= len(self._items.popitem(last=False)[1])

    def conversation(self, response_id: Any) -> list[dict]:
        """A copy of the conversation of ``response_id``.

        Raises:
            APIError: no such response is held (never made, not stored, or dropped) (400).
        """
        with self._lock:
            held = self._items.get(response_id) if isinstance(response_id, str) else None
            if held is None:
                raise _bad(f"Previous response with id {response_id!r} not found (responses are kept in memory "
                           f"while the server runs: the {self.max_responses} most recently used, "
                           f"{self.max_bytes >> 20} MiB of conversation at most)",
                           "previous_response_id", "previous_response_not_found")
            self._items.move_to_end(response_id)
            return json.loads(held)

    def keep(self, chat: Mapping[str, Any], response: Mapping[str, Any]) -> None:
        """Keep ``response`` (when its request did not say ``store: false``) with the conversation of ``chat``."""
        if response.get("store") is False:
            return
        messages = list(chat["messages"])
        if response.get("instructions") and messages and messages[0]["role"] == "system":
            messages = messages[1:]
        self.put(response["id"], messages + [assistant_message(response["output"])])

