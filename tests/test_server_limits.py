"""``engine serve`` (uvicorn, on loopback) against hostile clients: file: URLs to secrets, pipes, folders and
huge files; more images than the context holds; lone surrogates; a flood of waiting requests; clients that
connect and say nothing, or trickle their request head."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import threading
import time
import types

import httpx
import pytest

from engine.events import PrefillStats, TurnSummary
from engine.openai import ServerConfig, ServerThread

URL_PARAM = "messages[0].content[0].image_url.url"


def _body(model: str, *parts, **extra) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": list(parts)}], **extra}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _png(size=(8, 8)) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _post(server, body, **kw) -> httpx.Response:
    return httpx.post(server.url + "/chat/completions", json=body, timeout=60, **kw)


# ---- file: URLs -----------------------------------------------------------------------------------------


def test_a_file_that_is_not_an_image_is_named_so_and_never_quoted(served_vision, tmp_path) -> None:
    server, _ = served_vision
    secret = tmp_path / "id_rsa.png"
    secret.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY----- hunter2")
    r = _post(server, _body("tiny-vl", _image(secret.as_uri())))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == URL_PARAM
    assert error["message"] == f"{URL_PARAM}: not an image"


def test_missing_unreadable_folder_pipe_and_huge_files_get_one_answer(served_vision, tmp_path) -> None:
    server, _ = served_vision
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.png").mkdir()
    with open(tmp_path / "huge.png", "wb") as f:        # sparse: checked by size before anything is read
        f.write(_png())
        f.truncate(200 << 20)
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.png")
    names = ["missing.png", "pipe.png", "folder.png", "huge.png", "dangling.png"]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "zero.png", 0o020600, os.makedev(1, 5))     # a character device: /dev/zero
        names.append("zero.png")
    messages = set()
    for name in names:
        t0 = time.monotonic()
        r = _post(server, _body("tiny-vl", _image((tmp_path / name).as_uri())))
        assert r.status_code == 400 and time.monotonic() - t0 < 10, (name, r.text)
        messages.add(r.json()["error"]["message"])
    assert messages == {f"{URL_PARAM}: the file: URL does not name a readable regular file of at most 64 MiB"}


# ---- the context before any image is encoded ----------------------------------------------------------------


@pytest.mark.parametrize("count", [100, 600])
def test_too_many_images_are_refused_before_any_is_encoded(served_vision, monkeypatch, count) -> None:
    """100 images of 64 x 64 px (4 tokens each) (more tokens than the 512-token window) are measured, not encoded; 600
    do not
    fit even at one token each and are refused from the text alone."""
    server, engine = served_vision
    encoded = []
    real = engine.vision.encode
    monkeypatch.setattr(engine.vision, "encode", lambda *a, **k: encoded.append(1) or real(*a, **k))
    url = "data:image/png;base64," + base64.b64encode(_png((64, 64))).decode()
    r = _post(server, _body("tiny-vl", *[_image(url)] * count, {"type": "text", "text": "Which?"}))
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
    assert f"{count} images" in error["message"] and encoded == []


def test_images_that_fit_are_still_answered(served_vision) -> None:
    server, _ = served_vision
    url = "data:image/png;base64," + base64.b64encode(_png((64, 64))).decode()
    r = _post(server, _body("tiny-vl", _image(url), _image(url), {"type": "text", "text": "Which?"}))
    assert r.status_code == 200, r.text


# ---- text the tokenizer cannot take ---------------------------------------------------------------------------


@pytest.mark.parametrize("raw, param", [
    ('{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ('{"model": "tiny", "stop": ["x\\udc00"], "messages": [{"role": "user", "content": "hi"}]}', "stop[0]"),
    ('{"model": "tiny", "prompt": "\\ud83d"}', "prompt"),
])
def test_a_lone_surrogate_is_400_naming_its_field(served, raw, param) -> None:
    server = served[2]
    route = "/completions" if '"prompt"' in raw else "/chat/completions"
    r = httpx.post(server.url + route, content=raw.encode(), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "lone surrogate" in r.json()["error"]["message"]


# ---- the waiting queue --------------------------------------------------------------------------------------


class _Gated:
    """A served "engine" whose turns wait for ``gate`` (so requests pile up behind the first)."""

    info = types.SimpleNamespace(context=512, has_vision=False)

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = 0

    def chat(self, messages, sampling, cancel, enable_thinking=False, **_options):
        self.started += 1
        yield PrefillStats(prompt_tokens=1, reused_tokens=0, prefilled_tokens=1, prefill_ms=0.0, restore_ms=0.0,
                           device="cpu", ttft_ms=0.0)
        while not self.gate.wait(0.05) and not cancel.is_set():
            pass
        yield TurnSummary(stop_reason="eos", message="", prompt_tokens=1, reused_tokens=0, generated_tokens=0,
                          ttft_ms=0.0, prefill_tok_s=0.0, decode_tok_s=0.0, text="")


def _until_waiting(server, n: int) -> None:
    """Return once ``n`` requests wait for the engine (the server's ``deltadesk_queue_length``)."""
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=60).text
        if f"\ndeltadesk_queue_length {float(n)}\n" in text:
            return
        assert time.monotonic() < deadline, f"{n} requests never waited for the engine:\n{text}"
        time.sleep(0.02)


