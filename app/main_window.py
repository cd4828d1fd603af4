"""The main window: conversations on the left, the chat in the middle, the sidebar on the right.

Every long-lived object is built by the caller (see :mod:`app.__main__`) and passed in; the window
wires them together, owns the shortcuts and remembers its geometry.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Signal, Slot
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import QLabel, QMainWindow, QSplitter, QVBoxLayout, QWidget

from .chat_view import ChatView
from .composer import Composer
from .controller import ChatController
from .conversations import ConversationListModel, ConversationPanel
from .engine_worker import ModelSummary, WorkerThread
from .history import HistoryStore, ImageStore
from .markdown_render import MarkdownRenderer
from .sidebar import MonitorThread, Sidebar


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

        for keys, slot in ((QKeySequence("Ctrl+K"), self.panel.focus_search),
                           (QKeySequence("Ctrl+B"), self.toggle_sidebar),
                           (QKeySequence(QKeySequence.New), self.new_conversation),
                           (QKeySequence(Qt.Key_Escape), self.escape)):
            QShortcut(keys, self, slot)
        self._restore_state()

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

    def toggle_sidebar(self) -> None:
        """Ctrl+B: show or hide the sidebar."""
        self.sidebar.setVisible(not self.sidebar.isVisible())

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
