"""The history database on its own thread: order, callbacks on the UI thread, errors, draining on stop."""

from __future__ import annotations

import threading

import pytest

from app.history import HistoryError, HistoryStore
from app.history_thread import HistoryThread
from app_helpers import stored


def test_jobs_run_in_order_off_the_ui_thread_and_answer_on_it(qtbot, history):
    ran_on, answered_on, got = [], [], []

    def create(store, title):
        ran_on.append(threading.current_thread())
        return store.create_conversation(title)

    def answered(result):
        answered_on.append(threading.current_thread())
        got.append(result)

    first = history.call(create, "a", then=answered)
    history.call(HistoryStore.rename_conversation, first.result(30), "renamed")
    titles = history.call(HistoryStore.conversations, "", then=answered)
    assert [c.title for c in titles.result(30)] == ["renamed"]
    qtbot.waitUntil(lambda: len(got) == 2)
    assert ran_on[0] is not threading.main_thread()
    assert answered_on == [threading.main_thread()] * 2


def test_a_failing_job_is_reported_and_the_thread_goes_on(qtbot, history):
    errors = []
    with qtbot.waitSignal(history.failed) as blocker:
        future = history.call(HistoryStore.regenerate, 12345, on_error=errors.append)
    assert isinstance(future.exception(5), HistoryError)
    assert blocker.args[0].startswith("Chat history: message 12345 is not a stored assistant message")
    qtbot.waitUntil(lambda: len(errors) == 1)
    assert stored(history, HistoryStore.conversations, "") == []


def test_stop_runs_the_jobs_already_posted(tmp_path):
    thread = HistoryThread(tmp_path / "h.db")
    thread.start()
    c = thread.call(HistoryStore.create_conversation, "kept").result(30)
    for i in range(50):
        thread.call(HistoryStore.add_message, c, None, "user", f"m{i}")
    thread.stop()
    assert not thread.isRunning()
    store = HistoryStore.open(tmp_path / "h.db")
    assert len(store.all_messages(c)) == 50
    store.close()


def test_a_database_of_a_newer_deltadesk_falls_back_to_memory(qtbot, tmp_path):
    import sqlite3
    path = tmp_path / "h.db"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    thread = HistoryThread(path)
    with qtbot.waitSignal(thread.unavailable) as blocker:
        thread.start()
    assert "newer than this DeltaDesk" in blocker.args[0] and "will not be saved" in blocker.args[0]
    assert stored(thread, HistoryStore.create_conversation, "x") == 1
    thread.stop()
    with sqlite3.connect(path) as conn:              # left as it was
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 99


def test_a_turn_adds_question_and_answer_in_one_go(tmp_path):
    store = HistoryStore.open(tmp_path / "h.db")
    c = store.create_conversation()
    start = store.reply(c, "Why is the sky blue?", ["/i/a.png"], "Why is the sky")
    assert store.conversation(c).title == "Why is the sky"
    user, answer = start.branch.path
    assert (user.content, user.images, answer.id, answer.state) == ("Why is the sky blue?", ("/i/a.png",),
                                                                    start.answer_id, "streaming")
    again = store.regenerate(answer.id)
    assert again.branch.siblings[again.answer_id] == [answer.id, again.answer_id]
    edited = store.resend(user.id, "Why is the sea blue?", [])
    assert [m.content for m in edited.branch.path] == ["Why is the sea blue?", ""]
    store.reply(c, "And at night?", [], "ignored")
    assert store.conversation(c).title == "Why is the sky"
    with pytest.raises(HistoryError, match="not a stored user message"):
        store.resend(answer.id, "x", [])
    store.close()


@pytest.mark.parametrize("full_text", [True, False])
def test_search_finds_words_in_any_message(tmp_path, full_text):
    store = HistoryStore.open(tmp_path / "h.db", full_text=full_text)
    assert store.full_text == full_text
    a = store.create_conversation()
    b = store.create_conversation()
    store.reply(a, "How long do I bake a pear tart?", [], "Cooking")
    start = store.reply(b, "Trains from Lyon to Turin", [], "Travel")
    store.update_message(start.answer_id, "The Fréjus line; book ahead.")
    assert [c.id for c in store.conversations("tart")] == [a]
    assert [c.id for c in store.conversations("fréjus")] == [b]
    assert [c.id for c in store.conversations("cook")] == [a]
    assert store.conversations("turin tart") == []
    if full_text:
        # word prefixes in any order, across one message
        assert [c.id for c in store.conversations("bake pea")] == [a]
        assert [c.id for c in store.conversations('"lyon')] == [b]
    store.close()


def test_the_search_index_is_rebuilt_when_missing(tmp_path):
    path = tmp_path / "h.db"
    store = HistoryStore.open(path)
    c = store.create_conversation()
    store.reply(c, "quokka facts", [], "t")
    store._conn.execute("DROP TABLE messages_fts")
    store._conn.execute("DROP TRIGGER messages_fts_insert")
    store.close()
    store = HistoryStore.open(path)
    assert store.full_text and [x.id for x in store.conversations("quokka")] == [c]
    store.delete_conversation(c)
    store.purge_deleted()
    store._conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
    store.close()
