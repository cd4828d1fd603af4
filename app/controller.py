"""The chat controller: turns the user's actions into history rows and engine turns.

It owns the one live turn (the engine runs one at a time): the answer being streamed, its cancel
flag, and the timer that saves its text every few seconds. The turn keeps running when the user
switches to another conversation; switching back shows it still streaming. Each conversation has
at most one turn of its own: a message sent in another chat meanwhile is stored at once and its
turn waits, its answer saying "Waiting for the engine", until the live one ends (first sent, first
answered); Stop in that chat takes it out of the queue.

Every database call goes to the :class:`~app.history_thread.HistoryThread`; the controller acts on
the results when they come back (a conversation is shown, a turn starts), so the UI thread never
waits for SQLite. A finished answer the database refuses to store (another program held it locked
past the history's wait) stays in the chat view marked "not saved" with a retry, and so does a message
whose rows cannot be added (its retry sends it again), so nothing typed or answered is lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine.events import PrefillProgress, PrefillStats, TurnSummary

from .chat_view import ChatView, MessageWidget
from .engine_worker import ChatRequest, EngineWorker
from .history import Branch, HistoryStore, Message, TurnStart
from .history_thread import HistoryThread
from .markdown_render import THINK_CLOSE, THINK_OPEN, split_thinking
from .settings import Settings

SAVE_INTERVAL_MS = 3000
TITLE_CHARS = 48
_STATE_OF_STOP = {"eos": "complete", "max_tokens": "complete", "cancelled": "stopped",
                  "context_full": "error", "error": "error"}


def engine_messages(path: list[Message], has_vision: bool, system_prompt: str = "") -> list[dict]:
    """The active branch in the engine's message format, after one system message if there is any.

    The chat templates of Qwen3.5/3.6 (and most others) take a system message only first: the
    settings' system prompt and every system message of the branch (an imported chat may hold one
    anywhere) are joined, in that order and separated by a blank line, into that one message.
    An assistant message is sent without its thinking. A user message with images becomes a list
    of parts, ``{"type": "image", "image": path}`` then ``{"type": "text", "text": ...}``, when the
    model has a vision tower; without one the images are left out (the window warns about it).
    """
    systems = [system_prompt] + [m.content for m in path if m.role == "system"]
    system = "\n\n".join(t.strip() for t in systems if t.strip())
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    for m in path:
        if m.role == "system":
            continue
        text = split_thinking(m.content, False)[1] if m.role == "assistant" else m.content
        if m.images and has_vision:
            parts: list[dict] = [{"type": "image", "image": p} for p in m.images]
            out.append({"role": m.role, "content": parts + [{"type": "text", "text": text}]})
        else:
            out.append({"role": m.role, "content": text})
    return out


def title_for(text: str) -> str:
    """A conversation title from its first message: the first words, at most :data:`TITLE_CHARS`."""
    title = " ".join((text or "Image").split())
    return title if len(title) <= TITLE_CHARS else title[:TITLE_CHARS - 1] + "\u2026"


@dataclass
class LiveTurn:
    """The answer being generated: where it is stored and what has arrived so far (``progress``:
    the last prefill progress, until the prompt has been read)."""

    conversation_id: int
    message_id: int
    request: ChatRequest
    thinking: bool
    question: Message | None = None
    """The user message this turn added (a new message or an edit; None for a regenerate)."""
    started: float = field(default_factory=time.monotonic)
    text: str = ""
    """The answer as the model wrote it (what the history stores)."""
    reasoning: str = ""
    answer: str = ""
    """The answer's reasoning and the rest (tool-call text included), from the engine's channels."""
    channel: str = ""
    """The channel of the last text ("" before any)."""
    thought_s: float | None = None
    saved_len: int = 0
    restore_ms: float = 0.0
    note: str = ""
    progress: PrefillProgress | None = None

    def stored_text(self) -> str:
        """What the history keeps: the text as the model wrote it, with ``<think>`` in front when the
        channels saw reasoning that the text neither opens nor closes (the prompt opened it and the answer
        ended inside it), so that a stored answer cut off mid-thought is read back as thinking."""
        if self.reasoning and THINK_OPEN not in self.text and THINK_CLOSE not in self.text:
            return f"{THINK_OPEN}\n{self.text}"
        return self.text


class ChatController(QObject):
    """Connects the chat view, the history thread and the engine worker.

    Attributes:
        settings: sampling, system prompt and the rest, read when a turn starts.
        has_vision: whether the loaded model can see images.
        unavailable: why no turn can start now (no model is loaded, ...), or "" when one can.
        context: the loaded model's context window, tokens (the settings' size capped at the
            model's own limit).
        remote: whether the model runs on a remote server (its token counts come from the server's
            ``usage``, or are not reported; it restores no snapshots here).

    Signals:
        request_chat(ChatRequest): connected (queued) to :meth:`EngineWorker.chat`.
        busy_changed(bool): a turn was asked for, started, queued or ended; whether any is left.
        activity_changed(): which conversations have a turn changed (see :meth:`activity`).
        turn_refused(int, str, list, str): the engine refused a turn before reading it (the prompt
            does not fit the context); its rows were removed. The conversation, the refused
            message's text and images ("" and [] for a regenerate) and why, in words.
        conversation_touched(int): a conversation got a new message or title.
        turn_finished(TurnSummary): the live turn ended (the engine's summary); emitted before the
            ``busy_changed`` it leads to, so a view connected to it shows the turn's figures by then.
    """

    request_chat = Signal(object)
    busy_changed = Signal(bool)
    activity_changed = Signal()
    turn_refused = Signal(int, str, list, str)
    conversation_touched = Signal(int)
    turn_finished = Signal(object)

    def __init__(self, history: HistoryThread, view: ChatView, worker: EngineWorker, settings: Settings,
                 save_interval_ms: int = SAVE_INTERVAL_MS) -> None:
        super().__init__()
        self.history = history
        self.view = view
        self.settings = settings
        self.has_vision = False
        self.unavailable = "No model is loaded yet."
        self.unsaved: dict[int, tuple[int, str, str, dict[str, Any], str]] = {}
        """Answers the history refused to store: id -> (conversation, text, state, stats, reason)."""
        self.unsent: dict[int, tuple[int, str, list[str], bool, str]] = {}
        """Messages whose rows could not be added, shown under a stand-in id below 0:
        id -> (conversation, text, images, thinking, reason)."""
        self.context = 0
        self.remote = False
        self.conversation_id: int | None = None
        self.live: LiveTurn | None = None
        self.waiting: list[LiveTurn] = []
        self._starting: set[int | None] = set()
        self._stop_on_start: set[int | None] = set()     # stopped while their rows were being added
        self.request_chat.connect(worker.chat)
        worker.prefill_progress.connect(self.on_prefill_progress)
        worker.prefilled.connect(self.on_prefilled)
        worker.tokens.connect(self.on_tokens)
        worker.finished.connect(self.on_finished)
        view.branch_requested.connect(self.select_branch)
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(save_interval_ms)
        self._save_timer.timeout.connect(self.save_partial)

    @property
    def busy(self) -> bool:
        """Whether any answer is being generated, waits for the engine, or has its rows being added."""
        return self.live is not None or bool(self.waiting) or bool(self._starting)

    def busy_in(self, conversation_id: int | None) -> bool:
        """Whether ``conversation_id`` has a turn: answering, waiting, or its rows being added."""
        return conversation_id in self.activity() or conversation_id in self._starting

    def activity(self) -> dict[int, str]:
        """Conversation id -> "answering" (the live turn) or "waiting" (queued for the engine)."""
        out = {t.conversation_id: "waiting" for t in self.waiting}
        if self.live is not None:
            out[self.live.conversation_id] = "answering"
        return out

    def _changed(self) -> None:
        self.activity_changed.emit()
        self.busy_changed.emit(self.busy)

    def open(self, conversation_id: int) -> None:
        """Show a conversation's active branch (re-attaching the live answer if it is this one)."""
        self.conversation_id = conversation_id
        self.history.call(HistoryStore.branch, conversation_id, then=self._show)

    def _show(self, branch: Branch) -> None:
        if branch.conversation_id != self.conversation_id:
            return
        self.view.show_messages(branch.path, branch.siblings.__getitem__)
        live = self.live
        if live is not None and live.conversation_id == branch.conversation_id:
            widget = self.view.widget_for(live.message_id)
            if widget is not None:
                widget.raw = ""
                widget.start_streaming(live.thinking)
                if live.text:
                    self._show_stream(widget, live)
                elif live.progress is not None:
                    widget.show_prefill(live.progress.done, live.progress.total)
        for turn in self.waiting:
            widget = self.view.widget_for(turn.message_id) if turn.conversation_id == branch.conversation_id else None
            if widget is not None:
                widget.start_streaming(turn.thinking)
                widget.show_waiting()
        for stand_in, entry in self.unsent.items():
            if entry[0] == branch.conversation_id:
                self._show_unsent(stand_in)
        for message_id, (conversation, text, state, stats, reason) in self.unsaved.items():
            widget = self.view.widget_for(message_id) if conversation == branch.conversation_id else None
            if widget is not None:
                widget.finish(text, state, stats)
                widget.mark_unsaved(reason, lambda message_id=message_id: self.retry_save(message_id))

    def send(self, text: str, images: list[str], thinking: bool = False) -> bool:
        """Add a user message at the end of the active branch and answer it (at once, or after
        the turn of another chat); False while this chat has a turn or :attr:`unavailable`."""
        if self.busy_in(self.conversation_id) or self.unavailable or self.conversation_id is None:
            return False
        self._begin(thinking, HistoryStore.reply, self.conversation_id, text, images, title_for(text),
                    giveback=(text, images, thinking))
        return True

    def edit_and_resend(self, message_id: int, text: str, images: list[str], thinking: bool = False) -> bool:
        """Add an edited copy of a user message as its sibling (a new branch) and answer it."""
        if self.busy_in(self.conversation_id) or self.unavailable:
            return False
        self._begin(thinking, HistoryStore.resend, message_id, text, images, giveback=(text, images, thinking))
        return True

    def regenerate(self, message_id: int, thinking: bool = False) -> bool:
        """Answer again the user message above an assistant message (a new branch)."""
        if self.busy_in(self.conversation_id) or self.unavailable:
            return False
        self._begin(thinking, HistoryStore.regenerate, message_id)
        return True

    def select_branch(self, message_id: int) -> None:
        """Show the branch through ``message_id`` (a sibling version)."""
        self.history.call(HistoryStore.select_branch, message_id)
        if self.conversation_id is not None:
            self.open(self.conversation_id)

    def stop(self) -> None:
        """Stop the shown conversation's turn: the live one ends within one token, a waiting one
        leaves the queue (stored as stopped), and one whose rows are still being added is stored
        as stopped once they are, without reaching the engine."""
        live = self.live
        if live is not None and live.conversation_id == self.conversation_id:
            live.request.cancel.set()
            return
        if self.conversation_id in self._starting:
            self._stop_on_start.add(self.conversation_id)
        for turn in [t for t in self.waiting if t.conversation_id == self.conversation_id]:
            self._drop_waiting(turn)

    def stop_all(self) -> None:
        """Stop the live turn and empty the queue (another model is being loaded)."""
        if self.live is not None:
            self.live.request.cancel.set()
        for turn in list(self.waiting):
            self._drop_waiting(turn)

    def _drop_waiting(self, turn: LiveTurn) -> None:
        self.waiting.remove(turn)
        stats = {"stop_reason": "cancelled", "message": "Stopped before the engine began."}
        self.history.call(HistoryStore.update_message, turn.message_id, "", "stopped", stats)
        widget = self._shown_widget(turn)
        if widget is not None:
            widget.finish("", "stopped", stats)
        self._changed()

    def _begin(self, thinking: bool, add_rows: Callable[..., TurnStart], *args: Any,
               giveback: tuple[str, list[str], bool] | None = None) -> None:
        conversation = self.conversation_id
        self._starting.add(conversation)
        self._changed()
        self.history.call(add_rows, *args, then=lambda start: self._start_turn(conversation, start, thinking),
                          on_error=lambda error: self._not_started(conversation, error, giveback))

    def _not_started(self, conversation: int | None, error: Exception | None = None,
                     giveback: tuple[str, list[str], bool] | None = None) -> None:
        """The turn's rows could not be added: the message stays shown, marked "not saved", with a retry."""
        self._starting.discard(conversation)
        self._stop_on_start.discard(conversation)
        if giveback is not None and conversation is not None:
            stand_in = min(self.unsent, default=0) - 1
            self.unsent[stand_in] = (conversation, giveback[0], list(giveback[1]), giveback[2], str(error))
            if conversation == self.conversation_id:
                self._show_unsent(stand_in)
        self._changed()

    def _show_unsent(self, stand_in: int) -> None:
        conversation, text, images, _, reason = self.unsent[stand_in]
        message = Message(stand_in, conversation, None, "user", text, time.time(), tuple(images))
        widget = self.view.add_message(message, [stand_in])
        widget.action_button.setEnabled(False)
        widget.mark_unsaved(reason, lambda: self.retry_send(stand_in))

    def retry_send(self, stand_in: int) -> None:
        """Send again a message whose rows could not be added (it is shown until then)."""
        entry = self.unsent.get(stand_in)
        if entry is None or entry[0] != self.conversation_id or self.busy_in(entry[0]) or self.unavailable:
            return
        del self.unsent[stand_in]
        self.send(entry[1], entry[2], entry[3])
        self.open(entry[0])

    def _store(self, conversation_id: int, message_id: int, text: str, state: str, stats: dict[str, Any]) -> None:
        """Store an answer's final text, state and stats; one the history refuses is marked "not saved"."""
        self.history.call(HistoryStore.update_message, message_id, text, state, stats,
                          then=lambda _: self._saved(message_id),
                          on_error=lambda error: self._not_saved(conversation_id, message_id, text, state, stats,
                                                                 str(error)))

    def _saved(self, message_id: int) -> None:
        entry = self.unsaved.pop(message_id, None)
        widget = self.view.widget_for(message_id) if entry is not None and entry[0] == self.conversation_id else None
        if widget is not None:
            widget.mark_saved(entry[2], entry[3])

    def _not_saved(self, conversation_id: int, message_id: int, text: str, state: str, stats: dict[str, Any],
                   reason: str) -> None:
        self.unsaved[message_id] = (conversation_id, text, state, stats, reason)
        widget = self.view.widget_for(message_id) if conversation_id == self.conversation_id else None
        if widget is not None:
            widget.mark_unsaved(reason, lambda: self.retry_save(message_id))

    def retry_save(self, message_id: int) -> None:
        """Try again to store an answer marked "not saved"."""
        entry = self.unsaved.get(message_id)
        if entry is not None:
            self._store(entry[0], message_id, *entry[1:4])

    def _start_turn(self, conversation: int | None, start: TurnStart, thinking: bool) -> None:
        """The rows are stored: run the turn now, or queue it behind the live one."""
        self._starting.discard(conversation)
        branch = start.branch
        settings = self.settings
        request = ChatRequest(messages=engine_messages(branch.path[:-1], self.has_vision, settings.system_prompt),
                              sampling=settings.sampling(), enable_thinking=thinking,
                              conversation=str(branch.conversation_id))
        only_answer = branch.siblings.get(start.answer_id, []) == [start.answer_id]
        asked = branch.path[-2] if len(branch.path) > 1 and branch.path[-2].role == "user" and only_answer else None
        turn = LiveTurn(branch.conversation_id, start.answer_id, request, thinking, asked)
        self.conversation_touched.emit(branch.conversation_id)
        stopped = conversation in self._stop_on_start
        self._stop_on_start.discard(conversation)
        if self.live is None and not stopped:
            self._run(turn)
        else:
            self.waiting.append(turn)
        self._show(branch)
        if stopped:
            self._drop_waiting(turn)
        self._changed()

    def _run(self, turn: LiveTurn) -> None:
        turn.started = time.monotonic()
        self.live = turn
        self._save_timer.start()
        self.request_chat.emit(turn.request)

    def _shown_widget(self, live: LiveTurn) -> MessageWidget | None:
        """The live answer's widget, when its conversation is the one shown."""
        return self.view.widget_for(live.message_id) if live.conversation_id == self.conversation_id else None

    @Slot(object)
    def on_prefill_progress(self, progress: PrefillProgress) -> None:
        """Part of the prompt has been read: show how much in the streaming message."""
        live = self.live
        if live is None:
            return
        live.progress = progress
        widget = self._shown_widget(live)
        if widget is not None:
            widget.show_prefill(progress.done, progress.total)

    @Slot(object)
    def on_prefilled(self, stats: PrefillStats) -> None:
        """The prompt has been read: remember how long restoring a cached prefix took and the engine's note."""
        if self.live is not None:
            self.live.progress = None
            self.live.restore_ms = stats.restore_ms
            self.live.note = stats.note

    @Slot(str, list, list)
    def on_tokens(self, text: str, _token_ms: list, parts: list) -> None:
        """A batch of answer text and its channels arrived from the worker."""
        live = self.live
        if live is None:
            return
        live.text += text
        for channel, piece in parts:
            if channel == "reasoning":
                live.reasoning += piece
            else:
                live.answer += piece
                if live.thinking and live.thought_s is None and live.channel == "reasoning":
                    live.thought_s = time.monotonic() - live.started
            live.channel = channel
        widget = self._shown_widget(live)
        if widget is not None:
            self._show_stream(widget, live)

    @staticmethod
    def _show_stream(widget: MessageWidget, live: LiveTurn) -> None:
        still = live.channel == "reasoning" or (live.thinking and not live.channel)
        widget.show_stream(live.text, live.reasoning, live.answer, still)

    def save_partial(self) -> None:
        """Write the live answer's text so far (the timer calls this every few seconds)."""
        live = self.live
        if live is not None and len(live.text) != live.saved_len:
            self.history.call(HistoryStore.update_message, live.message_id, live.stored_text())
            live.saved_len = len(live.text)

    @Slot(object)
    def on_finished(self, summary: TurnSummary) -> None:
        """The turn ended: store the answer with its stats and render it."""
        live = self.live
        if live is None:
            return
        self.live = None
        self._save_timer.stop()
        self.turn_finished.emit(summary)
        if summary.stop_reason == "context_full" and summary.generated_tokens == 0:
            self._refused(live, summary)
            return
        state = _STATE_OF_STOP.get(summary.stop_reason, "error")
        stats = {"ttft_ms": summary.ttft_ms, "prefill_tok_s": summary.prefill_tok_s,
                 "decode_tok_s": summary.decode_tok_s, "prompt_tokens": summary.prompt_tokens,
                 "reused_tokens": summary.reused_tokens, "generated_tokens": summary.generated_tokens,
                 "stop_reason": summary.stop_reason, "message": summary.message}
        if self.remote and not summary.prompt_tokens:     # a prompt has tokens: 0 is a server that sent no usage
            del stats["prompt_tokens"], stats["reused_tokens"]
            stats["usage"] = "not reported by the server"
        if summary.reused_tokens and not self.remote:
            stats["restore_ms"] = round(live.restore_ms, 1)
        if live.note:
            stats["note"] = live.note
        if live.thought_s is not None:
            stats["thinking_s"] = round(live.thought_s, 1)
        text = live.stored_text()
        self._store(live.conversation_id, live.message_id, text, state, stats)
        widget = self._shown_widget(live)
        if widget is not None:
            widget.finish(text, state, stats)
        self.conversation_touched.emit(live.conversation_id)
        self._next()

    def _refused(self, live: LiveTurn, summary: TurnSummary) -> None:
        """The prompt did not fit: remove the turn's rows (a message kept would make every later
        send in the chat fail too) and hand the message back with the reason."""
        self.history.call(HistoryStore.discard_turn, live.message_id, then=self._show)
        question = live.question
        self.turn_refused.emit(live.conversation_id, question.content if question else "",
                               list(question.images) if question else [],
                               self.refusal(summary.prompt_tokens))
        self.conversation_touched.emit(live.conversation_id)
        self._next()

    def refusal(self, prompt_tokens: int) -> str:
        """Why a prompt of ``prompt_tokens`` tokens cannot be answered, and what to do, in words."""
        asked = self.settings.context
        if asked > self.context:
            limit = f"{self.context} tokens, the model's own limit (Settings asks for {asked})"
            advice = "Shorten the message or start a new chat."
        else:
            limit = f"{self.context} tokens (Settings, Ctrl+,)"
            advice = "Shorten the message, start a new chat, or raise the context size."
        return (f"Not sent: with this message the prompt is {prompt_tokens:,} tokens, more than the model "
                f"reads at once, {limit}. {advice}")

    def _next(self) -> None:
        """Start the oldest waiting turn, if any (and a model can answer)."""
        if self.waiting and not self.unavailable:
            turn = self.waiting.pop(0)
            self._run(turn)
            widget = self._shown_widget(turn)
            if widget is not None:
                widget.start_streaming(turn.thinking)
        self._changed()

    def shutdown(self) -> None:
        """On quit: stop the live turn and store what it had written as stopped; the waiting ones
        are stored as stopped, empty."""
        live = self.live
        if live is not None:
            live.request.cancel.set()
            self.history.call(HistoryStore.update_message, live.message_id, live.text, "stopped")
            self.live = None
            self._save_timer.stop()
        for turn in self.waiting:
            self.history.call(HistoryStore.update_message, turn.message_id, "", "stopped")
        self.waiting = []
