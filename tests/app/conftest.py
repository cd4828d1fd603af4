"""Shared fixtures of the app tests: offscreen Qt, per-test data dirs, a window on a fake engine."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")  # never the user's keyring

import pytest  # noqa: E402

from app.__main__ import AppPaths, build_window  # noqa: E402
from app.history_thread import HistoryThread  # noqa: E402
from fake_engine import FakeEngine, loader_for  # noqa: E402


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
        qtbot.waitUntil(lambda: window.controller.conversation_id is not None, timeout=5000)
        if load:
            window.load_configured()
            qtbot.waitUntil(lambda: window.model is not None, timeout=5000)
        return window

    yield make
    for window in windows:
        if window.isVisible():
            window.close()
