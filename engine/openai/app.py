"""The OpenAI-compatible HTTP API on an :class:`engine.api.Engine`, as a Starlette (ASGI) application.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, and
the agent routes of :mod:`engine.openai.agent_routes` (``/v1/responses``, ``/v1/messages``, ``/metrics``).
Response and stream shapes follow the OpenAI API reference (chat completion object, chunk object,
``data: [DONE]`` after the last server-sent event); ``usage.prompt_tokens_details.cached_tokens`` is
the number of prompt tokens resumed from a prefix snapshot (``PrefillStats.reused_tokens``).

Each request's turn is a job of the engine's :class:`engine.session.Session` (shared with the app when it
serves the app's engine), which runs it in its turn; its events reach the event loop through an
``asyncio.Queue`` (``loop.call_soon_threadsafe``). A client that disconnects while its turn waits removes it
from the session's queue; one that leaves during prefill or while streaming sets the turn's cancel flag,
which the engine checks between prompt pieces and between tokens.

Cross-site requests are refused in front of every route (:class:`engine.openai.guard.RequestGuard`:
``Host`` not naming a loopback server, ``POST`` body not sent as JSON).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.events import Event, PrefillStats, TokenEvent, TurnSummary
from engine.errors import EngineError, GenerationCancelled
from engine.session import END, Session, SessionClosedError, Ticket, engine_parallel
from . import agent_routes
from .choices import Answer, Choice
from .constraints import Constraints
from .fields import agent_request, completion_fields
from .guard import RequestGuard, loopback_host
from .limits import DEFAULT_MAX_WAITING, DEFAULT_MAX_WAITING_BYTES, WaitingQueue, check_fits
from .metrics import RequestCounter, ServerMetrics
from .requests import APIError, TurnRequest, chat_request, completion_request
from .transport import ClientGone, authorize, error_of, event_stream, read_json

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 64 << 20
"""Largest request body, bytes (a few base64 photos fit)."""

_END = END
_STARTED = object()
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/v1/messages",
         "/v1/messages/count_tokens", "/metrics", "/health")
"""The routes, as :class:`engine.openai.metrics.ServerMetrics` counts requests by route."""


@dataclass(frozen=True)
class ServerConfig:
    """How the API answers.

    Attributes:
        model_name: the one model id the server lists and accepts (the GGUF file's stem by default).
        api_key: when set, every ``/v1`` request must carry ``Authorization: Bearer <api_key>``
            (compared in constant time, ``hmac.compare_digest``); ``/health`` stays open.
        max_body_bytes: larger request bodies are refused with 413.
        file_urls: whether ``file:`` image URLs are read from this machine's disk; :func:`engine.openai.serve`
            and :class:`engine.openai.ServerThread` turn it off when listening beyond loopback, so that a
            remote client cannot have the server's own files read. Even when on, a request whose
            ``Host`` header is not a loopback name or address is refused them: a web page whose domain
            was re-pointed at 127.0.0.1 (DNS rebinding) reaches a loopback server with its own domain
            as the host, and could otherwise read the answers about the user's image files.
        max_waiting, max_waiting_bytes: requests that may wait for the engine at once, and the bytes of
            their bodies together; beyond either, 429 with ``Retry-After`` (:mod:`engine.openai.limits`).
    """

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    file_urls: bool = True
    max_waiting: int = DEFAULT_MAX_WAITING
    max_waiting_bytes: int = DEFAULT_MAX_WAITING_BYTES


class _Turn:
    """One request's turn on the engine's session: each of its ``n`` choices a job of its own (so that the choices
    decode together in one batch), the events of each queued for the event loop in a queue of its own.

    Args:
        start: ``start(i, cancel)`` -> the engine's events of choice ``i`` (``Engine.chat`` / ``Engine.complete``)
            with ``cancel`` its flag.
        n: the number of choices.
    """

    def __init__(self, start: Callable[[int, threading.Event], Iterator[Event]], n: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self.flags = [threading.Event() for _ in range(n)]     # the cancel flag of each choice (its session job's)
        self._start = start
        self._tickets: list[Ticket] = []

    def stop(self) -> None:
        """Stop the whole turn (the client left, or the request is over): its choices dropped while queued."""
        for flag in self.flags:
            flag.set()
        for ticket in self._tickets:
            ticket.cancel()

    def stop_choice(self, index: int) -> None:
        """Stop choice ``index`` only (a stop string ended it; the other choices go on)."""
        self.flags[index].set()

    def submit(self, session: Session) -> None:
        """Queue the turn's choices on ``session`` (none of them when one is refused).

        Raises:
            QueueFullError: the session's queue is full. SessionClosedError: it is closed.
        """
        try:
            for i, flag in enumerate(self.flags):
                self._tickets.append(session.submit_stream(functools.partial(self._run, i),
                                                           functools.partial(self._put, i), flag))
        except BaseException:
            self.stop()
            raise

    def _put(self, index: int, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queues[index].put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _run(self, index: int, cancel: threading.Event) -> Iterator[Any]:
        """The items of choice ``index``, on the session thread: ``_STARTED`` (the first choice), then the
        engine's events."""
        if index == 0:
            yield _STARTED
        yield from self._start(index, cancel)


def _cut_off(when: str) -> APIError:
    """The 503 of an answer the stopping server cut off (``when``: where it was)."""
    return APIError(503, f"the server is stopping: this answer was cut off {when}; send the request again once "
                    "it is back", type="server_error", code="server_stopping")


class _Exchange:
    """A request's turn from queueing to its last event, watching for the client to disconnect."""

    def __init__(self, request: Request, turn: _Turn) -> None:
        self.request, self.turn = request, turn
        self.session: Session | None = None
        self.gone = asyncio.Event()
        self._watcher = asyncio.create_task(self._watch())

    @property
    def stopping(self) -> bool:
        """Whether the session running the turn is stopping (the server shuts down: a cancel is its doing)."""
        return self.session is not None and self.session.closed

    def error_of(self, exc: BaseException) -> APIError:
        """:func:`~engine.openai.transport.error_of`, except that a cancel the stopping server caused (e.g. while
        an image is encoded) is its 503, not an engine failure."""
        if isinstance(exc, GenerationCancelled) and not isinstance(exc, SessionClosedError) and self.stopping:
            return _cut_off("before its first token")
        return error_of(exc)

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.turn.stop()
        self.gone.set()
        log.debug("the client of %s %s disconnected: its turn is cancelled", self.request.method,
                  self.request.url.path)

    async def _until(self, awaitable: Any) -> Any:
        """``await awaitable``, unless the client leaves first (then :class:`ClientGone`)."""
        task = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if self.gone.is_set():        # even when the turn's last item came too: it was dropped for the client
            task.cancel()
            raise ClientGone()
        return task.result()

    def start(self, session: Session) -> None:
        """Queue this turn on ``session``; ``_STARTED`` comes first from :meth:`next` once it runs.

        Raises:
            APIError: the session's queue is full (429) or the session is closed (503).
        """
        self.session = session
        try:
            self.turn.submit(session)
        except EngineError as exc:
            raise error_of(exc) from exc

    async def next(self, index: int = 0) -> Any:
        """Choice ``index``'s next item: ``_STARTED``, an event, an exception it raised, or ``_END``."""
        return await self._until(self.turn.queues[index].get())

    def close(self) -> None:
        """Stop the turn if it still runs (or drop it from the queue)."""
        self.turn.stop()
        self._watcher.cancel()


def _too_long(summary: TurnSummary, context: int) -> APIError:
    return APIError(400, f"the prompt is {summary.prompt_tokens} tokens but the context window holds {context}: "
                    "shorten the conversation (or serve the model with a larger --context)",
                    param="messages", code="context_length_exceeded")


class _Routes:
    """The route handlers of one application: the engine, its config, and the session that runs its turns."""

    def __init__(self, engine: Any, config: ServerConfig, session: Session) -> None:
        self.engine, self.config = engine, config
        self.context, self.has_vision = engine.info.context, engine.info.has_vision
        self.created = int(time.time())
        self.session = session
        self.key = config.api_key.encode() if config.api_key else None
        self.metrics = ServerMetrics(PATHS)
        self.metrics.track_cache(getattr(engine, "cache", None))
        self.constraints = Constraints(engine)
        self.vocab = getattr(getattr(engine, "tokenizer", None), "n_vocab", 0)
        self.waiting = WaitingQueue(config.max_waiting, config.max_waiting_bytes)

    async def _first(self, ex: _Exchange, started: Callable[[], None]) -> list[Any]:
        """The turn's events up to its first token (or the end), so that errors still get their status code;
        ``started()`` is called when the session takes the turn up."""
        while True:
            item = await ex.next()
            if item is _STARTED:
                started()
                continue
            if isinstance(item, BaseException):
                raise ex.error_of(item)
            if item is _END:
                raise APIError(500, "the engine ended the turn without a summary", type="server_error")
            if isinstance(item, TurnSummary) and item.stop_reason == "context_full" and item.generated_tokens == 0:
                raise _too_long(item, self.context)
            if isinstance(item, (PrefillStats, TurnSummary)):
                return [item]

    async def _open(self, request: Request, start: Callable[[int, threading.Event], Iterator[Event]], n: int
                    ) -> tuple[_Exchange, list[Any]]:
        """Queue the turn's ``n`` choices (429 beyond the waiting queue's bounds), start them, and wait for the first
        one's prefill to succeed (errors raise with their status)."""
        queued = self.metrics.queued()
        ex = _Exchange(request, _Turn(self.metrics.watch(start, queued), n))
        try:
            with self.waiting.enter() as ticket:      # given back once the turn starts
                ticket.grow(getattr(request.state, "body_bytes", 0))
                ex.start(self.session)
                return ex, await self._first(ex, ticket.leave)
        except BaseException:
            ex.close()
            raise
        finally:
            queued.release()

    async def _whole(self, request: Request, req: TurnRequest, start: Callable[..., Iterator[Event]]) -> dict:
        ex, first = await self._open(request, start, req.n)
        try:
            choices = [item[1] async for item in _choices(ex, req, first, self._choice_maker(req))
                       if item[0] == "end"]
            return Answer(req).whole(choices)
        finally:
            ex.close()

    async def _chunks(self, request: Request, req: TurnRequest,
                      start: Callable[..., Iterator[Event]]) -> AsyncIterator[dict[str, Any]]:
        ex, first = await self._open(request, start, req.n)
        try:
            ans, summaries = Answer(req), []
            async for what, choice, pieces in _choices(ex, req, first, self._choice_maker(req)):
                if what == "start" and ans.chat:
                    yield ans.role_chunk(choice)
                elif what == "pieces":
                    for delta in choice.deltas(pieces):
                        yield ans.chunk(choice, delta)
                elif what == "end":
                    summaries.append(choice.summary)
                    yield ans.chunk(choice, {}, choice.finish_reason)
            if req.include_usage:
                yield ans.usage_chunk(summaries)
        finally:
            ex.close()

    def _choice_maker(self, req: TurnRequest) -> Callable[[int], Choice]:
        """Makes choice ``i`` of ``req``'s answer (its tool-call reader and token bytes for logprobs)."""
        reader = self.constraints.reader(req) if req.messages is not None else None
        return lambda i: Choice(i, req, reader, getattr(self.engine, "token_bytes", None))

    def _chat_turn(self, request: Request, body: Any) -> tuple[TurnRequest, Callable[..., Iterator[Event]]]:
        """The checked chat request and the function that runs its ``n`` choices on the engine."""
        config = self.config
        req = agent_request(body, chat_request(body, config.model_name, self.context,
                                               config.file_urls and loopback_host(request.headers.get("host", ""))),
                            self.vocab)
        if not self.has_vision and any(isinstance(m["content"], list)
                                       and any(p["type"] == "image" for p in m["content"])
                                       for m in req.messages or ()):
            raise APIError(400, f"{config.model_name} has no vision tower (serve it with --mmproj FILE), so it "
                           "cannot read images", param="messages", code="invalid_image")
        self.constraints.check(req)

        grammar: list[Any] = []          # the request's grammar, built by the first choice that starts

        def start(i: int, cancel: threading.Event) -> Iterator[Event]:
            if not grammar:
                check_fits(self.engine, req.messages, req.enable_thinking, self.context,   # before images are encoded
                           list(req.tools) or None)
                grammar.append(self.constraints.grammar(req))
            yield from self.engine.chat(req.messages, req.choice_sampling(i), cancel,
                                        enable_thinking=req.enable_thinking, tools=list(req.tools) or None,
                                        grammar=grammar[0])
        return req, start

    async def chat(self, request: Request, body: Any) -> dict[str, Any]:
        """The whole ``chat.completion`` object answering a chat-completions ``body`` (its ``stream`` is not
        looked at). ``request`` is watched for the client leaving (then :class:`ClientGone`).

        Raises:
            APIError: a bad body (4xx) or an engine failure (500), before any answer.
        """
        req, start = self._chat_turn(request, body)
        return await self._whole(request, req, start)

    async def chat_chunks(self, request: Request, body: Any) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects answering a chat-completions ``body``, without SSE framing:
        the role chunk of each choice, its content / reasoning / tool-call deltas, its finish chunk, then
        the usage chunk when ``stream_options.include_usage``. Bad input raises :class:`APIError` at the
        first ``__anext__`` (before anything is sent); an engine failure later raises it mid-stream.
        Close the iterator (``aclose``) when done with it early: that stops the turn."""
        req, start = self._chat_turn(request, body)
        async for chunk in self._chunks(request, req, start):
            yield chunk

    async def chat_completions(self, request: Request) -> Response:
        authorize(request, self.key)
        req, start = self._chat_turn(request, await read_json(request, self.config.max_body_bytes))
        if req.stream:
            return await event_stream(self._chunks(request, req, start))
        return JSONResponse(await self._whole(request, req, start))

    async def completions(self, request: Request) -> Response:
        authorize(request, self.key)
        body = await read_json(request, self.config.max_body_bytes)
        req = completion_fields(body, completion_request(body, self.config.model_name, self.context), self.vocab)

        def start(i: int, cancel: threading.Event) -> Iterator[Event]:
            yield from self.engine.complete(req.prompt, req.choice_sampling(i), cancel)
        if req.stream:
            return await event_stream(self._chunks(request, req, start))
        return JSONResponse(await self._whole(request, req, start))

    async def models(self, request: Request) -> Response:
        authorize(request, self.key)
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "deltadesk",
             "max_model_len": self.context, "vision": self.has_vision}]})


async def _gone(_request: Request, _exc: Exception) -> Response:
    return Response(status_code=499)    # the client left: nobody reads this


async def _health(_request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _api_error(_request: Request, exc: Exception) -> Response:
    error = exc if isinstance(exc, APIError) else error_of(exc)
    return JSONResponse(error.body(), status_code=error.status, headers=getattr(error, "headers", None))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
            else str(exc.detail))
    return JSONResponse(APIError(exc.status_code, what).body(), status_code=exc.status_code)


def create_app(engine: Any, config: ServerConfig, session: Session | None = None) -> Starlette:
    """The ASGI application serving ``engine``.

    Args:
        engine: an :class:`engine.api.Engine` (``chat``, ``complete``, ``info``).
        config: the model name, API key and body limit.
        session: the :class:`engine.session.Session` that runs the engine's work, shared with the engine's
            other users (the app); None = a session of the application's own (an idle daemon thread once
            the application is dropped: :class:`engine.openai.ServerThread` passes one it closes).

    Returns:
        A Starlette application (run it with uvicorn, see :func:`engine.openai.serve`).
    """
    handlers = _Routes(engine, config, session or Session(parallel=engine_parallel(engine)))
    routes = [Route("/v1/chat/completions", handlers.chat_completions, methods=["POST"]),
              Route("/v1/completions", handlers.completions, methods=["POST"]),
              Route("/v1/models", handlers.models, methods=["GET"]),
              Route("/health", _health, methods=["GET"])]
    agents = agent_routes.AgentRoutes(handlers)
    routes += [Route("/v1/responses", agents.responses, methods=["POST"]),
               Route("/v1/messages", agents.messages, methods=["POST"]),
               Route("/v1/messages/count_tokens", agents.count_tokens, methods=["POST"]),
               Route("/metrics", agents.metrics, methods=["GET"])]
    middleware = [Middleware(RequestCounter, metrics=handlers.metrics), Middleware(RequestGuard)]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={APIError: _api_error, HTTPException: _http_error, ClientGone: _gone,
                                         Exception: _api_error})


async def _choices(ex: _Exchange, req: TurnRequest, first: list[Any],
                   make: Callable[[int], Choice]) -> AsyncIterator[tuple[str, Choice, Any]]:
    """The turn's choices in order (choice ``i`` made by ``make(i)``), each as ``("start", choice, None)``,
    ``("pieces", choice, pieces)`` per token (:meth:`Choice.push`), and ``("end", choice, None)`` once its
    summary is in (``choice.summary``)."""
    pending = list(first)
    choice = make(0)
    yield "start", choice, None
    while True:
        item = pending.pop(0) if pending else await ex.next(choice.index)
        if isinstance(item, BaseException):
            raise ex.error_of(item)
        if item is _END:
            raise APIError(500, "the engine ended the turn without a summary", type="server_error")
        if isinstance(item, TokenEvent) and not choice.stopped:
            pieces = choice.push(item)
            if choice.stopped:
                ex.turn.stop_choice(choice.index)  # a stop string: the engine ends it at its next token
            yield "pieces", choice, pieces
        elif isinstance(item, TurnSummary):
            if item.stop_reason == "cancelled" and not choice.stopped and ex.stopping:
                raise _cut_off(f"after {item.generated_tokens} tokens")
            yield "pieces", choice, choice.close(item)
            yield "end", choice, None
            if choice.index + 1 == req.n:
                return
            choice = make(choice.index + 1)
            yield "start", choice, None
