"""Helpers of the app tests for reaching the history thread and waiting for its answers."""

from __future__ import annotations

from app.history_thread import HistoryThread


def stored(history: HistoryThread, fn, *args):
    """Run ``fn(store, *args)`` on the history thread after every job already posted; its result."""
    return history.call(fn, *args).result(timeout=30)


def settle(qtbot, history: HistoryThread) -> None:
    """Wait until the jobs posted so far have run and their callbacks have been delivered."""
    done = []
    history.call(lambda store: None, then=done.append)
    qtbot.waitUntil(lambda: bool(done))
