"""The engine worker: one QObject that owns the Engine and lives on its own QThread.

The UI talks to it through queued signals (``load``, ``chat``, ...) and cancels a running turn
through the ``threading.Event`` inside the :class:`ChatRequest`, which the engine checks between
prompt pieces and between tokens. Every use of a loaded engine is a job of its
:class:`engine.session.Session` (shared with "Serve on localhost"), which decodes up to four turns together
(the app's and served ones) and runs every other job alone.
Tokens and prefill progress are forwarded at most every :data:`BATCH_SECONDS`, so the UI thread
handles a few dozen small updates a second whatever the prefill and decode speed.

After a finished turn the worker reads ahead: a low-priority job of the session prefills the
conversation as the next turn will render it, answer included, and snapshots it
(``Engine.prefill_ahead``), so the follow-up reads only its new message. Any next job (a send, an
edit's new turn, an image measurement, a served request, closing) and a model switch stop it at its
current piece (32 tokens).

A 20 GB model takes a while to map and prepare, so each load runs on a daemon thread of its own
and reports the stage it is at. :meth:`EngineWorker.cancel_load` (or closing the window) sets the
load's cancel flag, which ``Engine.load`` checks between stages, and abandons the load at once:
whatever the loader thread still returns is dropped when it arrives.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from PySide6.QtCore import QMetaObject, QObject, Qt, QThread, Signal, Slot

from engine.errors import EngineError, GenerationCancelled
from engine.events import Event, PrefillProgress, PrefillStats, TokenEvent, TurnSummary
from engine.session import Session, Ticket, engine_parallel

from .gpu import gpu_report
from .serving import LocalServer

if TYPE_CHECKING:  # engine.api imports numpy and the model code: loaded off the UI thread, at the first load
    from engine.api import ChatEngine

log = logging.getLogger(__name__)

BATCH_SECONDS = 0.04


@dataclass(frozen=True)
class LoadRequest:
    """A model to load and the options to load it with.

    Attributes:
        model_path: GGUF text model; None = the engine's default model (with its vision tower).
        mmproj_path: GGUF vision tower, or None.
        context: context window, tokens.
        image_max_pixels: largest image area sent to the vision tower, pixels.
        cache_dir: folder of the prefix snapshots kept across restarts, or None (RAM only).
        threads: CPU kernel threads, or None for the engine's default (the physical cores).
        device: where prefill runs: "auto", "cuda" or "cpu".
        vram_budget: GPU memory prefill may use, bytes, or None to let the engine decide.
        weights: "auto", "ram" or "map" (:attr:`engine.api.EngineOptions.weights`).
        remote_url: base URL of an OpenAI-compatible server to use instead of a local model ("" = none);
            remote_model: the model it serves; api_key: its key (from the keyring, never saved), or None.
    """

    model_path: str | None = None
    mmproj_path: str | None = None
    context: int = 8192
    image_max_pixels: int = 1024 * 1024
    cache_dir: Path | None = None
    threads: int | None = None
    device: str = "auto"
    vram_budget: int | None = None
    remote_url: str = ""
    remote_model: str = ""
    api_key: str | None = field(default=None, repr=False)
    weights: str = "auto"

    @property
    def name(self) -> str:
        """The model's file name (or remote name and server), for messages."""
        if self.remote_url:
            return f"{self.remote_model} at {self.remote_url}"
        return Path(self.model_path).name if self.model_path else "the default model"


LoadProgress = Callable[[str], None]
EngineLoader = Callable[[LoadRequest, LoadProgress, threading.Event], "ChatEngine"]
"""Opens the model a request names; calls the progress callable with the name of each stage as it
starts and stops early (raising :class:`~engine.errors.GenerationCancelled`) once the event is set."""


def load_real_engine(request: LoadRequest, progress: LoadProgress, cancel: threading.Event) -> ChatEngine:
    """Open a model with :mod:`engine.api`; with no path, the engine's default model. The bundled demo
    named by its path without a tower gets its own (:func:`engine.api.bundled_mmproj_for`).

    ``engine.api`` (numpy, gguf, tokenizers) is imported here, off the UI thread, so the window
    appears before those heavy imports run. ``progress`` and ``cancel`` go to ``Engine.load``.
    A request with a ``remote_url`` connects to that server instead
    (:meth:`engine.openai.remote.RemoteEngine.connect`).
    """
    if request.remote_url:
        from engine.openai.remote import RemoteEngine
        progress("connecting to the server")
        return RemoteEngine.connect(request.remote_url, request.remote_model, request.api_key)
    from engine import api

    model_path, mmproj_path = request.model_path, request.mmproj_path
    if model_path is None:
        model_path, default_mmproj = api.default_model()
        mmproj_path = mmproj_path or default_mmproj
    elif mmproj_path is None:
        mmproj_path = api.bundled_mmproj_for(model_path)
    options = api.EngineOptions(context=request.context, image_max_pixels=request.image_max_pixels,
                                cache_disk_dir=request.cache_dir, threads=request.threads, device=request.device,
                                vram_budget=request.vram_budget, weights=request.weights)
    return api.Engine.load(model_path, mmproj_path, options, progress=progress, cancel=cancel)


