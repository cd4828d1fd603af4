"""MiniCPM-V 4.6 projector files (``mmproj`` GGUF): validated loading and writing.

The layout is llama.cpp's (converter ``MiniCPMV4_6VisionModel``, loader ``PROJECTOR_TYPE_MINICPMV4_6``);
shapes are math shapes (reversed GGUF ``ne``). ``wa_layer_indexes`` is required here (llama.cpp would
take layer 0). The reader accepts any type :mod:`engine.gguf.quant` can dequantize.
Design: docs/design/vision-towers.md (tensor table, keys, storage types).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from engine.gguf import quant, write as gguf_write
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gguf.header import Header, MetaReader, file_identity, read_header
from engine.gguf.table import check_tensors

Q = GGMLQuantizationType

PROJECTOR_TYPE = "minicpmv4_6"
"""``clip.projector_type`` of MiniCPM-V 4.6 (llama.cpp ``PROJECTOR_TYPE_MINICPMV4_6``)."""

SCALE_FACTOR_KEY = "clip.vision.projector.scale_factor"
INSERT_LAYER_KEY = "clip.vision.wa_layer_indexes"

WRITE_TYPES: dict[str, GGMLQuantizationType] = {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0}
"""File types :func:`write_mmproj` accepts, by name."""

_FILE_TYPE_IDS = {Q.F32: 0, Q.F16: 1, Q.Q8_0: 7}  # general.file_type (llama_ftype ALL_F32, MOSTLY_F16, MOSTLY_Q8_0)


@dataclass(frozen=True)
class MiniCPMVHParams:
    """Hyper-parameters of a MiniCPM-V 4.6 vision tower, named after their ``clip.vision.*`` keys.

    ``max_slices`` is not stored in the file: it is the HF image processor's ``max_slice_nums`` default.
    """

    n_embd: int                    # embedding_length (1152)
    n_ff: int                      # feed_forward_length (4304)
    n_layer: int                   # block_count (27)
    n_head: int                    # attention.head_count (16)
    patch_size: int                # patch_size (14), pixels
    out_dim: int                   # projection_dim = rows of mm.down.weight (LLM hidden, 1024)
    pos_side: int                  # sqrt(rows of v.position_embd.weight) (70)
    insert_layer: int              # wa_layer_indexes[0] (6): the window-attention merger runs after it
    scale_factor: int = 4          # projector.scale_factor: 4 = "16x" mode, 2 = "4x" mode
    image_size: int = 448          # image_size: the slice size (HF scale_resolution), pixels
    eps: float = 1e-6              # attention.layer_norm_epsilon
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_slices: int = 9
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        """Per-head width ``n_embd / n_head`` (72 for the real tower)."""
        return self.n_embd // self.n_head

    @property
    def mode(self) -> str:
        """The file's downsampling mode: ``"16x"`` (scale factor 4) or ``"4x"`` (scale factor 2)."""
        return "16x" if self.scale_factor == 4 else "4x"

    @property
    def patch_dim(self) -> int:
        """Length of one patch row: ``in_channels * patch_size**2`` (588), ordered (c, ky, kx)."""
        return self.in_channels * self.patch_size * self.patch_size


PRESETS: dict[str, MiniCPMVHParams] = {
    "tiny": MiniCPMVHParams(n_embd=64, n_ff=96, n_layer=4, n_head=4, patch_size=14, out_dim=64, pos_side=70,
                            insert_layer=1),
    "real": MiniCPMVHParams(n_embd=1152, n_ff=4304, n_layer=27, n_head=16, patch_size=14, out_dim=1024,
                            pos_side=70, insert_layer=6),
}
"""Tower shapes (for :func:`engine.testing.minicpmv.synth_mmproj`): ``tiny`` for tests
(4 layers of 64, merger after layer 1, the real
70x70 position grid), ``real`` = MiniCPM-V 4.6 (HF ``openbmb/MiniCPM-V-4.6`` ``config.json``)."""


