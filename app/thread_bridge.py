"""Results from Python threads to the GUI thread, with no Qt object ever deleted on the wrong thread.

PySide deletes an object Python owns (one without a Qt parent) on whichever thread drops the last reference
to it. A thread whose function holds a dialog (a closure over ``self``, a bound method) and ends after the
dialog's owner let go of it deletes the dialog, its widgets and their signals' connections on that thread
while the GUI thread may be using them, which crashes the app; Qt objects must be deleted on their own
thread. So such a thread holds only a :class:`ThreadBridge` and plain data: it emits the bridge's signals,
connected to the dialog's slots, and they arrive queued on the GUI thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from PySide6.QtCore import QCoreApplication, QObject, Slot


class ThreadBridge(QObject):
    """A child of the application that threads emit signals through (subclasses declare the signals).

    A reference dropped on a thread never deletes it (the application owns it); it deletes itself on the
    GUI thread (``deleteLater``) once ``owner`` is destroyed and the last thread :meth:`start` began has
    returned, so an emit never meets a deleted bridge.

    Args:
        owner: the GUI object the results are for (its ``destroyed`` signal releases the bridge).
    """

    def __init__(self, owner: QObject) -> None:
        super().__init__(QCoreApplication.instance())
        self._lock = threading.Lock()
        self._holders = 1
        owner.destroyed.connect(self._release)

    def start(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` on a daemon thread called ``name``. ``target`` must reach no Qt object but the
        bridge (no ``self`` of a widget in its closure): what it holds may be dropped on that thread."""
        with self._lock:
            self._holders += 1

        def run() -> None:
            try:
                target()
            finally:
                self._release()

        threading.Thread(target=run, name=name, daemon=True).start()

    @Slot()
    def _release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self.deleteLater()
