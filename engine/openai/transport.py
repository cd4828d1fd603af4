"""The HTTP transport shared by the API's routes: reading a JSON body under a size limit, the API key check,
engine errors as API errors, and server-sent-event responses whose client may leave at any time."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.errors import ContextFullError, EngineError, ImageError, TemplateError, UnsupportedModelError
from engine.session import QueueFullError, SessionClosedError
from engine.turn.grammar import GrammarError
from .limits import QueueFull, check_text
from .requests import APIError

log = logging.getLogger("engine.openai.app")


class ClientGone(Exception):
    """The client disconnected; the turn has been told to stop."""

def error_of(exc: BaseException) -> APIError:
    """The API error an exception from the engine becomes."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return QueueFull(str(exc))
    if isinstance(exc, SessionClosedError):
        return APIError(503, f"the model is not available: {exc}", type="server_error", code="model_unavailable")
    if isinstance(exc, ImageError):
        return APIError(400, str(exc), param="messages", code="invalid_image")
    if isinstance(exc, ContextFullError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (TemplateError, UnsupportedModelError)):
        return APIError(400, str(exc), param="messages")
    if isinstance(exc, GrammarError):
        log.warning("constrained decoding stopped: %s", exc)
        return APIError(400, "the response format or tools cannot be enforced: the grammar library gave up while "
                        f"decoding ({str(exc).splitlines()[0][:300]}); simplify the schema (a value that must nest "
                        "without end, a very ambiguous pattern)", code="unsupported_schema")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error")
    log.error("turn failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

def sse(payload: Any) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

def authorize(request: Request, key: bytes | None) -> None:
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


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, at most ``limit`` bytes (else 413; its size is kept as ``request.state.body_bytes``
    for the waiting queue); not JSON (or NaN/Infinity) -> 400; text that is not Unicode (a lone surrogate) ->
    400 naming its field."""
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
    request.state.body_bytes = size
    try:
        body = json.loads(b"".join(chunks), parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    check_text(body)
    return body

async def event_stream(chunks: AsyncIterator[dict[str, Any]], frame: Callable[[dict[str, Any]], str] = sse,
                       error: Callable[[APIError], str] = lambda exc: sse(exc.body()),
                       end: str = "data: [DONE]\n\n") -> Response:
    """A server-sent-event response of ``chunks``, each written by ``frame``; an :class:`APIError` raised
    before the first chunk is raised here (the request gets its status code), one raised later is sent
    as ``error(exc)`` and ends the stream; ``end`` follows the last chunk. A client that leaves before
    the first chunk gets 499 (nobody reads it); ``chunks`` is closed when the stream ends."""
    try:
        first = await chunks.__anext__()
    except ClientGone:
        return Response(status_code=499)

    async def frames() -> AsyncIterator[str]:
        yield frame(first)
        try:
            async for chunk in chunks:
                yield frame(chunk)
        except APIError as exc:
            yield error(exc)
            return
        except ClientGone:
            return
        yield end

    return _EventStream(frames(), chunks, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _EventStream(StreamingResponse):
    """Server-sent events whose client's disconnect the exchange watches (not Starlette's own listener:
    one reader of the connection); the chunk iterator (and with it the turn) is closed when the stream ends."""

    def __init__(self, content: AsyncIterator[str], chunks: AsyncIterator[Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content, self._chunks = content, chunks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass  # the client went away mid-send
        finally:
            for it in (self._content, self._chunks):
                close = getattr(it, "aclose", None)
                if close is not None:
                    await close()
