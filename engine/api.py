"""The engine's public surface: load a model once, then chat with it turn by turn.

Usage::

    engine = Engine.load("model.gguf")
    for event in engine.chat([{"role": "user", "content": "Hello"}], SamplingParams.greedy(64)):
        ...  # PrefillStats, then TokenEvent per token, then TurnSummary

Everything here is synchronous and Qt-free; the app runs it on a worker thread and cancels it
through a ``threading.Event``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import platformdirs

from .errors import EngineError, TemplateError, UnsupportedModelError
from .events import Event
from .gguf_file import GGUFFile
from .models.qwen35 import Qwen35Model
from .prefix_cache import PrefixCache
from .runtime import Turn, run_turn
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Engine", "EngineOptions", "ModelInfo", "SamplingParams", "default_model_path"]

Message = Mapping[str, Any]


@dataclass(frozen=True)
class EngineOptions:
    """Load-time settings.

    Attributes:
        context: context window in tokens (capped at the model's ``context_length``); the KV cache
            is preallocated for it: 2 * n_attn_layers * n_head_kv * head_dim * 4 bytes per token.
        prefix_cache: keep prefix snapshots so a prompt sharing a prefix resumes instead of
            re-prefilling (see :mod:`engine.prefix_cache`).
        cache_ram_bytes: RAM budget of the snapshots, bytes.
        cache_disk_dir: folder of the snapshots' disk tier; None = RAM only. The app passes
            ``platformdirs.user_cache_dir("deltadesk")/snapshots``.
        cache_disk_bytes: disk budget of the snapshots, bytes.
        snapshot_interval: also snapshot every this many prompt tokens during prefill.
    """

    context: int = 8192
    prefix_cache: bool = True
    cache_ram_bytes: int = 2 << 30
    cache_disk_dir: Path | None = None
    cache_disk_bytes: int = 8 << 30
    snapshot_interval: int = 512


@dataclass(frozen=True)
class ModelInfo:
    """What the app shows about a loaded model.

    Attributes:
        path: the GGUF file.
        arch: "qwen35moe" or "qwen35".
        n_layer: trunk layers; n_attn_layers of them are full attention.
        n_params: parameters in the file (all tensors, MTP blocks included).
        quant_mix: quant type name -> (tensor count, bytes).
        bytes_per_token: weight bytes read per decoded token.
        context: the context window in use, tokens.
        has_vision: whether an mmproj vision tower is loaded.
    """

    path: Path
    arch: str
    n_layer: int
    n_attn_layers: int
    n_params: int
    quant_mix: dict[str, tuple[int, int]]
    bytes_per_token: int
    context: int
    has_vision: bool


class Engine:
    """A loaded model: GGUF file, tokenizer, chat template and text model.

    Build it with :meth:`load`. One engine serves one conversation at a time; calls to
    :meth:`chat` must not overlap.
    """

    def __init__(self, gguf: GGUFFile, tokenizer: Tokenizer, model: Qwen35Model,
                 options: EngineOptions) -> None:
        self.gguf = gguf
        self.tokenizer = tokenizer
        self.model = model
        self.options = options
        hp = gguf.hparams
        self.context = min(options.context, hp.context_length)
        self.cache = PrefixCache(hp, gguf.identity, options.cache_ram_bytes, options.cache_disk_dir,
                                 options.cache_disk_bytes) if options.prefix_cache else None
        im_start = tokenizer.token_id("<|im_start|>")
        self._im_start = -1 if im_start is None else im_start
        self._header = tokenizer.encode("<|im_start|>assistant\n", special=True)

    @classmethod
    def load(cls, model_path: str | Path, mmproj_path: str | Path | None = None,
             options: EngineOptions = EngineOptions()) -> "Engine":
        """Open a Qwen3.5/3.6 GGUF text model (memory-mapped) and its tokenizer.

        Raises:
            ModelFormatError: the file is malformed (names the file and the key or tensor).
            UnsupportedModelError: wrong architecture, unsupported quant type, or an mmproj was
                given (the vision tower is not implemented yet).
            TokenizerError: tokenizer metadata or chat template missing or unusable.
        """
        if mmproj_path is not None:
            raise UnsupportedModelError(
                f"{mmproj_path}: vision towers (mmproj files) are not supported yet; load the text model alone")
        gguf = GGUFFile.open(model_path)
        tokenizer = Tokenizer.from_gguf(gguf.meta, str(gguf.path))
        model = Qwen35Model(gguf.hparams, gguf)
        return cls(gguf, tokenizer, model, options)

    @property
    def info(self) -> ModelInfo:
        """Summary of the loaded model (see :class:`ModelInfo`)."""
        hp = self.gguf.hparams
        n_attn = sum(not hp.is_recurrent(i) for i in range(hp.n_layer))
        return ModelInfo(path=self.gguf.path, arch=hp.arch, n_layer=hp.n_layer, n_attn_layers=n_attn,
                         n_params=sum(math.prod(self.gguf.info(n).ne) for n in self.gguf.tensor_names), quant_mix=self.gguf.quant_mix(),
                         bytes_per_token=self.gguf.bytes_per_token(), context=self.context,
                         has_vision=False)

    def render(self, messages: Sequence[Message], enable_thinking: bool = False) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize the prompt.

        Returns:
            Prompt token ids, ending with the assistant generation header.

        Raises:
            TemplateError: the template failed or the file carries none.
            UnsupportedModelError: a message has an image part but no vision tower is loaded.
        """
        for m in messages:
            content = m.get("content")
            if isinstance(content, list) and any(p.get("type") == "image" for p in content):
                raise UnsupportedModelError(
                    f"{self.gguf.path.name}: this model has no vision tower loaded, so it cannot read images")
        template = self.tokenizer.chat_template
        if template is None:
            raise TemplateError(f"{self.gguf.path}: key tokenizer.chat_template is missing")
        text = template.render(list(messages), add_generation_prompt=True, enable_thinking=enable_thinking)
        return self.tokenizer.encode(text, special=True)

    def checkpoints(self, prompt: Sequence[int]) -> list[int]:
        """Prompt positions worth a snapshot: the start of every message (so the system prompt and
        every earlier message are a reusable prefix) and the end of the last assistant header
        ``<|im_start|>assistant\\n``, before any ``<think>`` the template appends: the next turn
        re-renders this answer without its thinking, so that is where the two prompts part.
        """
        starts = [i for i, t in enumerate(prompt) if t == self._im_start and i > 0]
        points = list(starts)
        h = len(self._header)
        if starts and list(prompt[starts[-1]:starts[-1] + h]) == self._header:
            points.append(starts[-1] + h)
        return points

    def chat(self, messages: Sequence[Message], sampling: SamplingParams = SamplingParams(),
             cancel: threading.Event | None = None, enable_thinking: bool = False,
             conversation: str = "") -> Iterator[Event]:
        """Answer the conversation ``messages`` (the last one is usually the user's).

        The prompt resumes from the deepest prefix snapshot it shares (see
        :mod:`engine.prefix_cache`); ``PrefillStats.reused_tokens`` says how many tokens that saved.

        Args:
            messages: chat messages (see docs/interfaces.md for the format).
            sampling: sampling settings.
            cancel: set from any thread to stop within one token.
            enable_thinking: let the model think (``<think>`` block) before answering.
            conversation: an id recorded with the snapshots, for the app's snapshot list.

        Yields:
            :class:`~engine.events.PrefillStats`, then a :class:`~engine.events.TokenEvent` per
            generated token, then one :class:`~engine.events.TurnSummary`.

        Raises:
            TemplateError, UnsupportedModelError: see :meth:`render` (before any event).
        """
        prompt = self.render(messages, enable_thinking)
        return self.generate(prompt, sampling, cancel, self.checkpoints(prompt), conversation)

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                 cancel: threading.Event | None = None, checkpoints: Sequence[int] = (),
                 conversation: str = "") -> Iterator[Event]:
        """Continue raw token ids (no chat template); same events as :meth:`chat`.

        Args:
            checkpoints: extra prompt positions to snapshot at.
        """
        turn = Turn(model=self.model, tokenizer=self.tokenizer, prompt=list(prompt_ids),
                    context=self.context, sampling=sampling, cancel=cancel or threading.Event(),
                    cache=self.cache, checkpoints=checkpoints,
                    snapshot_interval=self.options.snapshot_interval, conversation=conversation)
        return run_turn(turn)


def default_model_path() -> Path:
    """The model the app and ``python -m engine generate`` use when none is given.

    Until the trained demo model ships under ``assets/`` (issue 8), this is the ``tiny`` synthetic
    model (random weights, real vocabulary and template), written once to the user cache dir.

    Raises:
        EngineError: the cache dir is not writable.
    """
    bundled = Path(__file__).resolve().parent.parent / "assets" / "models" / "deltadesk-demo.gguf"
    if bundled.is_file():
        return bundled
    from .synth import synth
    path = Path(platformdirs.user_cache_dir("deltadesk")) / "models" / "synth-tiny-q8_0.gguf"
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            synth(tmp, "tiny", quant="q8_0", seed=0)
            tmp.replace(path)
        except OSError as exc:
            raise EngineError(f"cannot write the default model to {path}: {exc}") from exc
    return path
