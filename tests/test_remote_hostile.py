"""The remote engine against hostile servers on 127.0.0.1: silence while the user presses Stop, keep-alive
comments only, a model list trickled a byte at a time, lines and bodies over the bound, JSON nested too
deep, control characters and thousands of ids in errors, nonsense context sizes."""

from __future__ import annotations

import json
import logging
import threading
import time
import tracemalloc

import pytest
from http_fakes import ScriptServer, delta, json_reply, sse_head

from engine.errors import RemoteError
from engine.events import TokenEvent, TurnSummary
from engine.openai.remote import RemoteEngine, list_models

HI = [{"role": "user", "content": "Say hello."}]
DEEP = b"[" * 200_000 + b"]" * 200_000


def _run(fn, timeout: float) -> dict:
    """Run ``fn`` on a daemon thread; {"value" or "error", "seconds"} once it ends, or {} after ``timeout``."""
    box: dict = {}

    def go() -> None:
        t0 = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 -- the test inspects whatever it was
            box["error"] = exc
        box["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    return box


def _silent(head: bytes):
    def script(conn, stop):
        conn.sendall(head)
        stop.wait(120)
    return script


@pytest.mark.parametrize("head", [b"", sse_head() + delta("Hi")], ids=["before-headers", "mid-answer"])
def test_stop_takes_effect_while_the_server_is_silent(head) -> None:
    """Stop ends the turn while the server says nothing (in tens of ms: the watch polls every 50 ms; the
    bound allows a loaded machine and is far below the 120-s read timeout)."""
    with ScriptServer(_silent(head)) as srv:
        cancel = threading.Event()
        events: list = []
        gen = RemoteEngine(srv.url, "m", timeout=120).chat(HI, cancel=cancel)
        worker = threading.Thread(target=lambda: events.extend(gen), daemon=True)
        worker.start()
        time.sleep(0.5)                   # the request is out; the server says nothing more
        t0 = time.monotonic()
        cancel.set()
        worker.join(30)
        took = time.monotonic() - t0
    assert not worker.is_alive() and took < 10, f"Stop took {took:.2f} s"
    assert isinstance(events[-1], TurnSummary) and events[-1].stop_reason == "cancelled"
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == ("Hi" if head else "")


def test_keep_alive_comments_alone_end_at_the_deadline() -> None:
    def script(conn, stop):
        conn.sendall(sse_head() + delta("Hi"))
        while not stop.wait(0.1):
            conn.sendall(b": keep-alive\n\n")

    with ScriptServer(script) as srv:
        got = _run(lambda: list(RemoteEngine(srv.url, "m", timeout=1.0).chat(HI)), 15)
    assert got, "a stream of keep-alive comments never ended"
    assert isinstance(got.get("error"), RemoteError)
    assert "no answer within 1 s (no data, or only keep-alive" in str(got["error"])
    assert got["seconds"] < 5


def test_a_model_list_trickled_a_byte_at_a_time_ends_at_its_deadline() -> None:
    body = json.dumps({"data": [{"id": "m" * 200}]}).encode()

    def script(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        for byte in body:
            if stop.wait(0.1):
                return
            conn.sendall(bytes([byte]))

    with ScriptServer(script) as srv:
        got = _run(lambda: list_models(srv.url, timeout=1.0), 12)
    assert got, "a trickled model list never ended"
    assert isinstance(got.get("error"), RemoteError) and "did not arrive whole within 1 s" in str(got["error"])


def _send_big(prefix: bytes, size: int):
    blob = b"a" * size

    def script(conn, stop):
        conn.sendall(prefix)
        conn.sendall(blob)
    return script


@pytest.mark.parametrize("what", ["stream line", "model list"])
def test_a_line_or_body_over_16_mib_is_an_error_not_buffered_whole(what) -> None:
    size = 64 << 20
    if what == "stream line":
        script = _send_big(sse_head() + b"data: ", size)
    else:
        script = _send_big(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size, size)
    with ScriptServer(script) as srv:
        tracemalloc.start()
        try:
            call = (lambda: list(RemoteEngine(srv.url, "m", timeout=30).chat(HI))) if what == "stream line" else \
                (lambda: list_models(srv.url, timeout=30))
            got = _run(call, 60)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert isinstance(got.get("error"), RemoteError) and "longer than 16 MiB" in str(got["error"])
    assert peak < 40 << 20, f"{peak >> 20} MiB held"


def test_a_huge_error_body_is_read_only_in_part() -> None:
    with ScriptServer(_send_big(b"HTTP/1.1 500 Oops\r\ncontent-length: %d\r\n\r\n" % (64 << 20), 64 << 20)) as srv:
        got = _run(lambda: list(RemoteEngine(srv.url, "m", timeout=30).chat(HI)), 60)
    assert isinstance(got.get("error"), RemoteError) and "answered 500: Oops" in str(got["error"])


@pytest.mark.parametrize("where", ["stream line", "error body", "model list"])
def test_deeply_nested_json_is_a_remote_error(where) -> None:
    if where == "stream line":
        reply = sse_head() + delta("Hi") + b"data: " + DEEP + b"\n\n"
    elif where == "error body":
        reply = json_reply(DEEP, "500 Internal Server Error")
    else:
        reply = json_reply(DEEP)
    with ScriptServer(lambda conn, stop: conn.sendall(reply)) as srv:
        call = (lambda: list_models(srv.url, timeout=30)) if where == "model list" else \
            (lambda: list(RemoteEngine(srv.url, "m", timeout=30).chat(HI)))
        got = _run(call, 30)
    assert isinstance(got.get("error"), RemoteError), repr(got)


def test_error_messages_carry_no_control_characters() -> None:
    hostile = "red\x1b[2J\x1b]0;pwned\x07\u202eevil\r\nX-Injected: 1\x00"
    body = json.dumps({"error": {"message": hostile}}).encode()
    for reply in (json_reply(body, "400 Bad Request"),
                  sse_head() + delta("Hi") + b"data: " + body + b"\n\n"):
        with ScriptServer(lambda conn, stop, reply=reply: conn.sendall(reply)) as srv:
            got = _run(lambda srv=srv: list(RemoteEngine(srv.url, "m", timeout=30).chat(HI)), 30)
        message = str(got["error"])
        assert isinstance(got["error"], RemoteError) and "red" in message and "evil" in message
        assert not any(c in message for c in "\x1b\x07\u202e\r\n\x00"), repr(message)


def test_a_refusal_names_at_most_a_few_of_thousands_of_model_ids() -> None:
    body = json.dumps({"data": [{"id": f"model-{i}\x1b[1m"} for i in range(5000)]}).encode()
    with ScriptServer(lambda conn, stop: conn.sendall(json_reply(body))) as srv, \
            pytest.raises(RemoteError) as info:
        RemoteEngine.connect(srv.url, "wanted")
    message = str(info.value)
    assert "model-0" in message and "model-4" in message and "model-5," not in message
    assert "and 4995 more" in message and "\x1b" not in message and len(message) < 600


@pytest.mark.parametrize("value", [-5, 0, 10**8, 10**30, 1.5, "512", True, [512], None])
def test_a_context_that_is_not_a_sane_positive_integer_is_ignored_with_a_note(value, caplog) -> None:
    body = json.dumps({"data": [{"id": "m", "max_model_len": value}]}).encode()
    with ScriptServer(lambda conn, stop: conn.sendall(json_reply(body))) as srv, \
            caplog.at_level(logging.WARNING, logger="engine.openai.remote"):
        eng = RemoteEngine.connect(srv.url, "m")
    assert eng.info.context == 0
    assert any("max_model_len" in r.getMessage() for r in caplog.records) == (value is not None)


def test_a_sane_context_is_kept() -> None:
    body = json.dumps({"data": [{"id": "m", "max_model_len": 32768}]}).encode()
    with ScriptServer(lambda conn, stop: conn.sendall(json_reply(body))) as srv:
        assert RemoteEngine.connect(srv.url, "m").info.context == 32768
