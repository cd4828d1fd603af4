"""The sidebar's list of prefix snapshots: a QAbstractListModel over ``SnapshotInfo`` rows and its panel.

A snapshot is the model's state after a prefix of some conversation's prompt (``engine.turn.prefix_cache``;
what it holds: docs/spec/qwen35.md section 3.2); the engine restores the deepest one a new prompt shares
instead of reading it again.
Each row shows its position (tokens), size, hits, where it is kept (RAM or disk), its age and the
conversation it was taken in. The rows come from the engine worker (``snapshots_listed``);
Remove and Clear all ask it to drop snapshots.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, QSize, Qt, QTimer, Signal
from PySide6.QtWidgets import QAbstractItemView, QHBoxLayout, QLabel, QListView, QPushButton, QVBoxLayout, QWidget

from .engine_worker import human_size

SnapshotKeyRole = Qt.UserRole + 1
AGE_REFRESH_MS = 5000


def human_age(seconds: float) -> str:
    """E.g. "40 s", "12 min", "3 h", "2 d"."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit}"
    return f"{seconds:.0f} s"


class SnapshotListModel(QAbstractListModel):
    """The engine's prefix snapshots, deepest first, as the worker last listed them.

    Ages count on from the listing: while rows are shown, ``age_timer`` (every
    :data:`AGE_REFRESH_MS`) emits ``dataChanged`` so the views draw the "N s ago" labels again.

    Args:
        title_of: the title of a conversation, given the id the snapshot records ("" if unknown).
    """

    def __init__(self, title_of: Callable[[str], str] = lambda _conversation: "") -> None:
        super().__init__()
        self._rows: list[Any] = []
        self._listed_at = time.monotonic()
        self._title_of = title_of
        self.age_timer = QTimer(self)
        self.age_timer.setInterval(AGE_REFRESH_MS)
        self.age_timer.timeout.connect(self._ages_changed)

    def _ages_changed(self) -> None:
        if self._rows:
            self.dataChanged.emit(self.index(0), self.index(len(self._rows) - 1),
                                  [Qt.DisplayRole, Qt.ToolTipRole])

    def set_snapshots(self, rows: Sequence[Any]) -> None:
        """Show a new listing (``SnapshotInfo`` rows)."""
        self.beginResetModel()
        self._rows = list(rows)
        self._listed_at = time.monotonic()
        self.endResetModel()
        if self._rows:
            self.age_timer.start()
        else:
            self.age_timer.stop()

    def relabel(self, *_args) -> None:
        """Draw the rows again: a chat's title changed (renamed, deleted, brought back)."""
        self._ages_changed()

    def keys_of(self, conversations: set[str]) -> list[str]:
        """The keys of the snapshots taken by turns of ``conversations`` (their ids, as recorded)."""
        return [s.key for s in self._rows if s.conversation in conversations]

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        """Number of snapshots (0 under a valid parent: this is a flat list)."""
        return 0 if parent.isValid() else len(self._rows)

    def total_bytes(self) -> int:
        """Bytes of all listed snapshots."""
        return sum(s.nbytes for s in self._rows)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.DisplayRole):
        """Two lines per snapshot (display), a tooltip, an accessible text and its key."""
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        s = self._rows[index.row()]
        tier = "RAM" if s.tier == "ram" else "disk"
        title = self._title_of(s.conversation) or (f"chat {s.conversation}" if s.conversation else "no chat recorded")
        age = human_age(s.age_s + time.monotonic() - self._listed_at)
        if role == Qt.DisplayRole:
            hits = f"{s.hits} hit" + ("" if s.hits == 1 else "s")
            return f"{s.pos} tokens \u00b7 {human_size(s.nbytes)} \u00b7 {hits} \u00b7 {tier}\n{title} \u00b7 {age} ago"
        if role == Qt.ToolTipRole:
            return (f"State after the first {s.pos} prompt tokens of \u201c{title}\u201d, kept in {tier}.\n"
                    f"Restored {s.hits} times; taken {age} ago.")
        if role == Qt.AccessibleTextRole:
            return f"Snapshot at {s.pos} tokens, {human_size(s.nbytes)}, {s.hits} hits, in {tier}, from {title}"
        if role == SnapshotKeyRole:
            return s.key
        return None

    def roleNames(self) -> dict[int, bytes]:
        """Role names for QML-style access and model testers."""
        return {**super().roleNames(), SnapshotKeyRole: b"key"}


class SnapshotView(QListView):
    """The snapshot list: it asks for its minimum height and grows into the room the sidebar has left.

    QListView's default hint (192 px) would be a floor: the sidebar's word-wrapped labels give it a height for
    its width, and its widget-resizable QScrollArea never makes it shorter than that.
    """

    def sizeHint(self) -> QSize:
        """Its usual width, its minimum height."""
        return QSize(super().sizeHint().width(), self.minimumHeight())


class SnapshotPanel(QWidget):
    """The snapshot list with a summary line, Remove (the selected one) and Clear all.

    Signals:
        clear_requested(object): a snapshot key, or None for all of them.
    """

    clear_requested = Signal(object)

    def __init__(self, model: SnapshotListModel) -> None:
        super().__init__()
        self.model = model
        self._remote = False
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setEnabled(False)
        layout.addWidget(self.summary)
        self.view = SnapshotView()
        self.view.setModel(model)
        self.view.setAccessibleName("Prefix snapshots")
        self.view.setSelectionMode(QAbstractItemView.SingleSelection)
        self.view.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.view.setTextElideMode(Qt.ElideRight)
        self.view.setAlternatingRowColors(True)
        self.view.setSpacing(2)
        self.view.setMinimumHeight(5 * self.fontMetrics().height())
        layout.addWidget(self.view, 1)
        row = QHBoxLayout()
        self.remove_button = QPushButton("Remove")
        self.remove_button.setAccessibleName("Remove the selected snapshot")
        self.remove_button.clicked.connect(self.remove_selected)
        self.clear_button = QPushButton("Clear all")
        self.clear_button.setAccessibleName("Clear all snapshots")
        self.clear_button.clicked.connect(lambda: self.clear_requested.emit(None))
        row.addWidget(self.remove_button)
        row.addWidget(self.clear_button)
        layout.addLayout(row)
        model.modelReset.connect(self._refresh)
        self.view.selectionModel().selectionChanged.connect(self._refresh)
        self._refresh()

    def set_remote(self, remote: bool) -> None:
        """Whether the model runs on a remote server, which keeps its prefix snapshots itself (none are listed)."""
        self._remote = remote
        self._refresh()

    def _refresh(self, *_args) -> None:
        n = self.model.rowCount()
        empty = ("The server keeps its own prefix snapshots; they are not listed here." if self._remote else
                 "No snapshots yet: they are taken as you chat.")
        self.summary.setText(f"{n} snapshot{'' if n == 1 else 's'}, {human_size(self.model.total_bytes())}"
                             if n else empty)
        self.view.setVisible(n > 0)
        self.clear_button.setEnabled(n > 0)
        self.remove_button.setEnabled(self.view.selectionModel().hasSelection())

    def remove_selected(self) -> None:
        """Ask to drop the selected snapshot."""
        index = self.view.currentIndex()
        if index.isValid() and self.view.selectionModel().hasSelection():
            self.clear_requested.emit(index.data(SnapshotKeyRole))
