"""The main window: conversations on the left, the chat in the middle, the sidebar on the right.

Every long-lived object is built by the caller (see :mod:`app.__main__`) and passed in; the window
wires them together, owns the shortcuts and remembers its geometry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Signal, Slot
from PySide6.QtGui import QCloseEvent, QGuiApplication, QKeySequence, QPalette, QShortcut
from PySide6.QtWidgets import QFileDialog, QLabel, QMainWindow, QSplitter, QVBoxLayout, QWidget

from .chat_view import ChatView
from .composer import Composer
from .controller import ChatController
from .conversations import ConversationListModel, ConversationPanel
from .engine_worker import ModelSummary, WorkerThread
from .history import HistoryError, HistoryStore, ImageStore
from .markdown_render import MarkdownRenderer
from .sidebar import MonitorThread, Sidebar


def follows_dark_scheme() -> bool:
    """Whether the system colour scheme (hence the palette Qt picked) is dark."""
    if QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark:
        return True
    return QGuiApplication.palette().color(QPalette.Window).lightness() < 128


class MainWindow(QMainWindow):
    """DeltaDesk's one window.

    Signals:
        load_requested(object, object): model and mmproj paths (None: the default), queued to the
            engine worker.
    """

    load_requested = Signal(object, object)

    def __init__(self, store: HistoryStore, images: ImageStore, engine: WorkerThread,
                 monitor: MonitorThread | None, settings: QSettings, renderer: MarkdownRenderer) -> None:
        super().__init__()
        self.setWindowTitle("DeltaDesk")
        self.setAcceptDrops(True)
        self.store = store
        self.engine = engine
        self.monitor = monitor
        self.settings = settings
        self.model: ModelSummary | None = None
        worker = engine.worker

        self.conversations = ConversationListModel(store)
        self.panel = ConversationPanel(self.conversations)
        self.chat_view = ChatView(renderer)
        self.composer = Composer(images)
        self.sidebar = Sidebar()
        self.controller = ChatController(store, self.chat_view, worker)

        self.banner = QLabel("Loading the model\u2026")
        self.banner.setWordWrap(True)
        self.banner.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.banner.setAccessibleName("Model status")
        self.banner.setContentsMargins(10, 4, 10, 4)
        center = QWidget()
        column = QVBoxLayout(center)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(self.banner)
        column.addWidget(self.chat_view, 1)
        column.addWidget(self.composer)

        self.splitter = QSplitter(Qt.Horizontal)
        self.splitter.addWidget(self.panel)
        self.splitter.addWidget(center)
        self.splitter.addWidget(self.sidebar)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([220, 640, 260])
        self.setCentralWidget(self.splitter)

        self.panel.conversation_selected.connect(self.controller.open)
        self.panel.conversation_selected.connect(self.composer.cancel_edit)
        self.panel.new_requested.connect(self.new_conversation)
        self.controller.conversation_touched.connect(self.conversations.touch)
        self.controller.busy_changed.connect(self.composer.set_busy)
        self.composer.send_requested.connect(self._send)
        self.composer.stop_requested.connect(self.controller.stop)
        self.chat_view.edit_requested.connect(self._edit)
        self.chat_view.regenerate_requested.connect(
            lambda message_id: self.controller.regenerate(message_id, self.composer.think_box.isChecked()))
        worker.loaded.connect(self._loaded)
        worker.load_failed.connect(self._load_failed)
        worker.prefilled.connect(self.sidebar.on_prefill)
        worker.tokens.connect(self.sidebar.on_tokens)
        worker.finished.connect(self.sidebar.on_summary)
        if monitor is not None:
            monitor.monitor.sampled.connect(self.sidebar.on_system)
        self.load_requested.connect(worker.load)

        QShortcut(QKeySequence(Qt.Key_Escape), self, self.escape)
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._scheme_changed)
        self._build_menus()
        self._restore_state()

    def _build_menus(self) -> None:
        chat = self.menuBar().addMenu("&Chat")
        chat.addAction("&New chat", QKeySequence.New, self.new_conversation)
        chat.addAction("Open &model\u2026", QKeySequence.Open, self.open_model_dialog)
        chat.addSeparator()
        chat.addAction("Export as &Markdown\u2026", lambda: self.export_dialog("md"))
        chat.addAction("Export as &JSON\u2026", lambda: self.export_dialog("json"))
        chat.addAction("&Import JSON\u2026", self.import_dialog)
        chat.addSeparator()
        chat.addAction("&Quit", QKeySequence.Quit, self.close)
        view = self.menuBar().addMenu("&View")
        view.addAction("&Search chats", QKeySequence("Ctrl+K"), self.panel.focus_search)
        view.addAction("Toggle &sidebar", QKeySequence("Ctrl+B"), self.toggle_sidebar)

    # model

    def load_model(self, model_path: str | None, mmproj_path: str | None = None) -> None:
        """Load a model on the worker thread (None: the engine's default model)."""
        self.model = None
        self._set_banner(f"Loading {Path(model_path).name if model_path else 'the default model'}\u2026", False)
        self.load_requested.emit(model_path, mmproj_path)

    @Slot(object)
    def _loaded(self, summary: ModelSummary) -> None:
        self.model = summary
        self._set_banner(summary.line, False)
        self.controller.has_vision = summary.has_vision
        self.composer.set_vision(summary.has_vision)
        self.sidebar.set_context(summary.context)

    @Slot(str)
    def _load_failed(self, message: str) -> None:
        self._set_banner(f"The model could not be loaded. {message}", True)

    def _set_banner(self, text: str, error: bool) -> None:
        self.banner.setText(text)
        self.banner.setStyleSheet("color: #c01c28; font-weight: bold;" if error else "")

    # conversations and messages

    def new_conversation(self) -> None:
        """Start an empty conversation and show it."""
        self.panel.select(self.conversations.create())
        self.composer.editor.setFocus()

    def _send(self, text: str, images: list[str]) -> None:
        thinking = self.composer.think_box.isChecked()
        if self.composer.editing_id is not None:
            self.controller.edit_and_resend(self.composer.editing_id, text, images, thinking)
            self.composer.end_edit()
        else:
            self.controller.send(text, images, thinking)

    def _edit(self, message_id: int) -> None:
        message = self.store.message(message_id)
        if message is not None and not self.controller.busy:
            self.composer.begin_edit(message_id, message.content, message.images)

    def escape(self) -> None:
        """Esc: stop the answer being generated, else abandon an edit."""
        if self.controller.busy:
            self.controller.stop()
        else:
            self.composer.cancel_edit()

    def _scheme_changed(self) -> None:
        """The system switched light/dark: re-render the messages with matching code colours."""
        self.chat_view.set_renderer(MarkdownRenderer(dark=follows_dark_scheme()))
        if self.controller.conversation_id is not None:
            self.controller.open(self.controller.conversation_id)

    def toggle_sidebar(self) -> None:
        """Ctrl+B: show or hide the sidebar."""
        self.sidebar.setVisible(not self.sidebar.isVisible())

    # files

    def open_model_dialog(self) -> None:
        """Pick a GGUF model file and load it."""
        path, _ = QFileDialog.getOpenFileName(self, "Open model", "", "GGUF models (*.gguf)")
        if path:
            self.load_model(path)

    def export_current(self, path: Path, kind: str) -> None:
        """Write the shown conversation to ``path``: "md" (active branch) or "json" (every branch)."""
        conversation_id = self.controller.conversation_id
        if conversation_id is None:
            return
        try:
            if kind == "md":
                path.write_text(self.store.export_markdown(conversation_id), encoding="utf-8")
            else:
                path.write_text(json.dumps(self.store.export_json(conversation_id), ensure_ascii=False, indent=1),
                                encoding="utf-8")
        except (OSError, HistoryError) as exc:
            self.statusBar().showMessage(f"Export failed: {exc}")
            return
        self.statusBar().showMessage(f"Exported to {path}", 8000)

    def import_file(self, path: Path) -> int | None:
        """Add the conversation in a JSON export and show it; returns its id (None on failure)."""
        try:
            conversation_id = self.store.import_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, HistoryError) as exc:
            self.statusBar().showMessage(f"Import failed: {path.name}: {exc}")
            return None
        self.conversations.reload("")
        self.panel.select(conversation_id)
        self.statusBar().showMessage(f"Imported {path.name}", 8000)
        return conversation_id

    def export_dialog(self, kind: str) -> None:
        """Ask where to export the shown conversation."""
        name = re.sub(r"[^\w\- ]+", "", self.store.conversation(self.controller.conversation_id).title)[:60] or "chat"
        pattern = "Markdown (*.md)" if kind == "md" else "JSON (*.json)"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"{name}.{kind}", pattern)
        if path:
            self.export_current(Path(path), kind)

    def import_dialog(self) -> None:
        """Pick a JSON export to import."""
        path, _ = QFileDialog.getOpenFileName(self, "Import chat", "", "JSON (*.json)")
        if path:
            self.import_file(Path(path))

    # drops of model files

    def dragEnterEvent(self, event) -> None:
        """Accept a dropped .gguf file (it will be loaded)."""
        if any(url.toLocalFile().lower().endswith(".gguf") for url in event.mimeData().urls()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        """Load the dropped .gguf model."""
        for url in event.mimeData().urls():
            if url.toLocalFile().lower().endswith(".gguf"):
                self.load_model(url.toLocalFile())
                event.acceptProposedAction()
                return

    # window state

    def _restore_state(self) -> None:
        geometry = self.settings.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1180, 760)
        splitter = self.settings.value("window/splitter")
        if splitter is not None:
            self.splitter.restoreState(splitter)
        self.sidebar.setVisible(self.settings.value("window/sidebar", True, type=bool))
        last = self.settings.value("history/last_conversation", 0, type=int)
        if self.store.conversation(last) is None:
            rows = self.store.conversations()
            last = rows[0].id if rows else self.conversations.create()
        self.panel.select(last)

    def closeEvent(self, event: QCloseEvent) -> None:
        """Remember the window, stop the live answer and the threads, close the history."""
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/splitter", self.splitter.saveState())
        self.settings.setValue("window/sidebar", self.sidebar.isVisible())
        if self.controller.conversation_id is not None:
            self.settings.setValue("history/last_conversation", self.controller.conversation_id)
        self.settings.sync()
        self.controller.shutdown()
        self.engine.stop()
        if self.monitor is not None:
            self.monitor.stop()
        self.conversations.forget_deleted()
        super().closeEvent(event)
