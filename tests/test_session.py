"""engine.session: one queue, one thread. Every wait is on an event (a gate job holds the thread while a test
lines jobs up), never on the clock; a bounded ``timeout`` only keeps a broken session from hanging the suite."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import EngineError, GenerationCancelled
from engine.session import QueueFullError, Session

WAIT = 30


@pytest.fixture
def session():
    s = Session(max_queued=4)
    yield s
    s.close(WAIT)


class Gate:
    """A call that holds the session thread from when it starts until :meth:`open`."""

    def __init__(self, session: Session) -> None:
        self.started, self._open = threading.Event(), threading.Event()
        self.ticket = session.call(self._hold)
        assert self.started.wait(WAIT)

    def _hold(self) -> str:
        self.started.set()
        assert self._open.wait(WAIT)
        return "gate"

    def open(self) -> None:
        self._open.set()
        assert self.ticket.result(WAIT) == "gate"


def _tokens(log: list, name: str, n: int = 2):
    """A turn's ``start``: ``n`` events named after it, recorded in ``log`` as they run."""
    def start(cancel):
        for i in range(n):
            log.append(f"{name}{i}")
            yield f"{name}{i}"
    return start


def test_jobs_run_one_at_a_time_in_submission_order(session) -> None:
    log: list[str] = []
    gate = Gate(session)
    a = session.stream(_tokens(log, "a"))
    b = session.call(lambda: log.append("b") or "b")
    c = session.stream(_tokens(log, "c"))
    gate.open()
    assert list(a) == ["a0", "a1"] and b.result(WAIT) == "b" and list(c) == ["c0", "c1"]
    assert log == ["a0", "a1", "b", "c0", "c1"]


def test_a_new_turn_preempts_a_read_ahead_at_its_next_piece(session) -> None:
    pieces, go, did = [], threading.Semaphore(0), threading.Semaphore(0)

    def read(cancel):
        for i in range(100):
            if cancel.is_set():
                return f"stopped after {i}"
            assert go.acquire(timeout=WAIT)
            pieces.append(i)
            did.release()
        return "read to the end"

    ahead = session.read_ahead(read)
    for _ in range(2):
        go.release()
        assert did.acquire(timeout=WAIT)
    log: list[str] = []
    turn = session.stream(_tokens(log, "t"))      # the read-ahead is in (waiting for) its third piece
    go.release()                                  # which ends; it stops before a fourth
    assert ahead.result(WAIT) == "stopped after 3" and pieces == [0, 1, 2]
    assert list(turn) == ["t0", "t1"]


def test_a_queued_read_ahead_is_dropped_by_any_new_job(session) -> None:
    ran: list[str] = []
    gate = Gate(session)
    ahead = session.read_ahead(lambda cancel: ran.append("ahead"))
    listing = session.call(lambda: ran.append("list") or "listed")
    gate.open()
    assert listing.result(WAIT) == "listed"
    with pytest.raises(GenerationCancelled, match="read-ahead"):
        ahead.result(WAIT)
    assert ran == ["list"]


def test_a_read_ahead_waits_behind_turns_queued_before_it(session) -> None:
    log: list[str] = []
    gate = Gate(session)
    turn = session.stream(_tokens(log, "t"))
    ahead = session.read_ahead(lambda cancel: log.append("ahead") or "read")
    gate.open()
    assert list(turn) == ["t0", "t1"] and ahead.result(WAIT) == "read" and log == ["t0", "t1", "ahead"]


def test_cancelling_a_queued_turn_removes_it(session) -> None:
    started: list[str] = []
    gate = Gate(session)
    events = session.stream(lambda cancel: started.append("ran") or iter(["x"]))
    events.ticket.cancel()
    gate.open()
    with pytest.raises(GenerationCancelled, match="before it started"):
        next(events)
    assert session.call(lambda: "after").result(WAIT) == "after" and started == []


