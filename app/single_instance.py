"""One DeltaDesk per user profile: a second launch raises the running window and exits.

Two copies on one history database and one snapshot cache would each write what the other does
not see. The first launch takes a :class:`QLockFile` in the data dir (stale locks of a crashed
run are taken over: QLockFile checks that the holder's process is gone) and listens on a
:class:`QLocalServer` named after that dir; a later launch finds the lock taken, connects, asks
the first to show its window, and exits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

CONNECT_MS = 1000


def server_name(data_dir: Path) -> str:
    """The local socket's name for a data dir: one per profile, short enough for a Unix socket path."""
    return "deltadesk-" + hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]


class SingleInstance(QObject):
    """The lock and the server of the running copy for ``data_dir``.

    Signals:
        raise_requested(): a later launch asked for the window.
    """

    raise_requested = Signal()

    def __init__(self, data_dir: Path) -> None:
        super().__init__()
        data_dir.mkdir(parents=True, exist_ok=True)
        self.name = server_name(data_dir)
        self.lock = QLockFile(str(data_dir / "deltadesk.lock"))
        self.lock.setStaleLockTime(0)
        self.server = QLocalServer(self)
        self.server.newConnection.connect(self._connected)

    def acquire(self) -> bool:
        """Become the running copy (True), or (False) ask the running one to raise its window.

        Raises:
            OSError: the lock is free but the local server cannot listen (names the server's error).
        """
        if not self.lock.tryLock(0):
            self._ask_to_raise()
            return False
        QLocalServer.removeServer(self.name)
        self.server.setSocketOptions(QLocalServer.UserAccessOption)
        if not self.server.listen(self.name):
            raise OSError(f"cannot listen on the local socket {self.name}: {self.server.errorString()}")
        return True

    def _ask_to_raise(self) -> None:
        """Connect to the running copy: a connection is the request (nothing is sent)."""
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if socket.waitForConnected(CONNECT_MS):
            socket.disconnectFromServer()

    def _connected(self) -> None:
        while (socket := self.server.nextPendingConnection()) is not None:
            socket.abort()
            socket.deleteLater()
            self.raise_requested.emit()

    def release(self) -> None:
        """Stop listening and drop the lock (at exit)."""
        self.server.close()
        self.lock.unlock()
