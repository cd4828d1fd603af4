"""A fast scripted engine for the app's tests: the real event dataclasses, no model."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

from PIL import Image

from app.engine_worker import BATCH_SECONDS
from engine.api import ModelInfo, SnapshotInfo
from engine.arch.qwen35.channels import splitter
from engine.errors import EngineError, GenerationCancelled
from engine.events import Event, PrefillProgress, PrefillStats, TokenEvent, TurnSummary
from engine.vision.images import ImageInfo


def fake_info(**fields) -> ModelInfo:
    """A real :class:`engine.api.ModelInfo` of a small made-up Q8_0 model on the CPU; ``fields`` override."""
    base = dict(path=Path("fake-model.gguf"), arch="qwen35moe", n_layer=4, n_attn_layers=1, n_params=12_000_000,
                quant_mix={"Q8_0": (20, 9_000_000), "F32": (9, 40_000)}, bytes_per_token=6_500_000, context=4096,
                has_vision=False)
    return ModelInfo(**(base | fields))


class FakeEngine:
    """Streams ``tokens`` (strings) one every ``token_ms``, honouring the cancel flag like the real one.

    ``info`` is a :class:`~engine.api.ModelInfo` (:func:`fake_info`) (its ``device`` goes into ``PrefillStats``),
    ``gpu_telemetry`` what :meth:`telemetry` returns (None: prefill on the CPU), ``note`` the turns'
    ``PrefillStats.note``. With ``prompt_pieces`` the 20 prefilled tokens of a 30-token prompt (10 reused) are read in
    that many pieces of ``piece_ms`` each, a ``PrefillProgress`` after each and the cancel flag checked between them, as
    the real engine does; ``pieces_read`` counts them. ``prefill_ahead`` takes ``ahead_pieces`` pieces of ``piece_ms``
    and records each call in ``aheads``. After :meth:`hold` a turn waits after ``after`` tokens (still answering,
    however long the test takes) until :meth:`release`, the cancel flag checked meanwhile; ``reading_ahead`` is set once
    a read-ahead has begun. ``produced`` counts the tokens it has yielded; ``calls`` keeps each turn's messages,
    ``samplings`` and ``conversations`` its other arguments, ``loads`` the LoadRequests that returned it. Each turn
    leaves a prefix snapshot; images reach the "model" at half their size.
    """

    def __init__(self, tokens: Sequence[str] = ("Hello", ",", " world", "."), token_ms: float = 1.0,
                 has_vision: bool = False, prefill_ms: float = 2.0, fail_with: Exception | None = None,
                 info: ModelInfo | None = None, prompt_pieces: int = 0, piece_ms: float = 1.0) -> None:
        self.tokens = list(tokens)
        self.prompt_pieces = prompt_pieces
        self.piece_ms = piece_ms
        self.pieces_read = 0
        self.token_ms = token_ms
        self.prefill_ms = prefill_ms
        self.fail_with = fail_with
        self.info = info or fake_info(has_vision=has_vision)
        self.gpu_telemetry = None
        self.note = ""
        self.produced = 0
        self.calls: list[list[dict]] = []
        self.thinking: list[bool] = []
        self.samplings: list = []
        self.conversations: list[str] = []
        self.loads: list = []
        self.snapshot_list: list[SnapshotInfo] = []
        self.closed = 0
        self.ahead_pieces = 0
        self.aheads: list[tuple[list[dict], str]] = []   # (messages, "done" | "cancelled") per read-ahead
        self.reading_ahead = threading.Event()
        self.held_at: int | None = None
        self._released = threading.Event()

    def hold(self, after: int) -> None:
        """Keep each later turn streaming after ``after`` tokens until :meth:`release` or its cancel flag.

        The last of those tokens comes a worker batch (``BATCH_SECONDS``) after the one before, so the
        worker has handed all ``after`` of them to the window when the turn stops to wait.
        """
        self.held_at = after
        self._released.clear()

    def release(self) -> None:
        """Let held turns stream on to their end."""
        self._released.set()

    def chat(self, messages, sampling=None, cancel: threading.Event | None = None,
             enable_thinking: bool = False, conversation: str = "") -> Iterator[Event]:
        """One scripted turn."""
        self.calls.append(list(messages))
        self.thinking.append(enable_thinking)
        self.samplings.append(sampling)
        self.conversations.append(conversation)
        self.snapshot_list.append(SnapshotInfo(key=f"{len(self.calls):04x}", conversation=conversation,
                                                  pos=20 * len(self.calls), nbytes=3_000_000, age_s=5.0,
                                                  hits=len(self.calls) - 1, tier="ram"))
        return self._turn(cancel or threading.Event(), enable_thinking)

    def prefill_ahead(self, messages, enable_thinking: bool = False, cancel: threading.Event | None = None,
                      conversation: str = ""):
        """Read ahead in ``ahead_pieces`` pieces of ``piece_ms``, checking the cancel flag between them."""
        cancel = cancel or threading.Event()
        self.reading_ahead.set()
        for _ in range(self.ahead_pieces):
            if cancel.is_set():
                self.aheads.append((list(messages), "cancelled"))
                return None
            time.sleep(self.piece_ms / 1e3)
        self.aheads.append((list(messages), "done"))
        return None

    def snapshots(self) -> list[SnapshotInfo]:
        """The snapshots the turns left, deepest first (as the real engine lists them)."""
        return sorted(self.snapshot_list, key=lambda s: -s.pos)

    def clear_snapshots(self, key: str | None = None) -> None:
        """Drop one snapshot or all."""
        self.snapshot_list = [s for s in self.snapshot_list if key is not None and s.key != key]

    def image_info(self, source) -> ImageInfo:
        """Half the image's (height, width); one token per 32 x 32 pixels of that, as the Qwen3.5/3.6 tower counts."""
        with Image.open(source) as image:
            height, width = image.height // 2, image.width // 2
        return ImageInfo(height, width, height * width // (32 * 32))

    def telemetry(self):
        """The scripted last GPU prefill (``gpu_telemetry``)."""
        return self.gpu_telemetry

    def close(self) -> None:
        """Count the calls (the real engine persists its snapshots here)."""
        self.closed += 1

    def _turn(self, cancel: threading.Event, thinking: bool = False) -> Iterator[Event]:
        t0 = time.perf_counter()
        for piece in range(self.prompt_pieces):
            if cancel.is_set():
                yield self._summary("cancelled", "", 0)
                return
            time.sleep(self.piece_ms / 1e3)
            self.pieces_read += 1
            yield PrefillProgress(done=10 + 20 * (piece + 1) // self.prompt_pieces, total=30,
                                  elapsed_ms=(time.perf_counter() - t0) * 1e3)
        time.sleep(self.prefill_ms / 1e3)
        yield PrefillStats(prompt_tokens=30, reused_tokens=10, prefilled_tokens=20, prefill_ms=self.prefill_ms,
                           restore_ms=1.5, device=self.info.device, ttft_ms=(time.perf_counter() - t0) * 1e3,
                           note=self.note)
        text = []
        channels = splitter("<|im_start|>assistant\n<think>\n" + ("" if thinking else "\n</think>\n\n"))
        for i, piece in enumerate(self.tokens):
            if cancel.is_set():
                yield self._summary("cancelled", "".join(text), i)
                return
            if self.fail_with is not None and i == len(self.tokens) // 2:
                raise self.fail_with
            held = i + 1 == self.held_at
            time.sleep(self.token_ms / 1e3 + (BATCH_SECONDS + 0.01 if held else 0.0))
            self.produced += 1
            text.append(piece)
            parts = tuple(channels.push(piece))
            yield TokenEvent(token_id=i, text=piece, ms=self.token_ms, index=i, channel=channels.channel, parts=parts)
            if held:
                self._wait_for_release(cancel)
        yield replace(self._summary("eos", "".join(text), len(text)), parts=tuple(channels.close()))

    def _wait_for_release(self, cancel: threading.Event) -> None:
        deadline = time.monotonic() + 300           # a test that never releases does not hang the suite
        while not cancel.is_set() and not self._released.wait(0.005) and time.monotonic() < deadline:
            pass

    def _summary(self, reason: str, text: str, n: int) -> TurnSummary:
        return TurnSummary(stop_reason=reason, message="" if reason == "eos" else "Stopped.", prompt_tokens=30,
                           reused_tokens=10, generated_tokens=n, ttft_ms=self.prefill_ms,
                           prefill_tok_s=20 / (self.prefill_ms / 1e3), decode_tok_s=1e3 / self.token_ms,
                           text=text, token_ms=(self.token_ms,) * n)


def loader_for(engine: FakeEngine):
    """An EngineLoader that returns ``engine`` whatever the request (recorded in ``engine.loads``)."""
    def load(request, progress, cancel):
        engine.loads.append(request)
        return engine
    return load


def failing_loader(message: str):
    """An EngineLoader that raises EngineError(message)."""
    def load(request, progress, cancel):
        raise EngineError(message)
    return load


class BlockingLoader:
    """An EngineLoader that waits until :meth:`release` (a big model loading), then returns ``engine``;
    it reports no stages and ignores the cancel flag (the worker must drop its late result)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.started = threading.Event()
        self._release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, request, progress, cancel):
        self.threads.append(threading.current_thread())
        self.started.set()
        self._release.wait(60)
        self.engine.loads.append(request)
        return self.engine

    def release(self) -> None:
        """Let the load finish and wait for its thread."""
        self._release.set()
        for thread in self.threads:
            thread.join(30)


class StagedLoader:
    """An EngineLoader that goes through ``Engine.load``'s stages one :meth:`step` at a time.

    Like the real load it calls ``progress`` with each stage's name as the stage starts and raises
    GenerationCancelled at the next stage once the cancel flag is set; ``stages`` are the names
    reported, ``cancelled`` is set when it stopped for the flag, ``finished`` when it has returned
    or raised.
    """

    STAGES = ("mapping tensors", "building the tokenizer", "preparing weights", "loading the vision tower",
              "placing weights on the GPU")

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.stages: list[str] = []
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self._steps = threading.Semaphore(0)

    def __call__(self, request, progress, cancel):
        try:
            for name in self.STAGES:
                if cancel.is_set():
                    self.cancelled.set()
                    raise GenerationCancelled(f"loading {request.name} was cancelled")
                self.stages.append(name)
                progress(name)
                self._steps.acquire(timeout=60)
            self.engine.loads.append(request)
            return self.engine
        finally:
            self.finished.set()

    def step(self) -> None:
        """Let the current stage end."""
        self._steps.release()
