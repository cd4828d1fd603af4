"""The conversation list model and panel: qtmodeltester, new, rename, delete with undo, search."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from app.conversations import ConversationIdRole, ConversationListModel, ConversationPanel
from app.history import HistoryStore


@pytest.fixture
def store(tmp_path):
    s = HistoryStore.open(tmp_path / "h.db")
    yield s
    s.close()


def titles(model):
    return [model.index(r).data() for r in range(model.rowCount())]


def test_model_passes_qtmodeltester(qtmodeltester, store):
    for name in ("a", "b", "c"):
        store.create_conversation(name)
    model = ConversationListModel(store)
    qtmodeltester.check(model, force_py=True)
    model.create("d")
    model.delete(1)
    model.undo_delete()
    model.touch(model.index(2).data(ConversationIdRole))
    model.reload("c")
    qtmodeltester.check(model, force_py=True)


def test_create_rename_delete_undo_search(store):
    model = ConversationListModel(store)
    a = model.create("Alpha")
    b = model.create("Beta")
    assert titles(model) == ["Beta", "Alpha"]
    assert model.setData(model.index(1), "  Apples ") and titles(model) == ["Beta", "Apples"]
    assert not model.setData(model.index(1), "   ")
    assert store.conversation(a).title == "Apples"
    assert model.flags(model.index(0)) & Qt.ItemIsEditable

    assert model.delete(0) == b and titles(model) == ["Apples"]
    assert model.undo_delete() == b and titles(model) == ["Beta", "Apples"]
    model.delete(0)
    model.forget_deleted()
    assert model.undo_delete() is None and store.conversation(b) is None

    store.add_message(a, None, "user", "what about pears?")
    model.reload("PEAR")
    assert titles(model) == ["Apples"]
    model.reload("kiwi")
    assert titles(model) == []
    model.create("Kiwi")
    assert model.query == "" and titles(model) == ["Kiwi", "Apples"]


def test_touch_moves_a_conversation_to_the_top(store):
    model = ConversationListModel(store)
    a = model.create("a")
    model.create("b")
    store.add_message(a, None, "user", "new")
    model.touch(a)
    assert titles(model) == ["a", "b"]


def test_panel_delete_undo_and_search_keep_the_selection(qtbot, store):
    model = ConversationListModel(store)
    panel = ConversationPanel(model)
    qtbot.addWidget(panel)
    shown = []
    panel.conversation_selected.connect(shown.append)
    a = model.create("apples")
    b = model.create("bananas")
    panel.select(b)
    assert shown == [b] and panel.current_id() == b
    panel.search.setText("app")
    assert titles(model) == ["apples"]
    panel.search.clear()
    assert panel.current_id() == b and shown == [b]

    panel.delete_current()
    assert titles(model) == ["apples"] and panel.undo_bar.isVisibleTo(panel) and shown == [b, a]
    panel.undo_button.click()
    assert titles(model) == ["bananas", "apples"] and shown == [b, a, b]
    assert not panel.undo_bar.isVisibleTo(panel)
    panel.delete_current()
    panel._undo_timer.timeout.emit()
    assert store.conversation(b) is None and not panel.undo_bar.isVisibleTo(panel)


def test_deleting_the_last_conversation_asks_for_a_new_one(qtbot, store):
    model = ConversationListModel(store)
    panel = ConversationPanel(model)
    qtbot.addWidget(panel)
    panel.select(model.create("only"))
    with qtbot.waitSignal(panel.new_requested, timeout=1000):
        panel.delete_current()
