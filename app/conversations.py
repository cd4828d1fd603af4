"""The conversation list: a QAbstractListModel over the history store and the panel that shows it,
newest first under date titles (Today, Yesterday, Last 7 days, ...) as in other chat programs."""

from __future__ import annotations

import datetime
import time
from typing import Callable

from PySide6.QtCore import (QAbstractListModel, QModelIndex, QPersistentModelIndex, QPoint, QSize, Qt, QTimer,
                            Signal)
from PySide6.QtGui import QColor, QFont, QKeySequence, QPainter, QPalette, QPixmap
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QLabel, QLineEdit, QListView, QPushButton,
                               QStyledItemDelegate, QStyleOptionViewItem, QVBoxLayout, QWidget)

from .history import Conversation, HistoryStore
from .history_thread import HistoryThread

ConversationIdRole = Qt.UserRole + 1
UpdatedRole = Qt.UserRole + 2
ActivityRole = Qt.UserRole + 3
GroupRole = Qt.UserRole + 4
ACTIVITY_TEXT = {"answering": "answering\u2026", "waiting": "waiting for the engine"}
ACTIVITY_COLOUR = {"answering": "#3b7dd8", "waiting": "#9a9a9a"}
UNDO_SECONDS = 8


def _when(timestamp: float) -> str:
    age = time.time() - timestamp
    if age < 86400:
        return time.strftime("%H:%M", time.localtime(timestamp))
    return time.strftime("%d %b %Y", time.localtime(timestamp))


def date_group(timestamp: float, now: float | None = None) -> str:
    """The chat list's section for a last-message time: "Today", "Yesterday", "Last 7 days",
    "Last 30 days" or "Older", by local calendar days before ``now`` (default: the current time)."""
    today = datetime.date.fromtimestamp(time.time() if now is None else now)
    days = (today - datetime.date.fromtimestamp(timestamp)).days
    if days <= 0:
        return "Today"
    if days == 1:
        return "Yesterday"
    if days < 7:
        return "Last 7 days"
    return "Last 30 days" if days < 30 else "Older"


class GroupedDelegate(QStyledItemDelegate):
    """Draws a section title ("Today", "Yesterday", ...) above the first row of each date group
    (:data:`GroupRole`); the rows themselves are drawn as usual below it."""

    def _header(self, index: QModelIndex | QPersistentModelIndex) -> str:
        group = index.data(GroupRole)
        above = index.siblingAtRow(index.row() - 1) if index.row() > 0 else QModelIndex()
        return group if group and (not above.isValid() or above.data(GroupRole) != group) else ""

    def _header_height(self, option: QStyleOptionViewItem) -> int:
        return option.fontMetrics.height() + 10

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> QSize:
        """The row's size, taller by a title line when a group starts at it."""
        size = super().sizeHint(option, index)
        if self._header(index):
            size.setHeight(size.height() + self._header_height(option))
        return size

    def paint(self, painter: QPainter, option: QStyleOptionViewItem,
              index: QModelIndex | QPersistentModelIndex) -> None:
        """The group title (when one starts here) in small bold grey, then the row under it."""
        header = self._header(index)
        if not header:
            super().paint(painter, option, index)
            return
        height = self._header_height(option)
        painter.save()
        font = QFont(option.font)
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 0.9)
        painter.setFont(font)
        painter.setPen(option.palette.color(QPalette.PlaceholderText))
        painter.drawText(option.rect.adjusted(4, 4, -4, 0).topLeft() + QPoint(0, option.fontMetrics.ascent()),
                         header)
        painter.restore()
        row = QStyleOptionViewItem(option)
        row.rect = option.rect.adjusted(0, height, 0, 0)
        super().paint(painter, row, index)

    def updateEditorGeometry(self, editor: QWidget, option: QStyleOptionViewItem,
                             index: QModelIndex | QPersistentModelIndex) -> None:
        """Rename in place on the row, below its group title."""
        row = QStyleOptionViewItem(option)
        if self._header(index):
            row.rect = option.rect.adjusted(0, self._header_height(option), 0, 0)
        super().updateEditorGeometry(editor, row, index)


def _dot(colour: str, size: int = 10) -> QPixmap:
    """A filled circle of ``colour``: the list's mark of a chat with a turn."""
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.Antialiasing)
    painter.setPen(Qt.NoPen)
    painter.setBrush(QColor(colour))
    painter.drawEllipse(1, 1, size - 2, size - 2)
    painter.end()
    return pixmap