@dataclass(frozen=True)
class ModelSummary:
    """The loaded model as the window shows it.

    Attributes:
        line: a one-line summary (arch, layers, quant mix, bytes read per token, context).
        info: the engine's :class:`engine.api.ModelInfo` (context, has_vision, device, device_note,
            placement, vram_budget, ...), passed on as it is.
    """

    line: str
    info: Any


def holds_gpu(info: Any) -> bool:
    """Whether a loaded model keeps buffers on the GPU (prefill or its vision tower runs there)."""
    return info.device == "cuda" or getattr(info, "vision_device", "") == "cuda"


def closed_first(info: Any, request: "LoadRequest | None") -> bool:
    """Whether the loaded model of ``info`` is closed before ``request`` loads: it holds the GPU (:func:`holds_gpu`),
    or its weights were read into memory and ``request`` opens a local file (a second copy beside them could
    exhaust the memory, and "auto" would measure it without them and map the new file)."""
    return holds_gpu(info) or (getattr(info, "weights", "") == "ram" and not getattr(request, "remote_url", ""))


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
    """Turn an :class:`engine.api.ModelInfo` into the window's :class:`ModelSummary`.

    The parameter count is the text model's (``info.n_params``, millions): a vision tower's
    parameters are not in it, so the line says "(text model)". A model that chats in ChatML for want
    of its own template says so at the end (``info.template_note``). A remote engine's line names the
    model and the server instead (it has no file fields).
    """
    if info.remote:
        context = f"context {info.context} tokens" if info.context else "context as the server sets it"
        return ModelSummary(line=f"{info.name} on {info.remote} (remote engine): {context}; "
                                 f"{'images sent' if info.has_vision else 'text only'}", info=info)
    quants = ", ".join(f"{name} \u00d7{count}" for name, (count, _) in
                       sorted(info.quant_mix.items(), key=lambda kv: -kv[1][1]))
    line = (f"{Path(info.path).name}: {info.arch}, {info.n_layer} layers ({info.n_attn_layers} attention), "
            f"{info.n_params / 1e6:.1f} M params (text model), {quants}; "
            f"{human_size(info.bytes_per_token)} read per token; "
            f"context {info.context} tokens; {'vision' if info.has_vision else 'text only'}")
    if info.template_note:
        line += f"; {info.template_note}"
    return ModelSummary(line=line, info=info)


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


class StopFlag(threading.Event):
    """A turn's cancel event that keeps when it was first set (``at``, ``time.monotonic()``; inf until then),
    so the tokens the engine made before the stop are told from the one it may make after."""

    def __init__(self) -> None:
        super().__init__()
        self.at = math.inf

    def set(self) -> None:
        """Set the flag, noting the time if it was not set yet."""
        if not self.is_set():
            self.at = time.monotonic()
        super().set()


@dataclass(frozen=True)
class ChatRequest:
    """One turn to run.

    Attributes:
        messages: the conversation in the engine's format (role, content, image parts).
        cancel: set it from any thread to stop the turn before its next token; the tokens made before are kept.
        sampling: an :class:`engine.sampling.SamplingParams`, or None for the engine's default.
        enable_thinking: let the model think before answering.
        conversation: the conversation's id, recorded with the prefix snapshots the turn takes.
    """

    messages: list[dict]
    cancel: StopFlag = field(default_factory=StopFlag)
    sampling: Any = None
    enable_thinking: bool = False
    conversation: str = ""


