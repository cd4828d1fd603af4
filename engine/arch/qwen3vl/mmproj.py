"""Qwen3.5/3.6 vision projector files ("mmproj" GGUF): validated loading and writing.

The layout is llama.cpp's converter (``conversion/qwen3vl.py``); keys and tensors are in
``docs/spec/qwen3vl.md`` sections 3 and 4; shapes are math shapes (reversed GGUF ``ne``). The reader
accepts any type :mod:`engine.gguf.quant` can dequantize.
Design: docs/design/vision-towers.md (tensor table, storage types).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, Keys

from engine.gguf import quant
from engine.gguf import write as gguf_write
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gguf.header import Header, MetaReader, StoredTensor, file_identity, read_header
from engine.gguf.table import check_tensors

Q = GGMLQuantizationType

PROJECTOR_TYPE = "qwen3vl_merger"
"""``clip.projector_type`` of Qwen3-VL-style towers (gguf ``VisionProjectorType.QWEN3VL``)."""

MIN_PIXELS_KEY = Keys.ClipVision.IMAGE_MIN_PIXELS
MAX_PIXELS_KEY = Keys.ClipVision.IMAGE_MAX_PIXELS
"""Optional keys (``clip.vision.image_min_pixels`` / ``image_max_pixels``): see :meth:`VisionHParams.pixel_bounds`."""

WRITE_TYPES: dict[str, GGMLQuantizationType] = {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0}
"""File types :func:`write_mmproj` accepts, by name."""


@dataclass(frozen=True)
class VisionHParams:
    """Hyper-parameters of a Qwen3.5/3.6 vision tower, named after their ``clip.vision.*`` keys.

    ``temporal_patch``, ``in_channels`` and ``rope_theta`` are not stored in the file: they are fixed
    by the architecture (HF ``Qwen3_5VisionConfig`` defaults; llama.cpp hard-codes them too).
    """

    n_embd: int                    # clip.vision.embedding_length (1152)
    n_ff: int                      # clip.vision.feed_forward_length (4304)
    n_layer: int                   # clip.vision.block_count (27)
    n_head: int                    # clip.vision.attention.head_count (16)
    patch_size: int                # clip.vision.patch_size (16), pixels
    merge: int                     # clip.vision.spatial_merge_size (2)
    out_dim: int                   # clip.vision.projection_dim = rows of mm.2.weight (LLM hidden)
    pos_side: int                  # sqrt(rows of v.position_embd.weight) (48)
    eps: float = 1e-6              # clip.vision.attention.layer_norm_epsilon
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)   # clip.vision.image_mean
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)    # clip.vision.image_std
    image_min_pixels: int | None = None    # clip.vision.image_min_pixels (absent in Qwen3.5/3.6 files)
    image_max_pixels: int | None = None    # clip.vision.image_max_pixels (absent in Qwen3.5/3.6 files)
    temporal_patch: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        """Per-head width ``n_embd / n_head`` (72 for the real tower)."""
        return self.n_embd // self.n_head

    @property
    def merged_dim(self) -> int:
        """Width of one merged token before the projector: ``merge**2 * n_embd`` (4608)."""
        return self.merge * self.merge * self.n_embd

    @property
    def factor(self) -> int:
        """Pixels per LLM token side: ``patch_size * merge`` (32)."""
        return self.patch_size * self.merge

    @property
    def patch_dim(self) -> int:
        """Length of one preprocessed patch row: ``in_channels * temporal_patch * patch_size**2`` (1536)."""
        return self.in_channels * self.temporal_patch * self.patch_size * self.patch_size

    def pixel_bounds(self, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """The area bounds (pixels) to resize an image to: the caller's, narrowed by the file's own.

        A projector may store the image areas its tower was trained for (``clip.vision.image_min_pixels``
        / ``image_max_pixels``, the keys llama.cpp's ``clip-impl.h`` defines; Qwen3.5/3.6 files have
        neither): the maximum becomes ``min(max_pixels, image_max_pixels)``, the minimum
        ``image_min_pixels`` in place of ``min_pixels``, and the minimum is then lowered to the maximum
        when above it, as :meth:`engine.vision.encoder.ImageEncoder.encode` does for a per-image bound.

        Args:
            min_pixels, max_pixels: the caller's bounds (engine options / user settings), pixels.

        Returns:
            (min_pixels, max_pixels) with ``min_pixels <= max_pixels``.
        """
        hi = int(max_pixels) if self.image_max_pixels is None else min(int(max_pixels), self.image_max_pixels)
        lo = int(min_pixels) if self.image_min_pixels is None else self.image_min_pixels
        return min(lo, hi), hi


PRESETS: dict[str, VisionHParams] = {
    "tiny": VisionHParams(n_embd=64, n_ff=128, n_layer=2, n_head=4, patch_size=16, merge=2,
                          out_dim=128, pos_side=8),
    "real": VisionHParams(n_embd=1152, n_ff=4304, n_layer=27, n_head=16, patch_size=16, merge=2,
                          out_dim=2048, pos_side=48),
}
"""Tower shapes (for :func:`engine.testing.qwen3vl.synth_mmproj`): ``tiny`` for tests, ``real`` = Qwen3.5/3.6-35B-A3B
(docs/spec/qwen3vl.md section 1)."""


@dataclass(frozen=True)
class Mmproj:
    """A loaded projector file: hyper-parameters plus every tensor dequantized to float32.

    Attributes:
        path: the file read.
        hparams: validated hyper-parameters.
        weights: GGUF tensor name -> float32 array in math shape (see the module table).
        qtypes: GGUF tensor name -> storage type name (``"F16"``, ``"Q8_0"``, ...).
        identity: hex digest of the file size and its first and last MiB; two files with equal
            identity hold the same weights (the key the embedding cache is scoped by).
        projector_type: ``clip.projector_type`` (:data:`PROJECTOR_TYPE`), the key :mod:`engine.registry`
            picks the tower by.
    """

    path: Path
    hparams: VisionHParams
    weights: dict[str, np.ndarray]
    qtypes: dict[str, str]
    identity: str
    projector_type: str = PROJECTOR_TYPE

    def f32(self, name: str) -> np.ndarray:
        """The float32 tensor ``name`` (math shape). Raises ``KeyError`` for an unknown name."""
        return self.weights[name]


def tensor_shapes(hp: VisionHParams) -> dict[str, tuple[int, ...]]:
    """Every tensor a projector file of shape ``hp`` must hold, name -> math shape (module table)."""
    d, f, p, c = hp.n_embd, hp.n_ff, hp.patch_size, hp.in_channels
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (d, c, p, p),
        "v.patch_embd.weight.1": (d, c, p, p),
        "v.patch_embd.bias": (d,),
        "v.position_embd.weight": (hp.pos_side * hp.pos_side, d),
    }
    for i in range(hp.n_layer):
        b = f"v.blk.{i}"
        shapes |= {
            f"{b}.ln1.weight": (d,), f"{b}.ln1.bias": (d,),
            f"{b}.attn_qkv.weight": (3 * d, d), f"{b}.attn_qkv.bias": (3 * d,),
            f"{b}.attn_out.weight": (d, d), f"{b}.attn_out.bias": (d,),
            f"{b}.ln2.weight": (d,), f"{b}.ln2.bias": (d,),
            f"{b}.ffn_up.weight": (f, d), f"{b}.ffn_up.bias": (f,),
            f"{b}.ffn_down.weight": (d, f), f"{b}.ffn_down.bias": (d,),
        }
    m = hp.merged_dim
    shapes |= {
        "v.post_ln.weight": (d,), "v.post_ln.bias": (d,),
        "mm.0.weight": (m, m), "mm.0.bias": (m,),
        "mm.2.weight": (hp.out_dim, m), "mm.2.bias": (hp.out_dim,),
    }
    return shapes


# ----------------------------------------------------------------------------------------------- reading

def _read_hparams(meta: MetaReader, tensors: Mapping[str, StoredTensor], source: str) -> VisionHParams:  # noqa: C901
    arch = meta.string("general.architecture")
    if arch != "clip":
        raise UnsupportedModelError(
            f"{source}: general.architecture is {arch!r}; a projector (mmproj) file has 'clip'"
            " (was a language-model GGUF given as the mmproj?)")
    if meta.has("clip.has_vision_encoder") and not meta.get("clip.has_vision_encoder"):
        raise UnsupportedModelError(f"{source}: clip.has_vision_encoder is false (an audio-only projector)")
    key = "clip.projector_type" if meta.has("clip.projector_type") else "clip.vision.projector_type"
    ptype = meta.string(key)
    if ptype != PROJECTOR_TYPE:
        raise UnsupportedModelError(
            f"{source}: {key} is {ptype!r}; only {PROJECTOR_TYPE!r} (Qwen3.5/3.6 vision) is supported")
    if meta.has("clip.vision.is_deepstack_layers"):
        flags = meta.get("clip.vision.is_deepstack_layers")
        if any(bool(x) for x in flags):
            raise UnsupportedModelError(
                f"{source}: clip.vision.is_deepstack_layers marks layers "
                f"{[i for i, x in enumerate(flags) if x]}: that is a Qwen3-VL projector; Qwen3.5/3.6 has none")
    pos = tensors.get("v.position_embd.weight")
    if pos is None:
        raise ModelFormatError(f"{source}: missing tensor 'v.position_embd.weight'")
    n_pos = pos.ne[1] if len(pos.ne) >= 2 else 0
    side = math.isqrt(n_pos)
    if side * side != n_pos or side < 2:
        raise ModelFormatError(
            f"{source}: tensor 'v.position_embd.weight' has {n_pos} rows; expected a square grid (e.g. 48*48)")
    head = "clip.vision."
    eps_key = head + "attention.layer_norm_epsilon"
    hp = VisionHParams(
        n_embd=meta.positive_int(head + "embedding_length"),
        n_ff=meta.positive_int(head + "feed_forward_length"),
        n_layer=meta.positive_int(head + "block_count"),
        n_head=meta.positive_int(head + "attention.head_count"),
        patch_size=meta.positive_int(head + "patch_size"),
        merge=meta.positive_int(head + "spatial_merge_size"),
        out_dim=meta.positive_int(head + "projection_dim"),
        pos_side=side,
        eps=meta.number(eps_key) if meta.has(eps_key) else 1e-6,
        image_mean=meta.floats(head + "image_mean", 3) if meta.has(head + "image_mean") else (0.5,) * 3,
        image_std=meta.floats(head + "image_std", 3) if meta.has(head + "image_std") else (0.5,) * 3,
        image_min_pixels=meta.positive_int(MIN_PIXELS_KEY) if meta.has(MIN_PIXELS_KEY) else None,
        image_max_pixels=meta.positive_int(MAX_PIXELS_KEY) if meta.has(MAX_PIXELS_KEY) else None,
    )
    if hp.n_embd % hp.n_head or hp.head_dim % 4:
        raise ModelFormatError(
            f"{source}: {head}embedding_length {hp.n_embd} / attention.head_count {hp.n_head} must give a "
            "head width divisible by 4 (2-D rotary embedding)")
    if not 0.0 < hp.eps < 1e-2:
        raise ModelFormatError(f"{source}: {eps_key} = {hp.eps} is not a plausible LayerNorm epsilon")
    if any(s <= 0 for s in hp.image_std):
        raise ModelFormatError(f"{source}: {head}image_std {hp.image_std} must be positive")
    for key, value in ((MIN_PIXELS_KEY, hp.image_min_pixels), (MAX_PIXELS_KEY, hp.image_max_pixels)):
        if value is not None and value < hp.factor ** 2:
            raise ModelFormatError(f"{source}: {key} = {value} is below one image token ({hp.factor}^2 pixels)")
    if None not in (hp.image_min_pixels, hp.image_max_pixels) and hp.image_min_pixels > hp.image_max_pixels:
        raise ModelFormatError(f"{source}: {MIN_PIXELS_KEY} = {hp.image_min_pixels} exceeds "
                               f"{MAX_PIXELS_KEY} = {hp.image_max_pixels}")
    return hp


def load_mmproj(path: str | os.PathLike[str]) -> Mmproj:
    """Open and validate a Qwen3.5/3.6 projector GGUF and dequantize all of its tensors to float32
    (:func:`mmproj_from_header` of its parsed header).

    Raises:
        ModelFormatError: unreadable/truncated file; see :func:`mmproj_from_header` for the rest.
    """
    source = str(path)
    if not Path(path).is_file():
        raise ModelFormatError(f"{source}: no such file")
    try:
        header = read_header(path)
    except ModelFormatError as e:
        raise ModelFormatError(f"{source}: not a readable GGUF file: {str(e).removeprefix(source + ': ')}") from e
    return mmproj_from_header(header)


def mmproj_from_header(header: Header) -> Mmproj:
    """Validate a parsed Qwen3.5/3.6 projector GGUF and dequantize all of its tensors to float32.

    Args:
        header: the ``mmproj-*.gguf`` file's header (llama.cpp layout, docs/spec/qwen3vl.md sections 3 and 4).

    Returns:
        :class:`Mmproj` with ``hparams`` and float32 ``weights`` (about 1.8 GB for the real tower).

    Raises:
        ModelFormatError: a missing or ill-typed key, a missing tensor or one of the wrong shape; the
            message names the file and the key or tensor.
        UnsupportedModelError: not a ``clip`` file, another projector type (Qwen2-VL, MiniCPM, ...),
            a Qwen3-VL deepstack projector, or a storage type :mod:`engine.gguf.quant` cannot dequantize.
    """
    source, tensors = header.source, header.tensors
    hp = _read_hparams(MetaReader(header), tensors, source)
    mm2 = tensors.get("mm.2.weight")
    if mm2 is not None and mm2.ne[-1] != hp.out_dim:
        raise ModelFormatError(
            f"{source}: clip.vision.projection_dim is {hp.out_dim} but tensor 'mm.2.weight' has "
            f"{mm2.ne[-1]} rows (the LLM width)")
    shapes = tensor_shapes(hp)
    check_tensors(source, tensors, {n: tuple(reversed(s)) for n, s in shapes.items()}, trailing_ones=True)
    weights: dict[str, np.ndarray] = {}
    qtypes: dict[str, str] = {}
    for name, shape in shapes.items():
        qtype = GGMLQuantizationType(tensors[name].type_id)
        try:
            weights[name] = quant.dequantize(header.tensor_bytes(tensors[name]), qtype, shape)
        except ValueError as e:
            raise ModelFormatError(f"{source}: tensor {name!r}: {e}") from e
        qtypes[name] = quant.type_name(qtype)
    path = Path(source)
    return Mmproj(path=path, hparams=hp, weights=weights, qtypes=qtypes, identity=file_identity(path))


# ----------------------------------------------------------------------------------------------- writing

def _storage_type(name: str, shape: tuple[int, ...], ftype: GGMLQuantizationType) -> GGMLQuantizationType:
    if len(shape) == 1:
        return Q.F32
    if name.startswith(("v.patch_embd.", "v.position_embd.")):
        return Q.F16 if ftype == Q.F16 else Q.F32
    if ftype == Q.Q8_0 and shape[-1] % quant.block_size(Q.Q8_0):
        return Q.F16
    return ftype


def _records(hp: VisionHParams, ftype: GGMLQuantizationType) -> list[bytes]:
    """The metadata records of llama.cpp's converter, in its order."""
    S, U32, F32, B, A = (GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL,
                         GGUFValueType.ARRAY)
    v, rec = "clip.vision.", gguf_write.kv_record
    pixels = [rec(key, value, U32) for key, value in ((MIN_PIXELS_KEY, hp.image_min_pixels),
                                                      (MAX_PIXELS_KEY, hp.image_max_pixels)) if value is not None]
    return [
        rec("general.architecture", "clip", S), rec("general.type", "mmproj", S),
        rec("general.file_type", {Q.F32: 0, Q.F16: 1, Q.Q8_0: 7}[ftype], U32),
        rec("clip.has_vision_encoder", True, B), rec("clip.projector_type", PROJECTOR_TYPE, S),
        rec(v + "projection_dim", hp.out_dim, U32), rec(v + "image_size", hp.pos_side * hp.patch_size, U32),
        rec(v + "patch_size", hp.patch_size, U32), rec(v + "embedding_length", hp.n_embd, U32),
        rec(v + "feed_forward_length", hp.n_ff, U32), rec(v + "block_count", hp.n_layer, U32),
        rec(v + "attention.head_count", hp.n_head, U32),
        rec(v + "image_mean", list(hp.image_mean), A, F32), rec(v + "image_std", list(hp.image_std), A, F32),
        rec("clip.use_gelu", True, B), rec(v + "spatial_merge_size", hp.merge, U32),
        rec(v + "attention.layer_norm_epsilon", hp.eps, F32),
        rec(v + "is_deepstack_layers", [False] * hp.n_layer, A, B), *pixels,
    ]


def write_mmproj(path: str | os.PathLike[str], hp: VisionHParams, weights: Mapping[str, np.ndarray],
                 ftype: str = "F16") -> Path:
    """Write a projector GGUF with llama.cpp's keys, tensor names and storage-type rules (streamed, one tensor
    in memory at a time, through :func:`engine.gguf.write.write`).

    Args:
        path: destination file (replaced only once complete).
        hp: hyper-parameters; ``hp.pos_side`` must match the rows of ``v.position_embd.weight``.
        weights: every name of :func:`tensor_shapes` ``(hp)`` -> float array of that math shape.
        ftype: ``"F32"``, ``"F16"`` or ``"Q8_0"`` (see the module doc for per-tensor types).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: unknown ``ftype``, or a missing / mis-shaped weight.
    """
    if ftype not in WRITE_TYPES:
        raise ValueError(f"ftype {ftype!r} is not one of {sorted(WRITE_TYPES)}")
    ft = WRITE_TYPES[ftype]
    types = {name: (shape, _storage_type(name, shape, ft)) for name, shape in tensor_shapes(hp).items()}
    outs = gguf_write.float_tensors(weights, types, "write_mmproj")
    gguf_write.write(path, _records(hp, ft), outs)
    return Path(path)
