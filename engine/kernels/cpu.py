"""CPU matrix kernels for decode: native SIMD W4A8 / W8A8 products, with numpy twins (``<name>_np``).

A weight matrix is its tensor's raw GGUF bytes, ``(rows, k // block * block_bytes)`` uint8. Activations
are quantized to Q8_0 and block dots taken exactly in integers; Q4_0 and Q8_0 scale them into float32 terms
summed in 16 float32 lanes in a fixed order, the other types into float64 terms summed in a fixed order and
rounded to float32 once, so results are bit-identical across ISA levels and thread counts. BF16 and F16
weights are multiplied by the float32 activations themselves (native/cpu/quant/bf16.h), same f64 order.
Levels ``scalar``/``ssse3``/``avx2``/``avx512vnni``/``numpy``: the best is used unless ``DELTADESK_ISA``
or :func:`set_isa` says otherwise. Design: docs/design/native-cpu.md (block layouts, exactness).
"""

from __future__ import annotations

import functools
import mmap
import os
import time
import warnings
from typing import Callable, Sequence

import numpy as np

from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.errors import EngineError
from engine.kernels.cpu_twins import (B_QUANTS, IL_TRAITS, K_QUANTS, KQ_ROWS, Q4Q8, Q8_0_BYTES, QK, RL_TRAITS,
                                      activations, bf16_product_np, bquant_product_np, kquant_product_np,
                                      layout_rows, q4q8_product_np, quantize_q8_0_np, row_major)
from engine.kernels.cpu_twins import (MXFP4_IL, Q2_K_RL, Q3_K_RL, Q4_0_IL,  # noqa: F401 (re-exported: the layouts'
                                      Q4_K_IL)                                # kernel types)
from engine.kernels.iq_twins import grids as iq_grids
from engine.kernels.lowbit_twins import LOW_BIT, lowbit_product_np
from engine.ops import reference

try:
    from engine import _native_cpu
except ImportError as err:
    _native_cpu = None
    warnings.warn(f"DeltaDesk native CPU kernels unavailable ({err}); using the slow numpy fallback "
                  "(reinstall with a C compiler present to build them).", RuntimeWarning, stacklevel=2)

if _native_cpu is not None:
    for _qtype, _grid in iq_grids().items():   # the IQ kernels' codebooks, once (dd_set_iq_grid)
        _at = _native_cpu.ffi.cast("int8_t *", _native_cpu.ffi.from_buffer(_grid))
        if _native_cpu.lib.dd_set_iq_grid(quant.TYPES[_qtype].cpu_kernel, _at, _grid.size) != 0:
            raise ImportError(f"the native CPU kernels refused the {_qtype.name} codebook")

ISA_LEVELS = ("scalar", "ssse3", "avx2", "avx512vnni")
"""Native levels in increasing order; the index is the C side's level number."""

Q = GGMLQuantizationType
KERNEL_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    t for t, traits in quant.TYPES.items() if traits.cpu_kernel is not None)
"""Weight types the kernels read as stored (the quant-type table's ``cpu_kernel``)."""
LAYOUTS = {**IL_TRAITS, **RL_TRAITS}
"""Stored type -> the kernel traits of its row-grouped layout (what ``Matrix(..., interleaved=True)`` carries)."""
_C_ERRORS = {-1: "ISA level not supported by this CPU", -2: "out of memory", -3: "invalid argument"}

MAX_THREADS = 256
"""The C pool's limit (DD_MAX_THREADS)."""

_active_isa: str | None = None
_threads = 1


def available() -> bool:
    """True when the native extension is built and importable."""
    return _native_cpu is not None


def supported_isas() -> tuple[str, ...]:
    """The native levels this CPU runs, lowest first; () without the extension."""
    if _native_cpu is None:
        return ()
    return tuple(name for i, name in enumerate(ISA_LEVELS) if _native_cpu.lib.dd_isa_supported(i))


def _resolve(name: str, source: str) -> str:
    if name == "numpy":
        return name
    if name not in ISA_LEVELS:
        raise EngineError(f"{source}={name!r}: expected one of {', '.join(ISA_LEVELS + ('numpy',))}")
    if _native_cpu is None:
        raise EngineError(f"{source}={name!r}: the native CPU kernels are not built (numpy fallback only)")
    if name not in supported_isas():
        raise EngineError(f"{source}={name!r}: this CPU does not support it "
                          f"(supported: {', '.join(supported_isas())})")
    return name


