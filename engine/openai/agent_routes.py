"""The routes agents use besides chat completions: ``POST /v1/responses`` (OpenAI Responses),
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic Messages), and ``GET /metrics``.

Each Responses or Messages request is translated into a chat-completions body and run as a chat turn
(``_Routes.chat`` / ``_Routes.chat_chunks`` of :mod:`engine.openai.app`: same queue, engine session,
snapshot cache and cancellation); the answer is translated back (:mod:`.responses_api`,
:mod:`.messages_api`). Errors of the Messages routes come in Anthropic's shape, and those routes take
the API key as ``x-api-key`` (Anthropic's header) as well as ``Authorization: Bearer``. ``/metrics``
needs the API key like ``/v1`` (its counts and timings describe the use of the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .transport import ClientGone, authorize, error_of, event_stream, read_json
from . import messages_api, responses_api, responses_stream
from .requests import APIError

RESPONSES_STORE = 256
"""Responses kept for ``previous_response_id`` (least recently used dropped first)."""


def _named(event: Mapping[str, Any]) -> str:
    """One server-sent event named by its ``type`` (``event: NAME`` then ``data: JSON``)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _frames(events: list[dict]) -> str:
    return "".join(_named(e) for e in events)


async def _translated(chunks: AsyncIterator[dict], translator: Any) -> AsyncIterator[dict]:
    """``translator``'s events for a chat chunk stream: its first chunk is awaited before anything is
    yielded (so that a bad request raises before the response starts), then ``start()``, ``feed()``
    per chunk and ``end()``; ``chunks`` is closed when this iterator is."""
    async with contextlib.aclosing(chunks):
        first = await chunks.__anext__()
        for event in translator.start() + translator.feed(first):
            yield event
        async for chunk in chunks:
            for event in translator.feed(chunk):
                yield event
    for event in translator.end():
        yield event


def _in_client_terms(exc: APIError, renames: Sequence[tuple[re.Pattern[str], str]]) -> APIError:
    """``exc`` with its ``param``, and that name in its message, as the field the client sent.

    A translated request's errors from the chat turn name chat-completions fields
    (``tools[0].function.parameters``); ``renames`` (``messages_api.CHAT_FIELDS``,
    ``responses_api.CHAT_FIELDS``) maps such a prefix onto the client API's field (``tools[0].input_schema``).
    """
    for pattern, field in renames:
        renamed, found = pattern.subn(field, exc.param or "", count=1)
        if found:
            exc.message, exc.param = exc.message.replace(exc.param, renamed), renamed
            exc.args = (exc.message,)
            break
    return exc


class AgentRoutes:
    """The handlers of the agent routes of one application, on its chat routes ``chat``."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat
        self.store = responses_api.ResponseStore(RESPONSES_STORE)

    async def _body(self, request: Request) -> Any:
        return await read_json(request, self.chat.config.max_body_bytes)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: a response object, or its stream of events (``stream: true``)."""
        authorize(request, self.chat.key)
        body = await self._body(request)
        chat = responses_api.chat_body(body, self.store)
        shell = responses_api.Shell(body, chat)
        try:
            if not chat.get("stream"):
                response = responses_api.response_object(shell, await self.chat.chat(request, chat))
                self.store.keep(chat, response)
                return JSONResponse(response)
            events = responses_stream.ResponseEvents(shell)
            translated = _translated(self.chat.chat_chunks(request, chat), _Ending(events, self.store, chat))
            return await event_stream(translated, frame=_named, error=lambda exc: _frames(events.fail(exc)), end="")
        except APIError as exc:
            raise _in_client_terms(exc, responses_api.CHAT_FIELDS) from None

    def _authorize_anthropic(self, request: Request) -> None:
        """``x-api-key: KEY`` or ``Authorization: Bearer KEY`` when the server has a key (else 401)."""
        key, given = self.chat.key, request.headers.get("x-api-key")
        if key is None or given is None:
            authorize(request, key)
        elif not hmac.compare_digest(given.strip().encode(), key):
            raise APIError(401, "a valid API key is required: the x-api-key header does not match the server's key",
                           type="authentication_error", code="invalid_api_key")

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages``: a message object, or its stream of events; errors in Anthropic's shape."""
        try:
            self._authorize_anthropic(request)
            body = await self._body(request)
            chat = messages_api.chat_body(body)
            stops = tuple(chat.get("stop") or ())
            if not chat.get("stream"):
                return JSONResponse(messages_api.message_object(await self.chat.chat(request, chat), stops))
            events = messages_api.MessageEvents(str(chat.get("model")), stops)
            return await event_stream(_translated(self.chat.chat_chunks(request, chat), events), frame=_named,
                                           error=lambda exc: _frames(events.fail(exc)), end="")
        except APIError as exc:
            return _anthropic_error(_in_client_terms(exc, messages_api.CHAT_FIELDS))
        except ClientGone:
            raise                 # nobody to answer (the app answers 499)
        except Exception as exc:  # noqa: BLE001 - any other failure in Anthropic's shape too
            return _anthropic_error(error_of(exc))

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the rendered prompt's length (images
        encoded and counted as the model reads them); no turn is run."""
        try:
            self._authorize_anthropic(request)
            body = await self._body(request)
            chat = messages_api.chat_body(dict(body, max_tokens=1) if isinstance(body, Mapping) else body)
            req = self.chat._chat_turn(request, chat)[0]
            return JSONResponse({"input_tokens": await asyncio.to_thread(self._count, req)})
        except APIError as exc:
            return _anthropic_error(_in_client_terms(exc, messages_api.CHAT_FIELDS))
        except Exception as exc:  # noqa: BLE001 - an engine error (template, image) in Anthropic's shape
            return _anthropic_error(error_of(exc))

    def _count(self, req: Any) -> int:
        """The prompt's tokens: rendered (text only), or prepared by a job of the engine's session (images are
        encoded by the vision tower, which the session's turns use too)."""
        tools = list(req.tools) or None
        if not any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                   for m in req.messages):
            return len(self.chat.engine.render(req.messages, req.enable_thinking, tools=tools))
        prepare = self.chat.engine.prepare
        def count() -> int:
            return len(prepare(req.messages, req.enable_thinking, tools=tools).tokens)
        return self.chat.session.call(count).result()

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus text exposition of this server's metrics."""
        authorize(request, self.chat.key)
        metrics = self.chat.metrics
        return Response(metrics.text(), media_type=metrics.content_type)


class _Ending:
    """A :class:`responses_stream.ResponseEvents` whose ``end`` also keeps the finished response in ``store``."""

    def __init__(self, events: responses_stream.ResponseEvents, store: responses_api.ResponseStore,
                 chat: dict[str, Any]) -> None:
        self.events, self.store, self.chat = events, store, chat
        self.start, self.feed = events.start, events.feed

    def end(self) -> list[dict]:
        out, response = self.events.end()
        self.store.keep(self.chat, response)
        return out


def _anthropic_error(exc: APIError) -> Response:
    return JSONResponse(messages_api.error_body(exc), status_code=exc.status, headers=getattr(exc, "headers", None))
