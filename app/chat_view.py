"""The chat view: one widget per message on the active branch, in a scroll area.

While an answer streams, only its own widget changes, and its text is shown plain (cheap to lay
out); when the turn ends the widget switches to rendered Markdown with highlighted code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QColor, QDesktopServices, QGuiApplication, QImageReader, QPalette, QPixmap, QTextCursor
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QScrollArea, QSizePolicy, QTextBrowser, QTextEdit,
                               QToolButton, QVBoxLayout, QWidget)

from .history import Message
from .markdown_render import MarkdownRenderer, split_thinking

THUMB_PX = 96
FOLD_CHARS = 4000
"""A user message longer than this is shown folded to its first FOLD_CHARS characters: laying out
an 80 KB paste took the window's thread about 450 ms, and as much again on every resize."""


def format_stats(stats: dict[str, Any]) -> str:
    """The stats line under an answer: TTFT, prefill and decode speed, tokens reused (or that a remote server
    did not report them, ``usage``), the engine's note."""
    if not stats:
        return ""
    parts = []
    if "ttft_ms" in stats:
        parts.append(f"TTFT {stats['ttft_ms']:.0f} ms")
    if stats.get("prefill_tok_s"):
        parts.append(f"prefill {stats['prefill_tok_s']:.0f} tok/s")
    if "decode_tok_s" in stats:
        parts.append(f"decode {stats['decode_tok_s']:.1f} tok/s")
    if "generated_tokens" in stats:
        parts.append(f"{stats['generated_tokens']} tokens")
    if "reused_tokens" in stats:
        reused = f"{stats['reused_tokens']} of {stats.get('prompt_tokens', 0)} prompt tokens reused"
        if stats.get("restore_ms"):
            reused += f" (restored in {stats['restore_ms']:.0f} ms)"
        parts.append(reused)
    if "usage" in stats:
        parts.append(f"prompt tokens {stats['usage']}")
    return " \u2014 ".join(p for p in (" \u00b7 ".join(parts), stats.get("note", "")) if p)


def _tool_button(text: str, tip: str, slot: Callable[[], None]) -> QToolButton:
    button = QToolButton()
    button.setText(text)
    button.setToolTip(tip)
    button.setAccessibleName(tip)
    button.setAutoRaise(True)
    button.clicked.connect(slot)
    return button


class MessageBody(QTextBrowser):
    """A message's text: as tall as its content, no scroll bars of its own, appendable in place.

    Appending at the end lays out only the last paragraph again, so a long streaming answer costs
    the same per batch as a short one.
    """

    link_clicked = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self.setFrameShape(QFrame.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.setOpenLinks(False)
        self.viewport().setAutoFillBackground(False)
        self.document().setDocumentMargin(0)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self.anchorClicked.connect(lambda url: self.link_clicked.emit(url.toString()))
        self._plain = ""
        self._fit()

    def _fit(self, *_args) -> None:
        self.setFixedHeight(max(int(self.document().size().height()) + 2 * self.frameWidth(), 1))

    def wheelEvent(self, event) -> None:
        """Leave wheel scrolling to the chat view."""
        event.ignore()

    def set_plain(self, text: str) -> None:
        """Show ``text`` as plain text, appending in place when it extends what is shown."""
        if text.startswith(self._plain) and self._plain and self.document().characterCount() > 1:
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.End)
            cursor.insertText(text[len(self._plain):])
        else:
            self.setPlainText(text)
        self._plain = text

    def set_html(self, html: str) -> None:
        """Show rendered rich text."""
        self._plain = ""
        self.setHtml(html)


