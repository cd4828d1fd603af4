"""The history database as another process or a damaged disk leaves it: pages overwritten, another program's
tables, a write lock held by another process, a job that raises anything."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from app_helpers import stored
from PySide6.QtCore import Qt

from app.history import HistoryStore
from app.history_thread import HistoryThread

PAGE = 4096
LOCKER = ("import sqlite3, sys; conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30); "
          "conn.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.read(); conn.execute('COMMIT')")


def _real_history(path) -> None:
    """A history of many pages: 3 conversations of 40 messages of 2 KB."""
    store = HistoryStore.open(path)
    for c in range(3):
        conversation = store.create_conversation(f"chat {c}")
        parent = None
        for i in range(40):
            parent = store.add_message(conversation, parent, "user" if i % 2 == 0 else "assistant", f"{i} " * 700)
    store.close()


def _damage(path) -> bytes:
    """Overwrite every page after the first (the schema page stays intact) with random bytes."""
    data = bytearray(path.read_bytes())
    assert len(data) > 20 * PAGE
    data[PAGE:] = os.urandom(len(data) - PAGE)
    path.write_bytes(bytes(data))
    return bytes(data)


def _damaged_files(folder) -> list:
    return sorted(p for p in folder.iterdir() if ".damaged-" in p.name and not p.name.endswith(("-wal", "-shm")))


def test_a_database_with_damaged_pages_is_moved_aside_and_a_new_one_started(qtbot, tmp_path) -> None:
    path = tmp_path / "history.db"
    _real_history(path)
    damaged = _damage(path)
    thread = HistoryThread(path)
    with qtbot.waitSignal(thread.damaged, timeout=10000) as blocker:
        thread.start()
    [moved] = _damaged_files(tmp_path)
    assert moved.read_bytes() == damaged                       # set aside untouched
    assert str(moved) in blocker.args[0] and "damaged" in blocker.args[0]
    assert stored(thread, HistoryStore.create_conversation, "new") == 1     # the new history works
    thread.stop()
    assert [c.title for c in HistoryStore.open(path).conversations()] == ["new"]


def test_a_sqlite_file_of_another_program_is_moved_aside_unchanged(qtbot, tmp_path) -> None:
    path = tmp_path / "history.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        conn.execute("INSERT INTO notes (text) VALUES ('keep me')")
    before = path.read_bytes()
    thread = HistoryThread(path)
    with qtbot.waitSignal(thread.damaged, timeout=10000) as blocker:
        thread.start()
    [moved] = _damaged_files(tmp_path)
    assert "another program's tables (notes)" in blocker.args[0] and str(moved) in blocker.args[0]
    assert moved.read_bytes() == before
    thread.stop()


def test_the_window_shows_a_dialog_naming_where_the_damaged_file_went(qtbot, paths) -> None:
    from fake_engine import FakeEngine, loader_for

    from app.__main__ import build_window
    paths.data.mkdir(parents=True)
    _real_history(paths.data / "history.db")
    _damage(paths.data / "history.db")
    window = build_window(paths, loader_for(FakeEngine()))
    window.show()
    try:
        qtbot.waitUntil(lambda: getattr(window, "history_dialog", None) is not None
                        and window.history_dialog.isVisible())
        [moved] = _damaged_files(paths.data)
        assert str(moved) in window.history_dialog.text()
        qtbot.waitUntil(lambda: window.controller.conversation_id is not None)    # and the app goes on
    finally:
        window.close()


class _Boom(BaseException):
    """Not an ``Exception``: what a job could raise that a plain ``except Exception`` lets through."""


def test_a_job_raising_anything_is_reported_and_the_next_job_runs(qtbot, history) -> None:
    def boom(store):
        raise _Boom("deep trouble")

    with qtbot.waitSignal(history.failed) as blocker:
        future = history.call(boom)
    assert isinstance(future.exception(5), _Boom) and "deep trouble" in blocker.args[0]
    assert stored(history, HistoryStore.create_conversation, "after") == 1


@pytest.fixture
def locker(tmp_path):
    """Start another process that holds the write lock of a database until the test lets go."""
    procs = []

    def lock(path):
        proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "locked"
        procs.append(proc)
        return proc

    yield lock
    for proc in procs:
        if proc.poll() is None:
            proc.communicate("", timeout=30)


def test_a_write_waits_out_a_lock_of_another_process(tmp_path, locker) -> None:
    from app.history import HistoryLocked
    path = tmp_path / "h.db"
    store = HistoryStore.open(path)
    store.lock_wait_s = 8.0
    proc = locker(path)
    t0 = time.monotonic()
    threading.Timer(3.0, lambda: proc.communicate("", timeout=30)).start()    # released after 3 s
    conversation = store.create_conversation("waited")
    assert 2.5 < time.monotonic() - t0 < 8.0
    assert store.conversation(conversation).title == "waited"
    store.lock_wait_s = 0.5
    locker(path)
    t0 = time.monotonic()
    with pytest.raises(HistoryLocked, match="locked by another program"):
        store.rename_conversation(conversation, "x")
    assert time.monotonic() - t0 < 3.0
    store.close()


def test_an_answer_the_locked_history_refuses_stays_shown_not_saved_with_a_retry(qtbot, make_window, locker) -> None:
    from fake_engine import FakeEngine
    engine = FakeEngine()
    engine.hold(after=2)
    window = make_window(engine)
    window.history.lock_wait_s = 0.5
    window.composer.editor.setPlainText("Hi")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: engine.produced >= 2 and window.controller.live is not None)
    answer_id = window.controller.live.message_id
    proc = locker(window.history.path)
    engine.release()

    def widget():
        return window.chat_view.widget_for(answer_id)
    qtbot.waitUntil(lambda: widget().retry_button is not None and widget().retry_button.isVisible())
    assert widget().stats_label.text().startswith("Not saved:") and "locked by another program" in \
        widget().stats_label.text()
    assert widget().raw == "Hello, world."
    proc.communicate("", timeout=30)
    qtbot.mouseClick(widget().retry_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: stored(window.history, HistoryStore.message, answer_id).state == "complete")
    assert stored(window.history, HistoryStore.message, answer_id).content == "Hello, world."
    qtbot.waitUntil(lambda: not widget().retry_button.isVisible())
    assert answer_id not in window.controller.unsaved


def test_a_message_the_locked_history_refuses_stays_shown_not_saved_with_a_retry(qtbot, make_window, locker) -> None:
    window = make_window()
    window.history.lock_wait_s = 0.5
    proc = locker(window.history.path)
    window.composer.editor.setPlainText("Keep what I typed")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)

    def shown():
        return [w for w in window.chat_view.widgets if w.message.id < 0]
    qtbot.waitUntil(lambda: len(shown()) == 1 and shown()[0].retry_button is not None
                    and shown()[0].retry_button.isVisible())       # Qt shows a widget added to a layout later
    [widget] = shown()
    assert widget.raw == "Keep what I typed" and widget.stats_label.text().startswith("Not saved:")
    proc.communicate("", timeout=30)
    qtbot.mouseClick(widget.retry_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not window.controller.busy)
    path = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)
    assert [m.content for m in path] == ["Keep what I typed", "Hello, world."]
    qtbot.waitUntil(lambda: not shown())


def test_a_folder_in_place_of_the_database_is_left_alone(qtbot, tmp_path) -> None:
    path = tmp_path / "history.db"
    path.mkdir()
    thread = HistoryThread(path)
    with qtbot.waitSignal(thread.unavailable, timeout=10000) as blocker:
        thread.start()
    assert "will not be saved" in blocker.args[0] and path.is_dir() and not _damaged_files(tmp_path)
    assert stored(thread, HistoryStore.create_conversation, "x") == 1
    thread.stop()
