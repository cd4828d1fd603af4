"""A fast scripted engine for the app's tests: the real event dataclasses, no model."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from engine.errors import EngineError
from engine.events import Event, PrefillStats, TokenEvent, TurnSummary


@dataclass(frozen=True)
class FakeInfo:
    """Has the fields of engine.api.ModelInfo."""

    path: Path = Path("fake-model.gguf")
    arch: str = "qwen35moe"
    n_layer: int = 4
    n_attn_layers: int = 1
    n_params: int = 12_000_000
    quant_mix: dict = field(default_factory=lambda: {"Q8_0": (20, 9_000_000), "F32": (9, 40_000)})
    bytes_per_token: int = 6_500_000
    context: int = 4096
    has_vision: bool = False


class FakeEngine:
    """Streams ``tokens`` (strings) one every ``token_ms``, honouring the cancel flag like the real one.

    ``produced`` counts the tokens it has yielded; ``calls`` keeps each turn's messages.
    """

    def __init__(self, tokens: Sequence[str] = ("Hello", ",", " world", "."), token_ms: float = 1.0,
                 has_vision: bool = False, prefill_ms: float = 2.0, fail_with: Exception | None = None) -> None:
        self.tokens = list(tokens)
        self.token_ms = token_ms
        self.prefill_ms = prefill_ms
        self.fail_with = fail_with
        self.info = FakeInfo(has_vision=has_vision)
        self.produced = 0
        self.calls: list[list[dict]] = []
        self.thinking: list[bool] = []

    def chat(self, messages, sampling=None, cancel: threading.Event | None = None,
             enable_thinking: bool = False) -> Iterator[Event]:
        """One scripted turn."""
        self.calls.append(list(messages))
        self.thinking.append(enable_thinking)
        return self._turn(cancel or threading.Event())

    def _turn(self, cancel: threading.Event) -> Iterator[Event]:
        t0 = time.perf_counter()
        time.sleep(self.prefill_ms / 1e3)
        yield PrefillStats(prompt_tokens=30, reused_tokens=10, prefilled_tokens=20, prefill_ms=self.prefill_ms,
                           restore_ms=0.0, device="cpu", ttft_ms=(time.perf_counter() - t0) * 1e3)
        text = []
        for i, piece in enumerate(self.tokens):
            if cancel.is_set():
                yield self._summary("cancelled", "".join(text), i)
                return
            if self.fail_with is not None and i == len(self.tokens) // 2:
                raise self.fail_with
            time.sleep(self.token_ms / 1e3)
            self.produced += 1
            text.append(piece)
            yield TokenEvent(token_id=i, text=piece, ms=self.token_ms, index=i)
        yield self._summary("eos", "".join(text), len(text))

    def _summary(self, reason: str, text: str, n: int) -> TurnSummary:
        return TurnSummary(stop_reason=reason, message="" if reason == "eos" else "Stopped.", prompt_tokens=30,
                           reused_tokens=10, generated_tokens=n, ttft_ms=self.prefill_ms,
                           prefill_tok_s=20 / (self.prefill_ms / 1e3), decode_tok_s=1e3 / self.token_ms,
                           text=text, token_ms=(self.token_ms,) * n)


def loader_for(engine: FakeEngine):
    """An EngineLoader that returns ``engine`` whatever the paths."""
    def load(model_path, mmproj_path):
        return engine
    return load


def failing_loader(message: str):
    """An EngineLoader that raises EngineError(message)."""
    def load(model_path, mmproj_path):
        raise EngineError(message)
    return load