def _create(store: HistoryStore, title: str) -> Conversation | None:
    return store.conversation(store.create_conversation(title))


class ConversationListModel(QAbstractListModel):
    """Live conversations, newest first, filtered by a search text; titles are editable (rename).

    Rows are read on the history thread: :meth:`reload` and :meth:`create` change the list when
    the answer comes back (their ``then`` callbacks run after that). Renames and deletions change
    the list at once and are written in the background. Deleting hides a conversation in the
    store; :meth:`undo_delete` brings back the last one until :meth:`forget_deleted` purges them.

    Signals:
        purged(list): the ids of the deleted conversations :meth:`forget_deleted` purged.
    """

    purged = Signal(list)

    def __init__(self, history: HistoryThread) -> None:
        super().__init__()
        self._history = history
        self._rows: list[Conversation] = []
        self._titles: dict[int, str] = {}
        self._query = ""
        self._activity: dict[int, str] = {}
        self._marks = {name: _dot(colour) for name, colour in ACTIVITY_COLOUR.items()}
        self.deleted: list[int] = []

    @property
    def query(self) -> str:
        """The current search text."""
        return self._query

    def reload(self, query: str | None = None, then: Callable[[], None] | None = None) -> None:
        """Re-read the list (optionally with a new search text); ``then()`` runs once it is shown.

        A listing that arrives after a newer search was asked for is dropped.
        """
        if query is not None:
            self._query = query
        asked = self._query
        self._history.call(HistoryStore.conversations, asked, then=lambda rows: self._listed(asked, rows, then))

    def _listed(self, query: str, rows: list[Conversation], then: Callable[[], None] | None) -> None:
        if query != self._query:
            return
        self._titles.update((c.id, c.title) for c in rows)
        self.beginResetModel()
        self._rows = rows
        self.endResetModel()
        if then is not None:
            then()

    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:
        """Number of conversations shown (0 under a valid parent: this is a flat list)."""
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.DisplayRole):
        """Title (display, edit), id, update time, a tooltip, the chat's turn: "answering",
        "waiting" or "" (:data:`ActivityRole`; a coloured dot as decoration), and its date group
        (:data:`GroupRole`, :func:`date_group`)."""
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        row = self._rows[index.row()]
        activity = self._activity.get(row.id, "")
        if role in (Qt.DisplayRole, Qt.EditRole):
            return row.title
        if role == Qt.DecorationRole:
            return self._marks.get(activity)
        if role == Qt.ToolTipRole:
            return f"{row.title}\nlast message {_when(row.updated)}" + (
                f"\n{ACTIVITY_TEXT[activity]}" if activity else "")
        if role == Qt.AccessibleTextRole:
            return f"Conversation {row.title}" + (f", {ACTIVITY_TEXT[activity]}" if activity else "")
        if role == ActivityRole:
            return activity
        if role == GroupRole:
            return date_group(row.updated)
        if role == ConversationIdRole:
            return row.id
        if role == UpdatedRole:
            return row.updated
        return None

    def set_activity(self, activity: dict[int, str]) -> None:
        """Mark the conversations with a turn: id -> "answering" or "waiting" (the others are unmarked)."""
        changed = set(activity.items()) ^ set(self._activity.items())
        self._activity = dict(activity)
        for conversation_id in {c for c, _ in changed}:
            row = self.row_of(conversation_id)
            if row >= 0:
                self.dataChanged.emit(self.index(row), self.index(row),
                                      [Qt.DecorationRole, Qt.ToolTipRole, Qt.AccessibleTextRole, ActivityRole])

    def setData(self, index: QModelIndex | QPersistentModelIndex, value, role: int = Qt.EditRole) -> bool:
        """Rename a conversation (empty titles are refused)."""
        if role != Qt.EditRole or not index.isValid() or not str(value).strip():
            return False
        row = self._rows[index.row()]
        title = str(value).strip()
        self._history.call(HistoryStore.rename_conversation, row.id, title)
        self._titles[row.id] = title
        self._rows[index.row()] = Conversation(row.id, title, row.created, row.updated)
        self.dataChanged.emit(index, index, [Qt.DisplayRole, Qt.EditRole, Qt.ToolTipRole])
        return True

    def flags(self, index: QModelIndex | QPersistentModelIndex) -> Qt.ItemFlag:
        """Rows are selectable and editable."""
        if not index.isValid():
            return Qt.NoItemFlags
        return Qt.ItemIsEnabled | Qt.ItemIsSelectable | Qt.ItemIsEditable | Qt.ItemNeverHasChildren

    def roleNames(self) -> dict[int, bytes]:
        """Role names for QML-style access and model testers."""
        return {**super().roleNames(), ConversationIdRole: b"conversationId", UpdatedRole: b"updated",
                ActivityRole: b"activity", GroupRole: b"group"}

    def row_of(self, conversation_id: int) -> int:
        """The row showing ``conversation_id``, or -1."""
        return next((i for i, c in enumerate(self._rows) if c.id == conversation_id), -1)

    def title(self, conversation_id: int) -> str | None:
        """The title of a conversation listed at some point, even if a search hides it now (else None)."""
        return self._titles.get(conversation_id)

    def create(self, title: str = "New chat", then: Callable[[int], None] | None = None) -> None:
        """Add a conversation at the top (clearing a search); ``then(id)`` runs once it is listed."""
        def created(conversation: Conversation | None) -> None:
            if conversation is None:
                return
            self._titles[conversation.id] = conversation.title
            if self._query:
                self.reload("", then=lambda: then(conversation.id) if then else None)
                return
            self.beginInsertRows(QModelIndex(), 0, 0)
            self._rows.insert(0, conversation)
            self.endInsertRows()
            if then is not None:
                then(conversation.id)

        self._history.call(_create, title, then=created)

    def delete(self, row: int) -> int:
        """Hide the conversation at ``row`` (undoable); returns its id."""
        conversation_id = self._rows[row].id
        self._history.call(HistoryStore.delete_conversation, conversation_id)
        self.deleted.append(conversation_id)
        self.beginRemoveRows(QModelIndex(), row, row)
        del self._rows[row]
        self.endRemoveRows()
        return conversation_id

    def undo_delete(self, then: Callable[[int], None] | None = None) -> int | None:
        """Bring back the most recently deleted conversation; returns its id (``then(id)`` once listed)."""
        if not self.deleted:
            return None
        conversation_id = self.deleted.pop()
        self._history.call(HistoryStore.restore_conversation, conversation_id)
        self.reload(then=lambda: then(conversation_id) if then else None)
        return conversation_id

    def forget_deleted(self) -> None:
        """Purge deleted conversations for good (``purged`` names them); undo is no longer possible."""
        purged, self.deleted = self.deleted, []
        self._history.call(HistoryStore.purge_deleted)
        if purged:
            self.purged.emit(purged)

    def touch(self, conversation_id: int) -> None:
        """Move a conversation whose content changed to its place (the top), with its new title."""
        self._history.call(HistoryStore.conversation, conversation_id, then=self._to_top)

    def _to_top(self, fresh: Conversation | None) -> None:
        if fresh is not None:
            self._titles[fresh.id] = fresh.title
        row = self.row_of(fresh.id) if fresh is not None else -1
        if row < 0:
            return
        if row == 0:
            self._rows[0] = fresh
            self.dataChanged.emit(self.index(0), self.index(0))
            return
        self.beginMoveRows(QModelIndex(), row, row, QModelIndex(), 0)
        del self._rows[row]
        self._rows.insert(0, fresh)
        self.endMoveRows()


