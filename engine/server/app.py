"""The OpenAI-compatible HTTP API on an :class:`engine.api.Engine`, as a Starlette (ASGI) application.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
Response and stream shapes follow the OpenAI API reference (chat completion object, chunk object,
``data: [DONE]`` after the last server-sent event); ``usage.prompt_tokens_details.cached_tokens`` is
the number of prompt tokens resumed from a prefix snapshot (``PrefillStats.reused_tokens``).

One turn runs on the engine at a time: requests wait in arrival order (an ``asyncio.Lock``, FIFO) and
each turn also holds the engine's ``threading.Lock``, which the app's own chat takes too when it shares
the engine; a turn waiting for that lock stops the app's read-ahead of a chat at its next piece
(``Engine.cancel_read_ahead``). The turn runs on a thread of its own; its events reach the event loop through an
``asyncio.Queue``. A client that disconnects (while queued, during prefill or while streaming) sets
the turn's cancel flag, which the engine checks between prompt pieces and between tokens.

Cross-site requests are refused in front of every route (:class:`engine.server.guard.RequestGuard`:
``Host`` not naming a loopback server, ``POST`` body not sent as JSON).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import ContextFullError, EngineError, ImageError, TemplateError, UnsupportedModelError
from engine.events import Event, PrefillStats, TokenEvent, TurnSummary
from .answer import AnswerSplitter
from .guard import RequestGuard, loopback_host
from .limits import DEFAULT_MAX_WAITING, DEFAULT_MAX_WAITING_BYTES, Ticket, WaitingQueue, check_fits, check_text
from .requests import APIError, TurnRequest, chat_request, completion_request

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 64 << 20
"""Largest request body, bytes (a few base64 photos fit)."""

_END = object()
_FINISH = {"eos": "stop", "max_tokens": "length", "context_full": "length"}


@dataclass(frozen=True)
class ServerConfig:
    """How the API answers.

    Attributes:
        model_name: the one model id the server lists and accepts (the GGUF file's stem by default).
        api_key: when set, every ``/v1`` request must carry ``Authorization: Bearer <api_key>``
            (compared in constant time, ``hmac.compare_digest``); ``/health`` stays open.
        max_body_bytes: larger request bodies are refused with 413.
        file_urls: whether ``file:`` image URLs are read from this machine's disk; :func:`engine.server.serve`
            and :class:`engine.server.ServerThread` turn it off when listening beyond loopback, so that a
            remote client cannot have the server's own files read. Even when on, a request whose
            ``Host`` header is not a loopback name or address is refused them: a web page whose domain
            was re-pointed at 127.0.0.1 (DNS rebinding) reaches a loopback server with its own domain
            as the host, and could otherwise read the answers about the user's image files.
        max_waiting, max_waiting_bytes: requests that may wait for the engine at once, and the bytes of
            their bodies together; beyond either, 429 with ``Retry-After`` (:mod:`engine.server.limits`).
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    file_urls: bool = True
    max_waiting: int = DEFAULT_MAX_WAITING
    max_waiting_bytes: int = DEFAULT_MAX_WAITING_BYTES


class _ClientGone(Exception):
    """The client disconnected; the turn has been told to stop."""


class _Turn:
    """One turn on the engine thread, its events queued for the event loop.

    Args:
        start: ``start(cancel)`` -> the engine's event iterator (``Engine.chat`` / ``Engine.complete``).
        preempt: called while the turn waits for the engine's lock (``Engine.cancel_read_ahead``: the
            app's read-ahead of a chat, which holds that lock, gives way within one piece), or None.
    """

    def __init__(self, start: Callable[[threading.Event], Iterator[Event]],
                 preempt: Callable[[], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self._start = start
        self._preempt = preempt

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def run(self, engine_lock: threading.Lock) -> None:
        """Run the turn (on its own thread) once the engine is free; every outcome is queued, then the end."""
        try:
            while not engine_lock.acquire(timeout=0.05):
                if self._preempt is not None:
                    self._preempt()      # again each time: a read-ahead may take the lock before it can be told
            try:
                if self.cancel.is_set():
                    return
                events = self._start(self.cancel)
                try:
                    for event in events:
                        self._put(event)
                finally:
                    close = getattr(events, "close", None)
                    if close is not None:
                        close()
            finally:
                engine_lock.release()
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the request as an error
            self._put(exc)
        finally:
            self._put(_END)


class _Exchange:
    """A request's turn from queueing to its last event, watching for the client to disconnect."""

    def __init__(self, request: Request, order: asyncio.Lock, turn: _Turn) -> None:
        self.request, self.order, self.turn = request, order, turn
        self.gone = asyncio.Event()
        self._holds_order = False
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.turn.cancel.set()
        self.gone.set()
        log.debug("the client of %s %s disconnected: its turn is cancelled", self.request.method,
                  self.request.url.path)

    async def _until(self, awaitable: Any) -> Any:
        """``await awaitable``, unless the client leaves first (then :class:`_ClientGone`)."""
        task = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            raise _ClientGone()
        return task.result()

    async def start(self, engine_lock: threading.Lock) -> None:
        """Wait for the turns before this one, then start this one on its thread."""
        await self._until(self.order.acquire())
        self._holds_order = True
        threading.Thread(target=self.turn.run, args=(engine_lock,), name="server-turn", daemon=True).start()

    async def next(self) -> Any:
        """The turn's next event, an exception it raised, or ``_END``."""
        return await self._until(self.turn.queue.get())

    def close(self) -> None:
        """Stop the turn if it still runs and let the next request in."""
        self.turn.cancel.set()
        self._watcher.cancel()
        if self._holds_order:
            self._holds_order = False
            self.order.release()


def _error_of(exc: BaseException) -> APIError:
    """The API error an exception from the engine becomes."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ImageError):
        return APIError(400, str(exc), param="messages", code="invalid_image")
    if isinstance(exc, ContextFullError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (TemplateError, UnsupportedModelError)):
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error")
    log.error("turn failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")



def _usage(summary: TurnSummary) -> dict[str, Any]:
    return {"prompt_tokens": summary.prompt_tokens, "completion_tokens": summary.generated_tokens,
            "total_tokens": summary.prompt_tokens + summary.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": summary.reused_tokens}}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Answer:
    """The pieces of one answer as chat or completion objects and chunks."""

    def __init__(self, req: TurnRequest) -> None:
        self.req = req
        self.chat = req.messages is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.splitter = AnswerSplitter(req.enable_thinking, req.stop, raw=not self.chat)
        self.parts: dict[str, list[str]] = {"reasoning": [], "content": []}

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.req.model}

    def chunk(self, kind: str, text: str, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {"reasoning_content" if kind == "reasoning" else "content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = self.head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            out = self.head("text_completion") | {"choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def finish_reason(self, summary: TurnSummary) -> str:
        return "stop" if self.splitter.stopped else _FINISH.get(summary.stop_reason, "stop")

    def whole(self, summary: TurnSummary) -> dict[str, Any]:
        content = "".join(self.parts["content"])
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.parts["reasoning"]:
                message["reasoning_content"] = "".join(self.parts["reasoning"])
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason(summary)}
            return self.head("chat.completion") | {"choices": [choice], "usage": _usage(summary)}
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": self.finish_reason(summary)}
        return self.head("text_completion") | {"choices": [choice], "usage": _usage(summary)}


def _too_long(summary: TurnSummary, context: int) -> APIError:
    return APIError(400, f"the prompt is {summary.prompt_tokens} tokens but the context window holds {context}: "
                    "shorten the conversation (or serve the model with a larger --context)",
                    param="messages", code="context_length_exceeded")


def _authorize(request: Request, key: bytes | None) -> None:
    """Refuse (401) a request without ``Authorization: Bearer <key>`` when the server has an API key."""
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)):
        raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def _read_json(request: Request, limit: int, ticket: Ticket | None = None) -> Any:
    """The request's JSON body, at most ``limit`` bytes (else 413), counted on ``ticket`` as it arrives (429
    when the waiting bodies are too many bytes); not JSON (or NaN/Infinity) -> 400; text that is not Unicode
    (a lone surrogate) -> 400 naming its field."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is {int(length)} bytes; at most {limit} are accepted",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        if ticket is not None:
            ticket.grow(len(chunk))
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    check_text(body)
    return body


class _Routes:
    """The route handlers of one application: the engine, its config, and the turn order they share."""

    def __init__(self, engine: Any, config: ServerConfig, engine_lock: threading.Lock | None) -> None:
        self.engine, self.config = engine, config
        self.context, self.has_vision = engine.info.context, engine.info.has_vision
        self.created = int(time.time())
        self.lock = engine_lock or threading.Lock()
        self.order = asyncio.Lock()
        self.key = config.api_key.encode() if config.api_key else None
        self.waiting = WaitingQueue(config.max_waiting, config.max_waiting_bytes)

    async def _first(self, ex: _Exchange) -> list[Any]:
        """The turn's events up to its first token (or the end), so that errors still get their status code."""
        while True:
            item = await ex.next()
            if isinstance(item, BaseException):
                raise _error_of(item)
            if item is _END:
                raise APIError(500, "the engine ended the turn without a summary", type="server_error")
            if isinstance(item, TurnSummary) and item.stop_reason == "context_full" and item.generated_tokens == 0:
                raise _too_long(item, self.context)
            if isinstance(item, (PrefillStats, TurnSummary)):
                return [item]

    async def answer(self, request: Request, req: TurnRequest,
                     start: Callable[[threading.Event], Iterator[Event]], ticket: Ticket | None = None) -> Response:
        """Run one turn in order and answer it whole or as server-sent events (``req.stream``); ``ticket``
        (its place among the waiting requests) is given back once the turn starts."""
        ex = _Exchange(request, self.order, _Turn(start, getattr(self.engine, "cancel_read_ahead", None)))
        streaming = False
        try:
            await ex.start(self.lock)
            if ticket is not None:
                ticket.leave()
            ans = _Answer(req)
            first = await self._first(ex)
            if not req.stream:
                return JSONResponse(await _collect(ex, ans, first))
            streaming = True
            return _EventStream(_stream(ex, ans, first), ex, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                ex.close()

    async def chat_completions(self, request: Request) -> Response:
        _authorize(request, self.key)
        with self.waiting.enter() as ticket:
            return await self._chat(request, ticket)

    async def _chat(self, request: Request, ticket: Ticket) -> Response:
        config = self.config
        req = chat_request(await _read_json(request, config.max_body_bytes, ticket), config.model_name, self.context,
                           config.file_urls and loopback_host(request.headers.get("host", "")))
        if not self.has_vision and any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                                       for m in req.messages or ()):
            raise APIError(400, f"{config.model_name} has no vision tower (serve it with --mmproj FILE), so it "
                           "cannot read images", param="messages", code="invalid_image")

        def start(cancel: threading.Event) -> Iterator[Event]:
            check_fits(self.engine, req.messages, req.enable_thinking, self.context)   # before any image is encoded
            return self.engine.chat(req.messages, req.sampling, cancel, enable_thinking=req.enable_thinking)

        return await self.answer(request, req, start, ticket)

    async def completions(self, request: Request) -> Response:
        _authorize(request, self.key)
        with self.waiting.enter() as ticket:
            req = completion_request(await _read_json(request, self.config.max_body_bytes, ticket),
                                     self.config.model_name, self.context)
            return await self.answer(request, req, lambda cancel: self.engine.complete(req.prompt, req.sampling,
                                                                                       cancel), ticket)

    async def models(self, request: Request) -> Response:
        _authorize(request, self.key)
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "deltadesk",
             "max_model_len": self.context, "vision": self.has_vision}]})


