"""The Responses API's stream: chat-completion chunks -> the Responses events (see :mod:`.responses_api`).

Event names and fields follow the OpenAI API reference ("Streaming events" of the Responses API) and
the ``openai`` SDK's event types (``openai.types.responses.ResponseStreamEvent``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .requests import APIError
from .responses_api import Shell, call_item, message_item, new_id, reasoning_item, status_of, usage_of


class ResponseEvents:
    """Chat-completion chunks -> the Responses stream events, in the OpenAI order: ``response.created``,
    ``response.in_progress``, then per output item ``response.output_item.added``, its content part's
    ``added``/deltas/``done`` (``output_text`` or ``reasoning_text``; ``function_call_arguments`` for a
    call), ``response.output_item.done``, and last ``response.completed`` (or ``response.incomplete``
    at ``max_output_tokens``, ``response.failed`` on an error). Each event carries ``sequence_number``.
    """

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}
        self.finish: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        """The stream's opening events: ``response.created`` and ``response.in_progress``."""
        head = self.shell.response("in_progress", [])
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _begin(self, item: dict) -> list[dict]:
        out = self._close()
        self.output.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item=json.loads(json.dumps(item))))
        if item["type"] != "function_call":
            part = {"type": item["content"][0]["type"], "text": ""}
            if part["type"] == "output_text":
                part["annotations"] = []
            out.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _close(self) -> list[dict]:
        item, out = self.open, []
        if item is None:
            return out
        item["status"] = "completed"
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **self._where(),
                                   name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if part["type"] == "output_text" else "response.reasoning_text.done"
            extra = {"logprobs": []} if part["type"] == "output_text" else {}
            out.append(self._event(kind, **self._where(), content_index=0, text=part["text"], **extra))
            out.append(self._event("response.content_part.done", **self._where(), content_index=0, part=part))
        out.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        self.open = None
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            item = reasoning_item("", status="in_progress") if kind == "reasoning" else message_item(
                "", status="in_progress")
            out += self._begin(item)
        part = self.open["content"][0]
        part["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(name, **self._where(), content_index=0, delta=text, **extra))
        return out

    def _call(self, piece: Mapping[str, Any]) -> list[dict]:
        out: list[dict] = []
        function = piece.get("function") or {}
        index = piece.get("index", 0)
        if index not in self.calls:
            call = {"id": piece.get("id") or new_id("call"), "function": {"name": function.get("name") or "",
                                                                            "arguments": ""}}
            self.calls[index] = call_item(call, status="in_progress")
            out += self._begin(self.calls[index])
        item = self.calls[index]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=function["arguments"]))
        return out

    def feed(self, chunk: Mapping[str, Any]) -> list[dict]:
        """The events one chat.completion.chunk makes (none for the role chunk)."""
        if chunk.get("usage"):
            self.usage = usage_of(chunk["usage"])
        out: list[dict] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for piece in delta.get("tool_calls") or ():
                out += self._call(piece)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> tuple[list[dict], dict[str, Any]]:
        """The closing events and the finished response object."""
        out = self._close()
        if not self.output:
            out += self._begin(message_item("", status="in_progress")) + self._close()
        status = status_of(self.finish)
        response = self.shell.response(status, self.output, self.usage)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self._event(kind, response=response)], response

    def fail(self, error: APIError) -> list[dict]:
        """The closing events of a stream that failed (``response.failed`` with the error)."""
        out = self._close()
        failed = self.shell.response("failed", self.output, self.usage,
                                     {"code": error.code or error.type, "message": error.message})
        return out + [self._event("response.failed", response=failed)]