class StoredWeights(Mapping[str, np.ndarray]):
    """A projector's tensors by GGUF name: the 1-D ones and the position table dequantized to float32 at load,
    the other matrices (the projections and the patch kernel) left in the file's read-only memory map.

    ``w[name]`` is a float32 array in math shape; for a matrix it is dequantized on each access (a new
    array: callers that use it more than once keep it). :meth:`stored` gives a matrix as stored, without a
    copy, for consumers that convert it themselves (the native GEMM's packing). The map stays open while this
    object (or a view from :meth:`stored`) is referenced.
    """

    def __init__(self, header: Header, shapes: dict[str, tuple[int, ...]], qtypes: dict[str, GGMLQuantizationType]):
        self._shapes, self._qtypes = shapes, qtypes
        self._raw = {n: header.tensor_bytes(header.tensors[n]) for n in shapes if _is_matrix(n, shapes[n])}
        self._loaded = {n: quant.dequantize(header.tensor_bytes(header.tensors[n]), qtypes[n], shapes[n])
                        for n in shapes if n not in self._raw}

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._raw:
            return quant.dequantize(self._raw[name], self._qtypes[name], self._shapes[name])
        return self._loaded[name]

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    @property
    def loaded(self) -> dict[str, np.ndarray]:
        """The float32 tensors dequantized at load (the 1-D ones and the position table), by name."""
        return self._loaded

    def stored(self, name: str) -> np.ndarray | None:
        """Matrix ``name`` in math shape as stored: a float32, float16 or :data:`engine.kernels.sgemm.BF16`
        view of the map for an F32, F16 or BF16 tensor; None for a block-quantized one or a tensor loaded as
        float32 at load. Raises KeyError for an unknown name."""
        qtype = self._qtypes[name]
        if name not in self._raw or qtype not in _STORED_DTYPES:
            return None
        return self._raw[name].view(_STORED_DTYPES[qtype]).reshape(self._shapes[name])


_STORED_DTYPES = {Q.F32: np.dtype("<f4"), Q.F16: np.dtype("<f2"), Q.BF16: np.dtype([("x", "<u2")])}
"""Storage types whose tensors :meth:`StoredWeights.stored` views as they are -> the numpy dtype."""


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """True for the tensors :class:`StoredWeights` keeps in the map (every 2-D+ one but the position table)."""
    return len(shape) >= 2 and name != "v.position_embd.weight"


@dataclass(frozen=True)
class MiniCPMVMmproj:
    """A loaded projector file: hyper-parameters plus every tensor as float32 (:class:`StoredWeights`).

    Attributes:
        path: the file read. hparams: validated hyper-parameters.
        weights: GGUF tensor name -> float32 array in math shape (module table); the matrices stay in the
            file's memory map until read (:class:`StoredWeights`).
        qtypes: GGUF tensor name -> storage type name (``"F16"``, ``"Q8_0"``, ...).
        identity: hex digest of the file size and its first and last MiB (:func:`engine.gguf.header.file_identity`),
            the key embedding caches are scoped by.
        projector_type: ``clip.projector_type`` (:data:`PROJECTOR_TYPE`), the key :mod:`engine.registry` reads.
    """

    path: Path
    hparams: MiniCPMVHParams
    weights: StoredWeights
    qtypes: dict[str, str]
    identity: str
    projector_type: str = PROJECTOR_TYPE


def tensor_shapes(hp: MiniCPMVHParams) -> dict[str, tuple[int, ...]]:
    """Every tensor a projector file of shape ``hp`` holds, name -> math shape (module table)."""
    d, f, p, c = hp.n_embd, hp.n_ff, hp.patch_size, hp.in_channels
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (d, c, p, p), "v.patch_embd.bias": (d,),
        "v.position_embd.weight": (hp.pos_side * hp.pos_side, d),
    }

    def attn(prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.attn_{x}.{y}": (d, d) if y == "weight" else (d,)
                for x in ("q", "k", "v", "out") for y in ("weight", "bias")}

    for i in range(hp.n_layer):
        b = f"v.blk.{i}"
        shapes |= {f"{b}.ln1.weight": (d,), f"{b}.ln1.bias": (d,)} | attn(b) | {
            f"{b}.ln2.weight": (d,), f"{b}.ln2.bias": (d,),
            f"{b}.ffn_up.weight": (f, d), f"{b}.ffn_up.bias": (f,),
            f"{b}.ffn_down.weight": (d, f), f"{b}.ffn_down.bias": (d,),
        }
    m = "v.vit_merger"
    shapes |= {"v.post_ln.weight": (d,), "v.post_ln.bias": (d,),
               f"{m}.ln1.weight": (d,), f"{m}.ln1.bias": (d,)} | attn(m) | {
        f"{m}.ds_ln.weight": (4 * d,), f"{m}.ds_ln.bias": (4 * d,),
        f"{m}.ds_ffn_up.weight": (4 * f, 4 * d), f"{m}.ds_ffn_up.bias": (4 * f,),
        f"{m}.ds_ffn_down.weight": (d, 4 * f), f"{m}.ds_ffn_down.bias": (d,),
        "mm.input_norm.weight": (4 * d,), "mm.input_norm.bias": (4 * d,),
        "mm.up.weight": (4 * d, 4 * d), "mm.up.bias": (4 * d,),
        "mm.down.weight": (hp.out_dim, 4 * d), "mm.down.bias": (hp.out_dim,),
    }
    return shapes