def test_a_turn_whose_flag_is_set_while_queued_never_starts(session) -> None:
    started: list[str] = []
    flag = threading.Event()
    gate = Gate(session)
    events = session.stream(lambda cancel: started.append("ran") or iter(["x"]), cancel=flag)
    flag.set()                                     # as the app's stop button does
    gate.open()
    with pytest.raises(GenerationCancelled):
        list(events)
    assert started == []


def test_cancelling_a_running_turn_stops_it_at_its_next_token(session) -> None:
    def start(cancel):
        for i in range(1000):
            if cancel.is_set():
                yield "cancelled"
                return
            yield i
            if i == 1:
                assert cancel.wait(WAIT)           # the consumer cancels while the turn is between tokens

    events = session.stream(start)
    assert [next(events), next(events)] == [0, 1]
    events.ticket.cancel()
    assert list(events) == ["cancelled"]


def test_closing_the_iterator_cancels_its_turn(session) -> None:
    seen = threading.Event()

    def start(cancel):
        yield "first"
        assert cancel.wait(WAIT)
        seen.set()
        yield "cancelled"

    events = session.stream(start)
    assert next(events) == "first"
    events.close()
    assert seen.wait(WAIT) and session.call(lambda: "free").result(WAIT) == "free"


def test_a_full_queue_refuses_the_job_with_a_clear_error(session) -> None:
    gate = Gate(session)
    waiting = [session.call(lambda k=k: k) for k in range(4)]
    with pytest.raises(QueueFullError, match="holds 4 jobs already"):
        session.stream(_tokens([], "x"))
    gate.open()
    assert [t.result(WAIT) for t in waiting] == [0, 1, 2, 3]
    assert list(session.stream(_tokens([], "y"))) == ["y0", "y1"]


def test_an_exception_in_a_job_goes_to_its_caller_and_the_loop_goes_on(session) -> None:
    def broken_turn(cancel):
        yield "one"
        raise ValueError("broken turn")

    def broken_call():
        raise KeyError("broken call")

    events = session.stream(broken_turn)
    assert next(events) == "one"
    with pytest.raises(ValueError, match="broken turn"):
        next(events)
    with pytest.raises(KeyError, match="broken call"):
        session.call(broken_call).result(WAIT)
    with pytest.raises(TypeError):
        list(session.stream(lambda cancel: 42))    # start returned no iterator

    def broken_sink(item):
        raise RuntimeError("the caller's sink fails")

    session.submit_stream(_tokens([], "s"), broken_sink)
    assert session.call(lambda: "alive").result(WAIT) == "alive"


def test_close_stops_the_running_job_drops_the_queued_and_joins() -> None:
    session = Session()
    told = threading.Event()

    def start(cancel):
        yield "first"
        told.set() if cancel.wait(WAIT) else None
        yield "stopped"

    running = session.stream(start)
    assert next(running) == "first"
    queued = session.call(lambda: "never")
    session.close(WAIT)
    assert not session._thread.is_alive() and told.is_set()
    assert list(running) == ["stopped"]
    with pytest.raises(GenerationCancelled, match="closed"):
        queued.result(WAIT)
    with pytest.raises(EngineError, match="closed"):
        session.call(lambda: None)


def test_ready_takes_the_queued_events_without_waiting(session) -> None:
    """What a turn made before its reader stopped (the app's Stop) is there to keep, what it made after is not;
    the turn's end ends the iteration."""
    made, hold = threading.Event(), threading.Event()

    def start(cancel):
        yield "t0"
        yield "t1"
        made.set()
        assert hold.wait(WAIT)
        yield "t2"

    events = session.stream(start)
    assert next(events) == "t0" and events.made_at <= time.monotonic()
    assert made.wait(WAIT)
    assert events.ready() == ["t1"] and events.ready() == []    # t2 is not made yet: no wait for it
    stop = time.monotonic()
    hold.set()
    ended = session.stream(_tokens([], "e", 3))
    assert session.call(lambda: "after").result(WAIT) == "after"   # both turns have ended
    assert events.ready(stop) == [] and list(events) == []          # t2 came after the stop
    assert ended.ready() == ["e0", "e1", "e2"] and list(ended) == []
