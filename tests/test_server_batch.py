"""``engine serve`` with the session's batch: ``n`` choices and concurrent clients decode together, the app's own
turn and a served one run at once, 100 streams queue or get 429 without stalling the server, a closing session
answers queued requests 503, and a raw completion cut mid-character keeps its last bytes.

Design: docs/design/engine-session.md ("Batched decode"), docs/design/http-server.md.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import openai
import pytest

from engine.events import TurnSummary
from engine.sampling import SamplingParams
from engine.session import Session
from engine.openai import ServerConfig, ServerThread

HI = [{"role": "user", "content": "Say hello."}]
BYTE_E4 = 160
"""The tiny model's token for the lone byte 0xE4 (the first of a three-byte UTF-8 character)."""


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def batches(engine):
    """The sizes of the batched decode steps the served engine runs during the test."""
    sizes: list[int] = []
    model = engine.model
    real = getattr(type(model), "forward_batch", None)

    def spy(tokens, states, positions):
        sizes.append(len(tokens))
        if real is not None:
            return real(model, tokens, states, positions)
        import numpy as np
        return np.stack([model.forward(tokens[i:i + 1], s, positions=p)[-1] for i, (s, p) in
                         enumerate(zip(states, positions, strict=True))])

    model.forward_batch = spy
    yield sizes
    del model.forward_batch


def _text(events) -> str:
    """The answer text of a turn's events (its summary's)."""
    return [e for e in events if isinstance(e, TurnSummary)][-1].text


def _until(condition, seconds: float = 60.0) -> bool:
    import time
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_n_choices_decode_as_one_batch_and_equal_single_requests(client, batches) -> None:
    """``n=3`` runs its choices as three sequences of one batch; each equals the single request with its seed."""
    def ask(**kw: Any):
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=1.5, top_p=1.0,
                                              extra_body={"top_k": 0}, **kw)

    singles = [ask(seed=21 + i).choices[0].message.content for i in range(3)]
    batches.clear()
    many = ask(n=3, seed=21)
    assert [c.message.content for c in many.choices] == singles
    assert max(batches) == 3


def test_the_apps_turn_and_a_served_request_run_at_once(engine, hold, server, batches) -> None:
    """An in-process turn on the shared session (the app's chat) and a served request, queued together, decode in
    the same batches and give their lone answers."""
    other = [{"role": "user", "content": "Name a colour."}]
    with hold:
        want, alone = (_text(engine.chat(m, SamplingParams.greedy(10))) for m in (HI, other))
    batches.clear()
    box: dict = {}

    def ask() -> None:
        box["served"] = httpx.post(server.url + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": other, "max_tokens": 10, "temperature": 0}).json()

    with hold:
        app_turn = hold.session.stream(lambda c: engine.chat(HI, SamplingParams.greedy(10), c))
        asker = threading.Thread(target=ask)
        asker.start()
        assert _until(lambda: len(hold.session._queued) == 2)
    got = _text(app_turn)
    asker.join(60)
    assert got == want and box["served"]["choices"][0]["message"]["content"] == alone
    assert max(batches) == 2


def test_a_raw_completion_cut_mid_character_keeps_its_bytes(client, engine, hold) -> None:
    """``max_tokens`` ends the answer after the first byte of a three-byte character: the stream's final flush
    (U+FFFD) comes out of ``/v1/completions`` as it does in process and in chat completions."""
    assert engine.token_bytes(BYTE_E4) == b"\xe4"
    sampling = SamplingParams(max_tokens=1, logit_bias=((BYTE_E4, 100.0),))
    with hold:
        want = _text(engine.complete("Once upon", sampling))
    assert want == "\ufffd"
    kw: dict[str, Any] = {"model": "tiny", "prompt": "Once upon", "max_tokens": 1, "logit_bias": {str(BYTE_E4): 100}}
    assert client.completions.create(**kw).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == want


def test_a_queued_request_gets_503_when_the_session_closes(engine) -> None:
    """The model is unloaded while a request waits for it: the request is answered 503 naming why, not 500."""
    session = Session(parallel=1)
    srv = ServerThread(engine, ServerConfig("tiny"), port=0, session=session).start()
    running, release = threading.Event(), threading.Event()

    def block() -> bool:
        running.set()
        return release.wait(60)

    blocker = session.call(block)
    assert running.wait(60)
    box: dict = {}

    def ask() -> None:
        box["r"] = httpx.post(srv.url + "/chat/completions", timeout=60,
                              json={"model": "tiny", "messages": HI, "max_tokens": 4})

    asker = threading.Thread(target=ask)
    try:
        asker.start()
        assert _until(lambda: len(session._queued) == 1)
        closer = threading.Thread(target=session.close)
        closer.start()
        asker.join(60)
        release.set()
        closer.join(60)
        blocker.result(60)
    finally:
        srv.stop()
    assert box["r"].status_code == 503
    assert "session closed" in box["r"].json()["error"]["message"]


def test_a_request_after_the_session_closed_gets_503(engine) -> None:
    """A request that arrives once the session has closed is refused at once with 503, not a 500."""
    session = Session(parallel=1)
    srv = ServerThread(engine, ServerConfig("tiny"), port=0, session=session).start()
    try:
        session.close()
        r = httpx.post(srv.url + "/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": HI, "max_tokens": 4})
    finally:
        srv.stop()
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "model_unavailable"