# ----------------------------------------------------------------------------------------------- reading

def _read_hparams(t: Header) -> MiniCPMVHParams:
    """Hyper-parameters from the keys, every one checked (see the module doc)."""
    k, src = MetaReader(t), t.source
    arch = k.string("general.architecture")
    if arch != "clip":
        raise UnsupportedModelError(f"{src}: general.architecture is {arch!r}; a projector (mmproj) file has "
                                    "'clip' (was a language-model GGUF given as the mmproj?)")
    if k.has("clip.has_vision_encoder") and k.get("clip.has_vision_encoder") is not True:
        raise UnsupportedModelError(f"{src}: clip.has_vision_encoder is not true (an audio-only projector)")
    ptype = k.string("clip.projector_type")
    if ptype != PROJECTOR_TYPE:
        raise UnsupportedModelError(f"{src}: clip.projector_type is {ptype!r}, expected {PROJECTOR_TYPE!r}")
    pos = t.tensors.get("v.position_embd.weight")
    if pos is None or len(pos.ne) != 2:
        raise ModelFormatError(f"{src}: missing 2-D tensor 'v.position_embd.weight' (the learned position grid)")
    side = math.isqrt(pos.ne[1])
    if side * side != pos.ne[1] or side < 2:
        raise ModelFormatError(f"{src}: tensor 'v.position_embd.weight' has {pos.ne[1]} rows; expected a square "
                               "grid (70*70 = 4900)")
    v = "clip.vision."
    n_layer = k.positive_int(v + "block_count")
    insert = k.get(INSERT_LAYER_KEY)
    if (not isinstance(insert, list) or len(insert) != 1 or isinstance(insert[0], bool)
            or not isinstance(insert[0], int) or not 0 <= insert[0] < n_layer):
        raise ModelFormatError(f"{src}: key {INSERT_LAYER_KEY!r} should hold one layer index in 0..{n_layer - 1} "
                               f"(the window-attention merger's insert layer), found {insert!r}")
    scale = k.positive_int(SCALE_FACTOR_KEY) if k.has(SCALE_FACTOR_KEY) else 4   # llama.cpp clip.cpp's default
    if scale not in (2, 4):
        raise UnsupportedModelError(f"{src}: {SCALE_FACTOR_KEY} is {scale}; MiniCPM-V 4.6 has 4 (16x mode) or "
                                    "2 (4x mode)")
    eps_key = v + "attention.layer_norm_epsilon"
    eps = k.number(eps_key) if k.has(eps_key) else 1e-6
    hp = MiniCPMVHParams(
        n_embd=k.positive_int(v + "embedding_length"), n_ff=k.positive_int(v + "feed_forward_length"),
        n_layer=n_layer, n_head=k.positive_int(v + "attention.head_count"), patch_size=k.positive_int(v + "patch_size"),
        out_dim=k.positive_int(v + "projection_dim"), pos_side=side, insert_layer=insert[0], scale_factor=scale,
        image_size=k.positive_int(v + "image_size"), eps=eps,
        image_mean=k.floats(v + "image_mean", 3) if k.has(v + "image_mean") else (0.5,) * 3,
        image_std=k.floats(v + "image_std", 3) if k.has(v + "image_std") else (0.5,) * 3)
    if hp.n_embd % hp.n_head:
        raise ModelFormatError(f"{src}: {v}embedding_length {hp.n_embd} is not a multiple of "
                               f"attention.head_count {hp.n_head}")
    if not 0.0 < hp.eps < 1e-2:
        raise ModelFormatError(f"{src}: {eps_key} = {hp.eps} is not a plausible LayerNorm epsilon")
    if any(s <= 0 for s in hp.image_std):
        raise ModelFormatError(f"{src}: {v}image_std {hp.image_std} must be positive")
    return hp


def load_mmproj(path: str | os.PathLike[str]) -> MiniCPMVMmproj:
    """Open and validate a MiniCPM-V 4.6 projector GGUF (:func:`mmproj_from_header` of its parsed header).

    Raises:
        ModelFormatError: unreadable/truncated file; see :func:`mmproj_from_header` for the rest.
    """
    return mmproj_from_header(read_header(path))