def isa() -> str:
    """The active level: set_isa's, else $DELTADESK_ISA's, else the best supported, else "numpy".

    Raises EngineError if $DELTADESK_ISA names an unknown level or one this CPU lacks.
    """
    global _active_isa
    if _active_isa is None:
        forced = os.environ.get("DELTADESK_ISA", "").strip().lower()
        if forced:
            _active_isa = _resolve(forced, "DELTADESK_ISA")
        else:
            _active_isa = ISA_LEVELS[_native_cpu.lib.dd_isa_best()] if _native_cpu else "numpy"
    return _active_isa


def set_isa(name: str | None) -> str:
    """Select a level by name ("numpy" = the twins); None goes back to the default. Returns the active one.

    Raises EngineError for an unknown level or one this CPU (or this build) lacks.
    """
    global _active_isa
    _active_isa = None if name is None else _resolve(name.strip().lower(), "isa")
    return isa()


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-thread siblings counted once), at least 1.

    Linux: the affinity mask, deduplicated by (package, core id) from /sys topology; elsewhere
    os.cpu_count().
    """
    if not hasattr(os, "sched_getaffinity"):
        return os.cpu_count() or 1
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as pkg, open(f"{topo}/core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def set_threads(n: int | None = None) -> int:
    """Use n threads (the caller's included, 1..MAX_THREADS) in the native kernels; None = physical_cores().
    Returns the count set.

    Results do not depend on n. Without the extension this is recorded and has no effect.
    """
    global _threads
    _threads = min(MAX_THREADS, physical_cores() if n is None else max(1, int(n)))
    if _native_cpu is not None:
        _native_cpu.lib.dd_set_threads(_threads)
    return _threads


def threads() -> int:
    """The thread count set by set_threads."""
    return _threads


def _native_level() -> int | None:
    level = isa()
    return None if level == "numpy" else ISA_LEVELS.index(level)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise EngineError(f"{what} failed in the native CPU kernels: {_C_ERRORS.get(rc, rc)}")


def _kernel_type(qtype: GGMLQuantizationType | int, what: str) -> quant.QuantType:
    """The quant-type table's row of a weight type the kernels read. Raises ValueError otherwise."""
    try:
        traits = quant.TYPES[Q(int(qtype))]
    except (ValueError, KeyError):
        traits = None
    if traits is None or traits.cpu_kernel is None:
        names = ", ".join(sorted(t.name for t in KERNEL_TYPES))
        raise ValueError(f"{what}: no CPU kernel reads {quant.type_name(qtype)} blocks (kernels: {names})")
    return traits


def _weights(raw: np.ndarray, k: int, traits: quant.QuantType, what: str) -> np.ndarray:
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{what}: expected raw block bytes as a 2-D uint8 array")
    if k % max(traits.block_values, QK) or raw.shape[1] != k // traits.block_values * traits.block_bytes:
        raise ValueError(f"{what}: rows of {raw.shape[1]} bytes do not hold k={k} values "
                         f"as {traits.name} blocks ({traits.block_values} values in {traits.block_bytes} bytes)")
    if not raw.flags.c_contiguous:
        raise ValueError(f"{what}: raw weights must be C-contiguous (copying them would double their memory)")
    return raw


def _ptr(ffi, ctype: str, a: np.ndarray):
    return ffi.cast(ctype, ffi.from_buffer(a))


# --- Q8_0 activation quantization -------------------------------------------------------------

def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Quantize float32 activations to ``block_q8_0`` bytes, bit-identical to ggml's reference.

    Args: x (m, k) or (k,) float32, k a multiple of 32 (other float dtypes are converted).
    Returns: (m, k // 32 * 34) or (k // 32 * 34,) uint8; per block f16 d = max|x| / 127, then
    32 int8 round-half-away(x / d) (0 when d == 0).
    Raises: ValueError for a bad shape.
    """
    level = _native_level()
    if level is None:
        return quantize_q8_0_np(x)
    x2, vector = activations(x)
    out = np.empty((x2.shape[0], x2.shape[1] // QK * Q8_0_BYTES), dtype=np.uint8)
    ffi, lib = _native_cpu.ffi, _native_cpu.lib
    _check(lib.dd_quantize_q8_0(level, _ptr(ffi, "float *", x2), x2.shape[0], x2.shape[1],
                                _ptr(ffi, "uint8_t *", out)), "quantize_q8_0")
    return out[0] if vector else out


# --- W4A8 / W8A8 matrix products ----------------------------------------------------------------

def matmul(raw: np.ndarray, x: np.ndarray, qtype: GGMLQuantizationType, name: str = "matmul") -> np.ndarray:
    """``y = x @ W.T`` with W in the blocks of ``qtype`` (one of :data:`KERNEL_TYPES`), x quantized to Q8_0.

    Args:
        raw: (rows, row bytes) uint8, C-contiguous: the weight's blocks, one row of k values per output.
        x: (m, k) or (k,) float32 activations; m up to ~16 is the intended use.
        qtype: the weight's storage type (from the file's tensor table, never inferred from the bytes).
        name: used in error messages.
    Returns: (m, rows) or (rows,) float32.
    Raises: ValueError when shapes, dtypes or the type do not fit; EngineError if the native call fails.
    """
    traits = _kernel_type(qtype, name)
    level = _native_level()
    if level is None:
        return _matmul_np(raw, x, traits, name)
    x2, vector = activations(x)
    raw = _weights(raw, x2.shape[1], traits, name)
    y = np.empty((x2.shape[0], raw.shape[0]), dtype=np.float32)
    ffi, lib = _native_cpu.ffi, _native_cpu.lib
    _check(lib.dd_matmul(level, traits.cpu_kernel, _ptr(ffi, "uint8_t *", raw), raw.shape[0], x2.shape[1],
                         _ptr(ffi, "float *", x2), x2.shape[0], _ptr(ffi, "float *", y)), name)
    return y[0] if vector else y


def matmul_np(raw: np.ndarray, x: np.ndarray, qtype: GGMLQuantizationType, name: str = "matmul") -> np.ndarray:
    """numpy twin of :func:`matmul` (same arguments, same math: see the module doc)."""
    return _matmul_np(raw, x, _kernel_type(qtype, name), name)


def _matmul_np(raw: np.ndarray, x: np.ndarray, traits: quant.QuantType, name: str) -> np.ndarray:
    x2, vector = activations(x)
    raw, traits = row_major(_weights(raw, x2.shape[1], traits, name), traits)
    products = {**dict.fromkeys(Q4Q8, q4q8_product_np), **dict.fromkeys(K_QUANTS, kquant_product_np),
                **dict.fromkeys(B_QUANTS, bquant_product_np), **dict.fromkeys(LOW_BIT, lowbit_product_np),
                Q.BF16: bf16_product_np, Q.F16: bf16_product_np}
    product = products[traits.qtype]
    y = np.concatenate([product(raw[r0:r0 + KQ_ROWS], x2, traits.qtype) for r0 in range(0, raw.shape[0], KQ_ROWS)],
                       axis=1)
    return y[0] if vector else y


def matmul_q4_0(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """W4A8 product ``y = x @ W.T`` with W in Q4_0 blocks and x quantized to Q8_0 on the way.

    Args:
        raw: (rows, k // 32 * 18) uint8, C-contiguous: the weight's block_q4_0 bytes, one row per output.
        x: (m, k) or (k,) float32 activations (k a multiple of 32); m up to ~16 is the intended use.
    Returns: (m, rows) or (rows,) float32.
    Raises: ValueError when shapes or dtypes do not match; EngineError if the native call fails.
    """
    return matmul(raw, x, Q.Q4_0, "matmul_q4_0")


def matmul_q4_0_np(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`matmul_q4_0` (:func:`~engine.kernels.cpu_twins.q4q8_product_np`: the kernels' bits)."""
    return matmul_np(raw, x, Q.Q4_0, "matmul_q4_0")


def matmul_q8_0(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """W8A8 product ``y = x @ W.T`` with W in Q8_0 blocks; as :func:`matmul_q4_0` with rows of k // 32 * 34 bytes."""
    return matmul(raw, x, Q.Q8_0, "matmul_q8_0")


def matmul_q8_0_np(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`matmul_q8_0`."""
    return matmul_np(raw, x, Q.Q8_0, "matmul_q8_0")


class Matrix:
    """A weight matrix of a :data:`KERNEL_TYPES` type checked once, then multiplied many times (the
    decode hot path).

    Args:
        raw: (rows, row bytes) uint8, C-contiguous raw blocks (a ``GGUFFile.raw`` view is kept as
            is: no copy).
        k: input width (a multiple of the type's block size).
        qtype: the storage type, as the file's tensor table gives it (rows of Q4_0 and Q4_K, say,
            can have the same length, so it is never inferred from the bytes).
        interleaved: raw is rewritten in its type's row-grouped layout (:data:`LAYOUTS`): Q4_0, MXFP4 and Q4_K
            by :func:`engine.kernels.cpu_q4il.interleave` (8-row stripes, :data:`~engine.kernels.cpu_twins.IL_TRAITS`),
            Q2_K and Q3_K by :func:`engine.kernels.cpu_rl.pack` (4-row groups, ``Q2_K_RL``, ``Q3_K_RL``); the
            results are the row-major bytes' bits.
    Calling it is :func:`matmul` (or its twin when the active level is "numpy") without the per-call
    checks of the weights: x (m, k) float32 -> (m, rows) float32.
    Raises ValueError at construction when raw is not rows of k values of ``qtype``, not contiguous,
    ``qtype`` has no kernel, or ``interleaved`` is asked of a type without a row-grouped layout.
    """

    def __init__(self, raw: np.ndarray, k: int, qtype: GGMLQuantizationType, interleaved: bool = False) -> None:
        self.traits = _kernel_type(qtype, "Matrix")
        self.qtype = self.traits.qtype
        if interleaved and self.qtype not in LAYOUTS:
            raise ValueError(f"Matrix: only {', '.join(t.name for t in LAYOUTS)} rows have an interleaved layout, "
                             f"not {self.qtype.name}")
        self.interleaved = interleaved
        self.traits = LAYOUTS[self.qtype] if interleaved else self.traits
        self.raw = _weights(raw, k, self.traits, f"Matrix ({self.qtype.name})")
        self.rows, self.k = raw.shape[0], k
        self._ptr = _ptr(_native_cpu.ffi, "uint8_t *", self.raw) if _native_cpu is not None else None

    def rows_slice(self, r0: int, r1: int) -> "Matrix":
        """Rows [r0, r1) as a Matrix (a view: e.g. one expert of a stacked expert tensor). Raises ValueError
        for an interleaved matrix's range that does not start and end on its row groups (8-row stripes of Q4_0,
        MXFP4 and Q4_K, 4-row groups of Q2_K and Q3_K) or its end."""
        group = layout_rows(self.traits)
        if r0 % group or (r1 % group and r1 != self.rows):
            raise ValueError(f"Matrix: rows [{r0}, {r1}) of an interleaved matrix of {self.rows} rows do not "
                             f"start and end on its {group}-row stripes")
        return Matrix(self.raw[r0:r1], self.k, self.qtype, self.interleaved)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x (m, k) float32 times the rows: (m, rows) float32, on the active ISA level."""
        level = _native_level()
        if level is None:
            return _matmul_np(self.raw, x, self.traits, self.qtype.name)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"Matrix: expected x of shape (m, {self.k}), got {x.shape}")
        y = np.empty((x.shape[0], self.rows), dtype=np.float32)
        ffi, lib = _native_cpu.ffi, _native_cpu.lib
        _check(lib.dd_matmul(level, self.traits.cpu_kernel, self._ptr, self.rows, self.k,
                             _ptr(ffi, "float *", x), x.shape[0], _ptr(ffi, "float *", y)), "Matrix")
        return y


MATMUL_MANY_MAX = 8
"""The most matrices :func:`matmul_many` takes in one native call (deltadesk_cpu.h dd_matmul_many)."""


def matmul_many(mats: Sequence[Matrix], x: np.ndarray) -> list[np.ndarray]:
    """The products of several matrices with one input (a layer's projections of the same rows).

    x (m, k) float32 -> [(m, mats[i].rows) float32], each the bits of ``mats[i](x)``: one native call
    (dd_matmul_many) prepares x's activations once and runs the products in one pool job. Past
    :data:`MATMUL_MANY_MAX` matrices, for no rows, or on the "numpy" level, each matrix is called in turn.
    Raises ValueError when the matrices' k differ or x is not (m, k).
    """
    if not mats:
        return []
    k = mats[0].k
    if any(mat.k != k for mat in mats):
        raise ValueError(f"matmul_many: the matrices read {sorted({mat.k for mat in mats})} values, not one k")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"matmul_many: expected x of shape (m, {k}), got {x.shape}")
    level = _native_level()
    if level is None or not 0 < len(mats) <= MATMUL_MANY_MAX or x.shape[0] == 0:
        return [mat(x) for mat in mats]
    ys = [np.empty((x.shape[0], mat.rows), dtype=np.float32) for mat in mats]
    ffi, lib = _native_cpu.ffi, _native_cpu.lib
    _check(lib.dd_matmul_many(level, len(mats), ffi.new("int[]", [mat.traits.cpu_kernel for mat in mats]),
                              ffi.new("uint8_t *[]", [mat._ptr for mat in mats]),
                              ffi.new("size_t[]", [mat.rows for mat in mats]), k, _ptr(ffi, "float *", x),
                              x.shape[0], ffi.new("float *[]", [_ptr(ffi, "float *", y) for y in ys])),
           "matmul_many")
    return ys


# --- memory bandwidth ----------------------------------------------------------------------------

def best_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` after one warm-up call, seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


READ_RUNS = (1, 2, 4, 8)
"""The memory streams a thread keeps in flight in :func:`read_bandwidth`'s patterns; the fastest differs by CPU."""


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Measured streaming-read bandwidth in GB/s (1e9 bytes/s): the best of `repeats` sequential
    reads of an `nbytes` buffer (make it larger than the last-level cache) by set_threads' threads, in each
    pattern of :data:`READ_RUNS`.

    This is the roofline decode is compared with. Native: each thread reads its 1 MiB chunks as 1, 2, 4 and
    8 interleaved runs of 64-bit loads and the fastest pattern counts (which is fastest differs by CPU;
    docs/perf/log/cpu-notes.md "The stream read"); numpy fallback: a numpy sum over the buffer (one thread).
    The buffer is a private map in 4 KiB pages (``MADV_NOHUGEPAGE`` where the OS has it): a GiB of fresh 2 MiB
    pages, numpy's default, left the next prompt slower (docs/perf/log/probe-2026-12-07.md).
    """
    region = mmap.mmap(-1, max(64, nbytes) // 8 * 8)   # unmapped when the last view of it goes
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        region.madvise(advice)
    buf = np.frombuffer(region, dtype=np.uint64)
    buf[:] = 1
    if _native_cpu is None:
        return buf.nbytes / best_seconds(buf.sum, repeats) / 1e9
    ptr = _ptr(_native_cpu.ffi, "uint8_t *", buf)
    seconds = min(best_seconds(functools.partial(_native_cpu.lib.dd_stream_read, ptr, buf.nbytes, runs), repeats)
                  for runs in READ_RUNS)
    return buf.nbytes / seconds / 1e9


# --- elementwise ----------------------------------------------------------------------------------

def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` (the SwiGLU gate) in C: silu in float64, rounded to float32, times u in float32.

    Args: g, u: float32 arrays of one shape (the gate and up projections). Returns: float32, that shape.
    Raises: ValueError on mismatched shapes. With the "numpy" level (or no extension) the twin runs:
    ``engine.ops.reference.silu(g) * u``, the same formula with numpy's exp instead of libm's.
    """
    g, u = np.ascontiguousarray(g, dtype=np.float32), np.ascontiguousarray(u, dtype=np.float32)
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: gate {g.shape} and up {u.shape} differ")
    if _native_level() is None:
        return silu_mul_np(g, u)
    y = np.empty_like(g)
    ffi = _native_cpu.ffi
    _native_cpu.lib.dd_silu_mul(_ptr(ffi, "float *", g), _ptr(ffi, "float *", u), g.size, _ptr(ffi, "float *", y))
    return y


def rmsnorm_rows(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """:func:`engine.ops.reference.rmsnorm` of each row (last axis) in C, rows spread over the pool.

    The reference's float64 arithmetic (numpy's pairwise sum of the squares, the divide, the weight, one
    rounding to float32), so each row has the reference's bits whatever the rows around it or the threads.
    Args: x (..., d) float32, d >= 1; w (d,) float32 or None (no weight); eps the model's rms eps.
    Returns: (..., d) float32. Raises: ValueError when w is not (d,). With the "numpy" level (or no
    extension) the reference itself runs.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    d = x.shape[-1] if x.ndim else 0
    if w is not None:
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.shape != (d,):
            raise ValueError(f"rmsnorm_rows: weight {w.shape} does not match rows of {d} values")
    if _native_level() is None or x.size == 0:
        return reference.rmsnorm(x, w, eps)
    y = np.empty_like(x)
    ffi = _native_cpu.ffi
    wp = ffi.NULL if w is None else _ptr(ffi, "float *", w)
    _check(_native_cpu.lib.dd_rmsnorm_rows(_ptr(ffi, "float *", x), wp, x.size // d, d, float(eps),
                                           _ptr(ffi, "float *", y)), "dd_rmsnorm_rows")
    return y


def silu_mul_np(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`silu_mul`."""
    return reference.silu(g) * np.asarray(u, dtype=np.float32)


set_threads()
