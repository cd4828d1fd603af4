"""Loading models: drop a .gguf on the window, the load's stages in the banner, cancel a slow load,
close while one runs."""

from __future__ import annotations

import time

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication

from fake_engine import BlockingLoader, FakeEngine, StagedLoader, loader_for


def _mime(*paths):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    return mime


def drag_enter_accepted(window, mime) -> bool:
    event = QDragEnterEvent(QPoint(20, 20), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    event.ignore()
    QApplication.sendEvent(window, event)
    return event.isAccepted()


def drop(window, mime) -> None:
    """Drag ``mime`` onto the window and drop it there, as a file manager would."""
    assert drag_enter_accepted(window, mime)
    QApplication.sendEvent(window, QDropEvent(QPointF(20, 20), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier))


def test_dropping_a_gguf_on_the_window_loads_it_and_remembers_it(qtbot, make_window, tmp_path):
    engine = FakeEngine(has_vision=True)
    window = make_window(engine)
    model, tower = tmp_path / "Qwen3.6-35B-A3B-Q4_K_M.gguf", tmp_path / "mmproj-Qwen3.6-F16.gguf"
    photo = tmp_path / "a.png"
    assert not drag_enter_accepted(window, _mime(photo))
    assert drag_enter_accepted(window, _mime(photo, model))

    drop(window, _mime(tower, model))
    assert window.banner.text() == f"Loading {model.name}\u2026" and window.load_progress.isVisible()
    qtbot.waitUntil(lambda: window.model is not None)
    assert (engine.loads[-1].model_path, engine.loads[-1].mmproj_path) == (str(model), str(tower))
    assert not window.load_progress.isVisible() and "qwen35moe" in window.banner.text()
    assert (window.prefs.model_path, window.prefs.mmproj_path) == (str(model), str(tower))

    window.close()
    again = make_window(engine)
    assert (engine.loads[-1].model_path, engine.loads[-1].mmproj_path) == (str(model), str(tower))
    other = tmp_path / "mmproj-other.gguf"
    drop(again, _mime(other))
    qtbot.waitUntil(lambda: again.model is not None and again.prefs.mmproj_path == str(other))
    assert (engine.loads[-1].model_path, engine.loads[-1].mmproj_path) == (str(model), str(other))


def test_a_slow_load_can_be_cancelled_and_its_model_is_dropped(qtbot, make_window):
    engine = FakeEngine()
    loader = BlockingLoader(engine)
    window = make_window(loader=loader, load=False)
    window.load_model("/models/huge.gguf")
    assert loader.started.wait(5)
    assert window.cancel_load_button.isVisible()
    qtbot.mouseClick(window.cancel_load_button, Qt.LeftButton)
    assert "cancelled" in window.banner.text() and not window.cancel_load_button.isVisible()
    loader.release()
    qtbot.wait(50)
    assert window.model is None and window.prefs.model_path == ""
    window.composer.editor.setPlainText("anyone there?")
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy, timeout=5000):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    assert "Cannot answer: Loading the model was cancelled." in window.chat_view.widgets[-1].stats_label.text()


def test_the_banner_shows_the_load_stage_and_cancel_stops_the_load(qtbot, make_window):
    loader = StagedLoader(FakeEngine())
    window = make_window(loader=loader, load=False)
    window.load_model("/models/huge.gguf")
    qtbot.waitUntil(lambda: window.banner.text() == "Loading huge.gguf: mapping tensors\u2026")
    loader.step()
    qtbot.waitUntil(lambda: window.banner.text() == "Loading huge.gguf: building the tokenizer\u2026")
    assert window.load_progress.isVisible()
    qtbot.mouseClick(window.cancel_load_button, Qt.LeftButton)
    assert "cancelled" in window.banner.text() and not window.cancel_load_button.isVisible()
    loader.step()
    assert loader.finished.wait(5) and loader.cancelled.is_set()
    qtbot.wait(50)
    assert window.model is None and "cancelled" in window.banner.text()
    assert loader.stages == ["mapping tensors", "building the tokenizer"]


def test_a_staged_load_runs_to_the_model_summary(qtbot, make_window):
    loader = StagedLoader(FakeEngine())
    window = make_window(loader=loader, load=False)
    window.load_model("/models/small.gguf")
    for _ in loader.STAGES:
        loader.step()
    qtbot.waitUntil(lambda: window.model is not None)
    assert "qwen35moe" in window.banner.text() and not window.load_progress.isVisible()
    assert loader.stages == list(loader.STAGES)


def test_closing_while_a_model_loads_does_not_wait_for_it(qtbot, make_window):
    loader = BlockingLoader(FakeEngine())
    window = make_window(loader=loader, load=False)
    window.load_model("/models/huge.gguf")
    assert loader.started.wait(5)
    t0 = time.monotonic()
    window.close()
    closed_in = time.monotonic() - t0
    loader.release()
    assert closed_in < 1.0 and not window.engine.thread.isRunning() and not window.history.isRunning()


def test_a_new_load_replaces_one_in_progress(qtbot, make_window):
    loader = BlockingLoader(FakeEngine())
    window = make_window(loader=loader, load=False)
    window.load_model("/models/first.gguf")
    assert loader.started.wait(5)
    window.engine.worker._loader = loader_for(FakeEngine(tokens=["second"]))
    window.load_model("/models/second.gguf")
    qtbot.waitUntil(lambda: window.model is not None)
    loader.release()
    qtbot.wait(50)
    assert window.engine.worker._engine.tokens == ["second"]
