"""Continuous batching in the engine session: each turn's tokens and events equal what it gives alone.

Design: docs/design/engine-session.md ("Batched decode"). The model's ``forward_batch`` is wrapped by a spy that
records the batch sizes (and calls the model's own batched forward when it has one, else single forwards), so
every test also shows that the turns did decode together.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import numpy as np
import pytest

from engine.api import Engine, EngineOptions
from engine.errors import GenerationCancelled
from engine.events import TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.session import END, Session, SessionClosedError
from engine.turn.batch import Step, forward_batch, forward_rows

CHATS = [[{"role": "user", "content": text}] for text in
         ("Where is the circle?", "Count the squares, please.", "Name three colours.", "Hello there")]
SAMPLINGS = [SamplingParams.greedy(24), SamplingParams(temperature=0.9, seed=7, max_tokens=20),
             SamplingParams(temperature=1.2, top_k=20, seed=3, max_tokens=28, top_logprobs=2),
             SamplingParams.greedy(16)]


class BatchSpy:
    """Stands in for the model's ``forward_batch``: records each batch's size, optionally runs ``hook(calls)``
    first, and answers with the model's own batched forward when it has one."""

    def __init__(self, model: Any, hook: Any = None) -> None:
        self.model, self.hook, self.sizes = model, hook, []
        self.real = getattr(type(model), "forward_batch", None)

    def __call__(self, tokens: np.ndarray, states: list, positions: list) -> np.ndarray:
        self.sizes.append(len(tokens))
        if self.hook is not None:
            self.hook(len(self.sizes))
        if self.real is not None:
            return self.real(self.model, tokens, states, positions)
        return np.stack([self.model.forward(tokens[i:i + 1], s, positions=p)[-1]
                         for i, (s, p) in enumerate(zip(states, positions, strict=True))])


@pytest.fixture(scope="module", params=[True, False], ids=["cache", "no-cache"])
def loaded(request, synth_model):
    engine = Engine.load(synth_model("tiny", "q8_0"),
                         options=EngineOptions(context=512, prefix_cache=request.param, cache_disk_dir=None))
    yield engine
    engine.close()


@pytest.fixture
def engine(loaded):
    """The module's engine, its model without a spy after the test."""
    yield loaded
    loaded.model.__dict__.pop("forward_batch", None)


def _norm(events: list) -> list:
    """The events that must not depend on the batch: tokens (ids, text, logprobs, channels) and the summary."""
    out = []
    for e in events:
        if isinstance(e, TokenEvent):
            out.append((e.token_id, e.text, e.index, e.logprob, e.top_logprobs, e.channel, e.parts))
        elif isinstance(e, TurnSummary):
            out.append((e.stop_reason, e.message, e.prompt_tokens, e.generated_tokens, e.text, e.parts))
    return out


def _alone(engine: Engine, i: int, grammar: Any = None) -> list:
    return _norm(list(engine.chat(CHATS[i], SAMPLINGS[i], grammar=grammar)))


def _spy(engine: Engine, hook: Any = None) -> BatchSpy:
    spy = BatchSpy(engine.model, hook)
    engine.model.forward_batch = spy
    return spy


def _submit(session: Session, engine: Engine, i: int, cancel: threading.Event | None = None, grammar: Any = None):
    return session.stream(lambda c: engine.chat(CHATS[i], SAMPLINGS[i], c, grammar=grammar), cancel)


def test_turns_joining_at_different_times_give_their_lone_tokens(engine) -> None:
    """Two turns start together, a third joins once the first has streamed tokens, a fourth once the second
    has: every turn's events equal its lone run, and the decode steps ran in batches of more than one."""
    alone = [_alone(engine, i) for i in range(4)]
    spy = _spy(engine)
    with Session(parallel=4) as session:
        streams = [_submit(session, engine, 0), _submit(session, engine, 1)]
        got: list[list] = [[], [], [], []]
        for k, joiner in ((0, 2), (1, 3)):
            while sum(isinstance(e, TokenEvent) for e in got[k]) < 3:
                got[k].append(next(streams[k]))
            streams.append(_submit(session, engine, joiner))
        for k, stream in enumerate(streams):
            got[k] += list(stream)
    assert [_norm(g) for g in got] == alone
    assert max(spy.sizes) >= 3


