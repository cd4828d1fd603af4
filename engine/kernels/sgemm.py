"""Native float32 GEMM with weights packed once (``dd_sgemm`` in native/cpu/vit/sgemm_avx512.c) and a fused epilogue:
``out = act(x @ w.T + b) + add``, the vision towers' projections; and the ViT's full attention on the same
micro-kernel (:func:`vit_attention`).

Each output element is one float32 fused-multiply-add chain over k in order, so the result does not depend on
the thread count, on how rows or columns are split, or on which other rows share the call (deltadesk_cpu.h).
It needs AVX-512 F and the native extension, and runs when the active ISA level (:func:`engine.kernels.cpu.isa`)
is the best this CPU supports (a level set lower selects the numpy path); :func:`available` says so, and
callers keep their numpy path otherwise. :func:`linear_np` is the float64 reference the tests compare it with;
:func:`layer_norm` is the towers' LayerNorm on the same pool.
"""

from __future__ import annotations

import numpy as np

from engine.errors import EngineError
from engine.kernels import cpu
from engine.ops import vision_reference as ops

ACTS = {None: 0, "gelu_tanh": 1, "gelu_erf": 2}
"""Epilogue activations by name -> the C side's DD_ACT_* code."""

_ERRORS = {-1: "this CPU lacks AVX-512", -2: "out of memory", -3: "invalid argument"}


def available() -> bool:
    """True when the native GEMM can run and is chosen: the extension is built, the CPU has AVX-512 F (VNNI is not
    needed) and the active level (``DELTADESK_ISA`` / :func:`engine.kernels.cpu.set_isa`) is the best this CPU
    supports, i.e. it was not set lower (``avx512vnni`` on a CPU with VNNI, ``avx2`` on one with AVX-512 F alone)."""
    if not cpu.available() or not _native().lib.dd_sgemm_supported():
        return False
    best = cpu.supported_isas()[-1]
    return cpu.isa() == best


def _native():
    """The native extension's module; EngineError when it is not built."""
    if not cpu.available():
        raise EngineError("the native CPU kernels (engine._native_cpu) are not built: reinstall with a C compiler")
    from engine import _native_cpu
    return _native_cpu


def _act_code(act: str | None) -> int:
    """The C side's code of the activation ``act``; ValueError naming the known ones otherwise."""
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r} (expected one of {list(ACTS)})")
    return ACTS[act]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise EngineError(f"{what} failed in the native CPU kernels: {_ERRORS.get(rc, rc)}")


def _f32_ptr(a: np.ndarray):
    """``float *`` to the first element of ``a`` (any strides: the callers pass the row stride apart)."""
    return _native().ffi.cast("float *", a.ctypes.data)


BF16 = np.dtype([("x", "<u2")])
"""How a BF16 tensor is viewed as stored (:mod:`engine.gguf.quant`'s block dtype: the top 16 bits of a float32)."""

DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BF16: 2}
"""Weight dtypes :class:`PackedWeight` packs as they are -> the C side's DD_DTYPE_* code."""


