"""The engine worker: one QObject that owns the Engine and lives on its own QThread.

The UI talks to it through queued signals (``load``, ``chat``) and cancels a running turn through
the ``threading.Event`` inside the :class:`ChatRequest`, which the engine checks between tokens.
Tokens are forwarded in batches at most every :data:`BATCH_SECONDS`, so the UI thread handles a
few dozen small updates a second whatever the decode speed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Protocol, Sequence

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.errors import EngineError
from engine.events import Event, PrefillStats, TokenEvent, TurnSummary

BATCH_SECONDS = 0.04


class ChatEngine(Protocol):
    """What the worker needs of an engine: :class:`engine.api.Engine` and the tests' fakes."""

    @property
    def info(self) -> Any:
        """An :class:`engine.api.ModelInfo`."""

    def chat(self, messages: Sequence[dict], sampling: Any = ..., cancel: threading.Event | None = None,
             enable_thinking: bool = False) -> Generator[Event, None, None]:
        """Yield one turn's events."""


EngineLoader = Callable[[str | None, str | None], ChatEngine]


def load_real_engine(model_path: str | None, mmproj_path: str | None) -> ChatEngine:
    """Open a model with :mod:`engine.api`; with no path, the engine's default model.

    ``engine.api`` (numpy, gguf, tokenizers) is imported here, on the worker thread, so the window
    appears before those heavy imports run.
    """
    from engine import api

    if model_path is None:
        model_path, default_mmproj = api.default_model()
        mmproj_path = mmproj_path or default_mmproj
    return api.Engine.load(model_path, mmproj_path)


@dataclass(frozen=True)
class ModelSummary:
    """The loaded model as the window shows it.

    Attributes:
        name: the file name.
        line: a one-line summary (arch, layers, quant mix, bytes read per token, context).
        context: the context window in tokens.
        has_vision: whether images can be sent to it.
    """

    name: str
    line: str
    context: int
    has_vision: bool


def human_size(n: float) -> str:
    """A byte count as "512 B", "3.4 MB", ..."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024
        if n < 1024:
            break
    return f"{n:.1f} {unit}"


def summarize(info: Any) -> ModelSummary:
    """Turn an :class:`engine.api.ModelInfo` into the window's :class:`ModelSummary`."""
    quants = ", ".join(f"{name} \u00d7{count}" for name, (count, _) in
                       sorted(info.quant_mix.items(), key=lambda kv: -kv[1][1]))
    line = (f"{Path(info.path).name}: {info.arch}, {info.n_layer} layers ({info.n_attn_layers} attention), "
            f"{info.n_params / 1e6:.1f} M params, {quants}; {human_size(info.bytes_per_token)} read per token; "
            f"context {info.context} tokens; {'vision' if info.has_vision else 'text only'}")
    return ModelSummary(name=Path(info.path).name, line=line, context=info.context,
                        has_vision=info.has_vision)


