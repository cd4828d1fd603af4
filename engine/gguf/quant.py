"""GGML block layouts, dequantization and (writer-side) quantization.

Block structs are llama.cpp's ``ggml-common.h`` as packed numpy dtypes (:func:`block_view`); a row of
``ne0`` values is ``ne0 / block_size`` blocks of ``type_size`` bytes. Dequantization is ``gguf.quants``;
this module adds shapes, typed errors and :data:`TYPES`, the quant-type table (block size, bytes,
record, CPU kernel, GPU suffix, writable) the backends ask instead of keeping lists.
Design: docs/design/quant-formats.md (the table of every block layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq

from ..errors import UnsupportedModelError

Q = GGMLQuantizationType

_F16 = "<f2"
_K = 256  # QK_K

_BLOCK_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    Q.F32: np.dtype([("x", "<f4")]),
    Q.F16: np.dtype([("x", _F16)]),
    Q.BF16: np.dtype([("x", "<u2")]),
    Q.Q4_0: np.dtype([("d", _F16), ("qs", "u1", (16,))]),
    Q.Q4_1: np.dtype([("d", _F16), ("m", _F16), ("qs", "u1", (16,))]),
    Q.Q5_0: np.dtype([("d", _F16), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    Q.Q5_1: np.dtype([("d", _F16), ("m", _F16), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    Q.Q8_0: np.dtype([("d", _F16), ("qs", "i1", (32,))]),
    Q.Q2_K: np.dtype([("scales", "u1", (_K // 16,)), ("qs", "u1", (_K // 4,)), ("d", _F16), ("dmin", _F16)]),
    Q.Q3_K: np.dtype([("hmask", "u1", (_K // 8,)), ("qs", "u1", (_K // 4,)), ("scales", "u1", (12,)), ("d", _F16)]),
    Q.Q4_K: np.dtype([("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)), ("qs", "u1", (_K // 2,))]),
    Q.Q5_K: np.dtype([("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)), ("qh", "u1", (_K // 8,)),
                      ("qs", "u1", (_K // 2,))]),
    Q.Q6_K: np.dtype([("ql", "u1", (_K // 2,)), ("qh", "u1", (_K // 4,)), ("scales", "i1", (_K // 16,)),
                      ("d", _F16)]),
    Q.IQ4_NL: np.dtype([("d", _F16), ("qs", "u1", (16,))]),
    Q.IQ4_XS: np.dtype([("d", _F16), ("scales_h", "<u2"), ("scales_l", "u1", (_K // 64,)), ("qs", "u1", (_K // 2,))]),
    Q.IQ2_XXS: np.dtype([("d", _F16), ("qs", "u1", (64,))]),
    Q.IQ2_XS: np.dtype([("d", _F16), ("qs", "<u2", (32,)), ("scales", "u1", (8,))]),
    Q.IQ2_S: np.dtype([("d", _F16), ("qs", "u1", (32,)), ("signs", "u1", (32,)), ("qh", "u1", (8,)),
                       ("scales", "u1", (8,))]),
    Q.IQ3_XXS: np.dtype([("d", _F16), ("qs", "u1", (64,)), ("sas", "u1", (32,))]),
    Q.IQ3_S: np.dtype([("d", _F16), ("qs", "u1", (64,)), ("qh", "u1", (8,)), ("signs", "u1", (32,)),
                       ("scales", "u1", (4,))]),
    Q.IQ1_S: np.dtype([("d", _F16), ("qs", "u1", (32,)), ("qh", "<u2", (8,))]),
    Q.IQ1_M: np.dtype([("qs", "u1", (32,)), ("qh", "u1", (16,)), ("scales", "<u2", (4,))]),
    Q.MXFP4: np.dtype([("e", "u1"), ("qs", "u1", (16,))]),
}

# Kernel ids of native/cpu/deltadesk_cpu.h (enum DD_Q4_0, ...); tests/test_cpu_kernels.py checks they agree.
_CPU_KERNELS = {Q.Q4_0: 0, Q.Q8_0: 1, Q.Q4_K: 2, Q.Q5_K: 3, Q.Q6_K: 4, Q.Q4_1: 5, Q.Q5_0: 6, Q.Q5_1: 7,
                Q.IQ4_NL: 8, Q.IQ4_XS: 9, Q.Q2_K: 10, Q.Q3_K: 11, Q.IQ2_XXS: 12, Q.IQ2_XS: 13, Q.IQ2_S: 14,
                Q.IQ3_XXS: 15, Q.IQ3_S: 16, Q.IQ1_S: 17, Q.IQ1_M: 18, Q.MXFP4: 19, Q.BF16: 20,
                Q.F16: 21}
# Weight types native/cuda/gemm.cu has kernels for, by the suffix of their names (qgemm_<suffix>, ...).
_CUDA_SUFFIXES = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q8_0: "q8_0"}
# Types gguf.quants.quantize implements (it only dequantizes the K-quants).
_WRITABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4}


@dataclass(frozen=True)
class QuantType:
    """What every part of the engine needs to know about one storage type (one row of :data:`TYPES`).

    Attributes:
        qtype: the GGML type id.
        block_values: values per block (1 for float types, 32 for Q4_0..Q8_0 and IQ4_NL, 256 for K-quants
            and the IQ1..IQ4_XS types).
        block_bytes: bytes per block (``gguf.constants.GGML_QUANT_SIZES``).
        block_dtype: packed numpy record of one block (ggml-common.h layout, see the module doc).
        cpu_kernel: id of the native CPU kernel that reads these blocks as stored (the ``DD_*`` weight
            type of native/cpu/deltadesk_cpu.h), or None: the CPU backend converts the tensor at load.
        cuda_suffix: suffix of the GPU GEMM kernels that read these blocks (``qgemm_q4_0``, ...), or
            None: GPU prefill converts the tensor to Q8_0 on the host (the vision tower to F32).
        writable: :func:`quantize` can produce the type (``gguf.quants.quantize`` implements it).
    """

    qtype: GGMLQuantizationType
    block_values: int
    block_bytes: int
    block_dtype: np.dtype
    cpu_kernel: int | None
    cuda_suffix: str | None
    writable: bool

    @property
    def name(self) -> str:
        """GGML name (``"Q4_K"``)."""
        return self.qtype.name

    def dequantize(self, rows: np.ndarray) -> np.ndarray:
        """``(n, row_bytes)`` uint8 rows -> ``(n, row_values)`` float32 (``gguf.quants.dequantize``)."""
        return _gq.dequantize(rows, self.qtype)


TYPES: dict[GGMLQuantizationType, QuantType] = {
    t: QuantType(t, GGML_QUANT_SIZES[t][0], GGML_QUANT_SIZES[t][1], dtype, _CPU_KERNELS.get(t),
                 _CUDA_SUFFIXES.get(t), t in _WRITABLE)
    for t, dtype in _BLOCK_DTYPES.items()
}
"""The quant-type table: every storage type the engine reads, and its traits. Backends ask it (through
:func:`traits`) instead of keeping their own lists."""

BLOCK_DTYPES: dict[GGMLQuantizationType, np.dtype] = {t: q.block_dtype for t, q in TYPES.items()}
"""Packed numpy record type of one block per supported type (ggml-common.h layouts, see module doc)."""

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(TYPES)
"""Types the engine can dequantize: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4."""

WRITABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset(t for t, q in TYPES.items() if q.writable)
"""Types :func:`quantize` can produce (those ``gguf.quants.quantize`` implements)."""

FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset(t for t, q in TYPES.items() if q.block_values == 1)
"""Unquantized types (one value per block): F32, F16, BF16."""


def type_name(qtype: GGMLQuantizationType | int) -> str:
    """GGML name of a type id (``"Q4_0"``, ``"F32"``, ...); ``"type 99"`` for an unknown id."""
    try:
        return Q(int(qtype)).name
    except ValueError:
        return f"type {int(qtype)}"


def parse_type(name: str) -> GGMLQuantizationType:
    """Type from a case-insensitive name such as ``"q4_0"`` or ``"F16"``.

    Raises:
        ValueError: the name is not a GGML type.
    """
    try:
        return Q[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GGML type name {name!r}") from None


def block_size(qtype: GGMLQuantizationType) -> int:
    """Values per block (1 for float types, 32 for Q4_0..Q8_0, 256 for K-quants)."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: GGMLQuantizationType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes of one row of ``n`` values stored as ``qtype``.

    Raises:
        ValueError: ``n`` is not a multiple of the type's block size.
    """
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n % bs:
        raise ValueError(f"a row of {n} values is not a whole number of {type_name(qtype)} blocks of {bs}")
    return n // bs * ts


def traits(qtype: GGMLQuantizationType | int, what: str) -> QuantType:
    """The :data:`TYPES` row of a type id.

    Args:
        what: the tensor (and file) being checked, used in the message.

    Raises:
        UnsupportedModelError: naming ``what`` and the type, when the engine cannot read it.
    """
    try:
        return TYPES[Q(int(qtype))]
    except (ValueError, KeyError):
        names = ", ".join(sorted(type_name(s) for s in SUPPORTED_TYPES))
        raise UnsupportedModelError(f"{what}: quant type {type_name(qtype)} is not supported "
                                    f"(supported: {names})") from None


def check_supported(qtype: GGMLQuantizationType | int, what: str) -> GGMLQuantizationType:
    """Return ``qtype`` as an enum if the engine can dequantize it.

    Args:
        what: the tensor (and file) being checked, used in the message.

    Raises:
        UnsupportedModelError: naming ``what`` and the type.
    """
    return traits(qtype, what).qtype


def block_view(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """View raw bytes as block records.

    Args:
        raw: ``(..., row_bytes)`` uint8, C-contiguous in its last axis.
        qtype: a type of :data:`SUPPORTED_TYPES`.

    Returns:
        ``(..., row_bytes // type_size)`` array of :data:`BLOCK_DTYPES[qtype]` records sharing memory
        with ``raw`` (``view["d"]`` is the scales, ``view["qs"]`` the packed quants, ...).

    Raises:
        UnsupportedModelError: unsupported type.
    """
    check_supported(qtype, "block_view")
    return np.ascontiguousarray(raw).view(BLOCK_DTYPES[qtype])


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize raw GGUF tensor bytes.

    Args:
        raw: uint8 array holding ``prod(shape[:-1])`` rows of ``row_bytes(qtype, shape[-1])`` bytes
            (any shape, e.g. ``(rows, row_bytes)``; need not be contiguous).
        qtype: storage type.
        shape: math shape of the result (reversed GGUF ``ne``); ``shape[-1]`` = ``ne0``.

    Returns:
        float32 array of ``shape``, a new array (never a view of ``raw``).

    Raises:
        UnsupportedModelError: ``qtype`` is not in :data:`SUPPORTED_TYPES`.
        ValueError: the byte count does not match ``shape``.
    """
    tq = traits(qtype, "dequantize")
    qtype = tq.qtype
    shape = tuple(int(s) for s in shape)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    rb = row_bytes(qtype, shape[-1])
    if raw.size != n_rows * rb:
        raise ValueError(f"{raw.size} bytes do not hold a {type_name(qtype)} tensor of shape {shape}")
    rows = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n_rows, rb)
    out = tq.dequantize(rows)
    if qtype == Q.F32:
        out = out.copy()
    return out.reshape(shape)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 ``scales`` bytes of Q4_K / Q5_K super-blocks from their 8 six-bit scales and mins (writer side).

    The inverse of ggml-quants.c ``get_scale_min_k4``: for j < 4, byte j = sc_j | (sc_{j+4} >> 4) << 6,
    byte j + 4 = m_j | (m_{j+4} >> 4) << 6, byte j + 8 = (sc_{j+4} & 15) | (m_{j+4} & 15) << 4.

    Args: sc, mn: (..., 8) integers in 0..63.
    Returns: (..., 12) uint8.
    Raises: ValueError for values outside 0..63 or a last axis other than 8.
    """
    sc, mn = np.asarray(sc, dtype=np.int64), np.asarray(mn, dtype=np.int64)
    if sc.shape != mn.shape or sc.shape[-1:] != (8,) or sc.min(initial=0) < 0 or mn.min(initial=0) < 0 \
            or sc.max(initial=0) > 63 or mn.max(initial=0) > 63:
        raise ValueError(f"pack_k_scales: expected two (..., 8) arrays of 0..63, got {sc.shape} and {mn.shape}")
    lo_sc, hi_sc, lo_m, hi_m = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    return np.concatenate([lo_sc | (hi_sc >> 4) << 6, lo_m | (hi_m >> 4) << 6, (hi_sc & 15) | (hi_m & 15) << 4],
                          axis=-1).astype(np.uint8)


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize float values to GGUF block bytes (writer side, via ``gguf.quants.quantize``).

    Args:
        x: ``(..., ne0)`` float array (math shape); ``ne0`` must be a multiple of the block size.
        qtype: one of :data:`WRITABLE_TYPES`.

    Returns:
        ``(..., row_bytes(qtype, ne0))`` uint8, C-contiguous.

    Raises:
        UnsupportedModelError: ``qtype`` cannot be written (e.g. K-quants: gguf-py only dequantizes them).
        ValueError: ``ne0`` is not a multiple of the block size.
    """
    if Q(int(qtype)) not in WRITABLE_TYPES:
        names = ", ".join(sorted(type_name(s) for s in WRITABLE_TYPES))
        raise UnsupportedModelError(f"quantize: cannot write {type_name(qtype)} (writable: {names})")
    qtype = Q(int(qtype))
    x = np.ascontiguousarray(x, dtype=np.float32)
    rb = row_bytes(qtype, x.shape[-1])
    out = _gq.quantize(x, qtype)
    return np.ascontiguousarray(out).view(np.uint8).reshape(*x.shape[:-1], rb)