class PackedWeight:
    """A ``(n, k)`` weight (GGUF math shape: one row per output) and its float32 bias, laid out once in the
    kernel's panels of 32 output columns as float32 (:meth:`__call__` reads only those; the source is not kept,
    so it may be a view of a memory-mapped file).

    Args:
        w: (n, k) float32, float16 or :data:`BF16` with unit column stride (converted exactly while packing);
            a list of (n_i, k) such arrays is packed side by side as their (sum n_i, k) concatenation.
        b: (n,) bias (converted to float32) or None.

    Raises:
        ValueError: an empty or non-2-D weight, differing k, a dtype not in :data:`DTYPES`, a column stride other
            than one element, or a bias of the wrong shape. EngineError: the native extension is missing.
    """

    def __init__(self, w: np.ndarray | list[np.ndarray], b: np.ndarray | None = None):
        parts = [_weight(p) for p in (w if isinstance(w, list) else [w])]
        self.k = parts[0].shape[1]
        if any(p.shape[1] != self.k for p in parts):
            raise ValueError(f"PackedWeight: parts of differing k {[p.shape for p in parts]}")
        self.n = sum(len(p) for p in parts)
        if b is not None and np.shape(b) != (self.n,):
            raise ValueError(f"PackedWeight: bias {np.shape(b)} for {self.n} outputs")
        self.bias = None if b is None else np.ascontiguousarray(b, dtype=np.float32)
        n = _native()
        self.packed = empty_aligned(n.lib.dd_sgemm_packed_floats(self.n, self.k))
        row0 = 0
        for p in parts:
            ld = p.strides[0] // p.itemsize if len(p) > 1 else self.k
            _check(n.lib.dd_sgemm_pack_rows(n.ffi.cast("void *", p.ctypes.data), DTYPES[p.dtype], ld, len(p),
                                            self.k, row0, self.n, _f32_ptr(self.packed)), "sgemm pack")
            row0 += len(p)

    @classmethod
    def stacked(cls, ws: list[np.ndarray], bs: list[np.ndarray]) -> PackedWeight:
        """The weights ``ws`` (each (n_i, k), dtypes as the constructor's) as one (sum n_i, k) weight with the
        biases ``bs`` concatenated: one call then computes all their outputs side by side (e.g. q, k and v)."""
        return cls(list(ws), np.concatenate([np.asarray(b, dtype=np.float32) for b in bs]))

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None, act: str | None = None,
                 add: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
        """``out = act(x @ w.T + b) + add`` (module doc; act: None, "gelu_tanh" or "gelu_erf").

        Args:
            x: (m, k) float32 with unit column stride (rows may be further apart, e.g. a column slice).
            out: optional writable (m, n) float32 with unit column stride, sharing no memory with ``x``; may be
                ``add`` itself (the same view: a residual update) but not overlap it otherwise.
            add: optional (m, n) float32 with unit column stride, added after the activation.
            threads: at most this many of the native pool's threads take part (:func:`engine.kernels.cpu.set_threads`
                sets the pool's size).

        Returns:
            ``out``, or a new (m, n) float32 array from :func:`empty_aligned`.

        Raises:
            ValueError: a shape, dtype or stride does not fit, ``out`` is read-only or overlaps ``x`` (or ``add``
                other than as the same view), or ``act`` is unknown. EngineError: the native call failed (e.g. no
                AVX-512).
        """
        m = len(x)
        out = empty_aligned((m, self.n)) if out is None else out
        ldx = _rows(x, (m, self.k), "x")
        ldo = _rows(out, (m, self.n), "out", writeable=True)
        _separate(out, x, "x")
        ld_add = 0 if add is None else _rows(add, (m, self.n), "add")
        if add is not None:
            _separate(out, add, "add", same_ok=True)
        code = _act_code(act)
        n = _native()
        nul = n.ffi.NULL
        bias = nul if self.bias is None else _f32_ptr(self.bias)
        _check(n.lib.dd_sgemm(_f32_ptr(x), ldx, m, self.k, _f32_ptr(self.packed), self.n, bias, code,
                              nul if add is None else _f32_ptr(add), ld_add, _f32_ptr(out), ldo,
                              max(1, int(threads))), "sgemm")
        return out


ALIGN = 64
"""Byte alignment of :func:`empty_aligned` arrays: a cache line, the size of one AVX-512 vector."""