def plain_error(exc: BaseException, doing: str) -> str:
    """One sentence for the window about ``exc``, raised while ``doing`` something."""
    if isinstance(exc, EngineError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return f"Out of memory while {doing}. Try a smaller model or a shorter context."
    if isinstance(exc, FileNotFoundError):
        return f"File not found while {doing}: {exc.filename or exc}"
    if isinstance(exc, OSError):
        return f"Cannot read a file while {doing}: {exc}"
    return f"Unexpected error while {doing}: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ChatRequest:
    """One turn to run.

    Attributes:
        messages: the conversation in the engine's format (role, content, image parts).
        cancel: set it from any thread to stop the turn before its next token.
        sampling: an :class:`engine.sampling.SamplingParams`, or None for the engine's default.
        enable_thinking: let the model think before answering.
    """

    messages: list[dict]
    cancel: threading.Event = field(default_factory=threading.Event)
    sampling: Any = None
    enable_thinking: bool = False


class EngineWorker(QObject):
    """Owns the engine; runs model loads and turns on the thread it was moved to.

    Signals:
        loaded(ModelSummary), load_failed(str): the outcome of :meth:`load`.
        prefilled(PrefillStats): the prompt has been read.
        tokens(str, list): a batch of answer text and the per-token latencies (ms) it holds.
        finished(TurnSummary): the turn is over (also after a cancel or an error; its ``message``
            then says what happened in plain words).
    """

    loaded = Signal(object)
    load_failed = Signal(str)
    prefilled = Signal(object)
    tokens = Signal(str, list)
    finished = Signal(object)

    def __init__(self, loader: EngineLoader = load_real_engine) -> None:
        super().__init__()
        self._loader = loader
        self._engine: ChatEngine | None = None
        self._load_error = "No model is loaded yet."

    @Slot(object, object)
    def load(self, model_path: str | None, mmproj_path: str | None) -> None:
        """Load a model (replacing the current one); emits ``loaded`` or ``load_failed``."""
        self._engine = None
        try:
            engine = self._loader(model_path, mmproj_path)
            summary = summarize(engine.info)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message in the window
            self._load_error = plain_error(exc, f"loading {model_path or 'the default model'}")
            self.load_failed.emit(self._load_error)
            return
        self._engine = engine
        self.loaded.emit(summary)

    @Slot(object)
    def chat(self, request: ChatRequest) -> None:
        """Run one turn, streaming its events as signals; always ends with ``finished``."""
        stream = _TurnStream(self)
        if self._engine is None:
            stream.fail(f"Cannot answer: {self._load_error}")
            return
        kwargs: dict[str, Any] = {"cancel": request.cancel, "enable_thinking": request.enable_thinking}
        if request.sampling is not None:
            kwargs["sampling"] = request.sampling
        try:
            events = self._engine.chat(request.messages, **kwargs)
            for event in events:
                if request.cancel.is_set() and not isinstance(event, TurnSummary):
                    events.close()
                    stream.finish(stream.summary("cancelled", "Stopped."))
                    return
                stream.handle(event)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message in the window
            stream.fail(plain_error(exc, "answering"))
            return
        if not stream.done:
            stream.fail("The engine ended the turn without a summary.")


class _TurnStream:
    """Batches one turn's token events and emits the worker's signals."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.text: list[str] = []
        self.ms: list[float] = []
        self.pending: list[str] = []
        self.pending_ms: list[float] = []
        self.last_flush = time.monotonic()
        self.prefill: PrefillStats | None = None
        self.done = False

    def handle(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.text.append(event.text)
            self.ms.append(event.ms)
            self.pending.append(event.text)
            self.pending_ms.append(event.ms)
            if time.monotonic() - self.last_flush >= BATCH_SECONDS:
                self.flush()
        elif isinstance(event, PrefillStats):
            self.prefill = event
            self.worker.prefilled.emit(event)
        elif isinstance(event, TurnSummary):
            self.finish(event)

    def flush(self) -> None:
        if self.pending_ms:
            self.worker.tokens.emit("".join(self.pending), self.pending_ms)
            self.pending, self.pending_ms = [], []
        self.last_flush = time.monotonic()

    def summary(self, reason: str, message: str) -> TurnSummary:
        p = self.prefill
        decode_ms = sum(self.ms[1:])
        return TurnSummary(
            stop_reason=reason, message=message, prompt_tokens=p.prompt_tokens if p else 0,
            reused_tokens=p.reused_tokens if p else 0, generated_tokens=len(self.ms),
            ttft_ms=p.ttft_ms if p else 0.0, prefill_tok_s=p.prefill_tok_s if p else 0.0,
            decode_tok_s=(len(self.ms) - 1) / (decode_ms / 1e3) if decode_ms > 0 else 0.0,
            text="".join(self.text), token_ms=tuple(self.ms))

    def finish(self, summary: TurnSummary) -> None:
        self.flush()
        self.done = True
        self.worker.finished.emit(summary)

    def fail(self, message: str) -> None:
        self.finish(self.summary("error", message))


class WorkerThread:
    """An :class:`EngineWorker` moved to its own QThread, started and stopped together."""

    def __init__(self, loader: EngineLoader = load_real_engine) -> None:
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker(loader)
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def stop(self) -> None:
        """Let the current job end and join the thread."""
        self.thread.quit()
        self.thread.wait()
