"""Shared fixtures of the app tests: offscreen Qt, per-test data dirs, a window on a fake engine."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")  # never the user's keyring

import pytest  # noqa: E402

from app.__main__ import AppPaths, build_window  # noqa: E402
from app.history_thread import HistoryThread  # noqa: E402
from fake_engine import FakeEngine, loader_for  # noqa: E402

WAIT_MS = 30_000
"""How long a ``qtbot.waitUntil`` / ``waitSignal`` without its own ``timeout`` waits (pytest-qt's own
default is 5 s): CI runs the suite on a shared 2-core machine, where a thread of the app can wait
seconds for a core. A wait returns as soon as its condition holds, so this costs nothing on a pass."""


@pytest.fixture
def qtbot(qtbot):
    """pytest-qt's ``qtbot`` whose waits default to :data:`WAIT_MS`."""
    wait_until, wait_signal = qtbot.waitUntil, qtbot.waitSignal
    qtbot.waitUntil = lambda callback, *, timeout=WAIT_MS: wait_until(callback, timeout=timeout)
    qtbot.waitSignal = lambda signal, *, timeout=WAIT_MS, **kwargs: wait_signal(signal, timeout=timeout, **kwargs)
    return qtbot


@pytest.fixture
def paths(tmp_path):
    """Data, config and cache dirs inside the test's tmp dir."""
    return AppPaths(tmp_path / "data", tmp_path / "config", tmp_path / "cache")


@pytest.fixture
def history(tmp_path):
    """A started history thread on a database in the test's tmp dir."""
    thread = HistoryThread(tmp_path / "h.db")
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def make_window(qtbot, paths):
    """Build a shown main window on an engine (a FakeEngine by default), a conversation open, model loaded."""
    windows = []

    def make(engine=None, loader=None, gpu=None, load=True):
        loader = loader or loader_for(engine or FakeEngine())
        window = build_window(paths, loader, gpu)
        windows.append(window)
        window.show()
        qtbot.waitUntil(lambda: window.controller.conversation_id is not None)
        if load:
            window.load_configured()
            qtbot.waitUntil(lambda: window.model is not None)
        return window

    yield make
    for window in windows:
        if window.isVisible():
            window.close()
