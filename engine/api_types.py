"""The data types of the engine's public surface (re-exported by :mod:`engine.api`): the load-time
:class:`EngineOptions`, the loaded model's :class:`ModelInfo`, and the :class:`ChatEngine` protocol that
an in-process engine, a remote one and the tests' fakes all follow.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from .events import Event
from .vision.images import ImageInfo, ImageSource
from .turn.prefix_cache import SnapshotInfo
from .prompt.builder import Message
from .sampling import SamplingParams
from .session import DEFAULT_PARALLEL


@dataclass(frozen=True)
class EngineOptions:
    """Load-time settings.

    Attributes:
        context: context window in tokens (capped at the model's ``context_length``); the KV cache
            is preallocated for it: 2 * n_attn_layers * n_head_kv * head_dim * (2, 4 or 34/32, ``kv_type``) bytes
            per token.
        prefix_cache: keep prefix snapshots so a prompt sharing a prefix resumes instead of
            re-prefilling (see :mod:`engine.turn.prefix_cache`).
        cache_ram_bytes: RAM budget of the snapshots, bytes.
        cache_disk_dir: folder of the snapshots' disk tier; None = RAM only. The app passes
            ``platformdirs.user_cache_dir("deltadesk")/snapshots``.
        cache_disk_bytes: disk budget of the snapshots, bytes.
        snapshot_interval: also snapshot every this many prompt tokens during prefill.
        image_max_pixels: largest area an image is resized to before the vision tower, pixels
            (every 1024 pixels = one image token; lower it to bound CPU time). A projector that stores
            ``clip.vision.image_max_pixels`` (the bundled demo's: the sizes it was trained on) lowers it
            further (:meth:`engine.arch.qwen3vl.mmproj.VisionHParams.pixel_bounds`).
        device: where prefill and the vision tower run: "auto" (the GPU when one works, else the
            CPU), "cuda" or "cpu". Any GPU failure falls back to the CPU with a message
            (``ModelInfo.device_note`` for prefill, ``ModelInfo.vision_note`` for images).
        vram_budget: bytes of GPU memory the GPU may use (None = free memory minus a margin); the
            vision tower's weights and its activation buffers for the largest ``image_max_pixels`` image
            come out of it first (with None they are allocated before prefill measures free memory), the
            rest goes to prefill, whose routed experts that do not fit stream from pinned host RAM. When
            that rest is too small for GPU prefill, the tower is released and images are encoded on the
            CPU (prefill gains more from the GPU).
        gpu_min_tokens: shortest stretch of prompt sent to the GPU (each GPU pass streams every
            routed expert once; a few tokens are faster on the CPU).
        threads: CPU kernel threads (None = physical cores); process-wide.
        kv_type: the KV cache's element type, "f16" (half the bytes; each row rounded once when written,
            docs/design/kv-cache.md), "q8_0" (GGML Q8_0 blocks: 34 bytes per 32 values, rounded once when
            written) or "f32" (exact, what the conformance tests use).
        kernels: "native" runs the CPU model on the SIMD kernels when the extension is built
            (:class:`engine.arch.qwen35.cpu.NativeQwen35Model`, W4A8: activations quantized to
            8 bits inside Q4_0/Q8_0 products), else the numpy reference; "numpy" forces the reference.
        parallel: turns that run at once, each with its own state of ``context`` positions: the load refuses
            a context whose ``parallel`` states (plus ``cache_ram_bytes`` when ``prefix_cache``) do not fit the
            memory available; the session that drives the engine runs this many
            (:func:`engine.session.engine_parallel`).
        weights: where the tensor data is read from: "map" (the read-only file map: pages come from disk on first
            use and stay in the shared page cache), "ram" (the file read into this process's memory at load, in
            2 MiB pages: decode reads it faster; refused when it does not fit) or "auto" ("ram" when the file
            takes at most 0.7 of the available memory and no GPU prefill runs, else "map";
            :func:`engine.placement.weights_mode`). Design: docs/design/weights-in-ram.md.
    """

    context: int = 8192
    prefix_cache: bool = True
    cache_ram_bytes: int = 2 << 30
    cache_disk_dir: Path | None = None
    cache_disk_bytes: int = 8 << 30
    snapshot_interval: int = 512
    image_max_pixels: int = 1024 * 1024
    device: str = "auto"
    vram_budget: int | None = None
    gpu_min_tokens: int = 32
    threads: int | None = None
    kernels: str = "native"
    kv_type: str = "f16"
    parallel: int = DEFAULT_PARALLEL
    weights: str = "auto"


@dataclass(frozen=True)
class ModelInfo:
    """What the app shows about a loaded model.

    The fields from ``path`` to ``bytes_per_token`` describe a local GGUF file; an engine that runs
    elsewhere (:class:`engine.openai.remote.RemoteEngine`) leaves them at their defaults and fills ``name``
    and ``remote`` instead.

    Attributes:
        arch: "qwen35moe" or "qwen35" (a remote engine: "remote").
        context: the context window in use, tokens (a remote engine: 0 when the server does not say).
        has_vision: whether an mmproj vision tower is loaded (a remote engine: whether images are sent).
        path: the GGUF file, or None for a remote engine.
        n_layer: trunk layers; n_attn_layers of them are full attention (0 when unknown).
        n_params: parameters in the file (all tensors, MTP blocks included; 0 when unknown).
        quant_mix: quant type name -> (tensor count, bytes) ({} when unknown).
        bytes_per_token: weight bytes read per decoded token (0 when unknown).
        device: where prefill runs, "cuda" or "cpu" (decode always runs on the CPU); "remote" for a
            remote engine.
        device_note: why prefill is on the CPU when a GPU was asked for or looked for, or "".
        placement: the GPU placement plan in words (what stays in VRAM, what streams), or "".
        vram_budget: the GPU prefill's VRAM budget, bytes (0 on the CPU).
        vision_device: where images are encoded, "cuda" or "cpu" ("" without a vision tower).
        vision_note: why images are encoded on the CPU when a GPU was asked for or looked for, or "".
        template_note: one line when the file has no ``tokenizer.chat_template`` and chat falls back
            to ChatML (:data:`engine.api.CHATML_NOTE`), else "".
        name: the model's name as a server lists it ("" for a local file: its file name says it).
        remote: the base URL of the server that runs the model, or "" for an in-process engine.
        pruning: "128 of 256 experts kept (REAP)" for a file written by ``python -m engine prune``
            (its ``general.pruning`` note, :func:`engine.reap.pruned.pruning_summary`), else "".
        weights: "ram" when the file was read into this process's memory (:attr:`EngineOptions.weights`), else
            "map" (the file map; a remote engine too).
    """

    arch: str
    context: int
    has_vision: bool
    path: Path | None = None
    n_layer: int = 0
    n_attn_layers: int = 0
    n_params: int = 0
    quant_mix: dict[str, tuple[int, int]] = field(default_factory=dict)
    bytes_per_token: int = 0
    device: str = "cpu"
    device_note: str = ""
    placement: str = ""
    vram_budget: int = 0
    vision_device: str = ""
    vision_note: str = ""
    template_note: str = ""
    name: str = ""
    remote: str = ""
    pruning: str = ""
    weights: str = "map"


class ChatEngine(Protocol):
    """What a chat front end (the app's engine worker, :mod:`engine.openai`) needs of an engine:
    :class:`engine.api.Engine` (in process), :class:`engine.openai.remote.RemoteEngine` (an OpenAI-compatible server)
    and the tests' fakes."""

    @property
    def info(self) -> ModelInfo:
        """What is loaded (:class:`ModelInfo`)."""

    def chat(self, messages: Sequence[Message], sampling: SamplingParams = ..., cancel: threading.Event | None = None,
             enable_thinking: bool = False, conversation: str = "") -> Iterator[Event]:
        """Yield one turn's events (see :mod:`engine.events` for their order); set ``cancel`` to stop
        within one token."""

    def telemetry(self) -> Any:
        """The last GPU prefill's ``PrefillTelemetry``, or None (CPU prefill, a remote engine)."""

    def snapshots(self) -> list[SnapshotInfo]:
        """The prefix snapshots held, deepest first ([] when the engine keeps none it can list)."""

    def clear_snapshots(self, key: str | None = None) -> None:
        """Drop one prefix snapshot or all of them."""

    def image_info(self, source: ImageSource) -> ImageInfo | None:
        """The size an image has when it reaches the vision tower and the image tokens it takes in the
        prompt (all slices together), from one read of the image; None from a remote engine whose server
        reads images and sizes them itself.

        Raises:
            EngineError: the engine cannot tell (no vision tower, unreadable image, a remote server that
                does not say it reads images).
        """

    def close(self) -> None:
        """Release the engine (an in-process one persists its prefix snapshots first)."""
