"""One request's answer as OpenAI objects: each choice's token events become message / delta pieces.

A :class:`Choice` takes one choice's :class:`~engine.events.TokenEvent` stream and returns, per token,
the pieces ready to send (reasoning and content text, tool calls); at the end it knows its whole
message and finish reason. An :class:`Answer` builds the chat.completion / text_completion object and
its chunk objects (OpenAI API reference: "The chat completion object", "The chat completion chunk
object", "The completion object") for all ``n`` choices of one request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.events import TokenEvent, TurnSummary
from .answer import AnswerSplitter
from .requests import TurnRequest
from .tool_calls import CallReader, Piece, ToolCall, ToolCallStream

FINISH = {"eos": "stop", "max_tokens": "length", "context_full": "length"}


class Choice:
    """One choice's answer, built from its token events.

    Args:
        index: the choice's index in ``choices``.
        req: the checked request (thinking, stop strings, chat or raw completion).
        reader: reads tool calls out of the answer (tools offered and ``tool_choice`` not "none"), or None.
        token_bytes: a token id's bytes (``Engine.token_bytes``), for logprobs.
    """

    def __init__(self, index: int, req: TurnRequest, reader: CallReader | None = None,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.index = index
        self.chat = req.messages is not None
        self.want_logprobs = req.sampling.top_logprobs is not None
        self.token_bytes = token_bytes
        self.logprobs: list[tuple[TokenEvent, int]] = []   # (token, its text's offset in the answer)
        self.pending = 0          # logprobs not yet sent in a chunk
        self.offset = 0
        self.splitter = AnswerSplitter(req.stop, raw=not self.chat)
        self.calls_stream = ToolCallStream(reader) if reader is not None else None
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.calls: list[ToolCall] = []
        self.summary: TurnSummary | None = None

    @property
    def stopped(self) -> bool:
        """A stop string ended the answer: the engine should stop this choice."""
        return self.splitter.stopped

    def push(self, event: TokenEvent) -> list[Piece]:
        """The pieces this token completes: ``("reasoning" | "content", text)`` or ``("call", ToolCall)``."""
        if event.logprob is not None:
            self.logprobs.append((event, self.offset))
            self.pending += 1
        self.offset += len(event.text)
        pieces = self.splitter.push(self._parts(event.text, event.parts))
        return self._keep(pieces if self.calls_stream is None else self.calls_stream.push(pieces))

    def close(self, summary: TurnSummary) -> list[Piece]:
        """The pieces held back until the end of the answer (a raw completion's: the summary's text past what its
        tokens carried, the bytes of a character the token limit cut, as U+FFFD)."""
        self.summary = summary
        held = summary.text[self.offset:] if not self.chat else ""    # the tokenizer stream's final flush
        pieces = self.splitter.push(self._parts(held, summary.parts)) + self.splitter.close()
        if self.calls_stream is None:
            return self._keep(pieces)
        return self._keep(self.calls_stream.push(pieces) + self.calls_stream.close())

    def _parts(self, text: str, parts: tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...]:
        """The engine's channels as this answer sends them: a raw completion's ``text`` is all content (held
        parts are in it already); a chat answer's tool-call text is content when no tools are read."""
        if not self.chat:
            return (("content", text),) if text else ()
        if self.calls_stream is None:
            return tuple(("content" if channel == "tool_call" else channel, piece) for channel, piece in parts or ())
        return parts or ()

    def _keep(self, pieces: list[Piece]) -> list[Piece]:
        for kind, value in pieces:
            if kind == "call":
                self.calls.append(value)
            else:
                self.parts[kind].append(value)
        return pieces

    @property
    def finish_reason(self) -> str:
        """The OpenAI finish reason: "stop", "length" or "tool_calls" (only after ``close()``)."""
        assert self.summary is not None, "finish_reason before close()"
        if self.splitter.stopped:
            return "stop"
        reason = FINISH.get(self.summary.stop_reason, "stop")
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The whole chat message: ``role``, ``content`` (None when the model only called tools),
        ``reasoning_content`` when the model thought, ``tool_calls`` when it called."""
        content = "".join(self.parts["content"])
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if self.calls else "")}
        if self.parts["reasoning"]:
            message["reasoning_content"] = "".join(self.parts["reasoning"])
        if self.calls:
            message["tool_calls"] = [call.openai() for call in self.calls]
        return message

    def stop_reason(self) -> dict[str, Any]:
        """``{"stop_reason": the stop string that ended the answer}`` (vLLM's field), or {} when none did."""
        matched = self.splitter.stop_string
        return {} if matched is None else {"stop_reason": matched}

    def whole(self) -> dict[str, Any]:
        """The choice of the non-streamed object (chat: ``message``; completion: ``text``)."""
        logprobs = self.logprobs_of(self.logprobs)
        if self.chat:
            return {"index": self.index, "message": self.message(), "logprobs": logprobs,
                    "finish_reason": self.finish_reason} | self.stop_reason()
        return {"index": self.index, "text": "".join(self.parts["content"]), "logprobs": logprobs,
                "finish_reason": self.finish_reason}

    def take_logprobs(self) -> dict[str, Any] | None:
        """The logprobs of the tokens not yet sent (for the next chunk), or None when not asked for."""
        tokens = self.logprobs[len(self.logprobs) - self.pending:]
        self.pending = 0
        return self.logprobs_of(tokens)

    def _token(self, token_id: int) -> tuple[str, bytes]:
        data = self.token_bytes(token_id) if self.token_bytes is not None else b""
        return data.decode("utf-8", errors="replace"), data

    def logprobs_of(self, tokens: list[tuple[TokenEvent, int]]) -> dict[str, Any] | None:
        """OpenAI's logprobs object of ``tokens``: chat ``{"content": [{token, logprob, bytes, top_logprobs}],
        "refusal": None}``; completion ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
        if not self.want_logprobs:
            return None
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                text, data = self._token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(data)}
            return {"content": [entry(e.token_id, e.logprob)
                                | {"top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs]}
                                for e, _ in tokens], "refusal": None}
        return {"tokens": [self._token(e.token_id)[0] for e, _ in tokens],
                "token_logprobs": [e.logprob for e, _ in tokens],
                "top_logprobs": [{self._token(t)[0]: lp for t, lp in e.top_logprobs} for e, _ in tokens],
                "text_offset": [offset for _, offset in tokens]}

    def deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        """The chat deltas of ``pieces``: text as ``reasoning_content`` / ``content``; a call as two
        ``tool_calls`` deltas, its index, id, type and name first, then its arguments."""
        out: list[dict[str, Any]] = []
        for kind, value in pieces:
            if kind != "call":
                out.append({"reasoning_content" if kind == "reasoning" else "content": value})
                continue
            index = self.calls.index(value)
            out.append({"tool_calls": [{"index": index, "id": value.id, "type": "function",
                                        "function": {"name": value.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": value.arguments}}]})
        return out


def usage(summaries: list[TurnSummary]) -> dict[str, Any]:
    """The usage of ``n`` choices of one prompt: the prompt counted once (the first choice's prefill;
    the later choices resume the whole prompt from its snapshot), the answers' tokens summed."""
    first = summaries[0]
    completion = sum(s.generated_tokens for s in summaries)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.reused_tokens}}


