"""What the remote engine (:mod:`engine.openai.remote`) needs to read a server it does not trust.

* :class:`Watch` cuts a request's connection from a helper thread when the caller cancels or a deadline
  passes: it shuts the socket down (captured through httpcore's ``trace`` extension when the connection
  is made), which wakes a read blocked on it at once, so Stop takes effect within ``POLL_S`` even while
  the server is silent, and a stream of keep-alive comments or a body trickled a byte a second ends at
  its deadline instead of resetting the read timeout forever.
* :func:`lines` splits a streamed body into lines, each at most ``MAX_BYTES`` (never buffered whole
  beyond that); :func:`read_body` reads a whole body up to a bound.
* :func:`loads` parses JSON and turns nesting too deep for the parser into ``ValueError``.
* :func:`clean` makes a server's text safe to show: no control or format characters, bounded length.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import unicodedata
from collections.abc import Iterator
from typing import Any, Self

import httpx

MAX_BYTES = 16 << 20      # one SSE line, a model list or an error body, bytes
POLL_S = 0.05             # how often the watch looks at the cancel flag and the deadline, s


class Watch:
    """Cuts one request's connection when ``cancel`` is set or ``seconds`` pass without :meth:`progress`.

    Use as a context manager around the request, passing :attr:`extensions` to httpx (the client must not
    reuse connections, so every request connects anew and its socket is seen). After a cut, :attr:`fired`
    is "cancelled" or "deadline" and the read in progress fails with an ``httpx`` error.
    """

    def __init__(self, cancel: threading.Event | None, seconds: float) -> None:
        self.cancel = cancel
        self.seconds = seconds
        self.fired = ""
        self._deadline = time.monotonic() + seconds
        self._sockets: list[socket.socket] = []
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.extensions = {"trace": self._trace}

    def progress(self) -> None:
        """The server sent something that counts (a data line): the deadline starts again."""
        self._deadline = time.monotonic() + self.seconds

    def __enter__(self) -> Self:
        threading.Thread(target=self._run, name="remote-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith("connect_tcp.complete"):
            sock = info["return_value"].get_extra_info("socket")
            if isinstance(sock, socket.socket):
                with self._lock:
                    self._sockets.append(sock)
                if self.fired:
                    self._cut()

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            if self.cancel is not None and self.cancel.is_set():
                self.fired = "cancelled"
            elif time.monotonic() > self._deadline:
                self.fired = "deadline"
            else:
                continue
            self._cut()
            return

    def _cut(self) -> None:
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass          # already closed: nothing left to cut


def lines(response: httpx.Response, limit: int = MAX_BYTES) -> Iterator[str]:
    """The body's lines (``\\n`` or ``\\r\\n`` ended, decoded as UTF-8 with replacement), read as it streams.

    Raises:
        ValueError: a line longer than ``limit`` bytes (what had been read of it is dropped).
    """
    buffer = bytearray()
    for chunk in response.iter_bytes():
        seen = len(buffer)
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", max(start, seen))) >= 0:
            yield bytes(buffer[start:end]).rstrip(b"\r").decode("utf-8", "replace")
            start = seen = end + 1
        del buffer[:start]
        if len(buffer) > limit:
            raise ValueError(f"a line longer than {limit >> 20} MiB")
    if buffer:
        yield bytes(buffer).decode("utf-8", "replace")


def read_body(response: httpx.Response, limit: int = MAX_BYTES) -> bytes:
    """The whole body, read as it streams.

    Raises:
        ValueError: longer than ``limit`` bytes.
    """
    parts, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise ValueError(f"a body longer than {limit >> 20} MiB")
        parts.append(chunk)
    return b"".join(parts)


def loads(data: str | bytes) -> Any:
    """``json.loads``, with nesting too deep to parse reported as ``ValueError`` too."""
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deep") from exc


def clean(text: object, limit: int = 200) -> str:
    """``text`` as one safe line: control and format characters (escapes, bidi overrides) dropped, at most
    ``limit`` characters (an ellipsis when cut)."""
    out = "".join(c for c in str(text) if unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Zl", "Zp"))
    return out if len(out) <= limit else out[:limit] + "\u2026"
