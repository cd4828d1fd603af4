"""Which architecture folder runs a file: ``general.architecture`` picks a text architecture,
``clip.projector_type`` a vision tower.

:func:`open_text` and :func:`open_projector` open a file once, pick its family once and hand the
result on (:class:`LoadedText`, :class:`LoadedVision`). Each family lives in one package under
``engine/arch/`` that defines a module-level ``ARCH``: a :class:`TextArch` or a :class:`VisionArch`.
The tables below map the GGUF key's value to that package,
and the package is imported only when a file asks for it. Adding a family is one folder plus one line
here (see ``docs/adding-an-architecture.md``). A value that is not in a table is one clear
:class:`~engine.errors.UnsupportedModelError` that lists the supported values.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import ModelFormatError, UnsupportedModelError
from .gguf.file import GGUFFile
from .gguf.header import Header, StoredTensor, read_header
from .gguf.table import check_shape, check_tensors

TEXT_ARCHES: dict[str, str] = {
    "qwen35moe": "engine.arch.qwen35",
    "qwen35": "engine.arch.qwen35",
}
"""``general.architecture`` -> package whose ``ARCH`` is a :class:`TextArch`."""

VISION_ARCHES: dict[str, str] = {
    "qwen3vl_merger": "engine.arch.qwen3vl",
    "minicpmv4_6": "engine.arch.minicpmv",
}
"""``clip.projector_type`` -> package whose ``ARCH`` is a :class:`VisionArch`."""

Fused = tuple[str, tuple[int, ...], list[tuple[str, int]]]
"""(fused tensor name, its GGUF ``ne``, [(split name, rows per slab), ...]): a tensor some converters
store fused; when the first split name is absent from a file, the fused one must be there."""


class TextModel(Protocol):
    """The CPU text model a :class:`TextArch` builds; the runtime uses only this.

    ``state`` is an :class:`engine.turn.state.SequenceState`; it advances by the positions run.
    Optional: ``forward_batch(tokens (N,), states, positions) -> (N, n_vocab)``, one token for each of N
    sequences in one pass, row i and ``states[i]`` bit-identical to ``forward(tokens[i:i+1], states[i],
    positions=positions[i])`` (:meth:`engine.arch.qwen35.model.Qwen35Model.forward_batch`); the batched
    decode loops over ``forward`` for a model without it.
    """

    hp: Any
    """The architecture's hyper-parameters (``n_vocab``, ``n_embd``, ... as :class:`engine.turn.state.SequenceState`
    needs)."""

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(n, n_embd) float32 token embeddings of (n,) int ids. Raises ValueError for an id outside the vocabulary."""

    def forward(self, tokens: np.ndarray, state: Any, embeddings: np.ndarray | None = None,
                positions: np.ndarray | None = None, all_logits: bool = False, cb: Any = None) -> np.ndarray:
        """Run n new positions (``embeddings`` replace the token rows when given; ``positions`` (3, n) rotary
        positions): (n or 1, n_vocab) float32 logits. Split-invariant: two calls equal one, bit for bit."""


class GpuPrefill(Protocol):
    """A text architecture's GPU prefill (:attr:`TextArch.cuda_prefill`)."""

    plan: Any
    """Its weight placement: ``budget`` (bytes) and ``text()`` (a summary for the log and ModelInfo)."""
    last_telemetry: Any
    """What the last prefill measured (H2D bytes, VRAM, per-layer ms), or None before the first."""

    def prefill(self, tokens: np.ndarray, state: Any, positions: np.ndarray | None = None) -> np.ndarray:
        """Run the prompt piece through every layer, updating ``state`` like :meth:`TextModel.forward`:
        (n_vocab,) float32 logits of its last position. Raises DeviceError (then the CPU takes over)."""

    def close(self) -> None:
        """Free the device memory; closing twice is harmless."""


@dataclass(frozen=True)
class ChatMarkup:
    """A text family's marker tokens, as the text its chat template writes them (the tokenizer finds the ids).

    Attributes:
        message_start: the token that opens every message (a snapshot point).
        assistant_header: the text that opens the answer, from ``message_start`` on.
        image_pad: the placeholder the template writes for an image, expanded to one per image token.
        image_start: the token that opens each image (the image's positions count from it).
    """

    message_start: str
    assistant_header: str
    image_pad: str
    image_start: str


