"""The MoE feed-forward on the CPU kernels (docs/spec/qwen35.md 3.3): one token in one native call
(:func:`moe_ffn`, decode), n tokens grouped by expert (:func:`moe_prefill`, prefill), and their numpy
twins. The products are :mod:`engine.kernels.cpu`'s W4A8 / W8A8 kernels, with the same exactness: the
native results are bit-identical across ISA levels and thread counts, and ``moe_prefill``'s token t
equals ``moe_ffn`` of that token bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from gguf import GGMLQuantizationType

from engine.gguf import quant
from engine.kernels.cpu import _check, _kernel_type, _matmul_np, _native_cpu, _native_level, _ptr, _weights
from engine.kernels.cpu_twins import QK, layout_rows
from engine.ops import reference

class MoEWeights(NamedTuple):
    """One layer's MoE tensors (docs/spec/qwen35.md section 2: GGUF names in brackets), raw blocks as ``GGUFFile.raw``
    gives them.

    Each weight is of a :data:`engine.kernels.cpu.KERNEL_TYPES` type named by ``qtypes``: one type for all of them, or a
    mapping from the field name (``"gate"``, ``"up"``, ``"down"``, ``"sh_gate"``, ...) to its type, or to the kernel
    traits of a row-grouped layout (:data:`engine.kernels.cpu.LAYOUTS`: stacked experts whose row counts are
    multiples of the layout's 8 or 4 rows).
    d = model width, ff / ff_sh = expert hidden widths, multiples of their types' block sizes.
    """

    router: np.ndarray         # (n_expert, d) float32 [ffn_gate_inp]
    gate: np.ndarray           # (n_expert * ff, row bytes of d values) uint8 [ffn_gate_exps]
    up: np.ndarray             # (n_expert * ff, row bytes of d values) uint8 [ffn_up_exps]
    down: np.ndarray           # (n_expert * d, row bytes of ff values) uint8 [ffn_down_exps]
    n_used: int                # expert_used_count
    qtypes: GGMLQuantizationType | Mapping[str, GGMLQuantizationType | quant.QuantType]   # storage types, see above
    sh_gate: np.ndarray | None = None      # (ff_sh, ...) uint8 [ffn_gate_shexp]; None: no shared expert
    sh_up: np.ndarray | None = None        # (ff_sh, ...) uint8 [ffn_up_shexp]
    sh_down: np.ndarray | None = None      # (d, ff_sh/32 * block bytes) uint8 [ffn_down_shexp]
    sh_gate_inp: np.ndarray | None = None  # (d,) float32 [ffn_gate_inp_shexp]


class MoEResult(NamedTuple):
    """One token's MoE block: its output and the experts the router chose, with their weights."""
    out: np.ndarray            # (d,) float32
    experts: np.ndarray        # (n_used,) int32, in descending router probability
    weights: np.ndarray        # (n_used,) float32, renormalised to sum 1


def _moe_type(w: MoEWeights, name: str) -> quant.QuantType:
    qtype = w.qtypes.get(name) if isinstance(w.qtypes, Mapping) else w.qtypes
    if qtype is None:
        raise ValueError(f"moe_ffn: qtypes names no storage type for {name}")
    return qtype if isinstance(qtype, quant.QuantType) else _kernel_type(qtype, f"moe_ffn {name}")


def _moe_layout(x: np.ndarray, w: MoEWeights
                ) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, quant.QuantType]], int, int]:
    """Validate; return x as (d,) float32, {name: (raw, type traits)}, ff, ff_sh."""
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    d = x.shape[0]
    n_expert = w.router.shape[0]
    if w.router.shape != (n_expert, d) or d % QK or not 1 <= w.n_used <= min(n_expert, 64):
        raise ValueError(f"moe_ffn: router {w.router.shape} vs x ({d},), n_used={w.n_used}: "
                         f"expected (n_expert, d), d % 32 == 0, 1 <= n_used <= min(n_expert, 64)")
    if w.gate.shape[0] % n_expert or w.gate.shape[0] != w.up.shape[0] or w.down.shape[0] != n_expert * d:
        raise ValueError(f"moe_ffn: gate {w.gate.shape}, up {w.up.shape}, down {w.down.shape} "
                         f"do not stack {n_expert} experts of width d={d}")
    ff = w.gate.shape[0] // n_expert
    mats = {"gate": (w.gate, d), "up": (w.up, d), "down": (w.down, ff)}
    ff_sh = 0
    if w.sh_gate is not None:
        ff_sh = w.sh_gate.shape[0]
        mats |= {"sh_gate": (w.sh_gate, d), "sh_up": (w.sh_up, d), "sh_down": (w.sh_down, ff_sh)}
        if w.sh_up is None or w.sh_down is None or w.sh_gate_inp is None or w.sh_down.shape[0] != d:
            raise ValueError("moe_ffn: the shared expert needs sh_gate, sh_up, sh_down (d rows) and sh_gate_inp")
    layout = {}
    for name, (raw, k) in mats.items():
        traits = _moe_type(w, name)
        expert_rows, group = {"gate": ff, "up": ff, "down": d}.get(name, 0), layout_rows(traits)
        if expert_rows % group:
            raise ValueError(f"moe_ffn {name}: interleaved experts of {expert_rows} rows would share {group}-row "
                             f"stripes")
        layout[name] = (_weights(raw, k, traits, f"moe_ffn {name}"), traits)
    return x, layout, ff, ff_sh


