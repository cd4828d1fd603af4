"""``python -m engine serve``: the engine behind an OpenAI-compatible HTTP API (see :mod:`engine.openai.app`);
and the other side of that API, :class:`engine.openai.remote.RemoteEngine`: a chat engine on any
OpenAI-compatible server (its untrusted reads in :mod:`engine.openai.remote_http`).

The HTTP stack is Starlette (routing, requests, streamed responses) on uvicorn (the ASGI server): both
are small, widely used and maintained, and an event loop serves slow streaming clients without a
thread each while the engine's :class:`engine.session.Session` runs its turns on a thread of its own.

Security: the server binds to loopback unless told otherwise, and binding any other address needs an
API key (:func:`check_bind`), which every ``/v1`` request must then present; such a server also refuses
``file:`` image URLs (``ServerConfig.file_urls``), which would read its own disk for remote clients.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from engine.errors import EngineError
from engine.session import Session, engine_parallel
from .app import DEFAULT_MAX_BODY, ServerConfig, create_app
from .requests import APIError

__all__ = ["APIError", "DEFAULT_MAX_BODY", "ServerConfig", "ServerThread", "StopSignals", "bind_address", "check_bind",
           "create_app", "is_loopback", "serve"]

LOOPBACK = "127.0.0.1"

UVICORN_LIMITS = {"timeout_keep_alive": 5, "h11_max_incomplete_event_size": 16 << 10, "limit_concurrency": 256,
                  "backlog": 128}
"""uvicorn's own limits on slow or greedy clients: a connection closed when it has sent no whole request head
5 s after opening or after its last answer (uvicorn's keep-alive timeout; :class:`_HeadTimeoutH11` starts it
at the connection's opening too and lets trickled bytes not restart it), a request head over 16 KiB refused,
at most 256 connections and tasks at once (503 beyond), 128 connections pending accept. A slowly sent body is
bounded by what waiting requests may hold (:mod:`engine.openai.limits`): uvicorn has no body timeout."""


def _head_timeout_protocol() -> type:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _HeadTimeoutH11(H11Protocol):
        """uvicorn's h11 protocol whose keep-alive timer also runs from the connection's opening and is not
        restarted by the bytes of an unfinished request head, so a whole head must arrive in time."""

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            timer, self.timeout_keep_alive_task = self.timeout_keep_alive_task, None
            super().data_received(data)
            if timer is None:
                return
            if self.cycle is not None and not self.cycle.response_complete or self.timeout_keep_alive_task:
                timer.cancel()          # a request began (or uvicorn armed its own timer): uvicorn's rules now
            else:
                self.timeout_keep_alive_task = timer

    return _HeadTimeoutH11


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) reaches this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to serve beyond this machine without an API key.

    Raises:
        EngineError: ``host`` is not a loopback address and ``api_key`` is empty.
    """
    if not is_loopback(host) and not api_key:
        raise EngineError(f"refusing to listen on {host} without an API key: anyone who can reach this machine "
                          "could use the model; pass --api-key KEY (or bind to 127.0.0.1)")


def bind_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) and listening, for uvicorn to serve on: a
    client that connects before uvicorn runs waits in the backlog.

    Raises:
        EngineError: the address is in use or not this machine's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise EngineError(f"could not listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    return sock


GRACE_S = 2.0
"""Seconds a stopping server lets running answers finish before it cuts them off."""
CUT_WAIT_S = 30.0
"""Seconds it then waits for a cut answer's turn to see its cancel (one decode step or prefill piece) before
uvicorn cancels the request's task."""


def _uvicorn_server(engine: Any, config: ServerConfig, host: str, port: int, session: Session,
                    cut_answers: bool = False):
    """The uvicorn server of ``engine`` on ``session``. ``cut_answers`` (a session of the server's own): answers
    still running :data:`GRACE_S` after the shutdown began are cut off, each stream ending with an error event
    (:func:`engine.openai.app.create_app`) and the server's stderr with one line, instead of uvicorn cancelling
    their tasks (a ``CancelledError`` traceback and a stream broken mid-chunk); without it the grace period is
    uvicorn's own."""
    import uvicorn
    if not is_loopback(host):
        config = dataclasses.replace(config, file_urls=False)
    app = create_app(engine, config, session)

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if cut_answers:
                asyncio.get_running_loop().call_later(GRACE_S, _cut_answers, session)
            await super().shutdown(sockets)

    return _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                  timeout_graceful_shutdown=GRACE_S + (CUT_WAIT_S if cut_answers else 0.0),
                                  http=_head_timeout_protocol(), **UVICORN_LIMITS))


