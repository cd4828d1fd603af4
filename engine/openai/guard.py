"""Cross-site request refusals in front of every route of :mod:`engine.openai.app`.

A ``POST`` body must be ``application/json`` (or ``application/*+json``), else 415, which a web page can
send only after a CORS preflight this server never grants; a loopback server refuses (403) a ``Host``
that is not a loopback name or address with its port (DNS rebinding).
Design: docs/design/http-server.md (the attacks, and how other servers compare).
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .requests import APIError


def loopback_host(header: str) -> bool:
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
    """Why :class:`RequestGuard` refuses an HTTP request (see the module docstring), or None."""
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


class RequestGuard:
    """ASGI middleware that answers a refused request (:func:`_refusal`) with its OpenAI-style error
    and passes every other request on to ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """ASGI entry: an HTTP request the guard refuses is answered here, any other passes on."""
        error = _refusal(scope) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