def test_a_grammar_turn_and_free_turns_batch_unchanged(engine) -> None:
    """Constrained decoding keeps its own matcher per turn: two turns held to 50-60 letters and spaces beside a
    free one answer as alone."""
    grammar = engine.grammar(lark="start: /[a-z ]{50,60}/")
    alone = [_alone(engine, 0, grammar), _alone(engine, 1), _alone(engine, 2, grammar)]
    spy = _spy(engine)
    with Session(parallel=3) as session:
        streams = [_submit(session, engine, 0, grammar=grammar), _submit(session, engine, 1),
                   _submit(session, engine, 2, grammar=grammar)]
        got = [_norm(list(s)) for s in streams]
    assert got == alone
    assert max(spy.sizes) == 3


def test_a_turn_cancelled_during_a_batched_step_ends_cancelled_and_the_others_go_on(engine) -> None:
    """The cancel flag of one turn is set while its batch is computing: that turn ends with "cancelled" after the
    tokens it had (a prefix of its lone answer); the other turns' answers are unchanged."""
    alone = [_alone(engine, i) for i in range(3)]
    flag = threading.Event()
    _spy(engine, hook=lambda calls: flag.set() if calls == 4 else None)
    with Session(parallel=3) as session:
        streams = [_submit(session, engine, 0), _submit(session, engine, 1, cancel=flag), _submit(session, engine, 2)]
        got = [_norm(list(s)) for s in streams]
    assert got[0] == alone[0] and got[2] == alone[2]
    assert got[1][-1][0] == "cancelled"
    tokens = got[1][:-1]
    assert 1 <= len(tokens) < len(alone[1]) - 1 and tokens == alone[1][:len(tokens)]


def test_a_failing_turn_does_not_stop_the_others(engine) -> None:
    """A turn whose own code raises after a few tokens (its wrapper forwards the decode steps it does not
    understand) and one whose decode step fails get their errors; the others finish unchanged."""
    alone = [_alone(engine, i) for i in range(3)]

    def failing(cancel: threading.Event):
        for k, event in enumerate(engine.chat(CHATS[1], SAMPLINGS[1], cancel)):
            yield event
            if k == 6:
                raise RuntimeError("the caller's code failed")

    _spy(engine)
    with Session(parallel=3) as session:
        streams = [_submit(session, engine, 0), session.stream(failing), _submit(session, engine, 2)]
        with pytest.raises(RuntimeError, match="caller's code"):
            list(streams[1])
        assert _norm(list(streams[0])) == alone[0] and _norm(list(streams[2])) == alone[2]
        assert _norm(list(_submit(session, engine, 1))) == alone[1]     # the engine is free and unchanged


def test_one_failing_row_fails_only_its_step() -> None:
    """Without a batched forward, each step runs alone: a row whose forward raises fails that step only."""
    class Model:
        def forward(self, tokens, state, positions=None):
            if state == "bad":
                raise ValueError("this sequence's state is broken")
            return np.full((1, 3), float(tokens[0]), dtype=np.float32)

    steps = [Step(Model(), 1, "ok", None), Step(Model(), 2, "bad", None), Step(Model(), 3, "ok", None)]
    outcomes = forward_rows(steps)
    assert outcomes[0] is None and outcomes[2] is None and isinstance(outcomes[1], ValueError)
    assert steps[0].logits.tolist() == [1.0] * 3 and steps[2].logits.tolist() == [3.0] * 3
    assert forward_batch(Model(), np.array([4, 5]), ["ok", "ok"], [None, None]).tolist() == [[4.0] * 3, [5.0] * 3]


def test_read_ahead_runs_only_when_no_turn_is_active(engine) -> None:
    """A read-ahead queued behind two running turns starts only after both have ended (the engine has no turn)."""
    seen: list = []

    def ahead(cancel: threading.Event) -> None:
        seen.append((engine._turns, [s.ticket._job.state for s in streams]))

    with Session(parallel=4) as session:
        streams = [_submit(session, engine, 0), _submit(session, engine, 1)]
        next(streams[0])
        ticket = session.read_ahead(ahead)
        for s in streams:
            list(s)
        ticket.result(60)
    assert seen == [(0, ["done", "done"])]


def test_parallel_one_runs_turns_one_after_another(engine) -> None:
    """With ``parallel=1`` the second turn's first event comes after the first turn's summary, and no decode step
    is batched (today's one-at-a-time session)."""
    order: list = []
    spy = _spy(engine)
    with Session(parallel=1) as session:
        for i in range(2):
            session.submit_stream(lambda c, i=i: engine.chat(CHATS[i], SAMPLINGS[i], c),
                                  lambda item, i=i: order.append((i, item)))
        session.call(lambda: None).result(60)          # a call runs once no turn runs
    first_end = next(k for k, (i, item) in enumerate(order) if i == 0 and isinstance(item, TurnSummary))
    assert all(i == 0 for i, _ in order[:first_end + 1]) and any(i == 1 for i, _ in order[first_end + 1:])
    assert set(spy.sizes) <= {1}