class EngineWorker(QObject):
    """Owns the engine; runs turns, snapshot and image requests on the thread it was moved to.

    Signals:
        loaded(ModelSummary), load_failed(str): the outcome of :meth:`load` (none after a cancel).
        load_stage(LoadRequest, str): the load of that request has begun a stage ("mapping tensors", ...).
        prefill_progress(PrefillProgress): how much of the prompt has been read (at most one per batch).
        prefilled(PrefillStats): the prompt has been read.
        tokens(str, list, list): a batch of answer text as the model wrote it, the per-token latencies (ms) it
            holds and its ``(channel, text)`` parts (``TokenEvent.parts``; the last batch adds the summary's).
        finished(TurnSummary): the turn is over (also after a cancel or an error; its ``message``
            then says what happened in plain words).
        snapshots_listed(list): the engine's prefix snapshots (after a load, a turn, a clear).
        gpu_reported(GpuReport): where prefill runs and images are encoded, and the last GPU prefill
            (after a load, a turn).
        image_measured(str, object): an image path and the (height, width, image tokens, pieces) the model
            will see, () when a remote server sizes it itself, or a sentence saying why it cannot.
        notice(str): something went wrong outside a turn; plain words for the status bar.
        served(str): where "Serve on localhost" listens, or why it does not ("" when it is off).
    """

    loaded = Signal(object)
    load_failed = Signal(str)
    load_stage = Signal(object, str)
    prefill_progress = Signal(object)
    prefilled = Signal(object)
    tokens = Signal(str, list, list)
    finished = Signal(object)
    snapshots_listed = Signal(list)
    gpu_reported = Signal(object)
    image_measured = Signal(str, object)
    notice = Signal(str)
    served = Signal(str)
    _load_done = Signal(int, object, object)

    def __init__(self, loader: EngineLoader = load_real_engine) -> None:
        super().__init__()
        self._loader = loader
        self._engine: ChatEngine | None = None
        self._load_error = "No model is loaded yet."
        self._lock = threading.Lock()
        self._load_number = 0
        self._load_cancel = threading.Event()
        self.closing = threading.Event()
        self._session: Session | None = None
        self._server = LocalServer()
        self._serve_port = 0
        self._ahead: Ticket | None = None
        self._load_done.connect(self._install)

    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        """Load another model on a loader thread; the loaded one stays until that one is ready.

        A load still in progress is cancelled. Emits ``load_stage`` as the load goes, then
        ``loaded`` (the previous model was closed, its snapshots saved) or ``load_failed`` (the
        previous model, if any, is still loaded and answers), unless :meth:`cancel_load` was called
        meanwhile. Both models are open while the new one loads (their weights are used where the
        file is mapped: page cache, not a copy), except when the loaded one holds the GPU or its weights
        are read into memory (:func:`closed_first`): it is closed first, so the new model's VRAM budget and
        memory are measured free of it; the window then loads it again if the new one fails.
        """
        if self._ahead is not None:
            self._ahead.cancel()
        if self._engine is not None and closed_first(self._engine.info, request):
            self._close_engine()
        cancel = threading.Event()
        with self._lock:
            self._load_cancel.set()
            self._load_cancel = cancel
            self._load_number += 1
            number = self._load_number
        if self._engine is None:
            self._load_error = "The model is still loading."
        threading.Thread(target=self._load_in_background, args=(number, request, cancel),
                         name=f"model-load-{number}", daemon=True).start()

    def cancel_load(self) -> None:
        """Stop the load in progress; callable from any thread, returns at once.

        The load's cancel flag is set, so the engine stops at its next stage; whatever the loader
        thread still returns is dropped. The model loaded before, if any, stays.
        """
        with self._lock:
            self._load_cancel.set()
            self._load_number += 1
        if self._engine is None:
            self._load_error = "Loading the model was cancelled."

    def _is_current(self, number: int) -> bool:
        with self._lock:
            return number == self._load_number

    def _load_in_background(self, number: int, request: LoadRequest, cancel: threading.Event) -> None:
        def progress(stage: str) -> None:
            if self._is_current(number):
                self.load_stage.emit(request, stage)

        try:
            engine: ChatEngine | None = self._loader(request, progress, cancel)
            outcome: Any = summarize(engine.info)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a message in the window
            engine, outcome = None, plain_error(exc, f"loading {request.name}")
        if self._is_current(number):
            self._load_done.emit(number, engine, outcome)
        elif engine is not None:
            engine.close()

    @Slot(int, object, object)
    def _install(self, number: int, engine: ChatEngine | None, outcome: Any) -> None:
        if not self._is_current(number):
            if engine is not None:
                engine.close()
            return
        if engine is None:
            if self._engine is None:
                self._load_error = outcome
            self.load_failed.emit(outcome)
            return
        self._close_engine()
        self._engine, self._session = engine, Session(name="engine-session", parallel=engine_parallel(engine))
        self.loaded.emit(outcome)
        self.report_gpu()
        self.list_snapshots()
        if self._serve_port:
            self._apply_serving()

    @Slot(int)
    def serve(self, port: int) -> None:
        """Run the local server on ``port`` with the loaded engine (0: stop it); emits ``served``. It
        follows later loads (started on each new engine) until it is turned off."""
        self._serve_port = port
        self._apply_serving()

    def _apply_serving(self) -> None:
        if not self._serve_port:
            self._server.stop()
            self.served.emit("")
        elif self._engine is None:
            self._server.stop()
            self.served.emit("Not serving: no model is loaded")
        else:
            self.served.emit(self._server.start(self._engine, self._serve_port, self._session))

    def _read_ahead(self, request: ChatRequest, answer: str) -> None:
        """Queue ``Engine.prefill_ahead`` of ``request``'s conversation plus ``answer`` as the session's
        read-ahead (any later job stops it at its next piece); the snapshot list is emitted again when it
        has read something."""
        engine = self._engine
        read = getattr(engine, "prefill_ahead", None)    # an in-process Engine; a remote one cannot
        if read is None or self._session is None:
            return
        messages = list(request.messages) + [{"role": "assistant", "content": answer}]

        def run(cancel: threading.Event) -> None:
            try:
                stats = read(messages, enable_thinking=request.enable_thinking, cancel=cancel,
                             conversation=request.conversation)
            except Exception as exc:  # noqa: BLE001 - reading ahead is an optimisation; the next turn reads itself
                log.warning("reading the next turn ahead failed: %s", exc)
                return
            if stats is not None and stats.prefilled_tokens and not cancel.is_set():
                self._emit_snapshots(engine.snapshots)

        try:
            self._ahead = self._session.read_ahead(run)
        except EngineError as exc:      # the queue is full of served requests: the next turn reads itself
            log.info("not reading the next turn ahead: %s", exc)

    def _close_engine(self) -> None:
        if self._server.running:
            self._server.stop()
            self.served.emit("Not serving: the model is being replaced" if self._serve_port else "")
        engine, self._engine = self._engine, None
        session, self._session = self._session, None
        self._ahead = None
        if engine is None or session is None:
            return
        try:
            session.call(engine.close).result()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a message in the window
            self.notice.emit(plain_error(exc, "saving the prefix snapshots"))
        finally:
            session.close()

    @Slot()
    def shutdown(self) -> None:
        """Save the prefix snapshots to disk and drop the model (before the thread ends)."""
        self._close_engine()

    @Slot(object)
    def chat(self, request: ChatRequest) -> None:
        """Run one turn, streaming its events as signals; always ends with ``finished``. A turn that
        ends with an answer (end of text or the token limit) starts reading the next turn ahead."""
        stream = _TurnStream(self)
        engine, session = self._engine, self._session
        if engine is None or session is None:
            stream.fail(f"Cannot answer: {self._load_error}")
            return
        if request.cancel.is_set():
            stream.finish(stream.summary("cancelled", "Stopped."))
            return
        kwargs: dict[str, Any] = {"enable_thinking": request.enable_thinking, "conversation": request.conversation}
        if request.sampling is not None:
            kwargs["sampling"] = request.sampling
        answer: TurnSummary | None = None
        try:
            events = session.stream(lambda cancel: engine.chat(request.messages, cancel=cancel, **kwargs),
                                    request.cancel)
            for event in events:
                if request.cancel.is_set() and not isinstance(event, TurnSummary):
                    stop = request.cancel.at
                    made = [event] * (events.made_at < stop) + events.ready(stop)
                    events.close()
                    stream.stopped(made)
                    break
                stream.handle(event)
                if isinstance(event, TurnSummary) and event.stop_reason in ("eos", "max_tokens"):
                    answer = event
        except GenerationCancelled:
            stream.finish(stream.summary("cancelled", "Stopped."))
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message in the window
            stream.fail(plain_error(exc, "answering"))
        if not stream.done:
            stream.fail("The engine ended the turn without a summary.")
        self.report_gpu()
        self.list_snapshots()
        if answer is not None and not self.closing.is_set():
            self._read_ahead(request, answer.text)

    @Slot()
    def report_gpu(self) -> None:
        """Emit ``gpu_reported`` with the engine's device, its note, its last GPU prefill and its vision
        device and note."""
        if self._engine is None:
            return
        try:
            report = gpu_report(self._engine)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a message in the window
            self.notice.emit(plain_error(exc, "reading the GPU telemetry"))
            return
        self.gpu_reported.emit(report)

    @Slot()
    def list_snapshots(self) -> None:
        """Emit ``snapshots_listed`` with the engine's prefix snapshots ([] without a model)."""
        engine, session = self._engine, self._session
        if engine is None or session is None:
            self.snapshots_listed.emit([])
            return
        self._emit_snapshots(lambda: session.call(engine.snapshots).result())

    def _emit_snapshots(self, listing: Callable[[], list]) -> None:
        try:
            listed = listing()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a message in the window
            self.notice.emit(plain_error(exc, "listing the prefix snapshots"))
            return
        self.snapshots_listed.emit(listed)

    @Slot(object)
    def clear_snapshots(self, key: str | None) -> None:
        """Drop one prefix snapshot (its key) or, with None, all of them; then list what is left."""
        engine, session = self._engine, self._session
        if engine is not None and session is not None:
            try:
                session.call(lambda: engine.clear_snapshots(key)).result()
            except Exception as exc:  # noqa: BLE001 - every failure becomes a message in the window
                self.notice.emit(plain_error(exc, "clearing the prefix snapshots"))
        self.list_snapshots()

    @Slot(str)
    def measure_image(self, path: str) -> None:
        """Emit ``image_measured`` with the size ``path`` will have for the vision tower and the
        image tokens it will take (the tower's own count: it differs between model families).

        The engine prepares the image (reads and resizes it; no encoding) once to know both; a remote
        engine's server decides them (``image_info`` returns None: ``()`` is emitted). A request that
        arrives while the window closes is skipped.
        """
        engine, session = self._engine, self._session
        if engine is None or session is None or self.closing.is_set():
            return
        try:
            info = session.call(lambda: engine.image_info(path)).result()
            size: Any = () if info is None else (info.height, info.width, info.tokens, info.pieces)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a message in the window
            size = plain_error(exc, "reading the image")
        self.image_measured.emit(path, size)


