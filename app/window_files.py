"""The main window's file actions: exporting and importing chats, and drops anywhere on the window (model files
load, images go to the composer), outlined while they are dragged over it.

:class:`FileActions` is a mixin of :class:`app.main_window.MainWindow`; it uses the window's ``controller``,
``conversations``, ``history``, ``composer``, ``banner_bar``, ``prefs`` and ``load_model``.
"""

from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import QStandardPaths
from PySide6.QtWidgets import QFileDialog

from .export import export_conversation, import_conversation
from .model_files import gguf_files

DROP_OUTLINE = "border: 2px dashed palette(highlight); border-radius: 4px;"


class FileActions:
    """Export, import and drops of :class:`app.main_window.MainWindow`."""

    def export_current(self, path: Path, kind: str) -> None:
        """Write the shown conversation to ``path`` (on the history thread): "md" or "json"."""
        conversation_id = self.controller.conversation_id
        if conversation_id is None:
            return
        self.history.call(export_conversation, conversation_id, path, kind,
                          then=lambda _: self.statusBar().showMessage(f"Exported to {path}", 8000),
                          on_error=lambda exc: self.statusBar().showMessage(f"Export failed: {exc}"))

    def import_file(self, path: Path) -> None:
        """Add the conversation of a JSON export and show it (a failure is said in the status bar)."""
        def imported(conversation_id: int) -> None:
            self.panel.select(conversation_id)
            self.statusBar().showMessage(f"Imported {path.name}", 8000)

        self.history.call(import_conversation, path, then=imported,
                          on_error=lambda exc: self.statusBar().showMessage(f"Import failed: {path.name}: {exc}"))

    def export_dialog(self, kind: str) -> None:
        """Ask where to export the shown conversation (first offered: the user's documents folder, else the
        home folder; never the folder DeltaDesk was started in)."""
        if self.controller.conversation_id is None:
            return
        title = self.conversations.title(self.controller.conversation_id) or ""
        name = re.sub(r"[^\w\- ]+", "", title)[:60] or "chat"
        pattern = "Markdown (*.md)" if kind == "md" else "JSON (*.json)"
        documents = Path(QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation) or Path.home())
        folder = documents if documents.is_dir() else Path.home()
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(folder / f"{name}.{kind}"), pattern)
        if path:
            self.export_current(Path(path), kind)

    def import_dialog(self) -> None:
        """Pick a JSON export to import."""
        path, _ = QFileDialog.getOpenFileName(self, "Import chat", "", "JSON (*.json)")
        if path:
            self.import_file(Path(path))

    def dragEnterEvent(self, event) -> None:
        """Accept dropped .gguf files (they will be loaded) and images (they will be attached), outlining where
        they will land."""
        mime = event.mimeData()
        if any(gguf_files(mime)) or self.composer.can_attach(mime):
            event.acceptProposedAction()
            self._drop_highlight(mime)

    def _drop_highlight(self, mime) -> None:
        """Outline where a drag will land: the banner for a model file, the composer for images."""
        model = any(gguf_files(mime)) if mime is not None else False
        self.banner_bar.setStyleSheet(f"#bannerBar {{ {DROP_OUTLINE} }}" if model else "")
        self.composer.set_drop_highlight(not model and mime is not None and self.composer.can_attach(mime))

    def dragLeaveEvent(self, event) -> None:
        """The drag left the window: no outline."""
        self._drop_highlight(None)

    def dropEvent(self, event) -> None:
        """Load a dropped model, or attach dropped images to the composer.

        Drops on the chat view and on every other part that takes none of its own end here (Qt
        hands an ignored drag on to the parent widgets); the composer takes the drops made on it.

        A model loads with a dropped vision tower, if any (its name contains "mmproj"); a tower
        dropped alone is loaded with the configured model. What loads becomes the configured model.
        Images are attached by :meth:`Composer.attach_dropped`, exactly as a drop on the composer:
        the same thumbnails and measuring, the same warning when the model has no vision tower.
        A drop holding both .gguf files and images loads the model and leaves the images out, as
        the window always did; the same drop on the composer attaches the images and leaves the
        .gguf files out (the composer takes image drops only).
        """
        mime = event.mimeData()
        self._drop_highlight(None)
        models, towers = gguf_files(mime)
        if models or towers:
            tower = towers[0] if towers else None
            self.load_model(models[0] if models else self.prefs.model_path or None, tower, remember=True)
        elif self.composer.can_attach(mime):
            self.composer.attach_dropped(mime)
        else:
            return
        event.acceptProposedAction()