def _in_background(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_beyond_the_waiting_queue_requests_get_429_with_retry_after() -> None:
    engine = _Gated()
    server = ServerThread(engine, ServerConfig("m", max_waiting=2), port=0).start()
    body = _body("m", {"type": "text", "text": "hi"})
    try:
        running = [_in_background(lambda: _post(server, body))]
        deadline = time.monotonic() + 20
        while engine.started < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        waiting = [_in_background(lambda: _post(server, body)) for _ in range(2)]
        _until_waiting(server, 2)                  # both are queued behind the running turn
        r = _post(server, body)
        assert r.status_code == 429 and r.headers["Retry-After"].isdigit(), r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        engine.gate.set()
        for t, out in running + waiting:
            t.join(30)
            assert out and out[0].status_code == 200
        assert _post(server, body).status_code == 200              # the queue drained: served again
    finally:
        engine.gate.set()
        server.stop()


def test_waiting_bodies_are_bounded_in_bytes() -> None:
    engine = _Gated()
    server = ServerThread(engine, ServerConfig("m", max_waiting_bytes=4096), port=0).start()
    try:
        small = _body("m", {"type": "text", "text": "hi"})
        running = _in_background(lambda: _post(server, small))
        deadline = time.monotonic() + 20
        while engine.started < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = _post(server, _body("m", {"type": "text", "text": "x" * 8000}))
        assert r.status_code == 429 and "Retry-After" in r.headers, r.text
        engine.gate.set()
        running[0].join(30)
        assert running[1][0].status_code == 200
    finally:
        engine.gate.set()
        server.stop()


def test_a_full_engine_session_queue_is_429_with_retry_after() -> None:
    """The engine's session (shared with the app) holds its own bounded queue: a request it cannot take is a 429."""
    from engine.session import Session

    session, entered, leave, engine = Session(max_queued=1), threading.Event(), threading.Event(), _Gated()
    engine.gate.set()                                                       # its turns answer at once
    server = ServerThread(engine, ServerConfig("m"), port=0, session=session).start()
    try:
        busy = session.call(lambda: entered.set() or leave.wait(30))      # the app's own turn, say
        assert entered.wait(30)
        queued = session.call(lambda: "listed")                             # a snapshot listing waits behind it
        r = _post(server, _body("m", {"type": "text", "text": "hi"}))
        assert r.status_code == 429 and r.headers["Retry-After"].isdigit(), r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "queue holds 1 jobs" in r.text
        leave.set()
        assert busy.result(30) and queued.result(30) == "listed"
        engine_free = _post(server, _body("m", {"type": "text", "text": "hi"}))
        assert engine_free.status_code == 200, engine_free.text
    finally:
        leave.set()
        server.stop()
        session.close()


# ---- uvicorn's own limits on slow clients --------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes ``sock`` (sending ``trickle`` a byte at a time meanwhile), or None."""
    sock.settimeout(0.5)
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - t0
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - t0
            sent += 1
    return None


@pytest.mark.parametrize("trickle", [b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200],
                         ids=["silent", "trickled-head"])
def test_a_slow_client_is_cut_off_by_uvicorn(served, trickle) -> None:
    server = served[2]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        took = _closed_within(sock, 20, trickle)
    assert took is not None and took < 10, "a client that sends no whole request head was never cut off"


def test_a_request_head_of_a_mib_is_refused(served) -> None:
    server = served[2]
    try:
        status = httpx.get(server.url + "/models", headers={"X-Big": "a" * (1 << 20)}, timeout=30).status_code
    except (httpx.ReadError, httpx.WriteError):
        status = 400           # answered 400 and closed while the rest of the head was still being sent
    assert status in (400, 431)


def test_the_serve_command_takes_queue_limits(capsys) -> None:
    from engine.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(["serve", "--queue", "0"])
    assert info.value.code == 2 and "positive integer" in capsys.readouterr().err
    assert json.dumps(ServerConfig("m", max_waiting=3).max_waiting) == "3"


def test_the_messages_route_counts_against_the_same_queue() -> None:
    engine = _Gated()
    server = ServerThread(engine, ServerConfig("m", max_waiting=1), port=0).start()
    body = _body("m", {"type": "text", "text": "hi"})
    try:
        running = _in_background(lambda: _post(server, body))
        deadline = time.monotonic() + 20
        while engine.started < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        waiting = _in_background(lambda: _post(server, body))
        _until_waiting(server, 1)
        r = httpx.post(server.url + "/messages", timeout=60, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.headers["Retry-After"].isdigit(), r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        engine.gate.set()
        for t, out in (running, waiting):
            t.join(30)
            assert out and out[0].status_code == 200
    finally:
        engine.gate.set()
        server.stop()
