"""No stale state in the window: New chat clears the search, the sidebar's figures follow the chat shown, a
search result opens at the match, and a deleted chat's prefix snapshots are labelled, then dropped."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.sidebar import NO_SPEED, NO_TURN
from fake_engine import FakeEngine
from test_app_window import new_conversation, send


def _figures(window):
    bar = window.sidebar.context_bar
    return window.sidebar.last_turn.text(), window.sidebar.speed.text(), bar.parts, bar.context


def test_new_chat_clears_the_search(qtbot, make_window):
    window = make_window()
    send(qtbot, window, "about zebras")
    new_conversation(qtbot, window)
    send(qtbot, window, "about cats")
    qtbot.keyClicks(window.panel.search, "zebra")
    qtbot.waitUntil(lambda: window.conversations.rowCount() == 1)
    qtbot.keyClick(window, Qt.Key_N, Qt.ControlModifier)
    qtbot.waitUntil(lambda: window.conversations.rowCount() == 3 and not window.chat_view.widgets)
    assert window.panel.search.text() == "" and window.conversations.query == ""


def test_the_sidebar_figures_follow_the_chat_shown(qtbot, make_window):
    window = make_window(FakeEngine(token_ms=5.0))
    first = window.controller.conversation_id
    send(qtbot, window, "hello")
    qtbot.waitUntil(lambda: window.sidebar.context_bar.parts[2] == 4)
    shown = _figures(window)
    assert shown[0] != NO_TURN and shown[1] != NO_SPEED and shown[2] == (10, 20, 4)
    new_conversation(qtbot, window)
    assert _figures(window) == (NO_TURN, NO_SPEED, (0, 0, 0), 4096)
    assert len(window.sidebar.spark.values) == 0
    window.panel.select(first)
    qtbot.waitUntil(lambda: window.controller.conversation_id == first)
    assert _figures(window) == shown and len(window.sidebar.spark.values) == 4


def test_a_search_result_opens_at_the_highlighted_match(qtbot, make_window):
    window = make_window(FakeEngine(tokens=["line\n\n"] * 30))
    target = window.controller.conversation_id
    for text in ("first question", "the zebra question", "third question", "fourth question"):
        send(qtbot, window, text)
    new_conversation(qtbot, window)
    send(qtbot, window, "something else")
    qtbot.keyClicks(window.panel.search, "zebra")
    qtbot.waitUntil(lambda: window.conversations.rowCount() == 1)
    window.panel.view.setCurrentIndex(window.conversations.index(0))
    qtbot.waitUntil(lambda: window.controller.conversation_id == target and len(window.chat_view.widgets) == 8)
    match = window.chat_view.widgets[2]
    assert match.message.content == "the zebra question"
    marks = match.body.extraSelections()
    assert [m.cursor.selectedText() for m in marks] == ["zebra"]
    assert all(not w.body.extraSelections() for w in window.chat_view.widgets if w is not match)
    bar = window.chat_view.verticalScrollBar()

    def in_view() -> bool:
        top = match.mapTo(window.chat_view.widget(), match.rect().topLeft()).y()
        return bar.maximum() > 0 and bar.value() <= top < bar.value() + window.chat_view.viewport().height()

    qtbot.waitUntil(in_view)
    qtbot.wait(200)
    assert in_view() and bar.value() < bar.maximum()


def test_a_deleted_chats_snapshots_are_labelled_then_dropped(qtbot, make_window):
    engine = FakeEngine()
    window = make_window(engine)
    doomed = window.controller.conversation_id
    send(qtbot, window, "to be deleted")
    new_conversation(qtbot, window)
    send(qtbot, window, "to be kept")
    qtbot.waitUntil(lambda: window.snapshots.rowCount() == 2)
    window.panel.select(doomed)
    qtbot.waitUntil(lambda: window.controller.conversation_id == doomed)
    window.panel.delete_current()
    labels = [window.snapshots.index(i).data() for i in range(2)]
    assert sum("to be deleted (deleted)" in label for label in labels) == 1
    window.panel.undo_delete()
    qtbot.waitUntil(lambda: window.conversations.rowCount() == 2)
    assert not any("(deleted)" in window.snapshots.index(i).data() for i in range(2))
    window.panel.select(doomed)
    qtbot.waitUntil(lambda: window.controller.conversation_id == doomed)
    window.panel.delete_current()
    window.panel._undo_timer.timeout.emit()                 # the Undo offer runs out
    qtbot.waitUntil(lambda: window.snapshots.rowCount() == 1)
    assert [s.conversation for s in engine.snapshot_list] == [str(window.controller.conversation_id)]
