"""Fake HTTP servers that misbehave (drop the connection mid-answer, stay silent, send an error event),
for the remote engine's tests."""

from __future__ import annotations

import socket
import threading
import time


class RawServer:
    """A one-shot HTTP server that answers each connection with ``reply`` bytes and then closes it (or,
    with ``reply=None``, reads the request and says nothing)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.reply = reply
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            _read_request(conn)
            if self.reply is not None:
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


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


class OpenServer(RawServer):
    """Like :class:`RawServer`, but ``pieces`` are sent ``pause`` seconds apart (an answer streaming at its
    pace), and the connection stays open after the last one until :meth:`close`."""

    def __init__(self, pieces: list[bytes], pause: float = 0.2) -> None:
        self.pieces, self.pause = pieces, pause
        super().__init__(None)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            _read_request(conn)
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket) -> None:
        for piece in self.pieces:
            try:
                conn.sendall(piece)
            except OSError:
                return
            time.sleep(self.pause)
