"""``engine.openai.remote.RemoteEngine`` against ``engine serve`` on loopback, and against broken servers (refused
connection, silence, a connection dropped mid-answer)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from engine.errors import ImageError, RemoteError, UnsupportedModelError
from engine.events import PrefillStats, TokenEvent, TurnSummary
from engine.openai.remote import RemoteEngine, list_models
from engine.sampling import SamplingParams
from engine.openai import ServerConfig, ServerThread
from http_fakes import RawServer, delta, sse_head

HI = [{"role": "user", "content": "Say hello."}]


def _turn(events) -> tuple[list, TurnSummary]:
    events = list(events)
    assert isinstance(events[-1], TurnSummary)
    return events, events[-1]


@pytest.fixture(scope="module")
def remote(served):
    eng = RemoteEngine.connect(served[2].url, "tiny", timeout=60)
    yield eng
    eng.close()


def test_connect_reads_the_model_list(remote, served) -> None:
    assert [m["id"] for m in list_models(served[2].url)] == ["tiny"]
    info = remote.info
    got = (info.remote, info.name, info.context, info.has_vision, info.path)
    assert got == (served[2].url, "tiny", 512, False, None)
    with pytest.raises(RemoteError, match=r"does not serve a model named 'big' \(it lists: tiny\)"):
        RemoteEngine.connect(served[2].url, "big")


def test_a_remote_turn_equals_the_in_process_one(remote, served) -> None:
    engine, hold, _ = served
    with hold:
        want = [e for e in engine.chat(HI, SamplingParams.greedy(8)) if isinstance(e, TurnSummary)][-1]
    events, got = _turn(remote.chat(HI, SamplingParams.greedy(8)))
    assert isinstance(events[0], PrefillStats) and events[0].device == "remote"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert "".join(t.text for t in tokens) == got.text == want.text.lstrip()
    assert (got.stop_reason, got.prompt_tokens, got.generated_tokens) == ("max_tokens", want.prompt_tokens, 8)
    assert got.ttft_ms > 0 and len(got.token_ms) == len(tokens)


def test_cached_tokens_come_from_usage(remote, served) -> None:
    served[0].clear_snapshots()
    _, first = _turn(remote.chat(HI, SamplingParams.greedy(3)))
    _, again = _turn(remote.chat(HI, SamplingParams.greedy(3)))
    assert first.reused_tokens == 0 and again.reused_tokens == again.prompt_tokens > 0


def test_thinking_comes_back_inside_think_tags(remote) -> None:
    _, got = _turn(remote.chat(HI, SamplingParams.greedy(5), enable_thinking=True))
    assert got.text and not got.text.startswith("<think>")   # the prompt opened the block: text starts inside it


def test_cancel_stops_the_remote_turn(remote) -> None:
    cancel = threading.Event()
    seen = 0
    for event in remote.chat(HI, SamplingParams.greedy(300), cancel):
        if isinstance(event, TokenEvent):
            seen += 1
            if seen == 2:
                cancel.set()
        last = event
    assert isinstance(last, TurnSummary) and last.stop_reason == "cancelled" and last.generated_tokens == 2


def test_an_image_for_a_text_only_server_is_its_error(remote, tmp_path) -> None:
    img = tmp_path / "x.png"
    from PIL import Image
    Image.new("RGB", (8, 8)).save(img)
    with pytest.raises(RemoteError, match="answered 400: .*no vision tower"):
        list(remote.chat([{"role": "user", "content": [{"type": "image", "image": str(img)}]}]))
    with pytest.raises(ImageError, match="missing.png"):
        remote.chat([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "missing.png")}]}])
    with pytest.raises(UnsupportedModelError):
        remote.image_info(str(img))


def test_images_reach_a_vision_server(served_vision, tmp_path) -> None:
    server, engine = served_vision
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (64, 48), (240, 240, 240))
    ImageDraw.Draw(img).ellipse((8, 8, 40, 40), fill=(30, 30, 200))
    path = tmp_path / "blue.png"
    img.save(path)
    remote = RemoteEngine.connect(server.url, "tiny-vl")
    assert remote.info.has_vision
    messages = [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                             {"type": "text", "text": "Colour?"}]}]
    _, got = _turn(remote.chat(messages, SamplingParams.greedy(4)))
    assert got.prompt_tokens == len(engine.prepare(messages).tokens) and got.generated_tokens == 4
    remote.close()


def test_a_wrong_key_is_refused_with_a_hint(served) -> None:
    srv = ServerThread(served[0], ServerConfig("tiny", api_key="k1"), port=0, session=served[1].session).start()
    try:
        with pytest.raises(RemoteError, match="answered 401 .check the API key"):
            RemoteEngine.connect(srv.url, "tiny", api_key="k2")
        assert RemoteEngine.connect(srv.url, "tiny", api_key="k1").info.name == "tiny"
    finally:
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(RemoteError, match=f"cannot reach {url}/models"):
        RemoteEngine.connect(url, "tiny")
    with pytest.raises(RemoteError, match="cannot reach"):
        list(RemoteEngine(url, "tiny").chat(HI))


def test_a_connection_dropped_mid_answer_keeps_what_arrived() -> None:
    srv = RawServer(sse_head() + delta("Hel") + delta("lo"))
    try:
        events = []
        with pytest.raises(RemoteError, match="without 'data: \\[DONE\\]' after 2 pieces.*partial answer is kept"):
            for event in RemoteEngine(srv.url, "m", timeout=30).chat(HI):
                events.append(event)
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "Hello"
    finally:
        srv.close()


def test_a_silent_server_times_out() -> None:
    srv = RawServer(None)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="no answer within 0.5 s"):
            list(RemoteEngine(srv.url, "m", timeout=0.5).chat(HI))
        assert time.monotonic() - t0 < 60          # gave up, not hung: the silent server never answers
    finally:
        srv.close()


def test_an_error_event_in_the_stream_is_raised_after_the_text() -> None:
    srv = RawServer(sse_head() + delta("Par") + b'data: {"error": {"message": "GPU fell over"}}\n\n')
    try:
        events = []
        with pytest.raises(RemoteError, match="reported an error mid-answer: GPU fell over"):
            for event in RemoteEngine(srv.url, "m", timeout=30).chat(HI):
                events.append(event)
        assert [e.text for e in events if isinstance(e, TokenEvent)] == ["Par"]
    finally:
        srv.close()


def test_reasoning_content_is_rewrapped_for_the_app() -> None:
    chunks = (b'data: {"choices": [{"delta": {"reasoning_content": "hmm"}}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "Red."}, "finish_reason": "stop"}]}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, '
              b'"prompt_tokens_details": {"cached_tokens": 6}}}\n\ndata: [DONE]\n\n')
    for thinking, text in ((True, "hmm</think>\n\nRed."), (False, "<think>hmm</think>\n\nRed.")):
        srv = RawServer(sse_head() + chunks)
        try:
            _, got = _turn(RemoteEngine(srv.url, "m", timeout=30).chat(HI, enable_thinking=thinking))
        finally:
            srv.close()
        assert got.text == text and got.stop_reason == "eos"
        assert (got.prompt_tokens, got.reused_tokens, got.generated_tokens) == (9, 6, 4)


def _channels(events) -> list:
    """The answer's parts, adjacent text of one channel joined."""
    out: list = []
    for channel, text in [p for e in events if isinstance(e, TokenEvent) for p in e.parts] + list(events[-1].parts):
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))
    return out


