"""One DeltaDesk per user profile: a second launch raises the running window and exits.

Two copies on one history database and one snapshot cache would each write what the other does
not see. The first launch takes a :class:`QLockFile` in the data dir (stale locks of a crashed
run are taken over: QLockFile checks that the holder's process is gone) and listens on a
:class:`QLocalServer` named after that dir; a later launch finds the lock taken, connects, asks
the first to show its window, hands it the files of its command line (one JSON object,
``{"model": path, "mmproj": path}``, absolute paths or null), and exits.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

CONNECT_MS = 1000


def server_name(data_dir: Path) -> str:
    """The local socket's name for a data dir: one per profile, short enough for a Unix socket path."""
    return "deltadesk-" + hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]


def _absolute(name: str | None) -> str | None:
    """A file named on the command line, as an absolute path; anything else (a model hub name such as
    ``owner/repo:Q4_K_M``, a file that is not there) as it was typed, for the running copy to say why not."""
    if not name:
        return None
    return str(Path(name).resolve()) if Path(name).exists() else name


class SingleInstance(QObject):
    """The lock and the server of the running copy for ``data_dir``.

    Signals:
        raise_requested(): a later launch asked for the window.
        open_requested(object, object): a later launch was started with ``--model`` / ``--mmproj``: the
            absolute paths (None for one not given).
    """

    raise_requested = Signal()
    open_requested = Signal(object, object)

    def __init__(self, data_dir: Path) -> None:
        super().__init__()
        data_dir.mkdir(parents=True, exist_ok=True)
        self.name = server_name(data_dir)
        self.lock = QLockFile(str(data_dir / "deltadesk.lock"))
        self.lock.setStaleLockTime(0)
        self.server = QLocalServer(self)
        self.server.newConnection.connect(self._connected)
        self._pending: list[QLocalSocket] = []

    def acquire(self, model: str | None = None, mmproj: str | None = None) -> bool:
        """Become the running copy (True), or (False) ask the running one to raise its window and to open
        ``model`` / ``mmproj`` (paths made absolute here: the running copy has another working folder).

        Raises:
            OSError: the lock is free but the local server cannot listen (names the server's error).
        """
        if not self.lock.tryLock(0):
            self._ask_to_raise(*(_absolute(p) for p in (model, mmproj)))
            return False
        QLocalServer.removeServer(self.name)
        self.server.setSocketOptions(QLocalServer.UserAccessOption)
        if not self.server.listen(self.name):
            raise OSError(f"cannot listen on the local socket {self.name}: {self.server.errorString()}")
        return True

    def _ask_to_raise(self, model: str | None, mmproj: str | None) -> None:
        """Connect to the running copy and send the files to open (the connection alone asks for the window)."""
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if socket.waitForConnected(CONNECT_MS):
            if model or mmproj:
                socket.write(json.dumps({"model": model, "mmproj": mmproj}).encode())
                socket.waitForBytesWritten(CONNECT_MS)
            socket.disconnectFromServer()
            if socket.state() != QLocalSocket.UnconnectedState:
                socket.waitForDisconnected(CONNECT_MS)

    def _connected(self) -> None:
        while (socket := self.server.nextPendingConnection()) is not None:
            self._pending.append(socket)
            socket.disconnected.connect(self._hung_up)
            if socket.state() != QLocalSocket.ConnectedState:
                self._request(socket)

    def _hung_up(self) -> None:
        for socket in [s for s in self._pending if s.state() != QLocalSocket.ConnectedState]:
            self._request(socket)

    def _request(self, socket: QLocalSocket) -> None:
        """A later launch hung up: raise the window, then open what it sent (a request that is not the
        JSON object it sends is ignored)."""
        if socket not in self._pending:
            return
        self._pending.remove(socket)
        data = bytes(socket.readAll().data())
        socket.deleteLater()
        self.raise_requested.emit()
        try:
            request = json.loads(data) if data else {}
        except ValueError:
            return
        files = [request.get(k) if isinstance(request, dict) else None for k in ("model", "mmproj")]
        if any(isinstance(f, str) and f for f in files):
            self.open_requested.emit(*(f if isinstance(f, str) and f else None for f in files))

    def release(self) -> None:
        """Stop listening and drop the lock (at exit)."""
        self.server.close()
        self.lock.unlock()
