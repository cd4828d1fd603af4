"""The conversation list model and panel: qtmodeltester, new, rename, delete with undo, search."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.conversations import ConversationIdRole, ConversationListModel, ConversationPanel
from app.history import HistoryStore
from app_helpers import settle, stored


def titles(model):
    return [model.index(r).data() for r in range(model.rowCount())]


def created(qtbot, model, title):
    """Create a conversation through the model; its id once it is listed."""
    ids = []
    model.create(title, then=ids.append)
    qtbot.waitUntil(lambda: bool(ids))
    return ids[0]


def reloaded(qtbot, model, query=None):
    done = []
    model.reload(query, then=lambda: done.append(True))
    qtbot.waitUntil(lambda: bool(done))


def test_model_passes_qtmodeltester(qtbot, qtmodeltester, history):
    for name in ("a", "b", "c"):
        stored(history, HistoryStore.create_conversation, name)
    model = ConversationListModel(history)
    reloaded(qtbot, model)
    qtmodeltester.check(model, force_py=True)
    created(qtbot, model, "d")
    model.delete(1)
    model.undo_delete()
    settle(qtbot, history)
    model.touch(model.index(2).data(ConversationIdRole))
    reloaded(qtbot, model, "c")
    qtmodeltester.check(model, force_py=True)


def test_create_rename_delete_undo_search(qtbot, history):
    model = ConversationListModel(history)
    a = created(qtbot, model, "Alpha")
    b = created(qtbot, model, "Beta")
    assert titles(model) == ["Beta", "Alpha"]
    assert model.setData(model.index(1), "  Apples ") and titles(model) == ["Beta", "Apples"]
    assert not model.setData(model.index(1), "   ")
    assert stored(history, HistoryStore.conversation, a).title == "Apples"
    assert model.flags(model.index(0)) & Qt.ItemIsEditable

    assert model.delete(0) == b and titles(model) == ["Apples"]
    restored = []
    assert model.undo_delete(then=restored.append) == b
    qtbot.waitUntil(lambda: restored == [b])
    assert titles(model) == ["Beta", "Apples"]
    model.delete(0)
    model.forget_deleted()
    assert model.undo_delete() is None and stored(history, HistoryStore.conversation, b) is None

    stored(history, HistoryStore.add_message, a, None, "user", "what about pears?")
    reloaded(qtbot, model, "PEAR")
    assert titles(model) == ["Apples"]
    reloaded(qtbot, model, "kiwi")
    assert titles(model) == []
    created(qtbot, model, "Kiwi")
    assert model.query == "" and titles(model) == ["Kiwi", "Apples"]


def test_a_stale_search_result_is_dropped(qtbot, history):
    model = ConversationListModel(history)
    created(qtbot, model, "apples")
    created(qtbot, model, "bananas")
    model.reload("app")
    reloaded(qtbot, model, "ban")
    settle(qtbot, history)
    assert titles(model) == ["bananas"]


def test_touch_moves_a_conversation_to_the_top(qtbot, history):
    model = ConversationListModel(history)
    a = created(qtbot, model, "a")
    created(qtbot, model, "b")
    stored(history, HistoryStore.add_message, a, None, "user", "new")
    model.touch(a)
    qtbot.waitUntil(lambda: titles(model) == ["a", "b"])


def test_panel_delete_undo_and_search_keep_the_selection(qtbot, history):
    model = ConversationListModel(history)
    panel = ConversationPanel(model)
    qtbot.addWidget(panel)
    shown = []
    panel.conversation_selected.connect(shown.append)
    a = created(qtbot, model, "apples")
    b = created(qtbot, model, "bananas")
    panel.select(b)
    assert shown == [b] and panel.current_id() == b
    panel.search.setText("app")
    qtbot.waitUntil(lambda: titles(model) == ["apples"])
    panel.search.clear()
    qtbot.waitUntil(lambda: panel.current_id() == b)
    assert shown == [b]

    panel.delete_current()
    assert titles(model) == ["apples"] and panel.undo_bar.isVisibleTo(panel) and shown == [b, a]
    panel.undo_button.click()
    qtbot.waitUntil(lambda: shown == [b, a, b])
    assert titles(model) == ["bananas", "apples"] and not panel.undo_bar.isVisibleTo(panel)
    panel.delete_current()
    panel._undo_timer.timeout.emit()
    assert stored(history, HistoryStore.conversation, b) is None and not panel.undo_bar.isVisibleTo(panel)


def test_selecting_a_conversation_hidden_by_the_search_clears_it(qtbot, history):
    model = ConversationListModel(history)
    panel = ConversationPanel(model)
    qtbot.addWidget(panel)
    a = created(qtbot, model, "apples")
    created(qtbot, model, "bananas")
    panel.search.setText("ban")
    qtbot.waitUntil(lambda: titles(model) == ["bananas"])
    panel.select(a)
    qtbot.waitUntil(lambda: panel.current_id() == a)
    assert panel.search.text() == "" and titles(model) == ["bananas", "apples"]


def test_deleting_the_last_conversation_asks_for_a_new_one(qtbot, history):
    model = ConversationListModel(history)
    panel = ConversationPanel(model)
    qtbot.addWidget(panel)
    panel.select(created(qtbot, model, "only"))
    with qtbot.waitSignal(panel.new_requested):
        panel.delete_current()


def test_the_list_is_grouped_by_date_under_titles(qtbot, history):
    import time

    from app.conversations import GroupRole, date_group

    now = time.time()
    day = 86400.0
    ages = {"today": 0.0, "yesterday": day, "three days": 3 * day, "two weeks": 14 * day, "last year": 300 * day}
    for title, age in ages.items():
        conversation_id = stored(history, HistoryStore.create_conversation, title)
        stored(history, lambda store, c=conversation_id, t=now - age: store._write(
            "UPDATE conversations SET updated = ? WHERE id = ?", (t, c)))
    model = ConversationListModel(history)
    panel = ConversationPanel(model)
    qtbot.addWidget(panel)
    reloaded(qtbot, model)
    groups = [model.index(r).data(GroupRole) for r in range(model.rowCount())]
    assert groups == [date_group(now - age, now) for age in ages.values()]
    assert groups[:2] == ["Today", "Yesterday"] and groups[-1] == "Older"
    panel.resize(260, 500)
    panel.show()
    heights = [panel.view.visualRect(model.index(r)).height() for r in range(model.rowCount())]
    first = heights[0]
    assert all(h == first for h in heights), heights   # each row starts a group here: each has a title
    stored(history, HistoryStore.create_conversation, "also today")
    reloaded(qtbot, model)
    heights = [panel.view.visualRect(model.index(r)).height() for r in range(model.rowCount())]
    assert heights[1] < heights[0] == heights[2], heights   # "today" sits under "also today"'s title
    assert not panel.grab().isNull()