def _cut_answers(session: Session) -> None:
    """Stop ``session`` (no new turns, the running ones cancelled) and say how many answers that cut off."""
    running = session.stop()
    if running:
        print(f"[stopping: cut off {running} answer(s) still running {GRACE_S:g} s after the stop; each stream "
              "ends with a server_stopping error event]", file=sys.stderr, flush=True)


class StopSignals:
    """SIGINT (Ctrl+C) and SIGTERM (``kill``, a service manager, ``docker stop``) as a graceful stop of
    :func:`serve`, while the block runs in the main thread (elsewhere it changes nothing).

    The first signal stops the server: uvicorn stops taking requests and shuts down (its own handlers, while it
    runs, hand the signal back to these once it is done, instead of the default action that would end the process
    before the caller closes its session and engine). After :meth:`closing` a further signal exits the process at
    once with status 128 + its number, without finishing the shutdown. :attr:`signal`: the first signal, or None.
    """

    HANDLED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._server: Any = None
        self._closing = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.HANDLED}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def watch(self, server: Any) -> None:
        """Stop ``server`` (a ``uvicorn.Server`` about to run) on a signal, also on one that came before."""
        self._server = server
        server.should_exit = server.should_exit or self.signal is not None

    def closing(self) -> None:
        """The server has stopped: from now on a signal exits the process at once."""
        self._closing = True

    def _handle(self, sig: int, frame: Any) -> None:
        if self._closing:
            os.write(2, f"[{signal.Signals(sig).name} again: exiting before the shutdown finished]\n".encode())
            os._exit(128 + sig)
        self.signal = self.signal or signal.Signals(sig)
        if self._server is not None:
            self._server.should_exit = True


def serve(engine: Any, config: ServerConfig, host: str = LOOPBACK, port: int = 8080,
          sock: socket.socket | None = None, parallel: int | None = None,
          stop: StopSignals | None = None) -> signal.Signals | None:
    """Serve ``engine`` until SIGINT (Ctrl+C) or SIGTERM, in the calling thread; on ``sock`` when given (bound by
    :func:`bind_address` to ``host:port``), else on a socket bound here. Up to ``parallel`` requests' turns are
    decoded together (:class:`engine.session.Session`); 1 answers one request at a time; None: as many as the
    engine was loaded for (:func:`engine.session.engine_parallel`). ``stop``: the caller's handlers (to close
    more after this returns), else ones of its own. Returns the signal that stopped it (None: none did).

    Raises:
        EngineError: see :func:`check_bind` and :func:`bind_address`.
    """
    check_bind(host, config.api_key)
    if stop is None:
        with StopSignals() as own:
            return serve(engine, config, host, port, sock, parallel, own)
    sock = sock or bind_address(host, port)
    session = Session(parallel=parallel or engine_parallel(engine))
    server = _uvicorn_server(engine, config, host, port, session, cut_answers=True)
    stop.watch(server)
    try:
        server.run(sockets=[sock])
    finally:
        stop.closing()
        session.close()
    return stop.signal


class ServerThread:
    """The server on a background thread (the app's "Serve on localhost", the tests).

    Args:
        engine: the engine to serve (see :func:`engine.openai.app.create_app`).
        config: model name, key, body limit.
        host, port: where to listen; port 0 picks a free one (read :attr:`port` after :meth:`start`).
        session: the :class:`engine.session.Session` the engine's other users share; None = one of the
            server's own, closed by :meth:`stop`, running up to ``parallel`` turns together (None: as many as the
            engine was loaded for, :func:`engine.session.engine_parallel`).
    """

    def __init__(self, engine: Any, config: ServerConfig, host: str = LOOPBACK, port: int = 8080,
                 session: Session | None = None, parallel: int | None = None) -> None:
        check_bind(host, config.api_key)
        self.host = host
        self.port = port
        self._own = session is None
        self.session = session or Session(parallel=parallel or engine_parallel(engine))
        self._server = _uvicorn_server(engine, config, host, port, self.session)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL of the API (``http://host:port/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 10.0) -> "ServerThread":
        """Bind the address and start serving; returns once uvicorn listens.

        Raises:
            EngineError: the address could not be bound (in use, not this machine's), or the server did not
                start within ``timeout`` s.
        """
        sock = bind_address(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="engine-server",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            sock.close()
            raise EngineError(f"the server on {self.host}:{self.port} did not start")
        return self

    def stop(self) -> None:
        """Stop listening, end the running turn's stream and join the thread (and the server's own session)."""
        self._server.should_exit = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._own:
            self.session.close(timeout=10)