@dataclass(frozen=True)
class TextArch:
    """What a text family provides; the engine's generic rooms ask only this.

    Attributes:
        name: the folder (``"qwen35"``).
        hparams: ``(get, n_tokens, source) -> hp``: validated hyper-parameters from GGUF metadata
            (``get(full_key)`` returns None for an absent key; ``n_tokens`` = len(tokenizer.ggml.tokens)
            or None). Raises ModelFormatError naming the key.
        tensor_shapes: ``hp -> {name: ne}``: every tensor the forward reads, GGUF ``ne`` (fastest first).
        optional_tensors: names of ``tensor_shapes`` a file may omit.
        fused_tensors: ``hp -> [Fused, ...]``: fused storage forms the reader splits into the names above.
        reference_model: ``(hp, gguf) -> model``: the numpy reference forward (``gguf`` a
            :class:`~engine.gguf.file.GGUFFile` whose fused tensors are split, see :func:`load_text`).
        native_model: ``(hp, gguf, repack=True) -> model``: the same forward on the native CPU kernels (``repack``:
            it may rewrite weights read into memory into a kernel's layout; False when GPU prefill may read them).
        cuda_prefill: ``(hp, gguf, budget_bytes) -> prefill``: GPU prefill (imports pycuda), raising
            :class:`~engine.errors.DeviceError` when no GPU works.
        prefill_plan: ``(hp, gguf, budget_bytes) -> placement`` with ``text()`` and ``fixed_bytes``: what
            ``cuda_prefill`` would place under the budget, without a device (None: no plan to show).
        channels: ``prompt_tail -> splitter``: the family's split of an answer into reasoning, content and
            tool-call text (:class:`engine.channels.ChannelSplitter`), given the text of the prompt's last
            tokens (None: all of it is content).
        markup: the chat and image marker tokens (None: ChatML's, without image markers).
        decode_positions: ``(prompt positions or None, prompt length, k) -> positions``: the rotary
            positions ``forward`` takes for the k-th token decoded after the prompt (None: plain positions).
    """

    name: str
    hparams: Callable[[Callable[[str], Any], int | None, str], Any]
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    optional_tensors: frozenset[str]
    fused_tensors: Callable[[Any], list[Fused]]
    reference_model: Callable[[Any, Any], TextModel]
    native_model: Callable[..., TextModel]
    cuda_prefill: Callable[[Any, Any, int | None], GpuPrefill]
    prefill_plan: Callable[[Any, Any, int], Any] | None = None
    channels: Callable[[str], Any] | None = None
    markup: ChatMarkup | None = None
    decode_positions: Callable[[np.ndarray | None, int, int], np.ndarray] | None = None