class ConversationPanel(QWidget):
    """The left column: search box, the list, New / Rename / Delete and the undo bar.

    Signals:
        conversation_selected(int): the user picked a conversation (or one was created).
        new_requested(): the user asked for a new conversation.
    """

    conversation_selected = Signal(int)
    new_requested = Signal()

    def __init__(self, model: ConversationListModel) -> None:
        super().__init__()
        self.model = model
        self._shown_id: int | None = None
        self._wanted: int | None = None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 0, 6)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats (Ctrl+K)")
        self.search.setAccessibleName("Search conversations")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self._search)
        layout.addWidget(self.search)

        self.view = QListView()
        self.view.setModel(model)
        self.view.setItemDelegate(GroupedDelegate(self.view))
        self.view.setAccessibleName("Conversations")
        self.view.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.view.setTextElideMode(Qt.ElideRight)
        self.view.setEditTriggers(QAbstractItemView.EditKeyPressed | QAbstractItemView.DoubleClicked)
        self.view.selectionModel().currentChanged.connect(self._current_changed)
        model.modelReset.connect(self._reselect)
        layout.addWidget(self.view, 1)

        row = QHBoxLayout()
        self.new_button = QPushButton("New")
        self.new_button.setToolTip(f"New chat ({QKeySequence(QKeySequence.New).toString()})")
        self.new_button.setAccessibleName("New conversation")
        self.new_button.clicked.connect(self.new_requested)
        self.rename_button = QPushButton("Rename")
        self.rename_button.setAccessibleName("Rename conversation")
        self.rename_button.clicked.connect(self.rename_current)
        self.delete_button = QPushButton("Delete")
        self.delete_button.setAccessibleName("Delete conversation")
        self.delete_button.clicked.connect(self.delete_current)
        for button in (self.new_button, self.rename_button, self.delete_button):
            row.addWidget(button)
        layout.addLayout(row)

        self.undo_bar = QWidget()
        undo_row = QHBoxLayout(self.undo_bar)
        undo_row.setContentsMargins(0, 0, 0, 0)
        self.undo_label = QLabel("Chat deleted.")
        self.undo_button = QPushButton("Undo")
        self.undo_button.setAccessibleName("Undo delete")
        self.undo_button.clicked.connect(self.undo_delete)
        undo_row.addWidget(self.undo_label, 1)
        undo_row.addWidget(self.undo_button)
        self.undo_bar.hide()
        layout.addWidget(self.undo_bar)
        self._undo_timer = QTimer(self)
        self._undo_timer.setSingleShot(True)
        self._undo_timer.setInterval(UNDO_SECONDS * 1000)
        self._undo_timer.timeout.connect(self._undo_expired)

    def _current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid() and current.data(ConversationIdRole) != self._shown_id:
            self._shown_id = current.data(ConversationIdRole)
            self.conversation_selected.emit(self._shown_id)

    def _search(self, text: str) -> None:
        self.model.reload(text.strip())

    def _reselect(self) -> None:
        """After the list was re-read: select the conversation asked for, else the one shown."""
        wanted = self._wanted if self._wanted is not None else self._shown_id
        row = self.model.row_of(wanted) if wanted is not None else -1
        if row >= 0:
            self._wanted = None
            self.view.setCurrentIndex(self.model.index(row))

    def current_id(self) -> int | None:
        """The id of the selected conversation."""
        index = self.view.currentIndex()
        return index.data(ConversationIdRole) if index.isValid() else None

    def select(self, conversation_id: int) -> None:
        """Select ``conversation_id`` in the list, clearing a search that hides it.

        A conversation not listed yet is selected when the list has been read again.
        """
        row = self.model.row_of(conversation_id)
        if row >= 0:
            self.view.setCurrentIndex(self.model.index(row))
            return
        self._wanted = conversation_id
        if self.search.text():
            self.search.clear()
        else:
            self.model.reload()

    def focus_search(self) -> None:
        """Ctrl+K: put the cursor in the search box."""
        self.search.setFocus()
        self.search.selectAll()

    def rename_current(self) -> None:
        """Start editing the selected title in place."""
        index = self.view.currentIndex()
        if index.isValid():
            self.view.edit(index)

    def delete_current(self) -> None:
        """Delete the selected conversation, offering Undo for a few seconds."""
        index = self.view.currentIndex()
        if not index.isValid():
            return
        title = index.data(Qt.DisplayRole)
        row = index.row()
        self.model.delete(row)
        self.undo_label.setText(f"Deleted \u201c{title}\u201d.")
        self.undo_bar.show()
        self._undo_timer.start()
        if self.model.rowCount():
            self.view.setCurrentIndex(self.model.index(min(row, self.model.rowCount() - 1)))
        else:
            self.new_requested.emit()

    def undo_delete(self) -> None:
        """Restore the last deleted conversation and select it."""
        self.model.undo_delete(then=self.select)
        if not self.model.deleted:
            self.undo_bar.hide()
            self._undo_timer.stop()

    def _undo_expired(self) -> None:
        self.undo_bar.hide()
        self.model.forget_deleted()