def empty_aligned(shape: int | tuple[int, ...]) -> np.ndarray:
    """An uninitialized C-order float32 array of ``shape`` whose first element sits on an :data:`ALIGN`-byte boundary.

    numpy's own buffers start 16 bytes past a line (glibc's malloc header), so every 64-byte vector load of a
    packed panel there spans two cache lines; the kernel reads two such vectors per k step (plus 12 broadcasts).
    On 1024-row products that cost about 5 % under load (docs/perf/log/minicpmv.md). Rows whose byte length
    is a multiple of 64 (the towers' widths 1152, 3456, 4304 floats) are then all aligned as well.
    """
    count = int(np.prod(shape))
    raw = np.empty(count + ALIGN // 4, dtype=np.float32)
    skip = (-raw.ctypes.data % ALIGN) // 4
    return raw[skip:skip + count].reshape(shape)


def _weight(w: np.ndarray) -> np.ndarray:
    """``w`` if :class:`PackedWeight` can pack it as it is (module doc of the constructor), else ValueError."""
    if not isinstance(w, np.ndarray) or w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"PackedWeight: expected a non-empty (n, k) weight array, got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    if w.dtype not in DTYPES:
        raise ValueError(f"PackedWeight: weight dtype {w.dtype} is not float32, float16 or BF16")
    if w.strides[1] != w.itemsize or (len(w) > 1 and (w.strides[0] < w.itemsize * w.shape[1]
                                                      or w.strides[0] % w.itemsize)):
        raise ValueError(f"PackedWeight: weight rows must be unit-stride runs, got strides {w.strides}")
    return w


def _rows(a: np.ndarray, shape: tuple[int, int], name: str, writeable: bool = False) -> int:
    """The row stride in floats of ``a`` (``shape[1]`` for a single row, whatever numpy's stride, e.g. 0 for a
    broadcast row); ValueError unless ``a`` is a float32 array of ``shape`` whose rows are unit-stride runs of floats
    and, with ``writeable``, one that may be written."""
    if (not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape
            or (shape[0] > 1 and (a.strides[0] % 4 or a.strides[0] < 4 * shape[1])) or a.strides[1] != 4):
        raise ValueError(f"sgemm: {name} must be a float32 {shape} array with unit column stride, got "
                         f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')} "
                         f"strides {getattr(a, 'strides', '')}")
    if writeable and not a.flags.writeable:
        raise ValueError(f"sgemm: {name} is read-only (expected a writable array)")
    return a.strides[0] // 4 if shape[0] > 1 else shape[1]


def _separate(out: np.ndarray, a: np.ndarray, name: str, same_ok: bool = False) -> None:
    """ValueError if ``out`` may share memory with the input ``a`` (the kernel would read what it has written),
    unless ``same_ok`` and ``a`` is exactly the view ``out`` (same first element, shape and strides)."""
    same = (a.__array_interface__["data"][0] == out.__array_interface__["data"][0] and a.shape == out.shape
            and a.strides == out.strides)
    if np.may_share_memory(out, a) and not (same_ok and same):
        raise ValueError(f"sgemm: out overlaps {name} (expected separate memory"
                         f"{', or the very same view' if same_ok else ''})")


def activation(x: np.ndarray, act: str) -> np.ndarray:
    """The epilogue's activation alone (``dd_sgemm_act``): x any shape float32 -> same shape float32.

    Raises:
        ValueError: ``act`` is not "gelu_tanh" or "gelu_erf" (or None). EngineError: the native call failed.
    """
    code = _act_code(act)
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty_like(x)
    _check(_native().lib.dd_sgemm_act(code, _f32_ptr(x), x.size, _f32_ptr(y)), "sgemm activation")
    return y


def vit_attention(qkv: np.ndarray, starts: np.ndarray, n_head: int, out: np.ndarray | None = None,
                  threads: int = 1) -> np.ndarray:
    """Full attention of each piece of a stack, head by head (``dd_vit_attention``): row i of piece p gets, per
    head h, ``softmax_j((q_i / sqrt(hd)) . k_j) v_j`` over the rows j of p (no attention across pieces).

    Args:
        qkv: (S, 3 D) float32 rows ``[q | k | v]`` with unit column stride (a fused projection), D = n_head * hd,
            hd <= 256.
        starts: (n_piece + 1,) integer row offsets, non-decreasing from 0 to S, at least two: piece p is rows
            ``starts[p]:starts[p + 1]``.
        n_head: the number of heads, a positive integer dividing D.
        out: optional writable (S, D) float32 with unit column stride, sharing no memory with ``qkv``.
        threads: as :meth:`PackedWeight.__call__`.

    Returns:
        ``out``, or a new (S, D) float32 array from :func:`empty_aligned`.

    Raises:
        ValueError: a shape, dtype or stride does not fit, ``starts`` or ``n_head`` is not as above, or ``out`` is
            read-only or overlaps ``qkv``. EngineError: the native call failed.
    """
    if not isinstance(qkv, np.ndarray) or qkv.ndim != 2:
        raise ValueError(f"vit_attention: qkv must be a 2-D (S, 3 D) array, got {getattr(qkv, 'shape', type(qkv))}")
    s, width = qkv.shape
    d = width // 3
    ldq = _rows(qkv, (s, width), "qkv")
    if isinstance(n_head, bool) or not isinstance(n_head, (int, np.integer)) or n_head < 1:
        raise ValueError(f"vit_attention: n_head must be a positive integer, got {n_head!r}")
    if width != 3 * d or d % n_head:
        raise ValueError(f"vit_attention: qkv width {width} is not 3 D with D a multiple of n_head = {n_head}")
    starts = _starts(starts, s)
    out = empty_aligned((s, d)) if out is None else out
    ldo = _rows(out, (s, d), "out", writeable=True)
    _separate(out, qkv, "qkv")
    n = _native()
    _check(n.lib.dd_vit_attention(_f32_ptr(qkv), ldq, n.ffi.cast("size_t *", starts.ctypes.data),
                                  len(starts) - 1, n_head, d // n_head, _f32_ptr(out), ldo,
                                  max(1, int(threads))), "vit_attention")
    return out


def _starts(starts, s: int) -> np.ndarray:
    """``starts`` as contiguous uint64; ValueError unless it is a 1-D integer sequence of at least two offsets,
    non-decreasing from 0 to ``s``."""
    a = np.asarray(starts)
    if a.ndim != 1 or len(a) < 2 or a.dtype.kind not in "iu":
        raise ValueError(f"vit_attention: starts must be a 1-D integer array of at least two row offsets, got "
                         f"{a.dtype} {a.shape}")
    if a[0] != 0 or a[-1] != s or (np.diff(a.astype(np.int64)) < 0).any():
        raise ValueError(f"vit_attention: piece starts {a.tolist()} do not rise from 0 to the {s} rows of qkv")
    return np.ascontiguousarray(a, dtype=np.uint64)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray | None = None,
               threads: int = 1) -> np.ndarray:
    """LayerNorm of each row (``dd_vit_layer_norm``): ``((x - mean) * rstd) * w + b``, rstd = 1 / sqrt(var + eps),
    biased variance, as :func:`engine.ops.vision_reference.layer_norm` (sums in another order: within a few ulp).

    Args:
        x: (m, d) float32 with unit column stride. w, b: (d,) float32. eps: >= 0.
        out: optional writable (m, d) float32 with unit column stride: ``x`` itself (the same view), or memory
            sharing nothing with it.
        threads: as :meth:`PackedWeight.__call__`.

    Returns:
        ``out``, or a new (m, d) float32 array from :func:`empty_aligned`.

    Raises:
        ValueError: a shape, dtype or stride does not fit, ``out`` is read-only or overlaps ``x`` other than as the
            same view, or eps < 0. EngineError: the native call failed (e.g. no AVX-512).
    """
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"layer_norm: x must be a 2-D (m, d) array, got {getattr(x, 'shape', type(x))}")
    m, d = x.shape
    ldx = _rows(x, (m, d), "x")
    w, b = (np.ascontiguousarray(v, dtype=np.float32) for v in (w, b))
    if w.shape != (d,) or b.shape != (d,):
        raise ValueError(f"layer_norm: weight {w.shape} and bias {b.shape} for rows of {d}")
    if not eps >= 0:
        raise ValueError(f"layer_norm: eps must be >= 0, got {eps}")
    out = empty_aligned((m, d)) if out is None else out
    ldo = _rows(out, (m, d), "out", writeable=True)
    _separate(out, x, "x", same_ok=True)
    n = _native()
    _check(n.lib.dd_vit_layer_norm(_f32_ptr(x), ldx, m, d, _f32_ptr(w), _f32_ptr(b), float(eps), _f32_ptr(out), ldo,
                                   max(1, int(threads))), "layer_norm")
    return out


