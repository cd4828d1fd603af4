"""Small truths in the window: Settings name the loaded context and disable the GPU-only fields without a GPU,
no keyring is said in plain words (with the way to keep the key), a Markdown export carries its images, and
a drop target is outlined while a file is dragged over it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, Qt, QUrl
from PySide6.QtGui import QColor, QDragEnterEvent, QDragLeaveEvent, QDropEvent, QImage
from PySide6.QtWidgets import QApplication, QDialog

from app.connections import KEY_VARIABLE
from app.settings_dialog import SettingsDialog
from fake_engine import FakeEngine, fake_info
from test_app_window import send


def test_settings_show_the_loaded_context_and_no_gpu_fields_without_a_gpu(qtbot, make_window, monkeypatch):
    window = make_window(FakeEngine(info=fake_info(context=4096)))
    captured = []
    monkeypatch.setattr(SettingsDialog, "exec", lambda self: captured.append(self) or QDialog.Rejected)
    window.prefs = replace(window.prefs, context=8192)         # asked for more than the model's 4096
    qtbot.keyClick(window, Qt.Key_Comma, Qt.ControlModifier)
    dialog = captured[0]
    assert dialog.loaded_context.text() == "The loaded model reads 4,096 tokens at once (the model's own limit)."
    gpu_item = dialog.device.model().item(dialog.device.findData("cuda"))
    assert not gpu_item.isEnabled() and not dialog.vram_budget.isEnabled()
    assert "No NVIDIA GPU was found" in dialog.device.toolTip()


def test_without_a_keyring_the_window_says_how_to_keep_the_key(qtbot, make_window, monkeypatch, served):
    window = make_window()                       # the tests' keyring backend is keyring's "null" one
    dialog = SettingsDialog(window.prefs, window, window.keys)
    qtbot.addWidget(dialog)
    status = dialog.connections.status
    assert "no password store (keyring)" in status.text() and KEY_VARIABLE in status.text()
    assert "keyring.backends.null" in status.toolTip() and "keyring.backends" not in status.text()
    dialog.connections.url.setText(served[2].url)
    dialog.connections.list_models()
    qtbot.waitUntil(lambda: dialog.connections.list_button.isEnabled())
    assert status.text().startswith("The server lists 1 model.") and KEY_VARIABLE in status.text()
    monkeypatch.setenv(KEY_VARIABLE, "sk-from-env")
    assert window.keys.get("http://gpu-box:8000/v1") == "sk-from-env"
    window.keys.set("http://gpu-box:8000/v1", "sk-typed")
    assert window.keys.get("http://gpu-box:8000/v1") == "sk-typed"


def _png(path: Path, color: str = "red") -> Path:
    image = QImage(30, 20, QImage.Format_RGB32)
    image.fill(QColor(color))
    image.save(str(path))
    return path


def test_a_markdown_export_carries_its_images(qtbot, make_window, tmp_path):
    window = make_window(FakeEngine(has_vision=True))
    window.composer.add_file(_png(tmp_path / "pic.png"))
    qtbot.waitUntil(lambda: len(window.composer.attachments) == 1)
    send(qtbot, window, "what is it?")
    out = tmp_path / "export" / "chat.md"
    out.parent.mkdir()
    window.export_current(out, "md")
    qtbot.waitUntil(lambda: window.statusBar().currentMessage() == f"Exported to {out}")
    text = out.read_text()
    stored = Path(window.chat_view.widgets[0].message.images[0])
    assert f"![image](chat_images/{stored.name})" in text and "file://" not in text
    moved = tmp_path / "elsewhere"
    out.parent.rename(moved)                        # the file and its folder travel together
    assert (moved / "chat_images" / stored.name).read_bytes() == stored.read_bytes()


def _drag(widget, mime: QMimeData) -> QDragEnterEvent:
    event = QDragEnterEvent(QPoint(5, 5), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    QApplication.sendEvent(widget, event)
    return event


def test_a_drop_target_is_outlined_while_a_file_is_dragged_over(qtbot, make_window, tmp_path):
    window = make_window()
    images = QMimeData()
    images.setUrls([QUrl.fromLocalFile(str(_png(tmp_path / "a.png")))])
    assert _drag(window.chat_view.viewport(), images).isAccepted()
    assert window.composer.drop_highlighted and "dashed" in window.composer.styleSheet()
    QApplication.sendEvent(window, QDragLeaveEvent())
    assert not window.composer.drop_highlighted and window.composer.styleSheet() == ""
    model = QMimeData()
    model.setUrls([QUrl.fromLocalFile(str(tmp_path / "m.gguf"))])
    assert _drag(window.chat_view.viewport(), model).isAccepted()
    assert "dashed" in window.banner_bar.styleSheet() and not window.composer.drop_highlighted
    QApplication.sendEvent(window, QDragLeaveEvent())
    assert window.banner_bar.styleSheet() == ""
    assert _drag(window.composer, images).isAccepted() and window.composer.drop_highlighted
    drop = QDropEvent(QPoint(5, 5), Qt.CopyAction, images, Qt.LeftButton, Qt.NoModifier)
    QApplication.sendEvent(window.composer, drop)
    assert not window.composer.drop_highlighted
    qtbot.waitUntil(lambda: len(window.composer.attachments) == 1)


def test_the_export_dialog_offers_the_documents_folder(qtbot, make_window, monkeypatch, tmp_path):
    from PySide6.QtCore import QStandardPaths
    from PySide6.QtWidgets import QFileDialog
    window = make_window()
    send(qtbot, window, "export me")
    offered = []
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *args: offered.append(args[2]) or ("", ""))
    monkeypatch.chdir(tmp_path)
    window.export_dialog("md")
    documents = Path(QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation))
    assert offered == [str((documents if documents.is_dir() else Path.home()) / "export me.md")]