class _TurnStream:
    """Batches one turn's token events and emits the worker's signals."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.text: list[str] = []
        self.ms: list[float] = []
        self.pending: list[str] = []
        self.pending_ms: list[float] = []
        self.pending_parts: list[tuple[str, str]] = []
        self.pending_progress: PrefillProgress | None = None
        self.last_flush = time.monotonic()
        self.prefill: PrefillStats | None = None
        self.done = False

    def handle(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.text.append(event.text)
            self.ms.append(event.ms)
            self.pending.append(event.text)
            self.pending_ms.append(event.ms)
            self.pending_parts += event.parts
            if time.monotonic() - self.last_flush >= BATCH_SECONDS:
                self.flush()
        elif isinstance(event, PrefillProgress):
            self.pending_progress = event
            if time.monotonic() - self.last_flush >= BATCH_SECONDS:
                self.flush()
        elif isinstance(event, PrefillStats):
            self.pending_progress = None
            self.prefill = event
            self.worker.prefilled.emit(event)
        elif isinstance(event, TurnSummary):
            self.finish(event)

    def flush(self) -> None:
        if self.pending_progress is not None:
            self.worker.prefill_progress.emit(self.pending_progress)
            self.pending_progress = None
        if self.pending_ms or self.pending_parts:
            self.worker.tokens.emit("".join(self.pending), self.pending_ms, self.pending_parts)
            self.pending, self.pending_ms, self.pending_parts = [], [], []
        self.last_flush = time.monotonic()

    def summary(self, reason: str, message: str) -> TurnSummary:
        return TurnSummary.of_turn(reason, message, self.prefill, self.ms, "".join(self.text))  # type: ignore[arg-type]

    def finish(self, summary: TurnSummary) -> None:
        self.pending_parts += summary.parts
        self.flush()
        self.done = True
        self.worker.finished.emit(summary)

    def fail(self, message: str) -> None:
        self.finish(self.summary("error", message))

    def stopped(self, made: list[Event]) -> None:
        """End the turn as stopped, keeping the tokens in ``made``: made before the stop (the engine runs on
        the session thread, so some may still wait in the turn's queue when the worker sees it)."""
        for event in made:
            if isinstance(event, TokenEvent):
                self.handle(event)
        self.finish(self.summary("cancelled", "Stopped."))


class WorkerThread:
    """An :class:`EngineWorker` moved to its own QThread, started and stopped together."""

    def __init__(self, loader: EngineLoader = load_real_engine) -> None:
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker(loader)
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def stop(self) -> None:
        """Let the current job end (cancel a live turn first), save the snapshots, join the thread.

        A model load in progress is not waited for: cancel it with :meth:`EngineWorker.cancel_load`.
        """
        self.worker.closing.set()
        if self.thread.isRunning():
            QMetaObject.invokeMethod(self.worker, "shutdown", Qt.BlockingQueuedConnection)
            self.thread.quit()
            self.thread.wait()
