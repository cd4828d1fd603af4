"""The server's turns on the engine's session: whoever stops the session's job stops the engine's turn."""

from __future__ import annotations

import asyncio
import threading
import types

import httpx

from engine.events import PrefillStats, TokenEvent, TurnSummary
from engine.openai import ServerConfig, ServerThread
from engine.openai.app import _Turn
from engine.session import Session


def test_closing_the_session_stops_a_running_server_turn() -> None:
    """Session.close tells the running job to stop (its cancel flag): a served choice's job must be the one whose
    flag the engine's turn checks, or the engine goes on to its token limit."""
    started, stopped = threading.Event(), threading.Event()

    def start(index, flag):
        started.set()
        for i in range(300):                 # a turn of 300 tokens, 10 ms each, that checks its flag per token
            if flag.wait(0.01):
                stopped.set()
                return
            yield i

    async def main() -> None:
        session = Session()
        _Turn(start, 1).submit(session)
        assert await asyncio.to_thread(started.wait, 10)
        await asyncio.to_thread(session.close, 10)

    asyncio.run(main())
    assert stopped.is_set()


class _Parts(tuple):
    """A token's parts that the event loop can read only once the next choice has started on the engine."""

    def __new__(cls, parts: tuple, ready: threading.Event) -> _Parts:
        made = super().__new__(cls, parts)
        made.ready = ready
        return made

    def __iter__(self):
        assert self.ready.wait(10)
        return super().__iter__()


class _TwoChoices:
    """A served "engine": its first choice writes a stop string and ends on its own before the server has read
    it (as a fast engine does); its second waits half a second for a cancel, then answers "fine"."""

    info = types.SimpleNamespace(context=512, has_vision=False)

    def __init__(self) -> None:
        self.calls = 0
        self.second = threading.Event()

    def chat(self, messages, sampling, cancel, enable_thinking=False, **_options):
        self.calls += 1
        yield PrefillStats(prompt_tokens=1, reused_tokens=0, prefilled_tokens=1, prefill_ms=0.0, restore_ms=0.0,
                           device="cpu", ttft_ms=0.0)
        if self.calls == 1:
            yield TokenEvent(token_id=1, text="STOP", ms=0.0, index=0,
                             parts=_Parts((("content", "STOP"),), self.second))
            text, reason = "STOP", "eos"
        else:
            self.second.set()
            text, reason = ("", "cancelled") if cancel.wait(0.5) else ("fine", "eos")
            if text:
                yield TokenEvent(token_id=2, text=text, ms=0.0, index=0)
        yield TurnSummary.of_turn(reason, "", None, [0.0] * len(text), text)


def test_a_stop_string_read_late_stops_only_its_own_choice() -> None:
    """With ``n`` = 2, the stop string of choice 0 may be read after the engine has moved on to choice 1: only
    choice 0 (already over) is told to stop, and choice 1 answers in full."""
    engine = _TwoChoices()
    server = ServerThread(engine, ServerConfig("m"), port=0).start()
    try:
        r = httpx.post(server.url + "/chat/completions", timeout=60, json={
            "model": "m", "n": 2, "stop": ["STOP"], "messages": [{"role": "user", "content": "hi"}]})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["message"]["content"] for c in choices] == ["", "fine"]
