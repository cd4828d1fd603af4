"""The server's turns on the engine's session: whoever stops the session's job stops the engine's turn."""

from __future__ import annotations

import asyncio
import threading

from engine.openai.app import _Turn
from engine.session import Session


def test_closing_the_session_stops_a_running_server_turn() -> None:
    """Session.close tells the running job to stop (its cancel flag): a served turn must pass that on to the
    engine's own cancel flag of the choice running, or the engine goes on to its token limit."""
    started, stopped = threading.Event(), threading.Event()

    def start(next_cancel):
        flag = next_cancel()
        started.set()
        for i in range(300):                 # a turn of 300 tokens, 10 ms each, that checks its flag per token
            if flag.wait(0.01):
                stopped.set()
                return
            yield i

    async def main() -> None:
        session = Session()
        _Turn(start).submit(session)
        assert await asyncio.to_thread(started.wait, 10)
        await asyncio.to_thread(session.close, 10)

    asyncio.run(main())
    assert stopped.is_set()