async def _health(_request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _api_error(_request: Request, exc: Exception) -> Response:
    error = exc if isinstance(exc, APIError) else _error_of(exc)
    return JSONResponse(error.body(), status_code=error.status, headers=getattr(error, "headers", None))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
            else str(exc.detail))
    return JSONResponse(APIError(exc.status_code, what).body(), status_code=exc.status_code)


def create_app(engine: Any, config: ServerConfig, engine_lock: threading.Lock | None = None) -> Starlette:
    """The ASGI application serving ``engine``.

    Args:
        engine: an :class:`engine.api.Engine` (``chat``, ``complete``, ``info``).
        config: the model name, API key and body limit.
        engine_lock: held while a turn runs; pass the lock the engine's other user (the app) holds
            around its own turns. None = a lock of the server's own.

    Returns:
        A Starlette application (run it with uvicorn, see :func:`engine.server.serve`).
    """
    handlers = _Routes(engine, config, engine_lock)
    routes = [Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
              Route("/v1/completions", handlers.completions, methods=["POST"]),
              Route("/v1/models", handlers.models, methods=["GET"]),
              Route("/health", _health, methods=["GET"])]
    return Starlette(routes=routes, middleware=[Middleware(RequestGuard)],
                     exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _api_error})


async def _events(ex: _Exchange, ans: _Answer, first: list[Any]) -> AsyncIterator[tuple[str, str] | TurnSummary]:
    """The answer's pieces (kind, text) as they are known, then the turn's summary (last)."""
    pending = list(first)
    while True:
        item = pending.pop(0) if pending else await ex.next()
        if isinstance(item, BaseException):
            raise _error_of(item)
        if item is _END:
            raise APIError(500, "the engine ended the turn without a summary", type="server_error")
        if isinstance(item, TokenEvent) and not ans.splitter.stopped:
            for piece in ans.splitter.push(item.text):
                yield piece
            if ans.splitter.stopped:
                ex.turn.cancel.set()  # a stop string: the engine ends the turn at its next token
        elif isinstance(item, TurnSummary):
            for piece in ans.splitter.close():
                yield piece
            yield item
            return


