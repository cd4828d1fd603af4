"""Shared fixtures of the app tests: offscreen Qt, per-test data dirs, a window on a fake engine."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.__main__ import AppPaths, build_window  # noqa: E402
from fake_engine import FakeEngine, loader_for  # noqa: E402


@pytest.fixture
def paths(tmp_path):
    """Data and config dirs inside the test's tmp dir."""
    return AppPaths(tmp_path / "data", tmp_path / "config")


@pytest.fixture
def make_window(qtbot, paths):
    """Build a shown main window on an engine (a FakeEngine by default), model loaded."""
    windows = []

    def make(engine=None, loader=None, gpu=None, load=True):
        loader = loader or loader_for(engine or FakeEngine())
        window = build_window(paths, loader, gpu)
        windows.append(window)
        window.show()
        if load:
            window.load_model(None)
            qtbot.waitUntil(lambda: window.model is not None, timeout=5000)
        return window

    yield make
    for window in windows:
        if window.isVisible():
            window.close()
