"""Shared fixtures of the app tests: offscreen Qt, per-test data dirs, a window on a fake engine."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("PYTHON_KEYRING_BACKEND", "keyring.backends.null.Keyring")  # never the user's keyring

import pytest  # noqa: E402
from pytestqt.exceptions import TimeoutError as QtTimeoutError  # noqa: E402

from app.__main__ import AppPaths, build_window  # noqa: E402
from app.history_thread import HistoryThread  # noqa: E402
from fake_engine import FakeEngine, loader_for  # noqa: E402

WAIT_MS = 30_000
"""How long a ``qtbot.waitUntil`` / ``waitSignal`` without its own ``timeout`` waits (pytest-qt's own
default is 5 s): CI runs the suite on a shared 2-core machine, where a thread of the app can wait
seconds for a core. A wait returns as soon as its condition holds, so this costs nothing on a pass."""


@pytest.fixture
def qtbot(qtbot):
    """pytest-qt's ``qtbot`` whose waits default to :data:`WAIT_MS`, and whose ``waitSignal`` is safe for a
    signal emitted on another thread (:func:`_wait_signal`)."""
    wait_until = qtbot.waitUntil
    qtbot.waitUntil = lambda callback, *, timeout=WAIT_MS: wait_until(callback, timeout=timeout)
    qtbot.waitSignal = lambda signal, *, timeout=WAIT_MS, check_params_cb=None: _wait_signal(
        wait_until, signal, timeout, check_params_cb)
    return qtbot


@contextlib.contextmanager
def _wait_signal(wait_until, signal, timeout: int, check_params_cb=None):
    """Wait (after the ``with`` block) until ``signal`` is emitted with arguments ``check_params_cb`` accepts;
    the object yielded gets the first such emission's arguments as ``args``.

    PySide calls a plain callable connected to a signal on the thread of the signal's object, so the slot
    of pytest-qt's own blocker runs on the worker's thread for an EngineWorker signal: it stops the blocker's
    timer from there (Qt refuses and forgets the timer) and quits its event loop there, which is lost when
    the emit lands just before the loop starts; the wait then never ends. Here the slot only records the
    emission (a list append, thread-safe) and the GUI thread polls for it (``waitUntil``).

    Raises:
        pytestqt.exceptions.TimeoutError: no such emission within ``timeout`` ms.
    """
    seen: list[list] = []

    def record(*args) -> None:
        if check_params_cb is None or check_params_cb(*args):
            seen.append(list(args))

    signal.connect(record)
    waited = SimpleNamespace(args=None)
    try:
        yield waited
        try:
            wait_until(lambda: bool(seen), timeout=timeout)
        except QtTimeoutError as exc:
            raise QtTimeoutError(f"{signal} was not emitted (with accepted arguments) within {timeout} ms") from exc
        waited.args = seen[0]
    finally:
        with contextlib.suppress(RuntimeError):
            signal.disconnect(record)


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
