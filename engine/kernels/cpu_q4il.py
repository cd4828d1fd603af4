"""Q4_0, MXFP4 and Q4_K matrices in the 8-row interleaved layouts: the repack in place and its inverse.

The layouts (native/cpu/deltadesk_cpu.h, ``dd_q4_0_interleave``, ``dd_mxfp4_interleave``, ``dd_q4_k_interleave``):
each stripe of 8 rows keeps its bytes; a block (Q4_0, MXFP4) or super-block (Q4_K) of the stripe's rows holds the
8 rows' scales together (f16 d, e8m0 e, or Q4_K's d, dmin and 6-bit scales and mins), then their quant bytes 4 at a
time, the 8 rows' runs side by side. Rows past the last multiple of 8 stay row-major. A
:class:`engine.kernels.cpu.Matrix` built with ``interleaved=True`` multiplies by such rows (the native types
``DD_Q4_0_IL``, ``DD_MXFP4_IL``, ``DD_Q4_K_IL``: the AVX-512 VNNI level's GEMV reads the stripes directly, other
products de-interleave them into a scratch) with the bits of the row-major matrix.
Design: docs/design/q4-0-row-interleave.md, docs/design/mxfp4-interleave.md, docs/design/q4-k-row-interleave.md.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.kernels.cpu import _check, _native_cpu, _ptr

Q = GGMLQuantizationType
_NATIVE = {Q.Q4_0: ("dd_q4_0_interleave", "dd_q4_0_deinterleave", "DD_Q4_0_IL_MAX_ROW_BYTES"),
           Q.MXFP4: ("dd_mxfp4_interleave", "dd_mxfp4_deinterleave", "DD_MXFP4_IL_MAX_ROW_BYTES"),
           Q.Q4_K: ("dd_q4_k_interleave", "dd_q4_k_deinterleave", "DD_Q4_K_IL_MAX_ROW_BYTES")}
MAX_ROW_BYTES = {t: getattr(_native_cpu.lib, names[2]) if _native_cpu is not None else 0
                 for t, names in _NATIVE.items()}
"""The longest rows the layout takes per type (deltadesk_cpu.h's DD_*_IL_MAX_ROW_BYTES: k of 29,120 for Q4_0 and
MXFP4, 28,672 for Q4_K); 0 without the native kernels."""
TYPES = tuple(_NATIVE)
"""The stored types that have the layout."""


def _rows(raw: np.ndarray, qtype: GGMLQuantizationType, what: str, native: dict, max_bytes: dict,
          layout: str) -> np.ndarray:
    if qtype not in native:
        raise ValueError(f"{what}: {qtype.name} has no {layout} layout (only {', '.join(t.name for t in native)})")
    name, block = qtype.name, quant.TYPES[qtype].block_bytes
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected {name} rows as a 2-D uint8 array")
    if raw.shape[1] == 0 or raw.shape[1] % block:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are not whole {name} blocks of {block} bytes")
    if _native_cpu is not None and raw.shape[1] > max_bytes[qtype]:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes are longer than the layout takes "
                         f"({max_bytes[qtype]})")
    if not raw.flags.c_contiguous or not raw.flags.writeable:
        raise ValueError(f"{what}: the rows must be C-contiguous and writable to be repacked in place")
    if _native_cpu is None:
        raise ValueError(f"{what}: the native CPU kernels are not built")
    return raw


def permute_rows(raw: np.ndarray, qtype: GGMLQuantizationType, inverse: bool, native: dict, max_bytes: dict,
                 layout: str) -> None:
    """Repack ``raw`` in place by the native pair ``native[qtype]`` (repack, inverse): this module's and
    :mod:`engine.kernels.cpu_rl`'s layouts. ``max_bytes``: the longest rows per type; ``layout``: its name in
    errors. Raises ValueError for another type, shape, dtype or a read-only array; EngineError if the call fails.
    """
    fn_name = native[qtype][int(inverse)] if qtype in native else f"{layout} repack"
    raw = _rows(raw, qtype, fn_name, native, max_bytes, layout)
    fn = getattr(_native_cpu.lib, fn_name)
    _check(fn(_ptr(_native_cpu.ffi, "uint8_t *", raw), raw.shape[0], raw.shape[1]), fn_name)


def _permute(raw: np.ndarray, qtype: GGMLQuantizationType, inverse: bool) -> None:
    permute_rows(raw, qtype, inverse, _NATIVE, MAX_ROW_BYTES, "interleaved")


def interleave(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """Rewrite rows of ``qtype`` (Q4_0, MXFP4 or Q4_K) in place into the interleaved layout (one stripe of scratch).

    Args: raw (rows, k // block values * block bytes) uint8, C-contiguous and writable; qtype: its stored type.
    Raises ValueError for another type, shape, dtype or a read-only array; EngineError if the native call fails.
    """
    _permute(raw, qtype, inverse=False)


def deinterleave(raw: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """The inverse of :func:`interleave`, in place (the row-major bytes exactly). Same arguments."""
    _permute(raw, qtype, inverse=True)
