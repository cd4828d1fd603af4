"""Fake HTTP servers that misbehave (drop the connection mid-answer, stay silent, send an error event),
for the remote engine's tests."""

from __future__ import annotations

import socket
import threading
from typing import Self


def _read_request(conn: socket.socket) -> None:
    """Read one whole request (headers, then Content-Length bytes of body): a socket closed with unread
    bytes sends a reset instead of an orderly end of stream, which the client then reports as one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


def sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


def delta(text: str) -> bytes:
    return b'data: {"choices": [{"index": 0, "delta": {"content": "%s"}, "finish_reason": null}]}\n\n' % text.encode()


class ScriptServer:
    """An HTTP server on 127.0.0.1 that reads each request and then runs ``script(conn, stop)`` on a thread of
    its own (``stop`` is set by :meth:`close`, so a script that stalls or trickles ends with the test)."""

    def __init__(self, script) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.script = script
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        _read_request(conn)
        try:
            self.script(conn, self.stop)
        except OSError:
            pass                      # the client went away: what the test wanted
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            c.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RawServer(ScriptServer):
    """A :class:`ScriptServer` that answers each connection with ``reply`` bytes and then closes it (or,
    with ``reply=None``, reads the request and says nothing until the server is closed)."""

    def __init__(self, reply: bytes | None) -> None:
        super().__init__(lambda conn, stop: stop.wait() if reply is None else conn.sendall(reply))


def json_reply(body: bytes, status: str = "200 OK") -> bytes:
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (status.encode(), len(body)) + body


def paced(pieces: list[bytes], pause: float = 0.2):
    """A :class:`ScriptServer` script sending ``pieces`` ``pause`` seconds apart (an answer streaming at its
    pace), then keeping the connection open until the server is closed."""
    def script(conn: socket.socket, stop: threading.Event) -> None:
        for piece in pieces:
            conn.sendall(piece)
            if stop.wait(pause):
                return
        stop.wait()
    return script
