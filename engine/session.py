"""One owner for an engine: every use of the model runs on the session's thread, from one bounded queue.

Contract: once shared, an engine is touched only by jobs of its :class:`Session` -- a turn (:meth:`~Session.stream`),
a call (:meth:`~Session.call`: an image measurement, snapshot listing or clearing, closing) or a read-ahead
(:meth:`~Session.read_ahead`, lowest priority). Up to ``parallel`` turns run together, one step at a time: each
step decodes one token of every running turn in one batched forward (:mod:`engine.turn.batch`) plus at most one
prefill piece of a joining turn; a call or read-ahead runs alone, once no turn runs. Equal priorities are taken in
submission order; any new job cancels every read-ahead, which stops at its next piece.
Cancelling a queued job, or a turn admitted but not yet started, removes it (its caller gets
:class:`~engine.errors.GenerationCancelled`); a running turn stops at its next token. A full queue raises
:class:`QueueFullError`; a job's exception goes to its caller, never to the loop. Design:
docs/design/engine-session.md.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Self

from .errors import EngineError, GenerationCancelled
from .events import PrefillStats, TokenEvent
from .turn.batch import Step, answering_steps, forward_rows

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_QUEUED", "DEFAULT_PARALLEL", "END", "Events", "QueueFullError", "Session", "SessionClosedError",
           "Ticket", "engine_parallel"]

DEFAULT_MAX_QUEUED = 32
"""Jobs that may wait at once (read-aheads not counted: any new job drops them)."""

DEFAULT_PARALLEL = 4
"""Turns decoded together in one batch."""


def engine_parallel(engine: Any) -> int:
    """The turns ``engine`` was loaded to hold at once (``EngineOptions.parallel``, whose states the load
    checked fit in memory), so a session built for it runs no more; :data:`DEFAULT_PARALLEL` for an engine
    without load options (a remote one, the tests' fakes)."""
    return getattr(getattr(engine, "options", None), "parallel", DEFAULT_PARALLEL)

END = object()
"""What a stream's sink receives last, after its events (and the exception that ended it, if any)."""

_CLOSED_BEFORE_START = ("the engine session closed before this job started (the model is being unloaded or the "
                        "server is stopping)")

TURN, AHEAD = 0, 1
"""Priorities: lower runs first."""


class QueueFullError(EngineError):
    """The session's queue holds ``max_queued`` jobs already; the job was not taken."""


class SessionClosedError(GenerationCancelled):
    """The session closed (the model is being unloaded or the server stops): the job was not run, or not taken."""


class _Job(ABC):
    """A unit of work with a state (queued, running, done), run by the scheduler one :meth:`step` at a time."""

    def __init__(self, priority: int, cancel: threading.Event | None) -> None:
        self.priority = priority
        self.cancel = cancel or threading.Event()
        self.state = "queued"

    @abstractmethod
    def step(self) -> bool:
        """Run one piece on the session thread; False once the job has nothing left to do."""

    @abstractmethod
    def end(self, error: BaseException | None) -> None:
        """Deliver the outcome (``error`` None: success); called once, on the session thread or at close."""


class _Stream(_Job):
    """A turn: ``start(cancel)`` gives an iterator of events, each handed to ``sink``, and of the decode
    :class:`~engine.turn.batch.Step` s its turn asks the scheduler to answer (never handed to ``sink``)."""

    def __init__(self, start: Callable[[threading.Event], Iterator[Any]], sink: Callable[[Any], None],
                 cancel: threading.Event | None) -> None:
        super().__init__(TURN, cancel)
        self.start, self.sink = start, sink
        self.events: Iterator[Any] | None = None
        self.pending: Step | None = None   # the decode step the turn waits on
        self.decoding = False              # past its prefill: its pieces are decode tokens
        self.failure: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """The turn's pending decode step failed: it ends with ``error`` at its next step."""
        self.failure, self.pending = error, None

    def step(self) -> bool:
        """Advance the turn by one item, or to its next decode step; after its step was answered or its prompt
        read (:class:`PrefillStats`), by the token that follows and up to its next step.

        Raises:
            BaseException: what failed its decode step (:meth:`fail`), or what its events raised.
        """
        if self.failure is not None:
            raise self.failure
        if self.events is None:
            self.events = self.start(self.cancel)
        answered, self.pending = self.pending is not None, None
        with answering_steps():
            while True:
                try:
                    item = next(self.events)
                except StopIteration:
                    return False
                if isinstance(item, Step):
                    self.pending, self.decoding = item, True
                    return True
                self.sink(item)
                self.decoding = self.decoding or isinstance(item, (PrefillStats, TokenEvent))
                if isinstance(item, PrefillStats):
                    answered = True     # the first token comes from the prompt's logits, with no forward
                    continue
                if not (answered and isinstance(item, TokenEvent)):
                    return True
                answered = False

    def end(self, error: BaseException | None) -> None:
        close = getattr(self.events, "close", None)
        try:
            if close is not None:
                close()
        finally:
            if error is not None:
                self.sink(error)
            self.sink(END)


class _Call(_Job):
    """A call: ``fn(cancel)`` once, its result or exception set on ``future``."""

    def __init__(self, fn: Callable[[threading.Event], Any], priority: int, cancel: threading.Event | None) -> None:
        super().__init__(priority, cancel)
        self.fn = fn
        self.future: Future = Future()
        self.result: Any = None

    def step(self) -> bool:
        self.result = self.fn(self.cancel)
        return False

    def end(self, error: BaseException | None) -> None:
        if error is None:
            self.future.set_result(self.result)
        else:
            self.future.set_exception(error)


def _deliver(job: _Job, error: BaseException | None) -> None:
    """``job.end(error)``; a caller's sink that fails loses its own outcome only, never the loop."""
    job.state = "done"
    try:
        job.end(error)
    except BaseException:
        log.exception("delivering the outcome of an engine job failed")


class Ticket:
    """A submitted job: :meth:`cancel` removes it while queued, or sets its cancel flag while it runs."""

    def __init__(self, session: Session, job: _Job) -> None:
        self._session, self._job = session, job

    @property
    def future(self) -> Future:
        """A call's result (``concurrent.futures.Future``; ``asyncio.wrap_future`` for an event loop)."""
        assert isinstance(self._job, _Call)
        return self._job.future

    def result(self, timeout: float | None = None) -> Any:
        """Wait for a call's result; its exception is raised here."""
        return self.future.result(timeout)

    def cancel(self) -> None:
        """Stop the job: dropped while queued (outcome GenerationCancelled), told to stop while running."""
        self._session._cancel(self._job)


class Events(Iterator[Any]):
    """A turn's events as a blocking iterator; the exception that ended the turn is raised from ``next``.
    :meth:`close` (also when the iterator is dropped) cancels the turn. ``made_at``: when the session thread
    handed over the event ``next`` returned last (``time.monotonic()``, s)."""

    def __init__(self, ticket: Ticket, items: queue.SimpleQueue[tuple[float, Any]]) -> None:
        self.ticket, self._items, self._done = ticket, items, False
        self.made_at = -math.inf

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        self.made_at, item = self._items.get()
        if item is END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def ready(self, before: float = math.inf) -> list[Any]:
        """The events already queued that were handed over before ``before`` (``time.monotonic()``), taken
        without waiting; later ones are dropped, and the turn's end ends the iteration (the exception that
        ended it is dropped). A caller that stops reading at a stop keeps what was made before it."""
        out: list[Any] = []
        while not self._done:
            try:
                at, item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is END or isinstance(item, BaseException):
                self._done = True
            elif at < before:
                out.append(item)
        return out

    def close(self) -> None:
        """Cancel the turn unless it has ended; further iteration ends."""
        if not self._done:
            self._done = True
            self.ticket.cancel()

    def __del__(self) -> None:
        self.close()


class Session:
    """The scheduler thread of one engine and its queue (see the module docstring for the contract).

    Args:
        max_queued: jobs that may wait at once; one more raises :class:`QueueFullError`.
        name: the thread's name.
        parallel: turns that run together (decoded in one batch); 1 runs one turn at a time.

    Raises:
        ValueError: ``parallel`` below 1.
    """

    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED, name: str = "engine-session",
                 parallel: int = DEFAULT_PARALLEL) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1 turn, got {parallel}")
        self.max_queued, self.parallel = max_queued, parallel
        self._cond = threading.Condition()
        self._queued: list[_Job] = []
        self._running: list[_Job] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def stream(self, start: Callable[[threading.Event], Iterator[Any]],
               cancel: threading.Event | None = None) -> Events:
        """Queue a turn: ``start(cancel)`` returns its events (e.g. ``lambda c: engine.chat(m, cancel=c)``).

        Raises:
            QueueFullError: the queue is full. SessionClosedError: the session is closed.
        """
        items: queue.SimpleQueue[tuple[float, Any]] = queue.SimpleQueue()
        return Events(self.submit_stream(start, lambda item: items.put((time.monotonic(), item)), cancel), items)

    def submit_stream(self, start: Callable[[threading.Event], Iterator[Any]], sink: Callable[[Any], None],
                      cancel: threading.Event | None = None) -> Ticket:
        """:meth:`stream` for a caller that takes items as they come: ``sink`` gets each event, then the
        exception that ended the turn (if any), then :data:`END`, all on the session thread."""
        return self._submit(_Stream(start, sink, cancel))

    def call(self, fn: Callable[[], Any]) -> Ticket:
        """Queue ``fn()``; its result comes through :meth:`Ticket.result` / :attr:`Ticket.future`."""
        return self._submit(_Call(lambda _cancel: fn(), TURN, None))

    def read_ahead(self, fn: Callable[[threading.Event], Any]) -> Ticket:
        """Queue ``fn(cancel)`` at the lowest priority; any later job sets ``cancel`` (it should return at its
        next piece) or, while it waits, drops it."""
        return self._submit(_Call(fn, AHEAD, None))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Take no more jobs, drop the queued ones, tell the running one to stop, and join the thread."""
        self.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stop(self) -> int:
        """:meth:`close` without waiting: take no more jobs, drop the queued ones (they get
        :class:`SessionClosedError`) and tell the running ones to stop. Returns how many turns (streams, not
        calls) were running."""
        with self._cond:
            self._closed = True
            dropped, self._queued = self._queued, []
            running = sum(isinstance(job, _Stream) for job in self._running)
            for job in self._running:
                job.cancel.set()
            self._cond.notify_all()
        for job in dropped:
            _deliver(job, SessionClosedError(_CLOSED_BEFORE_START))
        return running

    @property
    def closed(self) -> bool:
        """Whether :meth:`stop` or :meth:`close` was called (the engine or the server is stopping)."""
        return self._closed

    def _submit(self, job: _Job) -> Ticket:
        with self._cond:
            if self._closed:
                raise SessionClosedError("the engine session is closed: it takes no more jobs (the model is being "
                                         "unloaded or the server is stopping)")
            kept = [j for j in self._queued if j.priority != AHEAD]
            if len(kept) >= self.max_queued:
                raise QueueFullError(f"the engine's queue holds {len(kept)} jobs already (at most "
                                     f"{self.max_queued}); try again when one has ended")
            dropped = [j for j in self._queued if j.priority == AHEAD]
            self._queued = [*kept, job]
            for running in self._running:
                if running.priority == AHEAD:
                    running.cancel.set()
            self._cond.notify_all()
        for old in dropped:
            _deliver(old, GenerationCancelled("a newer job replaced this read-ahead before it started"))
        return Ticket(self, job)

    def _cancel(self, job: _Job) -> None:
        with self._cond:
            job.cancel.set()
            queued = job in self._queued
            if queued:
                self._queued.remove(job)
        if queued:
            _deliver(job, GenerationCancelled("cancelled before it started"))

    def _loop(self) -> None:
        """The scheduler: take the running jobs' next step, run it, repeat until closed and idle."""
        while jobs := self._pick():
            ended = self._round(jobs)
            if ended:
                with self._cond:
                    self._running = [j for j in self._running if j not in ended]

    def _pick(self) -> list[_Job]:
        """The jobs whose step runs next: the running ones, after admitting queued jobs that may join them (a job
        cancelled while it waited is ended here); [] once closed and idle."""
        with self._cond:
            while True:
                self._admit()
                if self._running:
                    return list(self._running)
                if self._closed and not self._queued:
                    return []
                self._cond.wait()

    def _admit(self) -> None:
        """Move queued jobs to the running ones in priority and submission order, while the first may join: a turn
        while fewer than ``parallel`` turns and no call run, a call or read-ahead when nothing runs."""
        while self._queued:
            job = min(self._queued, key=lambda j: j.priority)
            if job.cancel.is_set():
                self._queued.remove(job)
                _deliver(job, GenerationCancelled("cancelled before it started"))
                continue
            if not self._may_join(job):
                return
            self._queued.remove(job)
            job.state = "running"
            self._running.append(job)

    def _may_join(self, job: _Job) -> bool:
        """Whether ``job`` may run beside the running jobs now."""
        if not isinstance(job, _Stream):
            return not self._running
        return len(self._running) < self.parallel and all(isinstance(j, _Stream) for j in self._running)

    def _round(self, jobs: list[_Job]) -> list[_Job]:
        """One step of the running jobs: a call alone, or each decoding turn up to its next decode step and the
        oldest joining turn by one piece, then every pending decode step in one batch. Returns the jobs that ended."""
        if not isinstance(jobs[0], _Stream):
            return [] if self._piece(jobs[0]) else [jobs[0]]
        ended: list[_Job] = []
        joining = True
        for job in jobs:
            assert isinstance(job, _Stream)
            if job.events is None and job.cancel.is_set():     # admitted, never started: dropped as if queued
                _deliver(job, self._dropped())
                ended.append(job)
                continue
            if not job.decoding:
                if not joining:
                    continue
                joining = False
            if not self._piece(job):
                ended.append(job)
        self._answer([j for j in jobs if isinstance(j, _Stream) and j.pending is not None and j not in ended])
        return ended

    def _dropped(self) -> GenerationCancelled:
        """The outcome of a job cancelled before it started: the session closed, or its caller cancelled it."""
        if self._closed:
            return SessionClosedError(_CLOSED_BEFORE_START)
        return GenerationCancelled("cancelled before it started")

    @staticmethod
    def _answer(jobs: list[_Stream]) -> None:
        """Answer the pending decode steps of ``jobs``: one batch per model; a step that failed fails its turn,
        which then ends with that error at its next step."""
        models: dict[int, list[_Stream]] = {}
        for job in jobs:
            models.setdefault(id(job.pending.model), []).append(job)
        for group in models.values():
            for job, error in zip(group, forward_rows([j.pending for j in group]), strict=True):
                if error is not None:
                    job.fail(error)

    def _piece(self, job: _Job) -> bool:
        """Run one piece of ``job``; False once it has ended (its outcome delivered, whatever it raised)."""
        try:
            if job.step():
                return True
            error: BaseException | None = None
        except BaseException as exc:  # noqa: BLE001 - the job's failure is its caller's, never the loop's
            error = exc
        _deliver(job, error)
        return False