async def _collect(ex: _Exchange, ans: _Answer, first: list[Any]) -> dict[str, Any]:
    async for item in _events(ex, ans, first):
        if isinstance(item, TurnSummary):
            return ans.whole(item)
        ans.parts[item[0]].append(item[1])
    raise APIError(500, "the engine ended the turn without a summary", type="server_error")


async def _stream(ex: _Exchange, ans: _Answer, first: list[Any]) -> AsyncIterator[str]:
    """Server-sent events: the role, one chunk per piece, the finish reason, the usage (when asked), [DONE]."""
    if ans.chat:
        yield _sse(ans.head("chat.completion.chunk") | {"choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            | ({"usage": None} if ans.req.include_usage else {}))
    try:
        async for item in _events(ex, ans, first):
            if isinstance(item, TurnSummary):
                yield _sse(ans.chunk("content", "", ans.finish_reason(item)))
                if ans.req.include_usage:
                    yield _sse(ans.head(ans.chunk("content", "")["object"]) | {"choices": [], "usage": _usage(item)})
            else:
                yield _sse(ans.chunk(*item))
    except APIError as exc:
        yield _sse(exc.body())
    except _ClientGone:
        return
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose client's disconnect the exchange watches (not Starlette's own listener:
    one reader of the connection); the turn is stopped and the queue released when the stream ends."""

    def __init__(self, content: AsyncIterator[str], ex: _Exchange, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._ex = ex

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass  # the client went away mid-send
        finally:
            self._ex.close()