class Answer:
    """The objects of one request's answer: the id, creation time and model they share."""

    def __init__(self, req: TurnRequest) -> None:
        self.req = req
        self.chat = req.messages is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if self.chat else "text_completion"

    def head(self, kind: str) -> dict[str, Any]:
        """The fields every chunk or completion object of this choice starts with."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    def chunk(self, choice: Choice, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        """A chunk object carrying ``delta`` (chat) or its ``content`` text (completion) for ``choice``, with
        the logprobs of the tokens read since the last chunk (when asked for)."""
        logprobs = choice.take_logprobs()
        if self.chat:
            body = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                body |= choice.stop_reason()
        else:
            body = {"index": choice.index, "text": delta.get("content", ""), "logprobs": logprobs,
                    "finish_reason": finish}
        out = self.head(self.kind) | {"choices": [body]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self, choice: Choice) -> dict[str, Any]:
        """The chat stream's first chunk of a choice: the assistant role and empty content."""
        return self.chunk(choice, {"role": "assistant", "content": ""})

    def usage_chunk(self, summaries: list[TurnSummary]) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self.head(self.kind) | {"choices": [], "usage": usage(summaries)}

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed chat.completion / text_completion object."""
        kind = "chat.completion" if self.chat else "text_completion"
        summaries = [c.summary for c in choices if c.summary is not None]
        return self.head(kind) | {"choices": [c.whole() for c in choices], "usage": usage(summaries)}
