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

Cross-site requests (:class:`_RequestGuard`, in front of every route): a web page the user opens can
send a "simple" request to ``http://127.0.0.1:PORT`` without the browser asking first (a CORS
preflight), as long as its body is ``text/plain``, a form, or untyped; so a ``POST`` body must be sent
as ``Content-Type: application/json`` (or another ``application/*+json`` type), which a page can only
send after a preflight this server never grants, and anything else is refused with 415. A page can
also point its own domain at 127.0.0.1 (DNS rebinding) and then read the answers as same-origin; such
a request names that domain in its ``Host`` header, so a server listening on a loopback address
refuses (403) a ``Host`` that is not a loopback name or address with the port it listens on. For
comparison: Ollama refuses, when bound to loopback, a ``Host`` that is not loopback, private, the
machine's own name or under ``.localhost``/``.local``/``.internal`` (403, ``allowedHostsMiddleware``
in its ``server/routes.go``); FastAPI, under vLLM's server, reads a JSON body only with a JSON
``Content-Type`` since 0.65.2 (CVE-2021-32677), though vLLM allows any CORS origin by default; llama.cpp's
``llama-server`` parses the body as JSON whatever its type and checks no ``Host``, leaving an API key as
the defence.
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
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import ContextFullError, EngineError, ImageError, TemplateError, UnsupportedModelError
from engine.events import Event, PrefillStats, TokenEvent, TurnSummary
from .answer import AnswerSplitter
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
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    file_urls: bool = True


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


def _loopback_host(header: str) -> bool:
    """Whether an HTTP ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names this machine only."""
    from . import is_loopback
    host = _host_port(header)[0]
    return bool(host) and is_loopback(host)


def _json_media_type(content_type: str) -> bool:
    """Whether a ``Content-Type`` header names JSON: ``application/json`` or ``application/*+json``,
    parameters (``; charset=utf-8``) aside."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _host_port(header: str) -> tuple[str, int | None]:
    """``(host, port)`` of an HTTP ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``);
    port None when absent, -1 when not a number."""
    host, port = header.strip(), ""
    if host.startswith("["):
        end = host.find("]")
        host, port = (host, "") if end < 0 else (host[:end + 1], host[end + 1:].removeprefix(":"))
    elif host.count(":") == 1:
        host, port = host.split(":")
    return host, (int(port) if port.isdigit() else -1) if port else None


def _refusal(scope: Any) -> APIError | None:
    """Why :class:`_RequestGuard` refuses an HTTP request (see the module docstring), or None."""
    from . import is_loopback
    headers = Headers(scope=scope)
    server = scope.get("server")
    if server is not None and is_loopback(str(server[0])):
        given = headers.get("host", "")
        host, port = _host_port(given)
        if not (host and is_loopback(host) and (port or 80) == server[1]):
            return APIError(403, f"the Host header {given!r} does not name this loopback server: send "
                            f"'Host: 127.0.0.1:{server[1]}' or 'localhost:{server[1]}' (a web page reaching a "
                            "local server through another domain name is refused)", code="host_not_allowed")
    if scope["method"] == "POST" and not _json_media_type(headers.get("content-type", "")):
        got = headers.get("content-type")
        return APIError(415, "the request body must be JSON sent with 'Content-Type: application/json' (got "
                        + (f"{got!r})" if got is not None else "no Content-Type)"), code="unsupported_media_type")
    return None


class _RequestGuard:
    """ASGI middleware that answers a refused request (:func:`_refusal`) with its OpenAI-style error
    and passes every other request on to ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        error = _refusal(scope) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


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
    info = engine.info
    context, has_vision = info.context, info.has_vision
    created = int(time.time())
    lock = engine_lock or threading.Lock()
    order = asyncio.Lock()
    key = config.api_key.encode() if config.api_key else None

    def authorize(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)):
            raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        limit = config.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body is {int(length)} bytes; at most {limit} are accepted",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
            chunks.append(chunk)

        def no_constants(name: str) -> Any:
            raise ValueError(f"{name} is not JSON")

        try:
            return json.loads(b"".join(chunks), parse_constant=no_constants)
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc

    async def answer(request: Request, req: TurnRequest, start: Callable[[threading.Event], Iterator[Event]]) -> Response:
        ex = _Exchange(request, order, _Turn(start, getattr(engine, "cancel_read_ahead", None)))
        streaming = False
        try:
            await ex.start(lock)
            ans = _Answer(req)
            first: list[Any] = []
            while True:  # up to the first token (or the end): errors still get their status code
                item = await ex.next()
                if isinstance(item, BaseException):
                    raise _error_of(item)
                if item is _END:
                    raise APIError(500, "the engine ended the turn without a summary", type="server_error")
                if isinstance(item, TurnSummary) and item.stop_reason == "context_full" and item.generated_tokens == 0:
                    raise _too_long(item, context)
                if isinstance(item, (PrefillStats, TurnSummary)):
                    first.append(item)
                    break
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

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = chat_request(await read_json(request), config.model_name, context,
                           config.file_urls and _loopback_host(request.headers.get("host", "")))
        if not has_vision and any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                                  for m in req.messages or ()):
            raise APIError(400, f"{config.model_name} has no vision tower (serve it with --mmproj FILE), so it "
                           "cannot read images", param="messages", code="invalid_image")
        return await answer(request, req, lambda cancel: engine.chat(
            req.messages, req.sampling, cancel, enable_thinking=req.enable_thinking))

    async def completions(request: Request) -> Response:
        authorize(request)
        req = completion_request(await read_json(request), config.model_name, context)
        return await answer(request, req, lambda cancel: engine.complete(req.prompt, req.sampling, cancel))

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": created, "owned_by": "deltadesk",
             "max_model_len": context, "vision": has_vision}]})

    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def api_error(_request: Request, exc: Exception) -> Response:
        error = exc if isinstance(exc, APIError) else _error_of(exc)
        return JSONResponse(error.body(), status_code=error.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                else str(exc.detail))
        return JSONResponse(APIError(exc.status_code, what).body(), status_code=exc.status_code)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, middleware=[Middleware(_RequestGuard)],
                     exception_handlers={APIError: api_error, HTTPException: http_error, Exception: api_error})


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
