"""``engine serve`` on loopback, driven by the official ``openai`` client and by raw HTTP:
answers equal the in-process engine's, streams end with ``data: [DONE]``, usage counts the tokens
resumed from a snapshot, and every bad request gets the OpenAI error shape with its status."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import openai
import pytest

from engine.__main__ import main
from engine.errors import EngineError
from engine.events import TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.openai import ServerConfig, ServerThread, check_bind, is_loopback

CONTEXT = 512
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tiny(synth_model):
    return synth_model("tiny", "q8_0")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _direct(engine, hold, messages=HI, n=8, **kw) -> TurnSummary:
    """The in-process answer, the engine held as a job of its session holds it."""
    with hold:
        return [e for e in engine.chat(messages, SamplingParams.greedy(n), **kw) if isinstance(e, TurnSummary)][-1]


def test_non_streaming_chat_equals_the_in_process_answer(client, engine, hold) -> None:
    want = _direct(engine, hold)
    assert "<think>" not in want.text and "</think>" not in want.text
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text.lstrip()
    assert choice.finish_reason == "length" and got.object == "chat.completion"
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == 8
    assert got.usage.total_tokens == want.prompt_tokens + 8


def test_streaming_chat_matches_and_ends_with_usage(client) -> None:
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(server) -> None:
    body = {"model": "tiny", "messages": HI, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_cached_tokens_count_the_resumed_prefix(client, engine) -> None:
    """A repeated prompt resumes whole from the end-of-prompt snapshot; the next turn resumes from the
    deepest snapshot point (message boundary) the two prompts share."""
    engine.clear_snapshots()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Another."}]
    old, new = engine.render(messages), engine.render(follow)
    shared = next(i for i, (a, b) in enumerate(zip(old + [-1], new)) if a != b)
    expected = max(p for p in engine.checkpoints(old) + [len(old)] if p <= shared)
    third = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4, temperature=0)
    assert third.usage.prompt_tokens == len(new)
    assert third.usage.prompt_tokens_details.cached_tokens == expected > 0


def test_sampling_parameters_reach_the_engine(client) -> None:
    def ask(**kw):
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, **kw).choices[0].message.content

    greedy = ask(temperature=0)
    assert ask(temperature=1.0, extra_body={"top_k": 1}) == greedy          # top-k 1 is greedy at any temperature
    assert ask(temperature=1.5, top_p=1.0, seed=7) == ask(temperature=1.5, top_p=1.0, seed=7)
    draws = {ask(temperature=1.5, top_p=1.0, extra_body={"top_k": 0}, seed=s) for s in range(4)}
    assert len(draws) > 1


def test_stop_string_cuts_the_answer(client) -> None:
    full = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0, stop=stop,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.find(stop)]


def test_thinking_is_returned_as_reasoning_content(client, engine, hold) -> None:
    want = _direct(engine, hold, n=6, enable_thinking=True)
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = got.choices[0].message
    assert got.usage.prompt_tokens == want.prompt_tokens != len(engine.render(HI))
    assert "</think>" not in want.text                  # this babbling model never closes its think block,
    assert message.reasoning_content == want.text.strip() and message.content == ""   # so all of it is reasoning


def test_raw_completion_equals_engine_complete(client, engine, hold) -> None:
    with hold:
        want = [e for e in engine.complete("Once upon a time", SamplingParams.greedy(6))
                if isinstance(e, TurnSummary)][-1]
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == want.prompt_tokens
    streamed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_models_and_health(client, server) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny"] and listed[0].max_model_len == CONTEXT
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def _error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error["message"]


@pytest.mark.parametrize("body, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    (b'{"model": "tiny", "messages": [], "temperature": NaN}', 400, "invalid_json", None),
    (b"[1, 2]", 400, None, None),
    (b"[" * 100_000, 400, "invalid_json", None),                       # nesting deeper than the parser goes
    (b'{"model": "tiny", "messages": "\xff\xfe"}', 400, "invalid_json", None),   # not UTF-8
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found", "model"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, None, "model"),
    (b'{"model": "tiny", "messages": []}', 400, None, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}', 400, None, "messages[0].role"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, None,
     "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, None, "max_tokens"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 1000}', 400, None, "n"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "audio"}]}]}', 400, None,
     "messages[0].content[0]"),
])
def test_bad_requests_get_openai_errors(server, body, status, code, param) -> None:
    r = httpx.post(server.url + "/chat/completions", content=body, headers={"content-type": "application/json"})
    _error(r, status, code, param)


def test_the_openai_client_raises_on_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=HI)
    with pytest.raises(openai.BadRequestError, match="context window holds 512"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 600}])
    with pytest.raises(openai.BadRequestError, match="no vision tower"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_unknown_routes_and_methods(server) -> None:
    _error(httpx.get(server.url + "/nothing"), 404)
    _error(httpx.get(server.url + "/chat/completions"), 405)


def test_prompt_over_the_context_is_400(server) -> None:
    body = {"model": "tiny", "prompt": "word " * 600, "max_tokens": 2}
    assert "context window holds 512" in _error(httpx.post(server.url + "/completions", json=body), 400,
                                                "context_length_exceeded")


def test_text_too_large_for_the_context_whatever_its_tokens_is_400(server, engine) -> None:
    text = "x" * (CONTEXT * engine.tokenizer.max_token_bytes + 1)    # Engine.render refuses it before tokenizing
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    assert "context window holds 512" in _error(httpx.post(server.url + "/chat/completions", json=body), 400,
                                                "context_length_exceeded", "messages")


def test_a_raw_prompt_too_large_for_the_context_whatever_its_tokens_is_400(server, engine) -> None:
    text = "x" * (CONTEXT * engine.tokenizer.max_token_bytes + 1)    # refused before tokenizing
    body = {"model": "tiny", "prompt": text, "max_tokens": 2}
    message = _error(httpx.post(server.url + "/completions", json=body), 400, "context_length_exceeded")
    assert "context window holds 512" in message and f"{len(text):,} bytes of text" in message


def test_too_large_a_body_is_413(engine, hold) -> None:
    srv = ServerThread(engine, ServerConfig("tiny", max_body_bytes=4096), port=0, session=hold.session).start()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
        _error(httpx.post(srv.url + "/chat/completions", json=body), 413, "request_too_large")
    finally:
        srv.stop()


def test_api_key_is_required_when_set(engine, hold) -> None:
    srv = ServerThread(engine, ServerConfig("tiny", api_key="s3cret"), port=0, session=hold.session).start()
    try:
        body = {"model": "tiny", "messages": HI, "max_tokens": 1}
        _error(httpx.post(srv.url + "/chat/completions", json=body), 401, "invalid_api_key")
        _error(httpx.post(srv.url + "/chat/completions", json=body, headers={"Authorization": "Bearer s3cre"}), 401)
        _error(httpx.get(srv.url + "/models", headers={"Authorization": "Bearer wrong"}), 401)
        ok = openai.OpenAI(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=HI, max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url, api_key="nope", max_retries=0).models.list()
        assert httpx.get(srv.url.removesuffix("/v1") + "/health").status_code == 200
    finally:
        srv.stop()


def test_binding_beyond_loopback_needs_a_key(tiny, capsys) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.com")
    check_bind("0.0.0.0", "k")
    with pytest.raises(EngineError, match="without an API key"):
        check_bind("0.0.0.0", None)
    assert main(["serve", "--model", str(tiny), "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_serve_keeps_snapshots_in_the_cache_dir(tiny, tmp_path) -> None:
    from engine.__main__ import _load, build_parser
    args = build_parser().parse_args(["serve", "--model", str(tiny), "--context", "256", "--cache-dir", str(tmp_path)])
    engine = _load(args, tiny, None)
    try:
        assert engine.options.cache_disk_dir == tmp_path
        for _ in engine.chat([{"role": "user", "content": "Remember this."}], SamplingParams(max_tokens=2)):
            pass
    finally:
        engine.close()                                       # persists the RAM snapshots to the disk tier
    assert list(tmp_path.rglob("*.snap"))


class _Recording:
    """The served engine, recording each turn's summary and when each turn ran (on the engine's thread)."""

    def __init__(self, engine) -> None:
        self.engine, self.summaries, self.spans = engine, [], []

    @property
    def info(self):
        return self.engine.info

    def chat(self, *args, **kwargs):
        start = time.monotonic()
        for event in self.engine.chat(*args, **kwargs):
            if isinstance(event, TurnSummary):
                self.summaries.append(event)
                self.spans.append((start, time.monotonic()))
            yield event


def _ask_three(srv, session) -> tuple[list[str], list[threading.Thread]]:
    """Three streamed requests queued while ``session`` is held, then let go together; their answers."""
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    answers = [""] * 3

    def ask(k: int) -> None:
        for chunk in client.chat.completions.create(model="tiny", max_tokens=10, temperature=0, stream=True,
                                                    messages=[{"role": "user", "content": f"Count {k}."}]):
            answers[k] += (chunk.choices[0].delta.content or "") if chunk.choices else ""

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    assert _until(lambda: len(session._queued) == 3)      # all three wait behind the holding call
    return answers, threads


@pytest.mark.parametrize("parallel", [1, 4])
def test_requests_run_together_up_to_parallel_and_answer_as_alone(engine, hold, parallel) -> None:
    """With ``parallel`` 1 no two turns overlap; with 4 the three queued requests run at once; either way each
    answer equals its in-process one."""
    want = [_direct(engine, hold, [{"role": "user", "content": f"Count {k}."}], n=10).text for k in range(3)]
    rec = _Recording(engine)
    with hold:
        srv = ServerThread(rec, ServerConfig("tiny"), port=0, parallel=parallel).start()
        try:
            hold_own = type(hold)(srv.session)
            with hold_own:
                answers, threads = _ask_three(srv, srv.session)
            for t in threads:
                t.join()
        finally:
            srv.stop()
    spans = sorted(rec.spans)
    apart = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert len(spans) == 3 and apart == (parallel == 1)
    assert answers == want


class _Pausing(_Recording):
    """:class:`_Recording` whose turns stop after ``after`` tokens until their cancel flag is set (the
    server's, the third argument of ``chat``) or 60 s pass: a turn still running when its client leaves."""

    def __init__(self, engine, after: int) -> None:
        super().__init__(engine)
        self.after = after

    def chat(self, *args, **kwargs):
        tokens = 0
        for event in super().chat(*args, **kwargs):
            yield event
            tokens += isinstance(event, TokenEvent)
            if tokens == self.after:
                args[2].wait(60)


def _until(condition, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_client_that_disconnects_stops_its_turn(engine, hold) -> None:
    rec = _Pausing(engine, after=3)
    srv = ServerThread(rec, ServerConfig("tiny"), port=0, session=hold.session).start()
    try:
        body = {"model": "tiny", "messages": HI, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/chat/completions", json=body, timeout=60) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= 4:
                    break
        assert _until(lambda: rec.summaries)
        assert rec.summaries[0].stop_reason == "cancelled" and rec.summaries[0].generated_tokens < 400
    finally:
        srv.stop()


def test_a_queued_client_that_disconnects_never_runs(engine, hold, caplog) -> None:
    import logging

    rec = _Recording(engine)
    srv = ServerThread(rec, ServerConfig("tiny"), port=0, session=hold.session).start()
    try:
        with caplog.at_level(logging.DEBUG, logger="engine.openai.app"):
            with hold:   # the engine is busy (as with the app's own turn): the request waits
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(srv.url + "/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2},
                               timeout=0.5)
                assert _until(lambda: any("disconnected" in r.getMessage() for r in caplog.records))
        hold.session.call(lambda: None).result(60)      # every job queued before this one has ended
        assert rec.summaries == []
    finally:
        srv.stop()


def test_a_request_stops_the_apps_read_ahead_instead_of_waiting_for_it(engine, hold, server, monkeypatch) -> None:
    """The app reads a chat ahead as a low-priority job of the session the server shares
    (``EngineWorker._read_ahead``); a served request arriving meanwhile stops it at its next piece rather
    than wait for the whole read."""
    from engine import api

    reading = threading.Event()

    def slow_read_ahead(turn):
        reading.set()
        turn.cancel.wait(60)                   # a long read, still going unless told to stop
        return real_read_ahead(turn)

    real_read_ahead = api.read_ahead
    monkeypatch.setattr(api, "read_ahead", slow_read_ahead)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 50}]
    ahead = hold.session.read_ahead(lambda cancel: engine.prefill_ahead(messages, cancel=cancel))
    assert reading.wait(60)
    r = httpx.post(server.url + "/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2,
                                                            "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert ahead.result(60) is None            # stopped, not read to its end after the 60 s wait


@pytest.fixture(scope="module")
def vision_server(served_vision):
    return served_vision


def _png(colour=(200, 30, 30)) -> bytes:
    from PIL import Image, ImageDraw
    im = Image.new("RGB", (64, 48), (240, 240, 240))
    ImageDraw.Draw(im).ellipse((8, 8, 40, 40), fill=colour)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def test_image_parts_as_data_and_file_urls(vision_server, tmp_path) -> None:
    srv, eng = vision_server
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    png = _png()
    path = tmp_path / "red dot.png"
    path.write_bytes(png)

    def ask(url: str):
        return client.chat.completions.create(model="tiny-vl", max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Colour?"}]}])

    by_data = ask("data:image/png;base64," + base64.b64encode(png).decode())
    by_file = ask(path.as_uri())
    direct = eng.prepare([{"role": "user", "content": [{"type": "image", "image": png},
                                                       {"type": "text", "text": "Colour?"}]}])
    assert by_data.usage.prompt_tokens == len(direct.tokens) == by_file.usage.prompt_tokens
    assert len(direct.tokens) > len(eng.render([{"role": "user", "content": "Colour?"}])) + 2
    assert by_data.choices[0].message.content == by_file.choices[0].message.content


@pytest.mark.parametrize("url, status, fragment", [
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), 400, "not an image"),
    ("data:image/png;base64,@@@", 400, "base64"),
    ("data:image/png,rawbytes", 400, "base64"),
    ("https://example.com/cat.png", 400, "not fetched"),
    ("file:///nonexistent/cat.png", 400, "does not name a readable regular file"),
    ("file://otherhost/cat.png", 400, "this machine"),
])
def test_unreadable_images_are_400(vision_server, url, status, fragment) -> None:
    srv, _ = vision_server
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    r = httpx.post(srv.url + "/chat/completions", json=body, timeout=60)
    assert fragment in _error(r, status, "invalid_image") and r.json()["error"]["param"].startswith("messages")


def test_a_port_in_use_is_a_clear_error(engine, hold, server) -> None:
    with pytest.raises(EngineError, match=f"could not listen on 127.0.0.1:{server.port}: Address already in use"):
        ServerThread(engine, ServerConfig("tiny"), port=server.port, session=hold.session).start(timeout=5)
