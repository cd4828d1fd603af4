"""The main window: conversations on the left, the chat in the middle, the sidebar on the right.

Every long-lived object is built by the caller (see :mod:`app.__main__`) and passed in; the window
wires them together, owns the shortcuts, the settings and the model loads, and remembers its
geometry.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Signal, Slot
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QIcon, QKeySequence, QPalette, QShortcut
from PySide6.QtWidgets import (QApplication, QDialog, QFileDialog, QHBoxLayout, QLabel, QMainWindow, QMessageBox,
                               QProgressBar, QPushButton, QScrollArea, QSplitter, QStyle, QToolButton, QVBoxLayout,
                               QWidget)

from .chat_view import ChatView
from .composer import Composer
from .controller import ChatController
from .connections import KeyStore
from .conversations import ConversationIdRole, ConversationListModel, ConversationPanel
from .engine_worker import LoadRequest, ModelSummary, WorkerThread, closed_first
from .gpu import GpuReport, device_phrase, vision_phrase
from .history import ImageStore
from .history_thread import HistoryThread
from .markdown_render import MarkdownRenderer
from .model_browser import show_model_browser
from .model_files import headline, paired_mmproj
from .window_files import FileActions
from .settings import Settings
from .settings_dialog import SettingsDialog
from .sidebar import MonitorThread, Sidebar
from .snapshots import SnapshotListModel
from .theme import apply_scheme, scheme_is_dark

NO_MODEL = "No model is loaded: open one with Ctrl+O (Chat \u25b8 Open model) or choose it in Settings (Ctrl+,)."


def follows_dark_scheme() -> bool:
    """Whether the system colour scheme (hence the palette Qt picked) is dark."""
    if QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark:
        return True
    return QGuiApplication.palette().color(QPalette.Window).lightness() < 128


class MainWindow(FileActions, QMainWindow):
    """DeltaDesk's one window.

    Args:
        history: the history database's thread (started by the caller after building the window).
        images: where attached images are kept.
        engine: the engine worker and its thread.
        monitor: the machine sampler, or None.
        state: the settings file (window geometry, last conversation, :class:`Settings`).
        renderer: Markdown renderer for answers.
        snapshot_dir: where the engine keeps prefix snapshots across restarts (None: RAM only).

    Signals:
        load_requested(LoadRequest): queued to the engine worker.
        serve_requested(int): the local server's port, 0 = off; queued to the engine worker.
    """

    load_requested = Signal(object)
    serve_requested = Signal(int)

    def __init__(self, history: HistoryThread, images: ImageStore, engine: WorkerThread,
                 monitor: MonitorThread | None, state: QSettings, renderer: MarkdownRenderer,
                 snapshot_dir: Path | None = None) -> None:
        super().__init__()
        self.setWindowTitle("DeltaDesk")
        self.setAcceptDrops(True)
        self.history = history
        self.engine = engine
        self.monitor = monitor
        self.state = state
        self.snapshot_dir = snapshot_dir
        self.prefs = Settings.read(state)
        self.model: ModelSummary | None = None
        self._previous: ModelSummary | None = None      # the model that answers again if a switch fails
        self._previous_prefs: Settings | None = None    # and the settings that load it
        self._loaded_request: LoadRequest | None = None  # what loaded the model in use
        self._after_load = ""                            # the status line once the next load is done
        self.loading: LoadRequest | None = None
        self._remember_load = False
        self.keys = KeyStore()
        worker = engine.worker

        self.conversations = ConversationListModel(history)
        self.panel = ConversationPanel(self.conversations)
        self.chat_view = ChatView(renderer)
        self.composer = Composer(images)
        self.composer.think_box.setChecked(self.prefs.thinking)
        self.snapshots = SnapshotListModel(self._snapshot_title)
        self.sidebar = Sidebar(self.snapshots)
        self.controller = ChatController(history, self.chat_view, worker, self.prefs)

        center = QWidget()
        column = QVBoxLayout(center)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(0)
        column.addWidget(self._build_banner())
        column.addWidget(self.chat_view, 1)
        column.addWidget(self.composer)

        self.splitter = QSplitter(Qt.Horizontal)
        self.splitter.addWidget(self.panel)
        self.splitter.addWidget(center)
        self.sidebar_area = QScrollArea()
        self.sidebar_area.setWidget(self.sidebar)
        self.sidebar_area.setWidgetResizable(True)
        self.sidebar_area.setFrameShape(QScrollArea.NoFrame)
        self.sidebar_area.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.sidebar_area.setMinimumWidth(self.sidebar.minimumWidth())
        self.splitter.addWidget(self.sidebar_area)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([220, 640, 260])
        self.setCentralWidget(self.splitter)

        self.panel.conversation_selected.connect(self.controller.open)
        self.panel.conversation_selected.connect(self._remember_conversation)
        self.panel.conversation_selected.connect(self.composer.cancel_edit)
        self.panel.new_requested.connect(self.new_conversation)
        self.controller.conversation_touched.connect(self.conversations.touch)
        self.controller.activity_changed.connect(self._activity_changed)
        self.controller.turn_refused.connect(self._turn_refused)
        self.panel.conversation_selected.connect(self._activity_changed)
        self.panel.conversation_selected.connect(self.sidebar.show_conversation)
        self.panel.conversation_selected.connect(self._find_on_open)
        self.controller.request_chat.connect(lambda request: self.sidebar.turn_started(int(request.conversation)))
        self.conversations.purged.connect(self._drop_snapshots_of)
        self.conversations.rowsRemoved.connect(self.snapshots.relabel)
        self.conversations.modelReset.connect(self.snapshots.relabel)
        self.composer.send_requested.connect(self._send)
        self.composer.stop_requested.connect(self.controller.stop)
        self.composer.think_box.toggled.connect(lambda on: self.apply_settings(replace(self.prefs, thinking=on)))
        self.composer.measure_requested.connect(worker.measure_image)
        self.chat_view.edit_requested.connect(self._edit)
        self.chat_view.regenerate_requested.connect(
            lambda message_id: self.controller.regenerate(message_id, self.composer.think_box.isChecked()))
        self.sidebar.snapshots.clear_requested.connect(worker.clear_snapshots)
        worker.loaded.connect(self._loaded)
        worker.load_failed.connect(self._load_failed)
        worker.load_stage.connect(self._load_stage)
        worker.prefilled.connect(self.sidebar.on_prefill)
        worker.tokens.connect(self.sidebar.on_tokens)
        self.controller.turn_finished.connect(self.sidebar.on_summary)     # before the turn's busy_changed
        worker.snapshots_listed.connect(self.snapshots.set_snapshots)
        worker.gpu_reported.connect(self._gpu_reported)
        worker.image_measured.connect(self.composer.on_measured)
        worker.notice.connect(self.statusBar().showMessage)
        self.serve_status = QLabel()
        self.serve_status.setAccessibleName("Local server")
        self.statusBar().addPermanentWidget(self.serve_status)
        worker.served.connect(self.serve_status.setText)
        self.serve_requested.connect(worker.serve)
        if self.prefs.serve_local:
            self.serve_requested.emit(self.prefs.serve_port)
        history.failed.connect(self.statusBar().showMessage)
        history.unavailable.connect(self._history_unavailable)
        history.damaged.connect(self._history_damaged)
        if monitor is not None:
            monitor.monitor.sampled.connect(self.sidebar.on_system)
        self.load_requested.connect(worker.load)

        QGuiApplication.styleHints().colorSchemeChanged.connect(self._scheme_changed)
        QShortcut(QKeySequence(Qt.Key_Escape), self, self.escape)
        self.chat_view.shown.connect(self._update_actions)
        self.chat_view.shown.connect(self._show_find)
        self._find = ""
        self._build_menus()
        self._restore_state()

    def _build_banner(self) -> QWidget:
        bar = self.banner_bar = QWidget()
        bar.setObjectName("bannerBar")
        row = QHBoxLayout(bar)
        row.setContentsMargins(10, 4, 10, 4)
        self.banner = QLabel("No model is loaded.")
        self.banner.setWordWrap(True)
        self.banner.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.banner.setAccessibleName("Model status")
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 0)
        self.load_progress.setMaximumWidth(120)
        self.load_progress.setTextVisible(False)
        self.load_progress.setAccessibleName("Loading the model")
        self.cancel_load_button = QPushButton("Cancel")
        self.cancel_load_button.setAccessibleName("Cancel loading the model")
        self.cancel_load_button.clicked.connect(self.cancel_load)
        self.details_button = QToolButton()
        self.details_button.setText("Details")
        self.details_button.setAccessibleName("Model details")
        self.details_button.setAutoRaise(True)
        self.details_button.clicked.connect(self.show_details)
        self.details_button.hide()
        self.models_button = QPushButton("Get a real model\u2026")      # shown while the demo model is loaded
        self.models_button.clicked.connect(lambda: show_model_browser(self))
        self.models_button.hide()
        row.addWidget(self.banner, 1)
        row.addWidget(self.models_button)
        row.addWidget(self.details_button)
        row.addWidget(self.load_progress)
        row.addWidget(self.cancel_load_button)
        self._show_loading(False)
        return bar

    def _build_menus(self) -> None:
        """The menus, and a toolbar with the actions a newcomer looks for first (new chat, search,
        attach, stop, regenerate, open model, settings), each named in words with its shortcut."""
        icon = self.style().standardIcon
        self.new_action = self._action("&New chat", QKeySequence.New, self.new_conversation,
                                       icon(QStyle.SP_FileDialogNewFolder))
        self.search_action = self._action("&Search chats", QKeySequence("Ctrl+K"), self.panel.focus_search,
                                          icon(QStyle.SP_FileDialogContentsView))
        self.attach_action = self._action("&Attach image\u2026", QKeySequence("Ctrl+Shift+A"),
                                          self.composer.attach_dialog, icon(QStyle.SP_DialogOpenButton))
        self.stop_action = self._action("Sto&p answer", QKeySequence(Qt.Key_Escape), self.controller.stop,
                                        icon(QStyle.SP_MediaStop), bind=False)
        self.regenerate_action = self._action("&Regenerate answer", QKeySequence("Ctrl+R"), self.regenerate_last,
                                              icon(QStyle.SP_BrowserReload))
        self.open_action = self._action("&Open model\u2026", QKeySequence.Open, self.open_model_dialog,
                                        icon(QStyle.SP_DirOpenIcon))
        self.settings_action = self._action("&Settings\u2026", QKeySequence("Ctrl+,"), self.open_settings,
                                            icon(QStyle.SP_FileDialogDetailedView))
        self.models_action = self._action("&Get models\u2026", QKeySequence("Ctrl+Shift+M"),
                                          lambda: show_model_browser(self), icon(QStyle.SP_ArrowDown))
        self.stop_action.setEnabled(False)
        self.regenerate_action.setEnabled(False)
        chat = self.menuBar().addMenu("&Chat")
        for action in (self.new_action, self.attach_action, self.stop_action, self.regenerate_action):
            chat.addAction(action)
        chat.addSeparator()
        chat.addAction(self.open_action)
        chat.addAction(self.models_action)
        chat.addAction(self.settings_action)
        chat.addSeparator()
        chat.addAction("Export as &Markdown\u2026", lambda: self.export_dialog("md"))
        chat.addAction("Export as &JSON\u2026", lambda: self.export_dialog("json"))
        chat.addAction("&Import JSON\u2026", self.import_dialog)
        chat.addSeparator()
        chat.addAction("&Quit", QKeySequence.Quit, self.close)
        view = self.menuBar().addMenu("&View")
        view.addAction(self.search_action)
        view.addAction("Toggle side&bar", QKeySequence("Ctrl+B"), self.toggle_sidebar)
        self.toolbar = self.addToolBar("Main")
        self.toolbar.setObjectName("mainToolbar")
        self.toolbar.setMovable(False)
        self.toolbar.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        for action in (self.new_action, self.search_action, self.attach_action, self.stop_action,
                       self.regenerate_action, self.open_action, self.settings_action):
            self.toolbar.addAction(action)

    def _action(self, text: str, shortcut: QKeySequence | QKeySequence.StandardKey, slot, icon: QIcon,
                bind: bool = True) -> QAction:
        """A menu and toolbar action; ``bind=False``: the shortcut is only named (Esc has its own
        QShortcut, which also abandons an edit)."""
        action = QAction(icon, text, self)
        shortcut = QKeySequence(shortcut)
        if bind:
            action.setShortcut(shortcut)
            action.setShortcutContext(Qt.WindowShortcut)
        action.setToolTip(f"{text.replace('&', '').rstrip(chr(0x2026))} ({shortcut.toString(QKeySequence.NativeText)})")
        action.triggered.connect(slot)
        return action

    def regenerate_last(self) -> None:
        """Ctrl+R / the toolbar: answer the shown chat's last question again (a new version)."""
        widgets = self.chat_view.widgets
        if widgets and widgets[-1].message.role == "assistant":
            self.controller.regenerate(widgets[-1].message.id, self.composer.think_box.isChecked())

    def _update_actions(self) -> None:
        """Stop while the shown chat has a turn; Regenerate when it ends with an answer and can start one."""
        busy = self.controller.busy_in(self.controller.conversation_id)
        widgets = self.chat_view.widgets
        self.stop_action.setEnabled(busy)
        self.regenerate_action.setEnabled(not busy and not self.controller.unavailable and bool(widgets)
                                          and widgets[-1].message.role == "assistant")

    # model

    def load_model(self, model_path: str | None, mmproj_path: str | None = None, remember: bool = False) -> None:
        """Load a model on the worker (None: the engine's default model) with the settings' options.

        The live answer is stopped first and the waiting ones leave the queue. Without ``mmproj_path``, a vision tower
        lying next to the model is loaded with it (:func:`paired_mmproj`). ``remember``: once loaded, the files become
        the configured model (what the app starts on next time).
        """
        if model_path and not mmproj_path:
            mmproj_path = paired_mmproj(model_path)
        prefs = self.prefs
        self._start_load(LoadRequest(model_path, mmproj_path, prefs.context, prefs.image_max_pixels, self.snapshot_dir,
                                     threads=prefs.threads or None, device=prefs.device,
                                     vram_budget=prefs.vram_budget, weights=prefs.weights), remember)

    def _start_load(self, request: LoadRequest, remember: bool = False) -> None:
        """Stop the live answer (and empty the queue), show the load as under way and send ``request``
        to the worker."""
        self.controller.stop_all()
        if self.loading is None:
            self._previous = self.model
        self.model = None
        self.loading = request
        self._remember_load = remember
        self._set_ready(f"Wait: {request.name} is loading.")
        self.composer.set_vision(None)
        self._set_banner(f"Loading {request.name}\u2026", False)
        self._show_loading(True)
        self.load_requested.emit(request)

    def load_configured(self, mmproj_path: str | None = None) -> None:
        """Load the model the settings name (the default model when none), optionally with another tower;
        with a remote engine configured (and no other tower asked for), connect to it instead."""
        prefs = self.prefs
        if prefs.remote_url and mmproj_path is None:
            self._start_load(LoadRequest(remote_url=prefs.remote_url, remote_model=prefs.remote_model,
                                         api_key=self.keys.get(prefs.remote_url) or None))
            return
        self.load_model(self.prefs.model_path or None, mmproj_path or self.prefs.mmproj_path or None)

    def cancel_load(self) -> None:
        """Stop the model load in progress; the window is usable at once, with no model."""
        if self.loading is None:
            return
        self.engine.worker.cancel_load()
        request, self.loading = self.loading, None
        name = request.name
        self._show_loading(False)
        if not self._keep_previous(f"Loading {name} was cancelled.", request):
            self._set_ready(NO_MODEL)
            self._set_banner("Loading was cancelled; no model is loaded. Open one with Ctrl+O or in Settings.", False)

    @Slot(object, str)
    def _load_stage(self, request: LoadRequest, stage: str) -> None:
        """The banner names the stage the load in progress has reached (stages of an older load are ignored)."""
        if request is self.loading:
            self._set_banner(f"Loading {request.name}: {stage}\u2026", False)

    @Slot(object)
    def _loaded(self, summary: ModelSummary) -> None:
        request, self.loading = self.loading, None
        self._previous = self._previous_prefs = None
        self._loaded_request = request
        self.sidebar.clear_model()
        self._use(summary)
        self.models_button.setVisible(request is not None and not request.model_path and not request.remote_url)
        if self._after_load:
            self._say(self._after_load)
            self._after_load = ""
        else:
            self.statusBar().showMessage(f"Now using {summary.info.name or Path(summary.info.path).name}.", 10000)
        if request is not None and self._remember_load:
            self.apply_settings(replace(self.prefs, model_path=request.model_path or "",
                                        mmproj_path=request.mmproj_path or "", remote_url="", remote_model=""),
                                reload=False)

    def _use(self, summary: ModelSummary) -> None:
        """Show ``summary``'s model as the one answering: banner, composer, controller and sidebar."""
        self.model = summary
        self._show_loading(False)
        self._set_ready("")
        info = summary.info
        self._show_model_line(info.device, info.device_note, info.vision_device, info.vision_note)
        self.controller.has_vision = info.has_vision
        self.controller.context = info.context
        self.controller.remote = bool(info.remote)
        self.composer.set_vision(info.has_vision, info.vision_note if info.remote and not info.has_vision else "")
        self.sidebar.set_context(info.context, bool(info.remote))

    def _keep_previous(self, what: str, request: LoadRequest | None) -> bool:
        """After a failed or cancelled switch (to ``request``): the model loaded before answers again (the settings
        name it again; loaded again when the worker closed it first), and the status bar says which model is still
        used and ``what`` happened; False when there was none."""
        previous, self._previous = self._previous, None
        prefs, self._previous_prefs = self._previous_prefs, None
        if previous is None:
            self.statusBar().showMessage(what)
            return False
        if prefs is not None:
            self.apply_settings(self.prefs.with_load_of(prefs), reload=False)
        name = previous.info.name or Path(previous.info.path).name
        if closed_first(previous.info, request) and self._loaded_request is not None:   # the worker closed it first
            self._after_load = f"Still using {name} (loaded again). {what}"
            self._start_load(self._loaded_request)
            return True
        self._use(previous)
        self._say(f"Still using {name}. {what}")
        return True

    def _say(self, message: str) -> None:
        """A lasting status-bar line (the model in use first: the bar cuts a long line), whole in its tooltip."""
        self.statusBar().showMessage(message)
        self.statusBar().setToolTip(message)

    def _show_model_line(self, device: str, note: str, vision_device: str, vision_note: str) -> None:
        """The banner: what a user asks about the model (:func:`headline`); the engineer's details
        (arch, layers, quant mix, bytes per token, context, the placement plan, the notes) in its
        tooltip and the Details button's window.

        ``device`` / ``note`` and ``vision_device`` / ``vision_note`` are where prefill runs and images
        are encoded, and why not on the GPU: the loaded model's, then the engine's latest report's.
        """
        summary = self.model
        if summary is None:
            return
        gpu = self.monitor.gpu if self.monitor is not None else None
        phrase = device_phrase(device, summary.info.vram_budget, gpu.name if gpu is not None else "")
        self._set_banner(headline(summary.info, phrase, vision_phrase(device, vision_device)), False)
        details = "\n\n".join(t for t in (summary.line, summary.info.placement if device == "cuda" else "", note,
                                           vision_note) if t)
        self.banner.setToolTip(details)
        self.details_button.setToolTip(details)
        self.details_button.show()

    def show_details(self) -> None:
        """The Details button: the loaded model's engineering details in a window (selectable text)."""
        box = QMessageBox(QMessageBox.Information, "Model details", self.banner.toolTip() or "No model is loaded.",
                          QMessageBox.Close, self)
        box.setTextInteractionFlags(Qt.TextSelectableByMouse)
        box.open()
        self.details_box = box

    @Slot(object)
    def _gpu_reported(self, report: GpuReport) -> None:
        """Feed the sidebar; when the GPU (prefill or vision tower) failed over to the CPU mid-session,
        say so in the banner."""
        self.sidebar.on_gpu_report(report)
        if self.model is not None and self.loading is None:
            self._show_model_line(report.device, report.note, report.vision_device, report.vision_note)

    @Slot(str)
    def _load_failed(self, message: str) -> None:
        request, self.loading = self.loading, None
        self._after_load = ""
        self._show_loading(False)
        name = request.name if request is not None else "the model"
        if not self._keep_previous(f"Could not open {name}: {message}", request):
            self._set_ready(NO_MODEL)
            self._set_banner(f"The model could not be loaded. {message}", True)

    def _set_ready(self, reason: str) -> None:
        """Whether a model can answer now ("") or why not: the composer and the controller refuse
        new turns meanwhile (a message sent then would be saved with no answer)."""
        self.controller.unavailable = reason
        self.composer.set_unavailable(reason)
        self._update_actions()
        if reason:
            self.details_button.hide()
            self.banner.setToolTip("")

    def _show_loading(self, shown: bool) -> None:
        self.load_progress.setVisible(shown)
        self.cancel_load_button.setVisible(shown)

    def _set_banner(self, text: str, error: bool) -> None:
        self.banner.setText(text)
        self.banner.setStyleSheet("color: #c01c28; font-weight: bold;" if error else "")

    # settings

    def open_settings(self) -> None:
        """Show the settings dialog and apply what the user accepts."""
        dialog = self.settings_dialog()
        if dialog.exec() == QDialog.Accepted:
            self.apply_settings(dialog.settings())

    def settings_dialog(self) -> SettingsDialog:
        """The settings dialog on the current settings, the loaded model and whether a GPU was found."""
        report = self.sidebar.gpu_report
        has_gpu = (self.monitor is not None and self.monitor.gpu is not None) or (
            report is not None and report.device == "cuda")
        return SettingsDialog(self.prefs, self, self.keys, self.model.info if self.model else None, has_gpu)

    def apply_settings(self, settings: Settings, reload: bool = True) -> None:
        """Use and save ``settings``; with ``reload``, the model is loaded again when its files or
        load options changed (sampling, system prompt and thinking apply from the next answer)."""
        old, self.prefs = self.prefs, settings
        if settings == old:
            return
        settings.write(self.state)
        self.controller.settings = settings
        self.composer.think_box.setChecked(settings.thinking)
        if (settings.serve_local, settings.serve_port) != (old.serve_local, old.serve_port):
            self.serve_requested.emit(settings.serve_port if settings.serve_local else 0)
        if reload and settings.load_key() != old.load_key():
            self.load_configured()
            self._previous_prefs = old

    def _snapshot_title(self, conversation: str) -> str:
        """A snapshot's chat title; "(deleted)" after it while Undo can bring the chat back."""
        if not conversation.isdigit():
            return ""
        title = self.conversations.title(int(conversation)) or ""
        return f"{title} (deleted)" if title and int(conversation) in self.conversations.deleted else title

    def _drop_snapshots_of(self, conversations: list[int]) -> None:
        """Deleted chats were purged: drop the prefix snapshots their turns took."""
        for key in self.snapshots.keys_of({str(c) for c in conversations}):
            self.sidebar.snapshots.clear_requested.emit(key)

    def _find_on_open(self, _conversation_id: int) -> None:
        """A chat opened while the list is searched: once shown, it scrolls to the match (:meth:`_show_find`)."""
        self._find = self.conversations.query

    def _show_find(self) -> None:
        if self._find:
            self.chat_view.find(self._find)
            self._find = ""

    def _history_unavailable(self, message: str) -> None:
        self.chat_view.empty_label.setText(message)
        self.statusBar().showMessage(message)

    def _history_damaged(self, message: str) -> None:
        """The history file was damaged and moved aside: a dialog says so and where it is (not blocking)."""
        self.history_dialog = QMessageBox(QMessageBox.Warning, "Chat history", message, QMessageBox.Ok, self)
        self.history_dialog.open()
        self.statusBar().showMessage(message.split("\n")[0], 15000)

    # conversations and messages

    def _remember_conversation(self, conversation_id: int) -> None:
        """Write the shown conversation to the settings file at once, so the next start reopens it
        even after a crash (closing the window is not the only way out)."""
        self.state.setValue("history/last_conversation", conversation_id)
        self.state.sync()

    def new_conversation(self) -> None:
        """Start an empty conversation and show it; the search box is cleared (the list shows every chat)."""
        self.panel.search.clear()
        self.conversations.create(then=self.panel.select)
        self.composer.editor.setFocus()

    def _send(self, text: str, images: list[str]) -> None:
        thinking = self.composer.think_box.isChecked()
        if self.composer.editing_id is not None:
            self.controller.edit_and_resend(self.composer.editing_id, text, images, thinking)
            self.composer.end_edit()
        else:
            self.controller.send(text, images, thinking)

    def _edit(self, message_id: int) -> None:
        widget = self.chat_view.widget_for(message_id)
        if widget is not None and not self.controller.busy_in(self.controller.conversation_id):
            self.composer.begin_edit(message_id, widget.message.content, widget.message.images)

    def _activity_changed(self, *_args) -> None:
        """A turn started, was queued or ended, or another chat is shown: Send or Stop for the shown
        chat, and the list's answering / waiting marks."""
        self.composer.set_busy(self.controller.busy_in(self.controller.conversation_id))
        self.conversations.set_activity(self.controller.activity())
        self._update_actions()

    def _turn_refused(self, conversation_id: int, text: str, images: list, reason: str) -> None:
        """A message did not fit the context: it is back in the composer (when its chat is shown and
        nothing new was typed) with the reason; the status bar says it too."""
        self.statusBar().showMessage(reason, 15000)
        if conversation_id == self.controller.conversation_id:
            self.composer.refused(text, images, reason)

    def escape(self) -> None:
        """Esc: stop the shown chat's answer (or take it out of the queue), else abandon an edit."""
        if self.controller.busy_in(self.controller.conversation_id):
            self.controller.stop()
        else:
            self.composer.cancel_edit()

    def _scheme_changed(self, scheme: Qt.ColorScheme | None = None) -> None:
        """The desktop switched light/dark: take the matching palette (:func:`app.theme.apply_scheme`)
        and re-render the messages with matching code colours."""
        app = QApplication.instance()
        if scheme is not None and isinstance(app, QApplication):
            apply_scheme(app, scheme_is_dark(scheme))
        self.chat_view.set_renderer(MarkdownRenderer(dark=follows_dark_scheme()))
        if self.controller.conversation_id is not None:
            self.controller.open(self.controller.conversation_id)

    def bring_to_front(self) -> None:
        """Show the window un-minimized and ask the window manager to activate it (a second launch)."""
        self.setWindowState(self.windowState() & ~Qt.WindowMinimized)
        self.show()
        self.raise_()
        self.activateWindow()

    def toggle_sidebar(self) -> None:
        """Ctrl+B: show or hide the sidebar."""
        self.sidebar_area.setVisible(not self.sidebar_area.isVisible())

    # files

    def open_model_dialog(self) -> None:
        """Pick a GGUF model file, load it and make it the configured model."""
        path, _ = QFileDialog.getOpenFileName(self, "Open model", "", "GGUF models (*.gguf)")
        if path:
            self.load_model(path, remember=True)

    # window state

    def _restore_state(self) -> None:
        geometry = self.state.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1180, 760)
        splitter = self.state.value("window/splitter")
        if splitter is not None:
            self.splitter.restoreState(splitter)
        self.sidebar_area.setVisible(self.state.value("window/sidebar", True, type=bool))
        self.conversations.reload(then=self._select_initial)

    def _select_initial(self) -> None:
        """Show the conversation of the last session, else the newest, else a new one; the keyboard
        goes to the message box (Qt would give it to the first field, the chat search)."""
        self.composer.editor.setFocus()
        last = self.state.value("history/last_conversation", 0, type=int)
        if self.conversations.row_of(last) >= 0:
            self.panel.select(last)
        elif self.conversations.rowCount():
            self.panel.select(self.conversations.index(0).data(ConversationIdRole))
        else:
            self.conversations.create(then=self.panel.select)

    def closeEvent(self, event: QCloseEvent) -> None:
        """Remember the window, stop the live answer and the threads, write and close the history.

        A model load in progress is cancelled, not waited for.
        """
        self.state.setValue("window/geometry", self.saveGeometry())
        self.state.setValue("window/splitter", self.splitter.saveState())
        self.state.setValue("window/sidebar", self.sidebar_area.isVisible())
        if self.controller.conversation_id is not None:
            self.state.setValue("history/last_conversation", self.controller.conversation_id)
        self.state.sync()
        self.controller.shutdown()
        self.cancel_load()
        self.conversations.forget_deleted()       # before the engine stops: their snapshots are dropped
        self.engine.stop()
        if self.monitor is not None:
            self.monitor.stop()
        self.history.stop()
        super().closeEvent(event)