class VisionTower(Protocol):
    """The CPU tower a :class:`VisionArch` builds; :class:`engine.vision.encoder.ImageEncoder` uses only this."""

    identity: str
    """The projector file's identity (scopes the embedding cache)."""

    def pixel_bounds(self, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """The caller's resize area bounds (pixels) narrowed by the projector's own; min <= max."""

    def prepare(self, source: Any, min_pixels: int, max_pixels: int, max_input_pixels: int) -> Any:
        """Decode and preprocess one image: an :class:`engine.vision.images.PreparedImage` (``pixel_values``,
        patch ``grid``, ``size``, ``original_size``, ``digest``). Raises ImageError."""

    def token_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of image tokens the patch ``grid`` becomes (rows * cols = embeddings rows)."""

    def encode(self, pixel_values: np.ndarray, grid: tuple[int, int], cb: Any = None,
               cancel: threading.Event | None = None) -> np.ndarray:
        """(n_tokens, out_dim) float32 embeddings of one prepared image."""


@dataclass(frozen=True)
class VisionArch:
    """What a vision family provides.

    Attributes:
        name: the folder (``"qwen3vl"``).
        load: ``header -> projector``: validated weights of a parsed :class:`~engine.gguf.header.Header` with
            ``projector_type``, ``path``, ``identity`` and
            ``hparams.out_dim`` (the LLM width). Raises ModelFormatError / UnsupportedModelError.
        cpu_tower: ``projector -> VisionTower``.
        cuda_tower: ``(projector, max_pixels, budget_bytes) -> tower`` with ``encode(pixel_values, grid)``,
            ``close()``, ``vram_bytes`` and ``weight_bytes``; raises DeviceError when no GPU works.
        positions: ``(token_ids, token_grids, image_pad_id, vision_start_id, start) -> (3, n) int64``:
            the rotary positions of a prompt holding these images.
        layout: ``(cpu tower, encoded image, index in the prompt) -> [str | int, ...]``: what the image's
            placeholder becomes, text to tokenize and runs of that many pads (each run takes the next rows
            of the embeddings); None = the placeholder becomes ``n_tokens`` pads (one run).
    """

    name: str
    load: Callable[[Any], Any]
    cpu_tower: Callable[[Any], VisionTower]
    cuda_tower: Callable[[Any, int, int | None], Any]
    positions: Callable[..., np.ndarray]
    layout: Callable[[Any, Any, int], list] | None = None


def _pick(table: Mapping[str, str], value: Any, what: str, source: str) -> Any:
    if not isinstance(value, str) or value not in table:
        raise UnsupportedModelError(
            f"{source}: {what} is {value!r}, which this engine does not run (supported: {', '.join(sorted(table))})")
    return importlib.import_module(table[value]).ARCH


def text_arch(architecture: Any, source: str) -> TextArch:
    """The :class:`TextArch` for a ``general.architecture`` value.

    Raises:
        UnsupportedModelError: naming ``source``, the value and every supported one.
    """
    return _pick(TEXT_ARCHES, architecture, "general.architecture", source)


def vision_arch(projector_type: Any, source: str, key: str = "clip.projector_type") -> VisionArch:
    """The :class:`VisionArch` for a ``clip.projector_type`` value (``key`` names the key it came from).

    Raises:
        UnsupportedModelError: naming ``source``, the key, the value and every supported one.
    """
    return _pick(VISION_ARCHES, projector_type, key, source)


@dataclass(frozen=True)
class LoadedText:
    """A text model opened once: its mapped file, the family that runs it and its hyper-parameters.

    Attributes:
        file: the :class:`~engine.gguf.file.GGUFFile`, fused tensors split (every name of the table reads).
        arch: the :class:`TextArch` of its ``general.architecture``.
        hparams: ``arch.hparams`` of its metadata.
    """

    file: GGUFFile
    arch: TextArch
    hparams: Any

    @property
    def source(self) -> str:
        """The file name used in error messages."""
        return self.file.source

    def bytes_per_token(self) -> int:
        """Weight bytes read to decode one token, in bytes.

        Every tensor of ``arch.tensor_shapes`` in full, except: routed expert tensors (3-D) count
        ``n_expert_used`` experts, and ``token_embd`` counts one row when ``output.weight`` exists
        (it is then only a lookup; without it, it is also the LM head and counts in full).
        """
        f, total = self.file, 0
        for name in self.arch.tensor_shapes(self.hparams):
            if not f.has(name):
                continue
            info = f.info(name)
            rows = info.ne[1] if len(info.ne) > 1 else 1
            if len(info.ne) == 3:
                total += self.hparams.n_expert_used * (info.nbytes // info.ne[2])
            elif name == "token_embd.weight" and f.has("output.weight"):
                total += info.nbytes // rows
            else:
                total += info.nbytes
        return total


@dataclass(frozen=True)
class LoadedVision:
    """A projector opened once: the family that runs it and its validated weights.

    Attributes:
        arch: the :class:`VisionArch` of its projector type.
        projector: what ``arch.load`` returned (``path``, ``identity``, ``projector_type``, ``hparams.out_dim``).
    """

    arch: VisionArch
    projector: Any


def open_text(path: str | os.PathLike[str], weights: str = "map") -> LoadedText:
    """Open, map and validate a text model GGUF (:func:`load_text`); ``weights`` "ram" reads its tensor data into
    memory (:meth:`GGUFFile.open`).

    Raises:
        ModelFormatError: malformed, truncated or inconsistent file; the message names the file and key/tensor.
        UnsupportedModelError: another architecture, or a needed tensor in an unsupported type.
        MemoryFitError: "ram" and the file does not fit the available memory.
    """
    return load_text(GGUFFile.open(path, weights))


def load_text(gguf: GGUFFile) -> LoadedText:
    """Pick the family of an opened file by ``general.architecture``, read its hyper-parameters and
    check its tensor table (exact ``ne``, supported type); fused storage forms are split into the
    table's names. Works on :meth:`GGUFFile.from_header` too.

    Raises: see :func:`open_text`.
    """
    source, meta = gguf.source, gguf.header.meta
    name = meta.get("general.architecture")
    if not isinstance(name, str):
        raise ModelFormatError(f"{source}: key general.architecture is missing or not a string")
    arch = text_arch(name, source)
    tokens = meta.get("tokenizer.ggml.tokens")
    hp = arch.hparams(gguf.meta, len(tokens) if isinstance(tokens, list) else None, source)
    context = f" for {name} with {hp.n_layer} layers"
    stored = gguf.header.tensors
    split: set[str] = set()
    for fused, ne, parts in arch.fused_tensors(hp):
        if parts[0][0] in stored:
            continue
        if fused not in stored:
            raise ModelFormatError(f"{source}: missing tensor {parts[0][0]!r} (or fused {fused!r} with ne={ne})")
        check_shape(source, stored[fused], ne, context, _expert_count_error(source, hp))
        gguf.split(fused, parts)
        split |= {part for part, _ in parts}
    table = {n: ne for n, ne in arch.tensor_shapes(hp).items() if n not in split}
    check_tensors(source, stored, table, arch.optional_tensors, context, _expert_count_error(source, hp))
    return LoadedText(gguf, arch, hp)


def _expert_count_error(source: str, hp: Any) -> Callable[[StoredTensor, tuple[int, ...]], Exception | None]:
    """A routed-expert tensor whose only difference is its expert count: per-layer counts, unsupported."""
    def explain(t: StoredTensor, ne: tuple[int, ...]) -> Exception | None:
        moe = "_exps." in t.name or t.name.endswith(".ffn_gate_inp.weight")
        if moe and len(t.ne) == len(ne) and t.ne[:-1] == ne[:-1]:
            return UnsupportedModelError(
                f"{source}: tensor {t.name} holds {t.ne[-1]} experts but {hp.arch}.expert_count = {ne[-1]}; "
                "per-layer expert counts are not supported (every layer needs the same count)")
        return None
    return explain


def open_projector(path: str | os.PathLike[str]) -> LoadedVision:
    """Open a projector (mmproj) GGUF: its header is parsed once, its family picked once by
    ``clip.projector_type``, and that family's loader validates it.

    Raises:
        ModelFormatError: unreadable or malformed file, ``general.architecture`` or the projector type
            missing or not a string (names the file and the key or tensor).
        UnsupportedModelError: not a ``clip`` file, a projector without a vision encoder
            (``clip.has_vision_encoder`` false: audio only), or a projector type no architecture folder
            runs (the message lists the supported ones).
    """
    header = read_header(path)
    source = header.source
    kind = _string_key(header, "general.architecture")
    if kind != "clip":
        raise UnsupportedModelError(f"{source}: general.architecture is {kind!r}; a projector (mmproj) file has "
                                    "'clip' (was a language-model GGUF given as the mmproj?)")
    if "clip.has_vision_encoder" in header.meta and not header.meta["clip.has_vision_encoder"]:
        raise UnsupportedModelError(f"{source}: clip.has_vision_encoder is false (an audio-only projector)")
    key = "clip.projector_type" if "clip.projector_type" in header.meta else "clip.vision.projector_type"
    arch = vision_arch(_string_key(header, key), source, key)
    return LoadedVision(arch, arch.load(header))


def _string_key(header: Header, key: str) -> str:
    """``header.meta[key]`` when it is a string. Raises ModelFormatError naming the file and ``key`` otherwise."""
    if key not in header.meta:
        raise ModelFormatError(f"{header.source}: missing metadata key {key!r}")
    value = header.meta[key]
    if not isinstance(value, str):
        raise ModelFormatError(f"{header.source}: key {key!r} should be a string, found {value!r}")
    return value