class MessageWidget(QFrame):
    """One message: header with actions, optional thinking block, body, images, stats.

    Signals:
        regenerate_requested(int), edit_requested(int): the message's id.
        branch_requested(int): the id of the sibling to show instead.
    """

    regenerate_requested = Signal(int)
    edit_requested = Signal(int)
    branch_requested = Signal(int)

    def __init__(self, message: Message, renderer: MarkdownRenderer, siblings: list[int]) -> None:
        super().__init__()
        self.message = message
        self.raw = message.content
        self.streaming = False
        self._renderer = renderer
        self._code_blocks: tuple[str, ...] = ()
        self.setObjectName("userMessage" if message.role == "user" else "assistantMessage")
        self.setFrameShape(QFrame.StyledPanel)
        if message.role == "assistant":
            self.setBackgroundRole(QPalette.Base)
            self.setAutoFillBackground(True)
        self.setAccessibleName("Your message" if message.role == "user" else "Assistant message")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 8)
        layout.setSpacing(4)
        layout.addLayout(self._header(siblings))

        self.thinking_button = QToolButton()
        self.thinking_button.setCheckable(True)
        self.thinking_button.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        self.thinking_button.setArrowType(Qt.RightArrow)
        self.thinking_button.setAutoRaise(True)
        self.thinking_button.setAccessibleName("Show the model's thinking")
        self.thinking_button.toggled.connect(self._toggle_thinking)
        self.thinking_label = MessageBody()
        self.thinking_label.setAccessibleName("The model's thinking")
        self.thinking_label.setEnabled(False)
        self.thinking_label.hide()
        layout.addWidget(self.thinking_button)
        layout.addWidget(self.thinking_label)

        self.body = MessageBody()
        self.body.setAccessibleName("Message text")
        self.body.link_clicked.connect(self._link)
        layout.addWidget(self.body)
        self.unfolded = False
        self.unfold_button = QToolButton()
        self.unfold_button.setAutoRaise(True)
        self.unfold_button.setAccessibleName("Show the whole message")
        self.unfold_button.clicked.connect(self.unfold)
        self.unfold_button.hide()
        layout.addWidget(self.unfold_button)

        if message.images:
            row = QHBoxLayout()
            for path in message.images:
                row.addWidget(self._thumbnail(path))
            row.addStretch(1)
            layout.addLayout(row)

        self.retry_button: QToolButton | None = None
        self.stats_label = QLabel()
        self.stats_label.setWordWrap(True)
        self.stats_label.setEnabled(False)
        self.stats_label.setAccessibleName("Answer statistics")
        layout.addWidget(self.stats_label)
        self._show_final(message.content, message.state, message.stats)

    def _header(self, siblings: list[int]) -> QHBoxLayout:
        row = QHBoxLayout()
        row.setSpacing(2)
        who = QLabel("<b>You</b>" if self.message.role == "user" else "<b>Assistant</b>")
        row.addWidget(who)
        if len(siblings) > 1:
            at = siblings.index(self.message.id)
            prev = _tool_button("\u2039", "Previous version", lambda: self.branch_requested.emit(siblings[at - 1]))
            nxt = _tool_button("\u203a", "Next version", lambda: self.branch_requested.emit(siblings[at + 1]))
            prev.setEnabled(at > 0)
            nxt.setEnabled(at < len(siblings) - 1)
            self.branch_label = QLabel(f"{at + 1}/{len(siblings)}")
            row.addWidget(prev)
            row.addWidget(self.branch_label)
            row.addWidget(nxt)
        row.addStretch(1)
        self.copy_button = _tool_button("Copy", "Copy message", self.copy)
        row.addWidget(self.copy_button)
        if self.message.role == "user":
            self.action_button = _tool_button("Edit", "Edit and resend",
                                              lambda: self.edit_requested.emit(self.message.id))
        else:
            self.action_button = _tool_button("Regenerate", "Regenerate answer",
                                              lambda: self.regenerate_requested.emit(self.message.id))
        row.addWidget(self.action_button)
        return row

    def _thumbnail(self, path: str) -> QLabel:
        """The image at thumbnail size, decoded at that size (a 50 MP photo is not decoded whole,
        nor refused by Qt's allocation limit); a file that is gone or cannot be decoded says which."""
        label = QLabel()
        reader = QImageReader(path)
        size = reader.size()
        if size.isValid():
            reader.setScaledSize(size.scaled(THUMB_PX, THUMB_PX, Qt.KeepAspectRatio))
        image = reader.read()
        if not image.isNull():
            label.setPixmap(QPixmap.fromImage(image))
        elif not Path(path).is_file():
            label.setText(f"[missing image {Path(path).name}]")
        else:
            label.setText(f"[cannot show {Path(path).name}: {reader.errorString()}]")
        label.setToolTip(path)
        label.setAccessibleName("Attached image")
        return label

    def _toggle_thinking(self, shown: bool) -> None:
        self.thinking_button.setArrowType(Qt.DownArrow if shown else Qt.RightArrow)
        self.thinking_label.setVisible(shown)

    def _set_thinking(self, thinking: str, still: bool, seconds: float | None = None) -> None:
        has = bool(thinking) or still
        self.thinking_button.setVisible(has)
        if not has:
            return
        if still:
            self.thinking_button.setText("Thinking\u2026")
        elif seconds is not None:
            self.thinking_button.setText(f"Thought for {seconds:.{1 if seconds < 10 else 0}f} s")
        else:
            self.thinking_button.setText("Thoughts")
        self.thinking_label.set_plain(thinking)

    def _link(self, href: str) -> None:
        if href.startswith("copy-code:"):
            QGuiApplication.clipboard().setText(self._code_blocks[int(href.split(":", 1)[1])])
        elif href.startswith(("http://", "https://")):
            QDesktopServices.openUrl(QUrl(href))

    def highlight(self, needle: str) -> bool:
        """Mark every occurrence of ``needle`` (case-insensitive) in the text; whether there was one."""
        marks = []
        cursor = self.body.document().find(needle)
        while not cursor.isNull():
            mark = QTextEdit.ExtraSelection()
            mark.cursor = cursor
            mark.format.setBackground(QColor("#f6d32d"))
            mark.format.setForeground(QColor("#000000"))
            marks.append(mark)
            cursor = self.body.document().find(needle, cursor)
        self.body.setExtraSelections(marks)
        return bool(marks)

    def unfold(self) -> None:
        """Show the whole of a folded long message (:data:`FOLD_CHARS`)."""
        self.unfolded = True
        self._show_final(self.raw, self.message.state, self.message.stats)

    def copy(self) -> None:
        """Put the message's answer text (without its thinking) on the clipboard."""
        QGuiApplication.clipboard().setText(split_thinking(self.raw, False)[1] or self.raw)

    def _show_final(self, raw: str, state: str, stats: dict[str, Any]) -> None:
        thinking, answer, still = split_thinking(raw, False) if self.message.role == "assistant" else ("", raw, False)
        self._set_thinking(thinking, False, stats.get("thinking_s"))
        if self.message.role == "assistant":
            rendered = self._renderer.render(answer)
            self._code_blocks = rendered.code_blocks
            self.body.set_html(rendered.html or "<i>(no answer)</i>")
        elif len(answer) > FOLD_CHARS and not self.unfolded:
            self.body.set_plain(answer[:FOLD_CHARS] + "\u2026")
            self.unfold_button.setText(f"Show all {len(answer):,} characters")
            self.unfold_button.show()
        else:
            self.body.set_plain(answer)
            self.unfold_button.hide()
        notes = {"stopped": "Stopped.", "streaming": "Interrupted: the program closed while this answer was written."}
        line = format_stats(stats)
        note = stats.get("message") if state == "error" else notes.get(state)
        self.stats_label.setText(" \u2014 ".join(p for p in (line, note) if p))
        self.stats_label.setVisible(bool(self.stats_label.text()))

    def mark_unsaved(self, reason: str, retry: Callable[[], None]) -> None:
        """Say that this message is not stored (the history database refused the write) and offer a retry."""
        if self.retry_button is None:
            self.retry_button = _tool_button("Retry saving", "Store this message in the chat history again", retry)
            self.layout().addWidget(self.retry_button)
        self.retry_button.show()
        self.stats_label.setText(f"Not saved: {reason}")
        self.stats_label.show()

    def mark_saved(self, state: str, stats: dict[str, Any]) -> None:
        """The message is stored after all (with ``state`` and ``stats``): drop the "not saved" note."""
        if self.retry_button is not None:
            self.retry_button.hide()
        self._show_final(self.raw, state, stats)

    def start_streaming(self, thinking_first: bool) -> None:
        """Show the message as an answer in progress."""
        self.streaming = True
        self.action_button.setEnabled(False)
        self.stats_label.setText("Reading the prompt\u2026")
        self.stats_label.show()
        self._set_thinking("", thinking_first)
        self.body.set_plain("")

    def show_waiting(self) -> None:
        """Say that this answer waits for the engine, which is answering another chat first."""
        if self.streaming and not self.raw:
            self.stats_label.setText("Waiting for the engine: it is answering another chat first "
                                     "(Stop takes this message out of the queue).")

    def show_prefill(self, done: int, total: int) -> None:
        """Say how much of the prompt has been read, until the answer's first text replaces it."""
        if self.streaming and not self.raw:
            self.stats_label.setText(f"Reading the prompt: {done:,} / {total:,} tokens")

    def show_stream(self, raw: str, thinking: str, answer: str, still: bool) -> None:
        """Show the answer so far, as plain text (this widget only): ``raw`` as the model wrote it, its
        ``thinking`` and ``answer`` (the engine's channels); ``still``: the model is still thinking."""
        self.raw = raw
        self._set_thinking(thinking.strip(), still)
        self.body.set_plain(answer.lstrip() if thinking else answer)
        if self.stats_label.text():
            self.stats_label.setText("")
            self.stats_label.hide()

    def finish(self, raw: str, state: str, stats: dict[str, Any]) -> None:
        """End streaming: render the final text as Markdown and show the turn's stats."""
        self.streaming = False
        self.raw = raw
        self.action_button.setEnabled(True)
        self._show_final(raw, state, stats)


