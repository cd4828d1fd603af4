"""Stop and closing the window while a remote server has gone silent mid-answer: neither waits for the network
(the remote engine cuts its connection at once, so the worker is free and the GUI thread never blocks)."""

from __future__ import annotations

import contextlib
import threading
import time

from PySide6.QtCore import Qt

from app.history import HistoryStore
from app_helpers import stored
from engine.events import TokenEvent
from engine.openai.remote import RemoteEngine
from http_fakes import ScriptServer, delta, sse_head


def _silent_after_hi(conn, stop):
    conn.sendall(sse_head() + delta("Hi"))
    stop.wait(120)


class _Watched(RemoteEngine):
    """A remote engine that says (``answered``) when the worker has taken an answer token and asked for more."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answered = threading.Event()

    def chat(self, *args, **kwargs):
        with contextlib.closing(super().chat(*args, **kwargs)) as events:
            for event in events:
                yield event
                if isinstance(event, TokenEvent):
                    self.answered.set()


def _start_turn(qtbot, make_window, srv):
    engine = _Watched(srv.url, "m", timeout=120)
    window = make_window(loader=lambda request, progress, cancel: engine)
    window.composer.editor.setPlainText("Hello?")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: window.controller.live is not None)
    assert engine.answered.wait(30)  # "Hi" has arrived (held in the worker's batch), then the server went silent
    return window


def test_stop_ends_a_silent_remote_turn_at_once(qtbot, make_window) -> None:
    with ScriptServer(_silent_after_hi) as srv:
        window = _start_turn(qtbot, make_window, srv)
        t0 = time.monotonic()
        with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
            window.escape()
        assert time.monotonic() - t0 < 10.0           # not the silent server's 120-s read timeout
        qtbot.waitUntil(lambda: [m.state for m in stored(window.history, HistoryStore.active_path,
                                                         window.controller.conversation_id)][-1] == "stopped")
        answer = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-1]
        assert answer.content == "Hi"


def test_closing_the_window_during_a_silent_remote_turn_does_not_wait_for_the_network(qtbot, make_window) -> None:
    with ScriptServer(_silent_after_hi) as srv:
        window = _start_turn(qtbot, make_window, srv)
        t0 = time.monotonic()
        window.close()
        assert time.monotonic() - t0 < 10.0, "closing waited for the silent server (120-s read timeout)"