def test_a_queued_turn_cancelled_behind_a_full_batch_never_starts(engine) -> None:
    """With the batch full, a further turn waits; cancelled while it waits, its caller gets GenerationCancelled."""
    with Session(parallel=1) as session:
        running = _submit(session, engine, 0)
        next(running)
        waiting = _submit(session, engine, 1)
        waiting.ticket.cancel()
        with pytest.raises(GenerationCancelled):
            next(waiting)
        assert _norm(list(running))[-1][0] in ("eos", "max_tokens")


def test_parallel_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="parallel must be at least 1"):
        Session(parallel=0)


def _wait(condition, seconds: float = 30.0) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled; only a broken session takes that long)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


class Prefilling:
    """A turn's ``start`` whose prefill goes on piece by piece, one piece per :meth:`piece`, until :meth:`end`; it
    holds the batch's one joining place, so turns admitted after it wait unstarted."""

    def __init__(self) -> None:
        self._pieces, self._ended = threading.Semaphore(0), threading.Event()

    def __call__(self, cancel: threading.Event):
        while self._pieces.acquire(timeout=30) and not self._ended.is_set():
            yield "piece"

    def piece(self, events) -> None:
        self._pieces.release()
        assert next(events) == "piece"

    def end(self) -> None:
        self._ended.set()
        self._pieces.release()


def _unstarted(session: Session, started: list) -> tuple[Any, list, threading.Event]:
    """A turn admitted beside a prefilling one (it waits unstarted): its ticket, the items its sink got, and an
    event set once its outcome is in. ``started`` records a call of its start function."""
    items: list = []
    over = threading.Event()

    def start(cancel: threading.Event):
        started.append(cancel)
        yield "token"

    def sink(item: Any) -> None:
        items.append(item)
        if item is END:
            over.set()

    return session.submit_stream(start, sink), items, over


def test_a_turn_cancelled_before_it_starts_ends_at_once_beside_a_long_prefill() -> None:
    """A turn admitted to the batch but still waiting for the joining place (another turn prefills) is cancelled:
    its caller gets GenerationCancelled within a piece of the other's prefill, and it never starts."""
    prefill, started = Prefilling(), []
    with Session(parallel=2) as session:
        long = session.stream(prefill)
        prefill.piece(long)
        ticket, items, over = _unstarted(session, started)
        prefill.piece(long)                             # admitted now: running, not queued
        ticket.cancel()
        prefill.piece(long)
        prefill.piece(long)
        try:
            assert over.wait(10), "the cancelled turn waited for the other turn's whole prefill"
        finally:
            prefill.end()
    assert isinstance(items[0], GenerationCancelled) and not started


def test_a_turn_not_yet_started_when_the_session_closes_gets_session_closed() -> None:
    """Closing the session while a turn waits unstarted in the batch answers it as a queued one:
    SessionClosedError (the server's 503), without starting it."""
    prefill, started = Prefilling(), []
    session = Session(parallel=2)
    long = session.stream(prefill)
    prefill.piece(long)
    _, items, over = _unstarted(session, started)
    prefill.piece(long)
    closer = threading.Thread(target=session.close)
    closer.start()
    try:
        assert _wait(lambda: session._closed)
        prefill.piece(long)
        assert over.wait(10), "the unstarted turn was not ended when the session closed"
    finally:
        prefill.end()
        closer.join(30)
    assert isinstance(items[0], SessionClosedError) and not started


def test_a_batched_forward_giving_the_wrong_rows_fails_its_turns_not_the_session() -> None:
    """A model whose ``forward_batch`` gives one row fewer than the steps it answers: each turn gets a ValueError
    naming the counts, and the session goes on (its thread does not die with the error)."""
    class Short:
        def forward_batch(self, tokens, states, positions):
            return np.zeros((len(tokens) - 1, 3), dtype=np.float32)

    model = Short()

    def start(cancel: threading.Event):
        step = Step(model, 1, object(), None)
        yield step
        yield step.logits

    items: list[list] = [[], []]
    over = [threading.Event(), threading.Event()]

    def sink(i: int, item: Any) -> None:
        items[i].append(item)
        if item is END:
            over[i].set()

    with Session(parallel=2) as session:
        for i in range(2):
            session.submit_stream(start, lambda item, i=i: sink(i, item))
        assert all(o.wait(10) for o in over), "the session's thread died with the batched forward's error"
        assert session.call(lambda: "alive").result(10) == "alive"
    for got in items:
        assert isinstance(got[0], ValueError)
        assert re.fullmatch(r"the model's forward_batch gave \d+ rows for \d+ sequences", str(got[0]))

