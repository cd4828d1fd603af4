"""The history database's own thread: every :class:`~app.history.HistoryStore` call runs there, in order.

The UI thread posts a job (a ``HistoryStore`` method or a function taking the store first, and its
arguments) with :meth:`HistoryThread.call` and gets on with its frame; the job's ``then`` callback
runs later on the UI thread with the result. Jobs run one at a time in the order they were posted,
so a read posted after a write sees it. :meth:`HistoryThread.stop` runs the jobs already posted,
then checkpoints and closes the file, so a quit loses no write.

The thread never dies silently: a job that raises anything reaches the window (``failed``, and the
job's ``on_error``) and the next job runs; a damaged history file is moved aside and a new one started
(``damaged``); a file that cannot be used at all leaves this run's chats in memory (``unavailable``).
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QThread, Signal, Slot

from .history import HistoryDamaged, HistoryError, HistoryStore
from .history_recovery import set_aside


@dataclass
class Job:
    """One call to run on the history thread.

    Attributes:
        fn: called as ``fn(store, *args)``.
        then: called on the UI thread with the result.
        on_error: called on the UI thread with the exception instead, when ``fn`` raised.
        future: resolved on the history thread (tests and shutdown may wait on it).
    """

    fn: Callable[..., Any]
    args: tuple
    then: Callable[[Any], None] | None = None
    on_error: Callable[[Exception], None] | None = None
    future: Future = field(default_factory=Future)


class HistoryThread(QThread):
    """Owns the history database on its own thread.

    Args:
        path: the database file.
        lock_wait_s: how long a write waits for another process's lock (``HistoryStore.lock_wait_s``).

    Signals:
        failed(str): a job raised; plain words for the window's status bar.
        unavailable(str): the database file could not be opened; this run keeps its chats in memory.
        damaged(str): the file was damaged (or another program's) and was moved aside; what happened
            and where the old file is now, for a dialog.
    """

    failed = Signal(str)
    unavailable = Signal(str)
    damaged = Signal(str)
    _done = Signal(object)

    def __init__(self, path: str | Path, lock_wait_s: float = HistoryStore.lock_wait_s) -> None:
        super().__init__()
        self.setObjectName("history")
        self.path = path
        self.lock_wait_s = lock_wait_s
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done.connect(self._deliver)

    def call(self, fn: Callable[..., Any], *args: Any, then: Callable[[Any], None] | None = None,
             on_error: Callable[[Exception], None] | None = None) -> Future:
        """Post ``fn(store, *args)``; returns its future (the callbacks run on the calling thread's loop)."""
        job = Job(fn, args, then, on_error)
        self._jobs.put(job)
        return job.future

    def run(self) -> None:
        """Open the database, run jobs until :meth:`stop`, close it (on this thread)."""
        store = self._open()
        while (job := self._jobs.get()) is not None:
            store.lock_wait_s = self.lock_wait_s
            try:
                result = job.fn(store, *job.args)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a message in the window
                job.future.set_exception(exc)
                self.failed.emit(f"Chat history: {exc}")
            else:
                job.future.set_result(result)
            if job.then is not None or job.on_error is not None:
                self._done.emit(job)
        store.close()

    def _open(self) -> HistoryStore:
        """The store on :attr:`path`; a damaged file moved aside for a new one; else one in memory."""
        try:
            return HistoryStore.open(self.path)
        except HistoryDamaged as exc:
            try:
                moved = set_aside(self.path)
                store = HistoryStore.open(self.path)
            except (HistoryError, OSError) as again:
                self.unavailable.emit(f"{exc}; it could not be replaced ({again}). This session's chats will "
                                      "not be saved.")
                return HistoryStore.open(":memory:")
            self.damaged.emit(f"The chat history could not be read: {exc}.\n\nThe file was moved to {moved} "
                              "(nothing in it was changed) and a new, empty history was started.")
            return store
        except Exception as exc:  # noqa: BLE001 - a newer DeltaDesk's file, an unreadable folder: say so
            self.unavailable.emit(f"{exc}. This session's chats will not be saved.")
            return HistoryStore.open(":memory:")

    @Slot(object)
    def _deliver(self, job: Job) -> None:
        error = job.future.exception()
        if error is None and job.then is not None:
            job.then(job.future.result())
        elif error is not None and job.on_error is not None:
            job.on_error(error)

    def stop(self) -> None:
        """Run the jobs already posted, close the database and join the thread."""
        if self.isRunning():
            self._jobs.put(None)
            self.wait()
