"""The main window on a fake engine: streaming, stop, branches, images, errors, restart, sidebar."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace

from PySide6.QtCore import QMimeData, Qt, QUrl
from PySide6.QtGui import QColor, QGuiApplication, QImage

from app.history import HistoryStore
from app_helpers import settle, stored
from engine.errors import EngineError
from fake_engine import FakeEngine


def turn_done(qtbot, window):
    """A context that waits until the window has finished a turn (answer stored and shown)."""
    return qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy)


def send(qtbot, window, text):
    """Type ``text`` and press Enter; wait for the answer to finish; returns the stored answer."""
    window.composer.editor.setPlainText(text)
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    return path_of(window)[-1]


def path_of(window, conversation_id=None):
    """The stored active branch of the shown (or the given) conversation."""
    return stored(window.history, HistoryStore.active_path, conversation_id or window.controller.conversation_id)


def shown_ids(window):
    return [w.message.id for w in window.chat_view.widgets]


def new_conversation(qtbot, window):
    """Create a conversation from the window and wait until it is the one shown (the view is
    emptied when its branch arrives from the history thread, which can be after the id changes)."""
    before = window.controller.conversation_id
    window.new_conversation()
    qtbot.waitUntil(lambda: window.controller.conversation_id != before and not window.chat_view.widgets)
    return window.controller.conversation_id


def test_send_streams_and_stores_the_answer(qtbot, make_window):
    window = make_window(FakeEngine(tokens=["**Bold**", " and ", "`code`"]))
    assert "qwen35moe" in window.banner.toolTip()
    assert send(qtbot, window, "Hello there").stats["stop_reason"] == "eos"
    user, answer = path_of(window)
    assert (user.role, user.content) == ("user", "Hello there")
    assert (answer.content, answer.state) == ("**Bold** and `code`", "complete")
    assert answer.stats["ttft_ms"] > 0 and answer.stats["reused_tokens"] == 10
    widget = window.chat_view.widget_for(answer.id)
    assert widget.body.toPlainText() == "Bold and code"
    assert "font-weight" in widget.body.toHtml() and "monospace" in widget.body.toHtml()
    assert "TTFT" in widget.stats_label.text() and "decode" in widget.stats_label.text()
    assert stored(window.history, HistoryStore.conversation, window.controller.conversation_id).title == "Hello there"
    assert not window.composer.busy and window.composer.editor.toPlainText() == ""


def test_shift_enter_is_a_newline(qtbot, make_window):
    window = make_window()
    qtbot.keyClicks(window.composer.editor, "one")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return, Qt.ShiftModifier)
    qtbot.keyClicks(window.composer.editor, "two")
    assert window.composer.editor.toPlainText() == "one\ntwo"
    assert path_of(window) == []


def test_stop_with_escape_mid_answer(qtbot, make_window):
    engine = FakeEngine(tokens=["w "] * 2000, token_ms=2.0)
    engine.hold(after=20)                                   # still answering when Escape is pressed
    window = make_window(engine)
    window.composer.editor.setPlainText("go on")
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: len(window.controller.live.text) > 20 if window.controller.live else False)
        assert window.composer.send_button.text() == "Stop"
        qtbot.keyClick(window, Qt.Key_Escape)
    answer = path_of(window)[-1]
    assert answer.state == "stopped" and 0 < len(answer.content) < 4000
    assert engine.produced < 2000
    assert "Stopped." in window.chat_view.widget_for(answer.id).stats_label.text()
    assert window.composer.send_button.text() == "Send"


def test_escape_at_once_after_enter_stops_the_turn_before_it_starts(qtbot, make_window):
    """Escape pressed while the new rows are still being stored (the turn not yet started)."""
    engine = FakeEngine(tokens=["w "] * 20)
    window = make_window(engine)
    window.composer.editor.setPlainText("never mind")
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        assert window.controller.busy and window.controller.live is None    # the history thread has not answered
        qtbot.keyClick(window, Qt.Key_Escape)
    user, answer = path_of(window)
    assert user.content == "never mind" and (answer.state, answer.content) == ("stopped", "")
    assert engine.calls == [] and window.composer.send_button.text() == "Send"
    qtbot.waitUntil(lambda: shown_ids(window) == [user.id, answer.id])
    assert answer.stats["message"] == "Stopped before the engine began."
    assert "Stopped." in window.chat_view.widget_for(answer.id).stats_label.text()
    assert send(qtbot, window, "and now?").state == "complete" and len(engine.calls) == 1


def test_prefill_progress_shows_in_the_streaming_message_until_the_answer(qtbot, make_window):
    # each piece outlasts a batch of the worker's (40 ms), so each shows its own count for a while
    engine = FakeEngine(tokens=["slow "] * 12, token_ms=25.0, prompt_pieces=12, piece_ms=80.0)
    engine.hold(after=1)                                    # still streaming while the first token is looked at
    window = make_window(engine)
    window.composer.editor.setPlainText("a long prompt")
    seen = []

    def reading():
        widget = window.chat_view.widgets[-1] if window.controller.live else None
        text = widget.stats_label.text() if widget is not None and widget.streaming else ""
        if text.startswith("Reading the prompt: ") and text not in seen:
            seen.append(text)
        return len(seen) >= 2

    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(reading)
        widget = window.chat_view.widgets[-1]
        qtbot.waitUntil(lambda: "slow" in widget.body.toPlainText())
        assert widget.streaming and not widget.stats_label.isVisible()
        engine.release()
    assert all(t.endswith(" / 30 tokens") for t in seen)
    assert "TTFT" in widget.stats_label.text() and path_of(window)[-1].content == "slow " * 12


def test_stop_while_the_prompt_is_read(qtbot, make_window):
    engine = FakeEngine(tokens=["never"], prompt_pieces=30_000, piece_ms=2.0)   # a minute unless stopped
    window = make_window(engine)
    window.composer.editor.setPlainText("a very long prompt")
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.controller.live is not None and window.controller.live.progress is not None)
        qtbot.keyClick(window, Qt.Key_Escape)
    answer = path_of(window)[-1]
    assert answer.state == "stopped" and answer.content == "" and engine.produced == 0
    assert engine.pieces_read < 30_000
    assert "Stopped." in window.chat_view.widget_for(answer.id).stats_label.text()


def test_regenerate_and_edit_make_branches(qtbot, make_window):
    engine = FakeEngine()
    window = make_window(engine)
    send(qtbot, window, "first")
    user, answer = path_of(window)
    widget = window.chat_view.widget_for(answer.id)
    with turn_done(qtbot, window):
        widget.action_button.click()
    user2, answer2 = path_of(window)
    assert user2.id == user.id and answer2.id != answer.id
    assert stored(window.history, HistoryStore.siblings, answer2.id) == [answer.id, answer2.id]
    assert window.chat_view.widget_for(answer2.id).branch_label.text() == "2/2"

    window.chat_view.widget_for(user.id).action_button.click()
    assert window.composer.editor.toPlainText() == "first" and window.composer.editing_id == user.id
    assert send(qtbot, window, "first, edited").stats["stop_reason"] == "eos"
    edited, _ = path_of(window)
    assert edited.content == "first, edited"
    assert stored(window.history, HistoryStore.siblings, edited.id) == [user.id, edited.id]
    assert engine.calls[-1] == [{"role": "user", "content": "first, edited"}]
    assert window.composer.editing_id is None

    # back to the first version of the question, with its latest answer
    window.chat_view.widget_for(edited.id).branch_requested.emit(user.id)
    qtbot.waitUntil(lambda: shown_ids(window) == [user.id, answer2.id])
    assert [m.id for m in path_of(window)] == [user.id, answer2.id]


def test_history_goes_to_the_model_without_thinking(qtbot, make_window):
    engine = FakeEngine(tokens=["<think>", "hmm", "</think>", "Answer"])
    window = make_window(engine)
    window.composer.think_box.setChecked(True)
    send(qtbot, window, "q1")
    answer = path_of(window)[-1]
    assert answer.content == "<think>hmm</think>Answer" and "thinking_s" in answer.stats
    widget = window.chat_view.widget_for(answer.id)
    assert widget.thinking_button.text().startswith("Thought for") and widget.thinking_label.isHidden()
    assert widget.body.toPlainText() == "Answer"
    widget.thinking_button.click()
    assert widget.thinking_label.isVisible() and widget.thinking_label.toPlainText() == "hmm"
    send(qtbot, window, "q2")
    assert engine.thinking == [True, True]
    assert engine.calls[-1][1] == {"role": "assistant", "content": "Answer"}


def _png(tmp_path, name="pic.png", color="red"):
    image = QImage(300, 200, QImage.Format_RGB32)
    image.fill(QColor(color))
    path = tmp_path / name
    image.save(str(path))
    return path


def test_drop_and_paste_images_with_no_vision_warning(qtbot, make_window, tmp_path):
    engine = FakeEngine(has_vision=False)
    window = make_window(engine)
    composer = window.composer
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(_png(tmp_path)))])
    assert composer.editor.canInsertFromMimeData(mime)
    composer.editor.insertFromMimeData(mime)
    pasted = QMimeData()
    image = QImage(64, 32, QImage.Format_RGB32)
    image.fill(QColor("blue"))
    pasted.setImageData(image)
    composer.editor.insertFromMimeData(pasted)
    qtbot.waitUntil(lambda: len(composer.attachments) == 2)
    assert [a.caption.split(" ")[0] for a in composer.attachments] == ["300\u00d7200", "64\u00d732"]
    assert composer.warning.isVisible() and "no vision tower" in composer.warning.text()
    stored = [a.path for a in composer.attachments]
    assert all(p.startswith(str(window.composer._images.folder)) for p in stored)
    send(qtbot, window, "what is this?")
    user = path_of(window)[0]
    assert list(user.images) == stored
    assert engine.calls[-1] == [{"role": "user", "content": "what is this?"}]
    assert not composer.warning.isVisible() and composer.attachments == []


def test_images_reach_a_vision_model_and_can_be_removed(qtbot, make_window, tmp_path):
    engine = FakeEngine(has_vision=True)
    window = make_window(engine)
    composer = window.composer
    composer.add_file(_png(tmp_path, "a.png", "red"))
    composer.add_file(_png(tmp_path, "b.png", "green"))
    qtbot.waitUntil(lambda: len(composer.thumbnails()) == 2)
    first, thumbs = composer.attachments[0], composer.thumbnails()
    qtbot.waitUntil(lambda: all(t.model_size.isVisibleTo(t) for t in thumbs))
    # the fake engine's tower sees 300x200 images at half size: 150x100 pixels, 14 tokens of 32x32
    assert thumbs[0].model_size.text() == "model sees 150\u00d7100 \u00b7 14 tokens"
    composer.remove_attachment(composer.attachments[1], thumbs[1])
    assert not composer.warning.isVisible()
    send(qtbot, window, "describe")
    assert engine.calls[-1] == [{"role": "user", "content": [{"type": "image", "image": first.path},
                                                             {"type": "text", "text": "describe"}]}]
    thumbs = [w for w in window.chat_view.widgets[0].findChildren(type(composer.warning))
              if w.accessibleName() == "Attached image"]
    assert len(thumbs) == 1 and not thumbs[0].pixmap().isNull()


def test_a_failed_switch_keeps_the_loaded_model_answering(qtbot, make_window):
    engine = FakeEngine()

    def loader(request, progress, cancel):
        if request.model_path == "m.gguf":
            raise EngineError("m.gguf: wrong magic b'GGUX', expected b'GGUF'")
        return engine

    window = make_window(loader=loader)
    send(qtbot, window, "first")
    banner, figures = window.banner.text(), window.sidebar.last_turn.text()
    assert window.sidebar.context_bar.context == 4096 and "TTFT \u2014" not in figures
    window.load_model("m.gguf")
    qtbot.waitUntil(lambda: "wrong magic" in window.statusBar().currentMessage())
    assert window.statusBar().currentMessage().startswith("Still using fake-model.gguf. Could not open m.gguf: m.gguf: "
                                                          "wrong magic")
    assert window.statusBar().toolTip() == window.statusBar().currentMessage()
    assert window.banner.text() == banner and window.model is not None
    assert window.sidebar.context_bar.context == 4096 and window.sidebar.last_turn.text() == figures
    assert window.composer.send_button.isEnabled() and not window.composer.status.isVisibleTo(window)
    send(qtbot, window, "second")
    assert [m.content for m in path_of(window)] == ["first", "Hello, world.", "second", "Hello, world."]


def test_a_failed_first_load_refuses_to_send(qtbot, make_window):
    def loader(request, progress, cancel):
        raise EngineError("m.gguf: wrong magic b'GGUX', expected b'GGUF'")

    window = make_window(loader=loader, load=False)
    window.load_model("m.gguf")
    qtbot.waitUntil(lambda: "could not be loaded" in window.banner.text())
    assert "wrong magic" in window.banner.text() and "wrong magic" in window.statusBar().currentMessage()
    assert not window.composer.send_button.isEnabled()
    assert "No model is loaded" in window.composer.status.text() and window.composer.status.isVisibleTo(window)
    window.composer.editor.setPlainText("hello?")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    settle(qtbot, window.history)
    assert path_of(window) == [] and window.composer.editor.toPlainText() == "hello?"
    assert window.sidebar.context_bar.context == 0 and "TTFT \u2014" in window.sidebar.last_turn.text()


def test_switch_conversations_mid_stream(qtbot, make_window):
    engine = FakeEngine(tokens=["z"] * 300, token_ms=2.0)
    engine.hold(after=20)                                   # still streaming when switched back
    window = make_window(engine)
    first = window.controller.conversation_id
    window.composer.editor.setPlainText("long one")
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.controller.live is not None and len(window.controller.live.text) > 10)
        new_conversation(qtbot, window)
        qtbot.waitUntil(lambda: window.chat_view.widgets == [])
        qtbot.wait(60)
        window.panel.select(first)
        qtbot.waitUntil(lambda: len(window.chat_view.widgets) == 2)
        widget = window.chat_view.widgets[-1]
        assert widget.streaming and widget.raw == window.controller.live.text
        engine.release()
    assert path_of(window, first)[-1].content == "z" * 300
    assert window.chat_view.widgets[-1].raw == "z" * 300


def test_partial_answer_is_saved_every_few_seconds(qtbot, make_window):
    engine = FakeEngine(tokens=["p"] * 300, token_ms=2.0)
    engine.hold(after=20)                                   # still streaming when the saved copy is read
    window = make_window(engine)
    window.controller._save_timer.setInterval(100)
    window.composer.editor.setPlainText("save me")
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.controller.live is not None)
        answer_id = window.controller.live.message_id
        qtbot.waitUntil(lambda: len(stored(window.history, HistoryStore.message, answer_id).content) > 0)
        assert stored(window.history, HistoryStore.message, answer_id).state == "streaming"
        engine.release()


def test_history_survives_a_restart(qtbot, make_window):
    window = make_window()
    send(qtbot, window, "remember me")
    conversation = window.controller.conversation_id
    window.composer.editor.setPlainText("unsent")
    window.close()
    again = make_window()
    assert again.controller.conversation_id == conversation
    assert [m.content for m in path_of(again)] == ["remember me", "Hello, world."]
    qtbot.waitUntil(lambda: [w.message.role for w in again.chat_view.widgets] == ["user", "assistant"])


def test_conversation_shortcuts_and_sidebar_toggle(qtbot, make_window):
    window = make_window()
    n = window.conversations.rowCount()
    qtbot.keyClick(window, Qt.Key_N, Qt.ControlModifier)
    qtbot.waitUntil(lambda: window.conversations.rowCount() == n + 1)
    qtbot.keyClick(window, Qt.Key_K, Qt.ControlModifier)
    assert window.panel.search.hasFocus() or QGuiApplication.focusObject() is window.panel.search
    visible = window.sidebar.isVisible()
    qtbot.keyClick(window, Qt.Key_B, Qt.ControlModifier)
    assert window.sidebar.isVisible() != visible


def test_sidebar_without_gpu_and_with_fake_telemetry(qtbot, make_window):
    window = make_window()
    qtbot.waitUntil(lambda: window.sidebar.cpu.text.endswith("%"))
    assert window.sidebar.gpu_label.text() == "No NVIDIA GPU found: prompts and images are read on the CPU."
    assert window.sidebar.vram.isHidden() and window.sidebar.cpu.text.endswith("%")
    assert "/" in window.sidebar.ram.text
    send(qtbot, window, "numbers please")
    assert window.sidebar.context_bar.parts == (10, 20, 4)
    assert window.sidebar.speed.text().endswith("tok/s") and len(window.sidebar.spark.values) == 4
    assert "TTFT" in window.sidebar.last_turn.text()


def test_closing_mid_answer_keeps_what_was_written(qtbot, make_window, paths):
    engine = FakeEngine(tokens=["c"] * 3000, token_ms=2.0)
    engine.hold(after=20)                                   # still answering when the window closes
    window = make_window(engine)
    window.composer.editor.setPlainText("long")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: window.controller.live is not None and len(window.controller.live.text) > 10)
    answer_id = window.controller.live.message_id
    window.close()
    assert not window.engine.thread.isRunning() and not window.monitor.thread.isRunning()
    assert not window.history.isRunning() and engine.closed == 1
    store = HistoryStore.open(paths.data / "history.db")
    answer = store.message(answer_id)
    store.close()
    assert answer.state == "stopped" and 10 < len(answer.content) < 3000


def test_switching_conversation_abandons_an_edit(qtbot, make_window):
    window = make_window()
    send(qtbot, window, "question")
    user = path_of(window)[0]
    window.chat_view.widget_for(user.id).action_button.click()
    assert window.composer.editing_id == user.id
    new_conversation(qtbot, window)
    assert window.composer.editing_id is None and window.composer.editor.toPlainText() == ""


def test_export_and_import_from_the_window(qtbot, make_window, tmp_path):
    window = make_window()
    send(qtbot, window, "export me")
    exported = window.controller.conversation_id
    window.export_current(tmp_path / "c.md", "md")
    window.export_current(tmp_path / "c.json", "json")
    qtbot.waitUntil(lambda: window.statusBar().currentMessage() == f"Exported to {tmp_path / 'c.json'}")
    assert "export me" in (tmp_path / "c.md").read_text()
    window.import_file(tmp_path / "c.json")
    qtbot.waitUntil(lambda: window.controller.conversation_id != exported)
    assert window.statusBar().currentMessage() == "Imported c.json"
    assert [m.content for m in path_of(window)] == ["export me", "Hello, world."]
    (tmp_path / "bad.json").write_text("{")
    window.import_file(tmp_path / "bad.json")
    qtbot.waitUntil(lambda: window.statusBar().currentMessage().startswith("Import failed: bad.json"))


def test_a_colour_scheme_change_re_renders_the_messages(qtbot, make_window):
    window = make_window(FakeEngine(tokens=["```py\n", "x = 1\n", "```"]))
    send(qtbot, window, "code")
    before = window.chat_view.widgets[-1]
    window._scheme_changed()
    qtbot.waitUntil(lambda: len(window.chat_view.widgets) == 2)
    after = window.chat_view.widgets[-1]
    assert after is not before and after.message.id == before.message.id
    assert "x = 1" in after.body.toPlainText()


def test_an_imported_mid_chat_system_message_and_the_system_prompt_reach_the_model_as_one(qtbot, make_window,
                                                                                           tmp_path):
    from engine.prompt.template import ChatTemplate
    from engine.arch.qwen35.vocab import QWEN35_CHAT_TEMPLATE

    engine = FakeEngine()
    window = make_window(engine)
    window.apply_settings(replace(window.prefs, system_prompt="Answer briefly."))
    chat = {"format": "deltadesk-conversation", "version": 1, "title": "imported", "messages": [
        {"id": 1, "parent": None, "role": "user", "content": "hi"},
        {"id": 2, "parent": 1, "role": "assistant", "content": "hello"},
        {"id": 3, "parent": 2, "role": "system", "content": "Speak French from now on."}]}
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    window.import_file(tmp_path / "chat.json")
    qtbot.waitUntil(lambda: window.statusBar().currentMessage() == "Imported chat.json")
    qtbot.waitUntil(lambda: len(window.chat_view.widgets) == 3)
    send(qtbot, window, "and now?")
    sent = engine.calls[-1]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[0]["content"] == "Answer briefly.\n\nSpeak French from now on."
    prompt = ChatTemplate(QWEN35_CHAT_TEMPLATE, origin="qwen35.jinja").render(sent)
    assert prompt.startswith("<|im_start|>system\nAnswer briefly.\n\nSpeak French from now on.<|im_end|>\n")


def test_each_menu_gives_its_items_different_access_keys(qtbot, make_window):
    window = make_window()
    for menu_action in window.menuBar().actions():
        texts = [a.text() for a in menu_action.menu().actions() if not a.isSeparator()]
        keys = [t[t.index("&") + 1].lower() for t in texts if "&" in t]
        assert len(keys) == len(texts) and len(set(keys)) == len(keys), (menu_action.text(), texts)


def test_a_crash_while_the_prompt_is_read_reopens_that_chat(qtbot, make_window):
    engine = FakeEngine(tokens=["never"], piece_ms=2.0)
    window = make_window(engine)
    send(qtbot, window, "a first chat")
    window.close()
    window = make_window(engine)
    new_conversation(qtbot, window)
    interrupted = window.controller.conversation_id
    engine.prompt_pieces = 30_000                           # a minute: still reading when the new window opens
    window.composer.editor.setPlainText("a long prompt")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: window.controller.live is not None and window.controller.live.progress is not None)
    # the process dies here: no closeEvent; a new window starts on the same files
    engine.prompt_pieces = 0
    again = make_window(engine, load=False)
    assert again.controller.conversation_id == interrupted
    window.controller.stop()


def test_the_banner_speaks_to_a_user_and_the_details_are_one_click_away(qtbot, make_window):
    window = make_window(FakeEngine(has_vision=True))
    assert window.banner.text() == ("fake-model \u00b7 12.0 M params \u00b7 Q8_0 \u00b7 text and images \u00b7 "
                                    "prefill on CPU, decode on CPU")
    details = window.banner.toolTip()
    assert "4 layers (1 attention)" in details and "Q8_0 \u00d720, F32 \u00d79" in details
    assert "6.2 MB read per token" in details and "context 4096 tokens" in details
    assert window.details_button.isVisibleTo(window)
    window.details_button.click()
    qtbot.waitUntil(lambda: window.details_box.isVisible())
    assert window.details_box.text() == details
    window.details_box.close()


def test_the_window_turns_dark_and_light_with_the_desktop(qtbot, make_window):
    from PySide6.QtGui import QPalette
    from PySide6.QtWidgets import QApplication

    window = make_window(FakeEngine(tokens=["```py\n", "x = 1\n", "```"]))
    send(qtbot, window, "code")
    hints = QGuiApplication.styleHints()
    try:
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)
        assert QApplication.palette().color(QPalette.Window).lightness() < 80
        qtbot.waitUntil(lambda: window.chat_view.palette().color(QPalette.Base).lightness() < 80)
        qtbot.waitUntil(lambda: len(window.chat_view.widgets) == 2)
        assert window.chat_view.renderer.dark
    finally:
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert QApplication.palette().color(QPalette.Window).lightness() > 180 and not window.chat_view.renderer.dark


def test_other_chats_stay_usable_while_one_answers_and_their_sends_wait_their_turn(qtbot, make_window):
    from app.conversations import ActivityRole

    engine = FakeEngine(tokens=["a "] * 3000, token_ms=5.0)
    engine.hold(after=20)                                   # still answering when the test stops it
    window = make_window(engine)
    first = window.controller.conversation_id
    window.composer.editor.setPlainText("long answer please")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: window.controller.live is not None and len(window.controller.live.text) > 10)
    second = new_conversation(qtbot, window)
    assert window.composer.send_button.text() == "Send" and window.composer.send_button.isEnabled()
    window.composer.editor.setPlainText("a question while the other chat answers")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: [w.message.role for w in window.chat_view.widgets] == ["user", "assistant"]
                    and window.chat_view.widgets[0].message.content.startswith("a question"))
    assert window.composer.editor.toPlainText() == "" and window.composer.send_button.text() == "Stop"
    qtbot.waitUntil(lambda: window.chat_view.widgets[-1].stats_label.text().startswith("Waiting for the engine"))
    assert window.controller.activity() == {first: "answering", second: "waiting"}
    model = window.conversations
    assert model.index(model.row_of(first)).data(ActivityRole) == "answering"
    assert model.index(model.row_of(second)).data(ActivityRole) == "waiting"
    assert model.index(model.row_of(second)).data(Qt.DecorationRole) is not None

    third = new_conversation(qtbot, window)
    window.composer.editor.setPlainText("and one more, taken back")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: third in window.controller.activity())
    qtbot.keyClick(window, Qt.Key_Escape)
    assert third not in window.controller.activity() and first in window.controller.activity()
    qtbot.waitUntil(lambda: path_of(window, third)[-1].state == "stopped")

    window.panel.select(first)
    qtbot.waitUntil(lambda: window.controller.conversation_id == first)
    engine.tokens = ["second ", "answer"]
    with turn_done(qtbot, window):
        assert window.composer.send_button.text() == "Stop"
        qtbot.keyClick(window, Qt.Key_Escape)
    assert path_of(window, first)[-1].state == "stopped"
    assert path_of(window, second)[-1].content == "second answer"
    assert [m[-1]["content"] for m in engine.calls] == ["long answer please", "a question while the other chat answers"]
    assert window.controller.activity() == {} and model.index(model.row_of(second)).data(ActivityRole) == ""


class PickyEngine(FakeEngine):
    """A vision model whose reader refuses 300x200 pictures (as the real one refuses an image out of bounds)."""

    def image_info(self, source):
        info = super().image_info(source)
        if (info.height, info.width) == (100, 150):
            raise EngineError("image 300x200 is outside the vision tower's bounds")
        return info


def test_an_image_the_model_cannot_read_is_not_sent(qtbot, make_window, tmp_path):
    window = make_window(PickyEngine(has_vision=True))
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a picture" * 20)
    composer = window.composer
    composer.add_file(broken)
    qtbot.waitUntil(lambda: composer.pending == 0)
    assert composer.thumbnails() == [] and "Could not attach broken.png" in composer.warning.text()
    text = tmp_path / "notes.jpg"
    text.write_bytes(b"this is not a picture\n" * 10)
    composer.add_file(text)
    qtbot.waitUntil(lambda: composer.pending == 0)
    warning = composer.warning.text()       # the user's files named, not the store's copies, which are gone
    assert "broken.png: truncated or corrupt image data" in warning and "images" + os.sep not in warning
    assert "notes.jpg: not an image Pillow can read; expected PNG, JPEG" in warning
    for path in (broken, text):
        copy = hashlib.sha256(path.read_bytes()).hexdigest()[:32] + path.suffix    # ImageStore's name for it
        assert not (composer._images.folder / copy).exists()
    composer.add_file(_png(tmp_path, "wide.png"))
    qtbot.waitUntil(lambda: len(composer.thumbnails()) == 1)
    [thumb] = composer.thumbnails()
    qtbot.waitUntil(lambda: thumb.model_size.text() == "model cannot read it")
    composer.editor.setPlainText("what is this?")
    qtbot.keyClick(composer.editor, Qt.Key_Return)
    settle(qtbot, window.history)
    assert path_of(window) == [] and composer.editor.toPlainText() == "what is this?"
    assert composer.warning.isVisibleTo(window) and "cannot read" in composer.warning.text()
    assert "image 1: " in composer.warning.text()
    composer.remove_attachment(composer.attachments[0], thumb)
    assert not composer.warning.isVisibleTo(window)
    assert send(qtbot, window, "what is this?").state == "complete"


def test_a_stored_image_that_cannot_be_decoded_says_so_in_the_bubble(qtbot, make_window, tmp_path):
    from app.chat_view import MessageWidget
    from app.history import Message
    from app.markdown_render import MarkdownRenderer

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"x" * 100)
    message = Message(1, 1, None, "user", "look", 0.0, images=(str(broken), str(tmp_path / "gone.png")))
    widget = MessageWidget(message, MarkdownRenderer(), [1])
    texts = [w.text() for w in widget.findChildren(type(widget.stats_label)) if w.accessibleName() == "Attached image"]
    assert texts[0].startswith("[cannot show broken.png: ") and texts[1] == "[missing image gone.png]"


class ContextEngine(FakeEngine):
    """Refuses, as the engine does before reading it, a prompt whose messages hold over 1000 characters."""

    def chat(self, messages, **kwargs):
        size = sum(len(m["content"]) for m in messages if isinstance(m["content"], str))
        if size <= 1000:
            return super().chat(messages, **kwargs)
        self.calls.append(list(messages))
        from engine.events import TurnSummary

        return iter([TurnSummary(stop_reason="context_full", message="raise the context size.", prompt_tokens=size,
                                 reused_tokens=0, generated_tokens=0, ttft_ms=0.0, prefill_tok_s=0.0,
                                 decode_tok_s=0.0, text="")])


def test_a_message_over_the_context_is_handed_back_not_kept(qtbot, make_window):
    engine = ContextEngine()
    window = make_window(engine)
    assert window.prefs.context == 8192 and window.controller.context == 4096
    send(qtbot, window, "short one")
    paste = "lorem ipsum " * 300
    window.composer.editor.setPlainText(paste)
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: len(window.chat_view.widgets) == 2)
    assert [m.content for m in path_of(window)] == ["short one", "Hello, world."]
    assert window.composer.editor.toPlainText() == paste.strip()
    warning = window.composer.warning.text()
    assert "3,6" in warning and "4096 tokens, the model's own limit (Settings asks for 8192)" in warning
    assert "raise the context" not in warning
    window.composer.editor.setPlainText("and a short one")
    answer = send(qtbot, window, "and a short one")
    assert answer.state == "complete" and not window.composer.warning.isVisibleTo(window)
    assert [m["content"] for m in engine.calls[-1]] == ["short one", "Hello, world.", "and a short one"]
    # a regenerate that no longer fits keeps its question and the earlier answer
    engine.calls.clear()
    window.apply_settings(replace(window.prefs, system_prompt="x" * 990))
    before = [m.id for m in path_of(window)]
    with turn_done(qtbot, window):
        window.controller.regenerate(before[-1])
    qtbot.waitUntil(lambda: [m.id for m in path_of(window)] == before)
    assert "Not sent" in window.composer.warning.text() and window.composer.editor.toPlainText() == ""


def test_the_toolbar_names_new_search_attach_stop_regenerate_and_settings(qtbot, make_window):
    engine = FakeEngine(tokens=["t "] * 2000, token_ms=2.0)
    engine.hold(after=5)                                    # still answering when Stop is pressed
    window = make_window(engine)
    texts = [a.text().replace("&", "") for a in window.toolbar.actions()]
    assert texts == ["New chat", "Search chats", "Attach image\u2026", "Stop answer", "Regenerate answer",
                     "Open model\u2026", "Settings\u2026"]
    assert window.toolbar.toolButtonStyle() == Qt.ToolButtonTextBesideIcon and window.toolbar.isVisible()
    tips = {a.text().replace("&", ""): a.toolTip() for a in window.toolbar.actions()}
    assert tips["Stop answer"] == "Stop answer (Esc)" and tips["Regenerate answer"] == "Regenerate answer (Ctrl+R)"
    assert not window.stop_action.isEnabled() and not window.regenerate_action.isEnabled()
    window.composer.editor.setPlainText("go")
    with turn_done(qtbot, window):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.stop_action.isEnabled() and window.controller.live is not None
                        and window.controller.live.text != "")
        assert not window.regenerate_action.isEnabled()
        window.stop_action.trigger()
    assert not window.stop_action.isEnabled() and window.regenerate_action.isEnabled()
    engine.tokens = ["again"]
    first = path_of(window)[-1]
    with turn_done(qtbot, window):
        qtbot.keyClick(window, Qt.Key_R, Qt.ControlModifier)
    answer = path_of(window)[-1]
    assert answer.id != first.id and answer.content == "again"
    window.search_action.trigger()
    assert window.panel.search.hasFocus() or QGuiApplication.focusObject() is window.panel.search


def test_at_800_by_550_nothing_overlaps_and_the_snapshot_hint_is_whole(qtbot, make_window):
    window = make_window()
    window.resize(800, 550)
    qtbot.wait(100)
    panel = window.sidebar.snapshots
    for widget in (panel.summary, panel.remove_button, panel.clear_button):
        assert widget.height() >= widget.sizeHint().height() or widget.height() >= widget.minimumSizeHint().height()
    summary = panel.summary
    assert summary.wordWrap() and summary.height() >= summary.heightForWidth(summary.width())
    send(qtbot, window, "one")
    qtbot.waitUntil(lambda: window.snapshots.rowCount() > 0)
    qtbot.wait(100)

    def box(w):
        return w.geometry().translated(w.parentWidget().mapTo(window, w.parentWidget().rect().topLeft()))

    assert not box(panel.view).intersects(box(panel.remove_button))
    assert panel.view.height() >= panel.view.minimumHeight()


def test_the_keyboard_starts_in_the_message_box(qtbot, make_window):
    window = make_window(load=False)
    assert window.focusWidget() is window.composer.editor
