"""app/thread_bridge.py: a thread's results reach the GUI thread through a bridge that no thread deletes."""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Qt, Signal

from app.thread_bridge import ThreadBridge


class _Bridge(ThreadBridge):
    said = Signal(str)


class _Owner(QObject):
    def __init__(self) -> None:
        super().__init__()
        self.heard: list[tuple[str, str]] = []
        self.bridge = _Bridge(self)
        self.bridge.said.connect(self._heard)

    def _heard(self, text: str) -> None:
        self.heard.append((text, threading.current_thread().name))


def _deleted_on(obj: QObject, where: list) -> None:
    obj.destroyed.connect(lambda *_: where.append(threading.current_thread().name), Qt.DirectConnection)


def test_results_arrive_on_the_gui_thread(qtbot):
    owner = _Owner()
    owner.bridge.start(lambda bridge=owner.bridge: bridge.said.emit("hello"), "worker")
    qtbot.waitUntil(lambda: owner.heard == [("hello", threading.main_thread().name)])


def test_the_bridge_outlives_its_owner_until_its_last_thread_ends(qtbot):
    """The owner goes while a thread runs: the thread's emit meets a live bridge (and no receiver), and the
    bridge is deleted afterwards on the GUI thread, never by the thread that held the last reference."""
    owner, go, emitted = _Owner(), threading.Event(), threading.Event()
    bridge, owner_gone, bridge_gone = owner.bridge, [], []
    _deleted_on(owner, owner_gone)
    _deleted_on(bridge, bridge_gone)

    def work(bridge=bridge) -> None:
        go.wait(30)
        bridge.said.emit("late")
        emitted.set()

    bridge.start(work, "late-worker")
    del owner, bridge
    assert owner_gone == [threading.main_thread().name] and bridge_gone == []
    go.set()
    assert emitted.wait(30)
    qtbot.waitUntil(lambda: bridge_gone == [threading.main_thread().name])