class ChatView(QScrollArea):
    """The messages of the active branch, newest at the bottom, following a streaming answer.

    Signals:
        regenerate_requested(int), edit_requested(int), branch_requested(int): from a message.
        shown(): another set of messages is shown.
    """

    regenerate_requested = Signal(int)
    edit_requested = Signal(int)
    branch_requested = Signal(int)
    shown = Signal()

    def __init__(self, renderer: MarkdownRenderer) -> None:
        super().__init__()
        self.renderer = renderer
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setAccessibleName("Conversation")
        self._content = QWidget()
        self._layout = QVBoxLayout(self._content)
        self._layout.setContentsMargins(12, 12, 12, 12)
        self._layout.setSpacing(10)
        self.empty_label = QLabel("Ask anything. Drop or paste an image to ask about it.")
        self.empty_label.setAlignment(Qt.AlignCenter)
        self.empty_label.setEnabled(False)
        self._layout.addWidget(self.empty_label, 1)
        self._layout.addStretch(1)
        self.setWidget(self._content)
        self.widgets: list[MessageWidget] = []
        self._follow = True
        self._target: MessageWidget | None = None    # a search match kept in view while the layout settles
        self.verticalScrollBar().rangeChanged.connect(self._range_changed)
        self.verticalScrollBar().valueChanged.connect(self._scrolled)

    def _scrolled(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4

    def _range_changed(self, _min: int, maximum: int) -> None:
        if self._target is not None:
            self.ensureWidgetVisible(self._target, 0, 40)
        elif self._follow:
            self.verticalScrollBar().setValue(maximum)

    def find(self, query: str) -> "MessageWidget | None":
        """Scroll to the first shown message holding ``query`` (case-insensitive; else one of its words, as
        the chat search matches them) and highlight it there; None when none holds it (the title matched)."""
        for needle in [query] + query.split():
            for widget in self.widgets:
                if widget.highlight(needle):
                    self._follow = False
                    self._target = widget
                    self.ensureWidgetVisible(widget, 0, 40)
                    return widget
        return None

    def show_messages(self, messages: list[Message], siblings: Callable[[int], list[int]]) -> None:
        """Show ``messages`` (the active branch), keeping the widgets of the part already shown."""
        keep = 0
        while (keep < min(len(self.widgets), len(messages))
               and self.widgets[keep].message.id == messages[keep].id):
            keep += 1
        for widget in self.widgets[keep:]:
            widget.hide()
            self._layout.removeWidget(widget)
            widget.deleteLater()
        del self.widgets[keep:]
        for message in messages[keep:]:
            self.add_message(message, siblings(message.id))
        self.empty_label.setVisible(not messages)
        self._follow = True
        self._target = None
        self.shown.emit()

    def set_renderer(self, renderer: MarkdownRenderer) -> None:
        """Use another renderer (light/dark); drops the widgets so the next show renders afresh."""
        self.renderer = renderer
        self.show_messages([], lambda _id: [])

    def add_message(self, message: Message, siblings: list[int]) -> MessageWidget:
        """Append one message at the bottom and return its widget."""
        widget = MessageWidget(message, self.renderer, siblings)
        widget.regenerate_requested.connect(self.regenerate_requested)
        widget.edit_requested.connect(self.edit_requested)
        widget.branch_requested.connect(self.branch_requested)
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self.widgets.append(widget)
        self.empty_label.hide()
        self._follow = True
        return widget

    def widget_for(self, message_id: int) -> MessageWidget | None:
        """The widget showing ``message_id``, if it is on screen."""
        return next((w for w in self.widgets if w.message.id == message_id), None)
