"""The user's settings: model files, load and device options, sampling, system prompt, thinking.

They live in the ``settings.ini`` of platformdirs' user config dir (a :class:`QSettings` in INI
format, which also keeps the window's geometry). A missing or unreadable value falls back to its
default, so a hand-edited file never stops the app from starting. With no model configured the
app loads the engine's default model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from PySide6.QtCore import QSettings

from engine.errors import EngineError
from engine.sampling import SamplingParams

GROUP = "preferences"
MIN_CONTEXT = 512
MIN_IMAGE_PIXELS = 32 * 32
DEVICES = ("auto", "cuda", "cpu")
WEIGHTS = ("auto", "ram", "map")
LOAD_FIELDS = ("model_path", "mmproj_path", "context", "image_max_pixels", "threads", "device", "vram_budget_gib",
               "remote_url", "remote_model", "weights")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty", "seed",
                   "max_tokens")
_DEFAULT_SAMPLING = SamplingParams()


@dataclass(frozen=True)
class Settings:
    """Everything the settings dialog edits.

    Sampling defaults are the engine's, except ``max_tokens``: 2048 leaves a thinking model room to
    finish its answer. ``context`` and ``image_max_pixels`` default to the engine's load options.

    Attributes:
        model_path: GGUF text model; "" = the engine's default model.
        mmproj_path: GGUF vision tower (mmproj); "" = none (the default model brings its own).
        context: context window, tokens.
        image_max_pixels: largest image area sent to the vision tower, pixels (1024 pixels = 1 token).
        threads: CPU threads of the engine's kernels; 0 = the physical cores.
        device: where prefill runs: "auto" (the GPU when one works), "cuda" (the GPU) or "cpu".
        vram_budget_gib: GPU memory prefill may use, GiB; 0 = automatic (free memory less a margin).
        weights: where the model's weights are read from: "auto", "ram" (read into memory at load) or "map" (from
            the file as needed); see :attr:`engine.api.EngineOptions.weights`.
        temperature, top_k, top_p, min_p, presence_penalty, repetition_penalty, max_tokens: sampling
            (see :class:`engine.sampling.SamplingParams`).
        seed: fixed random seed, or -1 for fresh randomness each answer.
        system_prompt: sent first in every conversation ("" = none).
        thinking: let the model think before answering (the composer's Think box).
        serve_local: run the OpenAI-compatible server on 127.0.0.1:``serve_port`` on the loaded model.
        remote_url: base URL of an OpenAI-compatible server to chat with instead of a model loaded here
            ("" = none); ``remote_model`` is the model it serves. Its API key is kept in the system
            keyring (:class:`app.connections.KeyStore`), never here.
    """

    model_path: str = ""
    mmproj_path: str = ""
    context: int = 8192
    image_max_pixels: int = 1024 * 1024
    threads: int = 0
    device: str = "auto"
    vram_budget_gib: float = 0.0
    temperature: float = _DEFAULT_SAMPLING.temperature
    top_k: int = _DEFAULT_SAMPLING.top_k
    top_p: float = _DEFAULT_SAMPLING.top_p
    min_p: float = _DEFAULT_SAMPLING.min_p
    presence_penalty: float = _DEFAULT_SAMPLING.presence_penalty
    repetition_penalty: float = _DEFAULT_SAMPLING.repetition_penalty
    seed: int = -1
    max_tokens: int = 2048
    system_prompt: str = ""
    thinking: bool = False
    serve_local: bool = False
    serve_port: int = 8080
    remote_url: str = ""
    remote_model: str = ""
    weights: str = "auto"

    def sampling(self) -> SamplingParams:
        """These settings as the engine's sampling parameters."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                              seed=None if self.seed < 0 else self.seed, max_tokens=self.max_tokens)

    def load_key(self) -> tuple[Any, ...]:
        """The settings a model load depends on: when they change, the model is loaded again."""
        return tuple(getattr(self, name) for name in LOAD_FIELDS)

    def with_load_of(self, other: "Settings") -> "Settings":
        """These settings with ``other``'s model files and load options (:data:`LOAD_FIELDS`)."""
        return replace(self, **{name: getattr(other, name) for name in LOAD_FIELDS})

    @property
    def vram_budget(self) -> int | None:
        """The VRAM budget in bytes, or None for automatic."""
        return round(self.vram_budget_gib * (1 << 30)) if self.vram_budget_gib > 0 else None

    @classmethod
    def read(cls, store: QSettings) -> "Settings":
        """The settings saved in ``store``; a missing, mistyped or invalid value takes its default."""
        values: dict[str, Any] = {}
        default = cls()
        for f in fields(cls):
            raw = store.value(f"{GROUP}/{f.name}")
            if raw is None:
                continue
            kind = type(getattr(default, f.name))
            try:
                values[f.name] = (str(raw).lower() in ("true", "1")) if kind is bool else kind(raw)
            except (TypeError, ValueError):
                continue
        settings = cls(**values)
        if settings.context < MIN_CONTEXT:
            settings = replace(settings, context=default.context)
        if settings.image_max_pixels < MIN_IMAGE_PIXELS:
            settings = replace(settings, image_max_pixels=default.image_max_pixels)
        if settings.threads < 0:
            settings = replace(settings, threads=default.threads)
        if settings.device not in DEVICES:
            settings = replace(settings, device=default.device)
        if settings.weights not in WEIGHTS:
            settings = replace(settings, weights=default.weights)
        if not settings.vram_budget_gib >= 0:
            settings = replace(settings, vram_budget_gib=default.vram_budget_gib)
        if not 1 <= settings.serve_port <= 65535:
            settings = replace(settings, serve_port=default.serve_port)
        try:
            settings.sampling()
        except EngineError:
            return replace(settings, **{name: getattr(default, name) for name in SAMPLING_FIELDS})
        return settings

    def write(self, store: QSettings) -> None:
        """Save to ``store`` (and flush it to disk)."""
        for name, value in asdict(self).items():
            store.setValue(f"{GROUP}/{name}", value)
        store.sync()