async def _hundred(url: str, hold: Any) -> tuple[list[httpx.Response], int, int]:
    """100 streamed chat requests at once while the engine is held: the refused ones answer at once; the server's
    health route answers meanwhile; then the hold is let go and the rest finish. Returns the responses and the
    thread counts before and at the peak."""
    before = threading.active_count()
    body = {"model": "tiny", "messages": HI, "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as http:
        async def one() -> httpx.Response:
            response = await http.post(url + "/chat/completions", json=body)
            await response.aread()
            return response

        tasks = [asyncio.create_task(one()) for _ in range(100)]
        while sum(t.done() for t in tasks) < 100 - 8:           # the waiting queue holds 8
            await asyncio.sleep(0.02)
        health = await http.get(url.removesuffix("/v1") + "/health")
        assert health.status_code == 200
        peak = threading.active_count()
        await asyncio.to_thread(hold.__exit__, None, None, None)
        return list(await asyncio.gather(*tasks)), before, peak


def test_a_hundred_streams_queue_or_get_429(server, hold) -> None:
    """Beyond the 8 requests that may wait, every stream is refused at once with 429 and ``Retry-After``; the
    server stays responsive and starts no thread per request; the 8 are answered once the engine is free."""
    hold.__enter__()
    try:
        responses, before, peak = asyncio.run(_hundred(server.url, hold))
    finally:
        hold._leave.set()                     # let go of the engine even when the scenario failed
    codes = [r.status_code for r in responses]
    assert codes.count(429) == 92 and codes.count(200) == 8
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in responses if r.status_code == 200)
    assert peak - before < 8


def test_serve_takes_parallel_and_refuses_zero(synth_model, monkeypatch, capsys) -> None:
    """``engine serve --parallel N`` loads the engine for N turns (its memory checked for N states; the serving
    session takes N from it); 0 is refused by the argument parser, naming it."""
    from engine.__main__ import main
    seen: dict = {}
    monkeypatch.setattr("engine.openai.serve", lambda engine, *args, **kw: seen.update(engine=engine))
    assert main(["serve", "--model", str(synth_model("tiny", "q8_0")), "--port", "0", "--parallel", "2"]) == 0
    assert seen["engine"].options.parallel == 2         # the serving session takes it from the engine
    with pytest.raises(SystemExit):
        main(["serve", "--parallel", "0"])
    assert "--parallel" in capsys.readouterr().err


def test_n_choices_beyond_parallel_wait_for_a_free_sequence(synth_model) -> None:
    """An engine loaded for 2 turns (its memory checked for 2 states) serves ``n=4`` with at most 2 sequences
    decoding at once; the other choices wait their turn and every choice is answered."""
    from engine.api import Engine, EngineOptions
    engine = Engine.load(synth_model("tiny", "q8_0"), options=EngineOptions(context=256, parallel=2))
    sizes: list[int] = []
    real = type(engine.model).forward_batch

    def spy(tokens, states, positions):
        sizes.append(len(tokens))
        return real(engine.model, tokens, states, positions)

    engine.model.forward_batch = spy
    server = ServerThread(engine, ServerConfig("tiny"), port=0).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, n=4, seed=5, temperature=1.0)
    finally:
        server.stop()
        engine.close()
    assert server.session.parallel == 2
    assert sorted(c.index for c in answer.choices) == [0, 1, 2, 3] and all(c.message.content for c in answer.choices)
    assert max(sizes) == 2
