"""The live answer is shown from the engine's channels (reasoning folded, the rest as the answer), not by
reading ``<think>`` in the text; the history keeps the text as the model wrote it."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.history import HistoryStore
from app_helpers import stored
from fake_engine import FakeEngine


def test_the_live_answer_follows_the_channels(qtbot, make_window):
    engine = FakeEngine(tokens=["Plan", " a </th", "ink>\n\nAns", "wer"])   # a marker split over two tokens
    engine.hold(after=2)
    window = make_window(engine)
    window.composer.think_box.setChecked(True)
    window.composer.editor.setPlainText("q")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: engine.produced >= 2 and window.controller.live is not None)
    live = window.controller.live
    widget = window.chat_view.widget_for(live.message_id)
    qtbot.waitUntil(lambda: widget.thinking_label.toPlainText() == "Plan a")   # " </th" may still close it
    assert widget.thinking_button.text() == "Thinking\u2026" and widget.body.toPlainText() == ""
    assert widget.raw == "Plan a </th" and live.thought_s is None
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        engine.release()
    answer = stored(window.history, HistoryStore.message, live.message_id)
    assert answer.content == "Plan a </think>\n\nAnswer" and "thinking_s" in answer.stats
    assert widget.thinking_label.toPlainText() == "Plan a" and widget.body.toPlainText() == "Answer"


def test_tool_call_text_is_part_of_the_answer(qtbot, make_window):
    engine = FakeEngine(tokens=["Calling ", "<tool_call>", "x", "</tool_call>"])
    engine.hold(after=3)
    window = make_window(engine)
    window.composer.editor.setPlainText("q")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    qtbot.waitUntil(lambda: engine.produced >= 3 and window.controller.live is not None)
    live = window.controller.live
    widget = window.chat_view.widget_for(live.message_id)
    qtbot.waitUntil(lambda: widget.raw == "Calling <tool_call>x")
    assert widget.body.toPlainText() == "Calling " and widget.thinking_button.isHidden()   # a block is sent whole
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        engine.release()
    assert live.answer == "Calling <tool_call>x</tool_call>" and live.reasoning == ""


def test_an_answer_that_ends_inside_its_reasoning_is_kept_as_thinking(qtbot, make_window):
    """The prompt opened ``<think>`` and the model never closed it: the stored row and the finished widget
    read it back as thinking (folded), not as the answer."""
    engine = FakeEngine(tokens=["Still ", "pondering"])
    window = make_window(engine)
    window.composer.think_box.setChecked(True)
    window.composer.editor.setPlainText("q")
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    answer = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-1]
    assert answer.content == "<think>\nStill pondering"
    widget = window.chat_view.widget_for(answer.id)
    assert widget.thinking_label.toPlainText() == "Still pondering" and "pondering" not in widget.body.toPlainText()