def _sse(deltas: list[dict]) -> bytes:
    lines = [b"data: " + json.dumps({"choices": [{"delta": d}]}).encode() + b"\n\n" for d in deltas]
    return sse_head() + b"".join(lines) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("thinking, deltas, want", [
    (True, [{"reasoning_content": "hmm"}, {"content": "<think>Red."}],
     [("reasoning", "hmm"), ("content", "<think>Red.")]),
    (False, [{"reasoning": "a"}, {"reasoning": "b", "content": ""}, {"content": "C"}],
     [("reasoning", "ab"), ("content", "C")]),
    (True, [{"content": "plan\n</th"}, {"content": "ink>\n\nRed."}],
     [("reasoning", "plan\n"), ("content", "\n\nRed.")]),
    (False, [{"content": " <th"}, {"content": "ink>x</think>Y"}], [("reasoning", "x"), ("content", "Y")]),
    (False, [{"content": "Just <think> text"}], [("content", "Just <think> text")]),
    (True, [{"content": "cut </thi"}], [("reasoning", "cut </thi")]),
])
def test_the_servers_reasoning_or_raw_text_becomes_channels(thinking, deltas, want) -> None:
    """A server's ``reasoning_content`` is the reasoning channel and its content then is content; raw text
    (no reasoning field) is split by the ``<think>`` markers, inside the block from the start when thinking
    was asked for (the template opened it)."""
    srv = RawServer(_sse(deltas))
    try:
        events, _ = _turn(RemoteEngine(srv.url, "m", timeout=30).chat(HI, enable_thinking=thinking))
    finally:
        srv.close()
    assert _channels(events) == want
    assert all(e.channel == e.parts[-1][0] for e in events if isinstance(e, TokenEvent) and e.parts)


def test_hostile_finish_reason_and_usage_values_are_ignored() -> None:
    """A server's odd finish_reason (a list) or usage counts (negative, true, text) are not trusted:
    the turn still ends with a summary, counting what arrived."""
    chunks = (delta("Hi") + b'data: {"choices": [{"delta": {}, "finish_reason": ["stop"]}]}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": -9, "completion_tokens": true, '
              b'"prompt_tokens_details": {"cached_tokens": "6"}}}\n\ndata: [DONE]\n\n')
    srv = RawServer(sse_head() + chunks)
    try:
        _, got = _turn(RemoteEngine(srv.url, "m", timeout=30).chat(HI))
    finally:
        srv.close()
    assert got.text == "Hi" and got.stop_reason == "eos"
    assert (got.prompt_tokens, got.reused_tokens, got.generated_tokens) == (0, 0, 1)
