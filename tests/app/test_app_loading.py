"""Loading models: drop a .gguf on the window, the load's stages in the banner, cancel a slow load,
close while one runs. Images dropped on the window or the chat view go to the composer."""

from __future__ import annotations

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
import pytest
from PySide6.QtGui import QDragEnterEvent, QDragLeaveEvent, QDropEvent
from PySide6.QtWidgets import QApplication

from fake_engine import BlockingLoader, FakeEngine, StagedLoader, loader_for
from test_app_window import _png, send


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


def drop_at(widget, mime) -> bool:
    """Drag ``mime`` over the middle of ``widget`` and drop it there if the drag is taken; whether it was.

    The events go to the window, as the platform sends them, so Qt itself picks the widget under
    the cursor that takes the drop.
    """
    handle = widget.window().windowHandle()
    pos = widget.mapTo(widget.window(), widget.rect().center())
    enter = QDragEnterEvent(pos, Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    enter.ignore()
    QApplication.sendEvent(handle, enter)
    if not enter.isAccepted():
        QApplication.sendEvent(handle, QDragLeaveEvent())
        return False
    QApplication.sendEvent(handle, QDropEvent(QPointF(pos), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier))
    return True


def test_dropping_a_gguf_on_the_window_loads_it_and_remembers_it(qtbot, make_window, tmp_path):
    engine = FakeEngine(has_vision=True)
    window = make_window(engine)
    model, tower = tmp_path / "Qwen3.6-35B-A3B-Q4_K_M.gguf", tmp_path / "mmproj-Qwen3.6-F16.gguf"
    photo = _png(tmp_path, "a.png")
    assert not drag_enter_accepted(window, _mime(tmp_path / "notes.txt"))
    # an image alone is attached to the composer, as a drop on the composer would do
    drop(window, _mime(photo))
    qtbot.waitUntil(lambda: len(window.composer.thumbnails()) == 1)
    [thumb] = window.composer.thumbnails()
    qtbot.waitUntil(lambda: thumb.model_size.isVisibleTo(thumb))
    assert thumb.model_size.text() == "model sees 150\u00d7100 \u00b7 14 tokens"
    window.composer.clear_attachments()

    # with a model in the drop, the model loads and the image is left out
    drop(window, _mime(photo, tower, model))
    assert window.composer.attachments == []
    assert window.banner.text() == f"Loading {model.name}\u2026" and window.load_progress.isVisible()
    qtbot.waitUntil(lambda: window.model is not None)
    assert (engine.loads[-1].model_path, engine.loads[-1].mmproj_path) == (str(model), str(tower))
    assert not window.load_progress.isVisible() and "qwen35moe" in window.banner.toolTip()
    assert (window.prefs.model_path, window.prefs.mmproj_path) == (str(model), str(tower))

    window.close()
    again = make_window(engine)
    assert (engine.loads[-1].model_path, engine.loads[-1].mmproj_path) == (str(model), str(tower))
    other = tmp_path / "mmproj-other.gguf"
    drop(again, _mime(other))
    qtbot.waitUntil(lambda: again.model is not None and again.prefs.mmproj_path == str(other))
    assert (engine.loads[-1].model_path, engine.loads[-1].mmproj_path) == (str(model), str(other))


@pytest.mark.parametrize("has_vision", [True, False])
def test_an_image_dropped_on_the_chat_view_is_attached_to_the_composer(qtbot, make_window, tmp_path, has_vision):
    window = make_window(FakeEngine(has_vision=has_vision))
    composer = window.composer
    assert window.chat_view.empty_label.isVisible()
    assert drop_at(window.chat_view, _mime(_png(tmp_path, "a.png")))
    qtbot.waitUntil(lambda: len(composer.thumbnails()) == 1)
    [thumb] = composer.thumbnails()
    assert thumb.attachment.caption.startswith("300\u00d7200")
    if has_vision:
        qtbot.waitUntil(lambda: thumb.model_size.isVisibleTo(thumb))
        assert thumb.model_size.text() == "model sees 150\u00d7100 \u00b7 14 tokens"
        assert not composer.warning.isVisible()
    else:
        assert composer.warning.isVisible() and "no vision tower" in composer.warning.text()
    assert not drop_at(window.chat_view, _mime(tmp_path / "notes.txt"))

    # over a shown message too (its read-only text refuses the drag; Qt hands it on to the window)
    send(qtbot, window, "what is this?")
    assert composer.attachments == []
    assert drop_at(window.chat_view.widgets[-1].body, _mime(_png(tmp_path, "b.png", "green")))
    qtbot.waitUntil(lambda: len(composer.attachments) == 1)
    assert [a.caption.split(" ")[0] for a in composer.attachments] == ["300\u00d7200"]
    assert composer.warning.isVisible() == (not has_vision)


def test_a_slow_load_can_be_cancelled_and_its_model_is_dropped(qtbot, make_window):
    engine = FakeEngine()
    loader = BlockingLoader(engine)
    window = make_window(loader=loader, load=False)
    window.load_model("/models/huge.gguf")
    assert loader.started.wait(30)
    assert window.cancel_load_button.isVisible()
    qtbot.mouseClick(window.cancel_load_button, Qt.LeftButton)
    assert "cancelled" in window.banner.text() and not window.cancel_load_button.isVisible()
    loader.release()
    qtbot.wait(50)
    assert window.model is None and window.prefs.model_path == ""
    window.composer.editor.setPlainText("anyone there?")
    qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    assert "No model is loaded" in window.composer.status.text() and not window.composer.send_button.isEnabled()
    assert window.chat_view.widgets == [] and window.composer.editor.toPlainText() == "anyone there?"


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
    assert loader.finished.wait(30) and loader.cancelled.is_set()
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
    assert "qwen35moe" in window.banner.toolTip() and not window.load_progress.isVisible()
    assert loader.stages == list(loader.STAGES)


def test_closing_while_a_model_loads_does_not_wait_for_it(qtbot, make_window):
    loader = BlockingLoader(FakeEngine())
    window = make_window(loader=loader, load=False)
    window.load_model("/models/huge.gguf")
    assert loader.started.wait(30)
    window.close()
    still_loading = loader.threads[0].is_alive()          # the load waits for release(): close did not wait for it
    loader.release()
    assert still_loading and not window.engine.thread.isRunning() and not window.history.isRunning()


def test_a_new_load_replaces_one_in_progress(qtbot, make_window):
    loader = BlockingLoader(FakeEngine())
    window = make_window(loader=loader, load=False)
    window.load_model("/models/first.gguf")
    assert loader.started.wait(30)
    window.engine.worker._loader = loader_for(FakeEngine(tokens=["second"]))
    window.load_model("/models/second.gguf")
    qtbot.waitUntil(lambda: window.model is not None)
    loader.release()
    qtbot.wait(50)
    assert window.engine.worker._engine.tokens == ["second"]


def test_a_vision_tower_lying_next_to_the_model_is_loaded_with_it(qtbot, make_window, tmp_path):
    engine = FakeEngine(has_vision=True)
    window = make_window(engine)
    folder = tmp_path / "models"
    folder.mkdir()
    model = folder / "Qwen3.6-35B-A3B-Q4_K_M.gguf"
    for name in (model.name, "mmproj-Qwen3.6-35B-A3B-F16.gguf", "notes.txt"):
        (folder / name).write_bytes(b"GGUF")
    window.load_model(str(model))
    qtbot.waitUntil(lambda: window.model is not None)
    assert engine.loads[-1].mmproj_path == str(folder / "mmproj-Qwen3.6-35B-A3B-F16.gguf")
    # of several towers the one named like the model; an explicit one wins
    (folder / "Qwen3.6-35B-A3B-mmproj-BF16.gguf").write_bytes(b"GGUF")
    (folder / "mmproj-other.gguf").write_bytes(b"GGUF")
    window.load_model(str(model))
    qtbot.waitUntil(lambda: window.model is not None)
    assert engine.loads[-1].mmproj_path == str(folder / "Qwen3.6-35B-A3B-mmproj-BF16.gguf")
    window.load_model(str(model), str(folder / "mmproj-other.gguf"))
    qtbot.waitUntil(lambda: window.model is not None)
    assert engine.loads[-1].mmproj_path == str(folder / "mmproj-other.gguf")