def vit_attention_np(qkv: np.ndarray, starts: np.ndarray, n_head: int) -> np.ndarray:
    """Float64 reference of :func:`vit_attention` (returns float64)."""
    s, width = qkv.shape
    d = width // 3
    hd = d // n_head
    x = qkv.astype(np.float64)
    out = np.empty((s, d))
    for p0, p1 in zip(starts[:-1], starts[1:], strict=True):
        for h in range(n_head):
            c = slice(h * hd, (h + 1) * hd)
            q, k, v = x[p0:p1, c], x[p0:p1, d + h * hd:d + (h + 1) * hd], x[p0:p1, 2 * d + h * hd:2 * d + (h + 1) * hd]
            sc = q @ k.T / np.sqrt(hd)
            e = np.exp(sc - sc.max(axis=1, keepdims=True))
            out[p0:p1, c] = (e / e.sum(axis=1, keepdims=True)) @ v
    return out


def linear_np(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, act: str | None = None,
              add: np.ndarray | None = None) -> np.ndarray:
    """Float64 reference of :meth:`PackedWeight.__call__`: the same formula with the product, the bias and the
    activation in float64 (the GELUs of :mod:`engine.ops.vision_reference`, the tanh form as y / (1 + exp(-2u))),
    returned as float64."""
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if b is not None:
        y += b
    if act == "gelu_tanh":   # 0.5 y (1 + tanh(u)) = y / (1 + exp(-2u)): no cancellation for y << 0
        with np.errstate(over="ignore"):
            y = y / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (y + 0.044715 * y ** 3)))
    elif act == "gelu_erf":
        y = 0.5 * y * ops.erfc(-y * np.sqrt(0.5))
    return y if add is None else y + add