def mmproj_from_header(t: Header) -> MiniCPMVMmproj:
    """Validate a parsed MiniCPM-V 4.6 projector GGUF; its vectors and position table are dequantized to
    float32, its matrices stay in the memory map (:class:`StoredWeights`).

    Args:
        t: the ``mmproj-*.gguf`` file's header (llama.cpp layout, module doc).

    Returns:
        :class:`MiniCPMVMmproj` (the matrices as float32 would be about 2.2 GB for the real tower).

    Raises:
        ModelFormatError: a missing or ill-typed key, a missing tensor or one of the wrong shape; the
            message names the file and the key or tensor.
        UnsupportedModelError: not a ``clip`` file, another projector type, an unknown scale factor, or a
            storage type :mod:`engine.gguf.quant` cannot dequantize.
    """
    hp = _read_hparams(t)
    down = t.tensors.get("mm.down.weight")
    if down is not None and down.ne[-1] != hp.out_dim:
        raise ModelFormatError(f"{t.source}: clip.vision.projection_dim is {hp.out_dim} but tensor "
                               f"'mm.down.weight' has {down.ne[-1]} rows (the LLM width)")
    shapes = tensor_shapes(hp)
    check_tensors(t.source, t.tensors, {n: tuple(reversed(s)) for n, s in shapes.items()}, trailing_ones=True)
    qtypes = {name: GGMLQuantizationType(t.tensors[name].type_id) for name in shapes}
    weights = StoredWeights(t, shapes, qtypes)
    names = {n: quant.type_name(q) for n, q in qtypes.items()}
    path = Path(t.source)
    return MiniCPMVMmproj(path, hp, weights, names, file_identity(path))


# ----------------------------------------------------------------------------------------------- writing

def storage_type(name: str, shape: tuple[int, ...], ftype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The converter's storage type of tensor ``name`` (math ``shape``) in a file of type ``ftype`` (module doc)."""
    if len(shape) == 1:
        return Q.F32
    if name == "v.position_embd.weight":
        return Q.F32
    if name == "v.patch_embd.weight":
        return Q.F16 if ftype == Q.F16 else Q.F32
    if ftype == Q.Q8_0 and shape[-1] % quant.block_size(Q.Q8_0):
        return Q.F16
    return ftype


def _records(hp: MiniCPMVHParams, ftype: GGMLQuantizationType) -> list[bytes]:
    """The metadata records of the converter, in its order."""
    S, U32, F32, B = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
    v = "clip.vision."
    rec = gguf_write.kv_record
    return [
        rec("general.architecture", "clip", S), rec("general.type", "mmproj", S),
        rec("general.file_type", _FILE_TYPE_IDS[ftype], U32),
        rec("clip.has_vision_encoder", True, B), rec("clip.projector_type", PROJECTOR_TYPE, S),
        rec(v + "projection_dim", hp.out_dim, U32), rec(v + "image_size", hp.image_size, U32),
        rec(v + "patch_size", hp.patch_size, U32), rec(v + "embedding_length", hp.n_embd, U32),
        rec(v + "feed_forward_length", hp.n_ff, U32), rec(v + "block_count", hp.n_layer, U32),
        rec(v + "attention.head_count", hp.n_head, U32),
        rec(v + "image_mean", list(hp.image_mean), GGUFValueType.ARRAY, F32),
        rec(v + "image_std", list(hp.image_std), GGUFValueType.ARRAY, F32),
        rec(SCALE_FACTOR_KEY, hp.scale_factor, U32),
        rec(INSERT_LAYER_KEY, [hp.insert_layer], GGUFValueType.ARRAY, GGUFValueType.INT32),
        rec("clip.use_gelu", True, B), rec(v + "attention.layer_norm_epsilon", hp.eps, F32),
    ]


def write_mmproj(path: str | os.PathLike[str], hp: MiniCPMVHParams, weights: Mapping[str, np.ndarray],
                 ftype: str = "F16") -> Path:
    """Write a projector GGUF with llama.cpp's keys, tensor names and storage types (streamed, one tensor in
    memory at a time, through :func:`engine.gguf.write.write`).

    Args:
        path: destination file (replaced only once complete).
        hp: hyper-parameters; ``hp.pos_side`` must match the rows of ``v.position_embd.weight``.
        weights: every name of :func:`tensor_shapes` ``(hp)`` -> float array of that math shape (a mapping
            that makes its values on access, such as :class:`engine.testing.minicpmv.RandomWeights`, keeps memory low).
        ftype: ``"F32"``, ``"F16"`` or ``"Q8_0"``.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: unknown ``ftype``, or a missing / mis-shaped weight.
    """
    if ftype not in WRITE_TYPES:
        raise ValueError(f"ftype {ftype!r} is not one of {sorted(WRITE_TYPES)}")
    ft = WRITE_TYPES[ftype]
    types = {name: (shape, storage_type(name, shape, ft)) for name, shape in tensor_shapes(hp).items()}
    outs = gguf_write.float_tensors(weights, types, "write_mmproj")
    gguf_write.write(path, _records(hp, ft), outs)
    return Path(path)