class PreparedMoE:
    """One layer's :class:`MoEWeights` checked and laid out for the native call once (decode calls
    :func:`moe_ffn` on it every token). Raises ValueError as :func:`moe_ffn` does."""

    def __init__(self, w: MoEWeights) -> None:
        self.weights = w
        self.d = w.router.shape[1]
        _, layout, ff, ff_sh = _moe_layout(np.zeros(self.d, dtype=np.float32), w)
        self._keep = [np.ascontiguousarray(w.router, dtype=np.float32)]
        self._c = None
        if _native_cpu is None:
            return
        ffi = _native_cpu.ffi
        c = ffi.new("dd_moe_weights *")
        c.d, c.n_expert, c.n_used, c.ff, c.ff_sh = self.d, w.router.shape[0], w.n_used, ff, ff_sh
        c.router = _ptr(ffi, "float *", self._keep[0])
        for name, (raw, traits) in layout.items():
            setattr(c, name, _ptr(ffi, "uint8_t *", raw))
            setattr(c, f"{name}_type", traits.cpu_kernel)
        if w.sh_gate is not None:
            self._keep.append(np.ascontiguousarray(w.sh_gate_inp, dtype=np.float32).reshape(-1))
            c.sh_gate_inp = _ptr(ffi, "float *", self._keep[1])
        self._c = c


def moe_ffn(x: np.ndarray, w: MoEWeights | PreparedMoE) -> MoEResult:
    """One token's MoE FFN in one native call (docs/spec/qwen35.md 3.3), shared expert included.

    ``p = softmax(router x)``; the ``n_used`` largest (ties: lower index first), renormalised;
    ``out = sum_e w_e down_e(silu(gate_e x) * up_e x) + sigmoid(sh_gate_inp . x) * shared(x)``,
    each product W4A8/W8A8 as in :func:`engine.kernels.cpu.matmul` (x and the hidden vectors quantized to Q8_0).

    Args: x (d,) float32; w: the layer's MoEWeights, or a PreparedMoE of them (no per-call checks).
    Returns: MoEResult(out (d,) float32, experts (n_used,) int32, weights (n_used,) float32).
    Raises: ValueError on inconsistent shapes; EngineError if the native call fails.
    """
    prepared = w if isinstance(w, PreparedMoE) else PreparedMoE(w)
    level = _native_level()
    if level is None:
        return moe_ffn_np(x, prepared.weights)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if x.shape[0] != prepared.d:
        raise ValueError(f"moe_ffn: x has {x.shape[0]} values, the router expects d={prepared.d}")
    ffi, lib = _native_cpu.ffi, _native_cpu.lib
    n_used = prepared.weights.n_used
    out = np.empty_like(x)
    experts = np.empty(n_used, dtype=np.int32)
    weights = np.empty(n_used, dtype=np.float32)
    _check(lib.dd_moe_ffn(level, prepared._c, _ptr(ffi, "float *", x), _ptr(ffi, "float *", out),
                          _ptr(ffi, "int32_t *", experts), _ptr(ffi, "float *", weights)), "moe_ffn")
    return MoEResult(out, experts, weights)


