"""The chat controller: turns the user's actions into history rows and engine turns.

It owns the one live turn (at most one runs at a time): the answer being streamed, its cancel
flag, and the timer that saves its text every few seconds. The turn keeps running when the user
switches to another conversation; switching back shows it still streaming.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.events import TurnSummary

from .chat_view import ChatView
from .engine_worker import ChatRequest, EngineWorker
from .history import HistoryStore, Message
from .markdown_render import THINK_CLOSE, split_thinking

SAVE_INTERVAL_MS = 3000
TITLE_CHARS = 48
_STATE_OF_STOP = {"eos": "complete", "max_tokens": "complete", "cancelled": "stopped",
                  "context_full": "error", "error": "error"}


def engine_messages(path: list[Message], has_vision: bool) -> list[dict]:
    """The active branch in the engine's message format.

    An assistant message is sent without its thinking. A user message with images becomes a list
    of parts, ``{"type": "image", "image": path}`` then ``{"type": "text", "text": ...}``, when the
    model has a vision tower; without one the images are left out (the window warns about it).
    """
    out = []
    for m in path:
        text = split_thinking(m.content, False)[1] if m.role == "assistant" else m.content
        if m.images and has_vision:
            parts: list[dict] = [{"type": "image", "image": p} for p in m.images]
            out.append({"role": m.role, "content": parts + [{"type": "text", "text": text}]})
        else:
            out.append({"role": m.role, "content": text})
    return out


@dataclass
class LiveTurn:
    """The answer being generated: where it is stored and what has arrived so far."""

    conversation_id: int
    message_id: int
    request: ChatRequest
    thinking: bool
    started: float = field(default_factory=time.monotonic)
    text: str = ""
    thought_s: float | None = None
    saved_len: int = 0


class ChatController(QObject):
    """Connects the chat view, the history store and the engine worker.

    Signals:
        request_chat(ChatRequest): connected (queued) to :meth:`EngineWorker.chat`.
        busy_changed(bool): a turn started or ended.
        conversation_touched(int): a conversation got a new message or title.
    """

    request_chat = Signal(object)
    busy_changed = Signal(bool)
    conversation_touched = Signal(int)

    def __init__(self, store: HistoryStore, view: ChatView, worker: EngineWorker,
                 save_interval_ms: int = SAVE_INTERVAL_MS) -> None:
        super().__init__()
        self.store = store
        self.view = view
        self.has_vision = False
        self.conversation_id: int | None = None
        self.live: LiveTurn | None = None
        self.request_chat.connect(worker.chat)
        worker.tokens.connect(self.on_tokens)
        worker.finished.connect(self.on_finished)
        view.branch_requested.connect(self.select_branch)
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(save_interval_ms)
        self._save_timer.timeout.connect(self.save_partial)

    @property
    def busy(self) -> bool:
        """Whether an answer is being generated."""
        return self.live is not None

    def open(self, conversation_id: int) -> None:
        """Show a conversation's active branch (re-attaching the live answer if it is this one)."""
        self.conversation_id = conversation_id
        self.view.show_messages(self.store.active_path(conversation_id), self.store.siblings)
        live = self.live
        if live is not None and live.conversation_id == conversation_id:
            widget = self.view.widget_for(live.message_id)
            if widget is not None:
                widget.raw = ""
                widget.start_streaming(live.thinking)
                widget.append(live.text)

    def send(self, text: str, images: list[str], thinking: bool = False) -> bool:
        """Add a user message at the end of the active branch and answer it; False while busy."""
        if self.busy or self.conversation_id is None:
            return False
        conversation_id = self.conversation_id
        path = self.store.active_path(conversation_id)
        user_id = self.store.add_message(conversation_id, path[-1].id if path else None, "user", text, images)
        if not path:
            title = " ".join((text or "Image").split())
            self.store.rename_conversation(
                conversation_id, title if len(title) <= TITLE_CHARS else title[:TITLE_CHARS - 1] + "\u2026")
        self._start_turn(conversation_id, user_id, thinking)
        return True

    def edit_and_resend(self, message_id: int, text: str, images: list[str], thinking: bool = False) -> bool:
        """Add an edited copy of a user message as its sibling (a new branch) and answer it."""
        original = self.store.message(message_id)
        if self.busy or original is None or original.role != "user":
            return False
        user_id = self.store.add_message(original.conversation_id, original.parent_id, "user", text, images)
        self._start_turn(original.conversation_id, user_id, thinking)
        return True

    def regenerate(self, message_id: int, thinking: bool = False) -> bool:
        """Answer again the user message above an assistant message (a new branch)."""
        answer = self.store.message(message_id)
        if self.busy or answer is None or answer.role != "assistant" or answer.parent_id is None:
            return False
        self._start_turn(answer.conversation_id, answer.parent_id, thinking)
        return True

    def select_branch(self, message_id: int) -> None:
        """Show the branch through ``message_id`` (a sibling version)."""
        self.store.select_branch(message_id)
        if self.conversation_id is not None:
            self.open(self.conversation_id)

    def stop(self) -> None:
        """Ask the live turn to stop; it ends within one token."""
        if self.live is not None:
            self.live.request.cancel.set()

    def _start_turn(self, conversation_id: int, user_id: int, thinking: bool) -> None:
        answer_id = self.store.add_message(conversation_id, user_id, "assistant", "", state="streaming")
        path = self.store.active_path(conversation_id)
        request = ChatRequest(messages=engine_messages(path[:-1], self.has_vision), enable_thinking=thinking)
        self.live = LiveTurn(conversation_id, answer_id, request, thinking)
        self.conversation_touched.emit(conversation_id)
        if conversation_id == self.conversation_id:
            self.open(conversation_id)
        self._save_timer.start()
        self.busy_changed.emit(True)
        self.request_chat.emit(request)

    @Slot(str, list)
    def on_tokens(self, text: str, _token_ms: list) -> None:
        """A batch of answer text arrived from the worker."""
        live = self.live
        if live is None:
            return
        live.text += text
        if live.thinking and live.thought_s is None and THINK_CLOSE in live.text:
            live.thought_s = time.monotonic() - live.started
        if live.conversation_id == self.conversation_id:
            widget = self.view.widget_for(live.message_id)
            if widget is not None:
                widget.append(text)

    def save_partial(self) -> None:
        """Write the live answer's text so far (the timer calls this every few seconds)."""
        live = self.live
        if live is not None and len(live.text) != live.saved_len:
            self.store.update_message(live.message_id, live.text)
            live.saved_len = len(live.text)

    @Slot(object)
    def on_finished(self, summary: TurnSummary) -> None:
        """The turn ended: store the answer with its stats and render it."""
        live = self.live
        if live is None:
            return
        self.live = None
        self._save_timer.stop()
        state = _STATE_OF_STOP.get(summary.stop_reason, "error")
        stats = {"ttft_ms": summary.ttft_ms, "prefill_tok_s": summary.prefill_tok_s,
                 "decode_tok_s": summary.decode_tok_s, "prompt_tokens": summary.prompt_tokens,
                 "reused_tokens": summary.reused_tokens, "generated_tokens": summary.generated_tokens,
                 "stop_reason": summary.stop_reason, "message": summary.message}
        if live.thought_s is not None:
            stats["thinking_s"] = round(live.thought_s, 1)
        self.store.update_message(live.message_id, live.text, state, stats)
        if live.conversation_id == self.conversation_id:
            widget = self.view.widget_for(live.message_id)
            if widget is not None:
                widget.finish(live.text, state, stats)
        self.busy_changed.emit(False)
        self.conversation_touched.emit(live.conversation_id)

    def shutdown(self) -> None:
        """On quit: stop the live turn and store what it had written as stopped."""
        live = self.live
        if live is not None:
            live.request.cancel.set()
            self.store.update_message(live.message_id, live.text, "stopped")
            self.live = None
            self._save_timer.stop()
