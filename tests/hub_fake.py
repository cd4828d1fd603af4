"""A fake Hugging Face hub on 127.0.0.1 for the real ``huggingface_hub`` client (set ``HF_ENDPOINT`` to
``FakeHub.url``). It serves the routes the client uses:

* ``GET /api/models/{owner}/{name}[/revision/{rev}]``: id, sha, gated, siblings with size and ``lfs``
  (sha256, size, pointerSize), as ``HfApi.model_info(files_metadata=True)`` reads them;
* ``HEAD``/``GET /{owner}/{name}/resolve/{rev}/{file}``: a 302 to a second origin (the "CDN", another port:
  the client does not follow it on HEAD and drops the token on GET) with ``X-Repo-Commit``, ``X-Linked-Etag``
  and ``X-Linked-Size``;
* ``GET /blob/{sha256}`` on the CDN: the bytes, with ``Range`` (206 + ``Content-Range``).

Errors as the hub sends them: ``X-Error-Code: RepoNotFound`` / ``EntryNotFound`` / ``GatedRepo`` (404 / 404 /
403), and 401 with ``X-Error-Message: Invalid credentials in Authorization header`` for a token not in
``tokens``. Faults to inject: ``drop_after`` (close the connection after that many body bytes, once per
blob), ``corrupt`` (serve other bytes than the listed sha256), ``delay`` (seconds per 64 KiB chunk),
``stall_after`` (once: stop sending after that many body bytes until ``release`` is set, at most 30 s),
``redirect_loop`` (the CDN redirects every blob to itself), ``short`` (every answer ends, cleanly, after that
many body bytes), ``listed_sha256`` (this string instead of each
file's sha256 in the listing).
Every request is logged in ``requests`` as (method, path, Range header, Authorization header).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_CHUNK = 64 << 10


@dataclass
class FakeRepo:
    """One repository: ``files`` name -> bytes; ``gated`` needs a token from the hub's ``tokens``."""

    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False


@dataclass
class FakeHub:
    """The fake hub; ``start()`` binds both origins on 127.0.0.1, ``close()`` stops them."""

    repos: dict[str, FakeRepo] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)
    drop_after: int | None = None
    corrupt: bool = False
    delay: float = 0.0
    stall_after: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    redirect_loop: bool = False
    short: int | None = None
    listed_sha256: str | None = None
    requests: list[tuple[str, str, str, str]] = field(default_factory=list)
    _dropped: set[str] = field(default_factory=set)

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return None

            def do_HEAD(self) -> None:
                hub._route(self, head=True)

            def do_GET(self) -> None:
                hub._route(self, head=False)

        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
        for s in self._servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._servers[0].server_port}"
        self.cdn = f"http://127.0.0.1:{self._servers[1].server_port}"
        return self

    def close(self) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def blobs(self) -> dict[str, bytes]:
        """sha256 -> bytes of every file served."""
        return {hashlib.sha256(b).hexdigest(): b for r in self.repos.values() for b in r.files.values()}

    # ---- routing -----------------------------------------------------------------------------------
    def _route(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        auth = h.headers.get("Authorization", "")
        self.requests.append((h.command, h.path, h.headers.get("Range", ""), auth))
        path = h.path.split("?")[0]
        if auth and auth.removeprefix("Bearer ") not in self.tokens:
            return _send(h, 401, b"", {"X-Error-Message": "Invalid credentials in Authorization header"}, head)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            return self._info(h, m.group(1), head)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._resolve(h, m.group(1), m.group(3), bool(auth), head)
        if m := re.fullmatch(r"/blob/([0-9a-f]{64})", path):
            return self._blob(h, m.group(1), head)
        _send(h, 404, b"", {}, head)

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, head)
        siblings = [{"rfilename": "README.md", "size": 5, "blobId": "0" * 40}]
        for name, data in repo.files.items():
            sha = hashlib.sha256(data).hexdigest()
            listed = self.listed_sha256 or sha
            siblings.append({"rfilename": name, "size": len(data), "blobId": sha[:40],
                             "lfs": {"sha256": listed, "size": len(data), "pointerSize": 134}})
        body = json.dumps({"id": repo_id, "sha": repo.sha, "gated": "auto" if repo.gated else False,
                           "private": False, "siblings": siblings}).encode()
        _send(h, 200, body, {"Content-Type": "application/json"}, head)

    def _resolve(self, h: BaseHTTPRequestHandler, repo_id: str, name: str, authed: bool, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, head)
        if repo.gated and not authed:
            return _send(h, 403, b"", {"X-Error-Code": "GatedRepo", "X-Repo-Commit": repo.sha}, head)
        data = repo.files.get(name)
        if data is None:
            return _send(h, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha}, head)
        sha = hashlib.sha256(data).hexdigest()
        _send(h, 302, b"", {"Location": f"{self.cdn}/blob/{sha}", "X-Repo-Commit": repo.sha,
                            "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)), "ETag": '"git-oid"'}, head)

    def _blob(self, h: BaseHTTPRequestHandler, sha: str, head: bool) -> None:
        data = self.blobs().get(sha)
        if data is None:
            return _send(h, 404, b"", {}, head)
        if self.redirect_loop:
            return _send(h, 302, b"", {"Location": f"{self.cdn}/blob/{sha}"}, head)
        if self.corrupt:
            data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        start, status, extra = 0, 200, {}
        if m := re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range", "")):
            start = int(m.group(1))
            stop = min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data))
            status, extra = 206, {"Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"}
            data_out = data[start:stop]
        else:
            data_out = data
        if self.short is not None:
            data_out = data_out[:self.short]
        h.send_response(status)
        for k, v in {"Content-Length": str(len(data_out)), "Accept-Ranges": "bytes", **extra}.items():
            h.send_header(k, v)
        h.end_headers()
        if head:
            return
        cut = None
        if self.drop_after is not None and sha not in self._dropped and len(data_out) > self.drop_after:
            self._dropped.add(sha)
            cut = self.drop_after
        self._write(h, data_out if cut is None else data_out[:cut])
        if cut is not None:
            h.close_connection = True

    def _write(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        import time
        try:
            for i in range(0, len(body), _CHUNK):
                if self.stall_after is not None and i >= self.stall_after:
                    self.stall_after = None
                    h.wfile.flush()
                    self.release.wait(30)
                    return
                h.wfile.write(body[i:i + _CHUNK])
                if self.delay:
                    h.wfile.flush()
                    time.sleep(self.delay)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
    h.send_response(status)
    for k, v in {"Content-Length": str(len(body)), **headers}.items():
        h.send_header(k, v)
    h.end_headers()
    if not head:
        h.wfile.write(body)