def moe_prefill(x: np.ndarray, w: MoEWeights | PreparedMoE) -> MoEResult:
    """The MoE FFN of n tokens in one native call, grouped by expert: each routed expert's weights
    are read once for all the tokens routed to it, the shared expert's once for all n.

    Token t's results are bit for bit those of ``moe_ffn(x[t], w)`` (same routing and tie rule, same
    products, same summation order; native/cpu/moe/moe_prefill.c), so prefill and decode agree and a prompt's
    split into pieces changes nothing.

    Args: x (n, d) float32; w: the layer's MoEWeights, or a PreparedMoE of them.
    Returns: MoEResult(out (n, d) float32, experts (n, n_used) int32, weights (n, n_used) float32).
    Raises: ValueError on inconsistent shapes; EngineError if the native call fails.
    """
    prepared = w if isinstance(w, PreparedMoE) else PreparedMoE(w)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != prepared.d:
        raise ValueError(f"moe_prefill: x has shape {x.shape}, expected (n, {prepared.d})")
    level = _native_level()
    if level is None:
        return moe_prefill_np(x, prepared.weights)
    ffi, lib = _native_cpu.ffi, _native_cpu.lib
    n, n_used = x.shape[0], prepared.weights.n_used
    out = np.empty_like(x)
    experts = np.empty((n, n_used), dtype=np.int32)
    weights = np.empty((n, n_used), dtype=np.float32)
    _check(lib.dd_moe_prefill(level, prepared._c, n, _ptr(ffi, "float *", x), _ptr(ffi, "float *", out),
                              _ptr(ffi, "int32_t *", experts), _ptr(ffi, "float *", weights)), "moe_prefill")
    return MoEResult(out, experts, weights)


def moe_prefill_np(x: np.ndarray, w: MoEWeights) -> MoEResult:
    """numpy twin of :func:`moe_prefill`: :func:`moe_ffn_np` token by token, results stacked."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, w.router.shape[1])
    if x.shape[0] == 0:
        return MoEResult(x.copy(), np.empty((0, w.n_used), np.int32), np.empty((0, w.n_used), np.float32))
    results = [moe_ffn_np(row, w) for row in x]
    return MoEResult(*(np.stack(parts) for parts in zip(*results)))


def moe_ffn_np(x: np.ndarray, w: MoEWeights) -> MoEResult:
    """numpy twin of :func:`moe_ffn`: the same steps through the numpy matmul twins and engine.ops.reference."""
    x, layout, ff, _ = _moe_layout(x, w)
    d = x.shape[0]
    logits = (np.asarray(w.router, dtype=np.float64) @ x).astype(np.float32)
    idx, weights = reference.topk_route(logits[None], w.n_used)

    def product(name: str, rows: slice, v: np.ndarray) -> np.ndarray:
        raw, traits = layout[name]
        return _matmul_np(raw[rows], v, traits, f"moe_ffn {name}")

    def swiglu(prefix: str, rows: slice, down_rows: slice) -> np.ndarray:
        h = reference.silu(product(prefix + "gate", rows, x)) * product(prefix + "up", rows, x)
        return product(prefix + "down", down_rows, h)

    out = np.zeros(d, dtype=np.float32)
    for e, weight in zip(idx[0], weights[0]):
        out += weight * swiglu("", slice(e * ff, (e + 1) * ff), slice(e * d, (e + 1) * d))
    if w.sh_gate is not None:
        gate = reference.sigmoid(np.float32(np.dot(np.asarray(w.sh_gate_inp, dtype=np.float64).reshape(-1), x)))
        out += gate * swiglu("sh_", slice(None), slice(None))
    return MoEResult(out, idx[0].astype(np.int32), weights[0])
