"""The token mixers in C: the Gated DeltaNet recurrent step and causal gated attention over the KV
cache, with numpy twins built from :mod:`engine.ops.reference`.

Native code: native/cpu/gdn/gdn_kernel.h and attn_kernel.h, compiled per ISA level. Same bits at every
level and thread count, and prefill gives each position decode's bits. Outputs agree with the twins
to <= 1e-6 relative (test bound 1e-5). Design: docs/design/native-cpu.md.
"""

from __future__ import annotations

import numpy as np

from engine.kernels import cpu
from engine.ops import reference as ops
from engine.turn.kv_types import Q8_BLOCK, Q8_BYTES, kv_widen


MAX_CONV = 16
"""Most conv taps the native kernel takes (``DD_GDN_MAX_CONV``; Qwen3.5/3.6 use 4)."""


class GDNLayer:
    """One Gated DeltaNet layer's small tensors (GGUF names in brackets) and head shape, checked and
    laid out for the native call once.

    Args:
        n_k, n_v: q/k heads [ssm.group_count] and v heads [ssm.time_step_rank], n_v % n_k == 0.
        dk, dv: head widths [ssm.state_size; ssm.inner_size / n_v], dv <= 1024.
        conv_w: (conv_dim, K) float32 [ssm_conv1d.weight], column 0 the oldest tap, K <= MAX_CONV;
            conv_dim = 2 * n_k * dk + n_v * dv.
        dt_bias: (n_v,) float32 [ssm_dt.bias]. ssm_a: (n_v,) float32 [ssm_a], stored -exp(A_log).
        norm_w: (dv,) float32 [ssm_norm.weight]. eps: attention.layer_norm_rms_epsilon.
    The conv weights are held once, tap-major (``conv_taps``, (K, conv_dim), what the native kernel loads a
    vector at a time); ``conv_w`` is its transposed view.
    Raises: ValueError on inconsistent shapes.
    """

    def __init__(self, n_k: int, n_v: int, dk: int, dv: int, conv_w: np.ndarray, dt_bias: np.ndarray,
                 ssm_a: np.ndarray, norm_w: np.ndarray, eps: float) -> None:
        if min(n_k, n_v, dk, dv) < 1 or n_v % n_k or dv > 1024:
            raise ValueError(f"GDNLayer: n_k={n_k}, n_v={n_v}, dk={dk}, dv={dv}: expected n_v % n_k == 0, dv <= 1024")
        self.n_k, self.n_v, self.dk, self.dv, self.eps = n_k, n_v, dk, dv, float(eps)
        self.conv_dim = 2 * n_k * dk + n_v * dv
        conv_w = np.asarray(conv_w)
        if conv_w.ndim != 2 or conv_w.shape[0] != self.conv_dim or not 1 <= conv_w.shape[1] <= MAX_CONV:
            raise ValueError(f"GDNLayer: conv_w has shape {conv_w.shape}, expected ({self.conv_dim}, K), "
                             f"1 <= K <= {MAX_CONV}")
        self.conv_taps = np.ascontiguousarray(_f32(conv_w, conv_w.shape, "conv_w").T)
        self.conv_w = self.conv_taps.T
        self.dt_bias, self.ssm_a = _f32(dt_bias, (n_v,), "dt_bias"), _f32(ssm_a, (n_v,), "ssm_a")
        self.norm_w = _f32(norm_w, (dv,), "norm_w")
        self._c = None
        if cpu.available():
            ffi = cpu._native_cpu.ffi
            c = ffi.new("dd_gdn_layer *")
            c.n_k, c.n_v, c.dk, c.dv, c.conv_kernel, c.eps = n_k, n_v, dk, dv, self.conv_w.shape[1], self.eps
            c.conv_w, c.dt_bias, c.ssm_a, c.norm_w = (ffi.cast("float *", ffi.from_buffer(t)) for t in
                                                      (self.conv_taps, self.dt_bias, self.ssm_a, self.norm_w))
            self._c = c


def _f32(a: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.size != int(np.prod(shape)):
        raise ValueError(f"{what}: expected {shape} float32 values, got shape {a.shape}")
    return a.reshape(shape)


def _state(a: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous \
            or not a.flags.writeable:
        raise ValueError(f"{what}: expected a writeable C-contiguous float32 array of shape {shape}")
    return a


def _gdn_args(layer: GDNLayer, mixed, z, b, a, conv_state, ssm_state):
    nvd = layer.n_v * layer.dv
    return (_f32(mixed, (layer.conv_dim,), "mixed"), _f32(z, (nvd,), "z"),
            _f32(b, (layer.n_v,), "b"), _f32(a, (layer.n_v,), "a"),
            _state(conv_state, (layer.conv_w.shape[1] - 1, layer.conv_dim), "conv_state"),
            _state(ssm_state, (layer.n_v, layer.dk, layer.dv), "ssm_state"))


def gdn_decode(layer: GDNLayer, mixed: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
               conv_state: np.ndarray, ssm_state: np.ndarray) -> np.ndarray:
    """One token of a Gated DeltaNet layer from its raw projections (docs/spec/qwen35.md 3.2 steps 2-6).

    Args:
        layer: the layer's :class:`GDNLayer`.
        mixed: (conv_dim,) float32 ``attn_qkv`` projection (pre-conv); z: (n_v*dv,) ``attn_gate``
            projection; b, a: (n_v,) ``ssm_beta`` / ``ssm_alpha`` projections.
        conv_state: (K-1, conv_dim) float32, the last K-1 raw projections, oldest first; updated.
        ssm_state: (n_v, dk, dv) float32 delta-rule state S; updated.
    Returns: (n_v*dv,) float32, ``rmsnorm(o_h) * ssm_norm * silu(z_h)`` per v-head (what ``ssm_out`` reads).
    Raises: ValueError on a shape/dtype mismatch (states must be writeable C-contiguous float32);
        EngineError if the native call fails.
    """
    if cpu.isa() == "numpy":
        return gdn_decode_np(layer, mixed, z, b, a, conv_state, ssm_state)
    args = _gdn_args(layer, mixed, z, b, a, conv_state, ssm_state)
    ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
    y = np.empty(layer.n_v * layer.dv, dtype=np.float32)
    ptrs = [ffi.cast("float *", ffi.from_buffer(t)) for t in (*args, y)]
    cpu._check(lib.dd_gdn_decode(layer._c, *ptrs), "gdn_decode")
    return y


def gdn_decode_np(layer: GDNLayer, mixed: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
                  conv_state: np.ndarray, ssm_state: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`gdn_decode`: the reference ops of ``Qwen35Model.delta_rule`` for one token."""
    mixed, z, b, a, conv_state, ssm_state = _gdn_args(layer, mixed, z, b, a, conv_state, ssm_state)
    nk, nv, dk, dv = layer.n_k, layer.n_v, layer.dk, layer.dv
    conv, new_conv = ops.causal_conv1d(mixed[None], layer.conv_w, conv_state)
    conv_state[...] = new_conv
    u = ops.silu(conv[0])
    q = ops.l2norm(u[:nk * dk].reshape(nk, dk), layer.eps) * np.float32(dk ** -0.5)
    k = ops.l2norm(u[nk * dk:2 * nk * dk].reshape(nk, dk), layer.eps)
    g = layer.ssm_a * ops.softplus(a + layer.dt_bias)
    o, s = ops.gdn_step(q, k, u[2 * nk * dk:].reshape(nv, dv), g, ops.sigmoid(b), ssm_state)
    ssm_state[...] = s
    return ops.gated_rmsnorm(o, layer.norm_w, z.reshape(nv, dv), layer.eps).reshape(-1)


def gdn_prefill(layer: GDNLayer, mixed: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
                conv_state: np.ndarray, ssm_state: np.ndarray) -> np.ndarray:
    """n tokens of a Gated DeltaNet layer, each by the arithmetic of one :func:`gdn_decode` step (so a
    token's output and the state it leaves do not depend on how many tokens share the call): native
    ``dd_gdn_prefill`` runs the tokens' conv inputs in order, then each v-head through all n tokens on
    the thread pool (one dispatch, not one per token); the twin loops :func:`gdn_decode_np`.

    Args: mixed (n, conv_dim), z (n, n_v*dv), b and a (n, n_v) float32; the states as for :func:`gdn_decode`.
    Returns: (n, n_v*dv) float32. Raises: as :func:`gdn_decode`.
    """
    n = mixed.shape[0]
    if cpu.isa() == "numpy":
        return np.stack([gdn_decode_np(layer, mixed[t], z[t], b[t], a[t], conv_state, ssm_state) for t in range(n)])
    nvd = layer.n_v * layer.dv
    mixed, z = _f32(mixed, (n, layer.conv_dim), "mixed"), _f32(z, (n, nvd), "z")
    b, a = _f32(b, (n, layer.n_v), "b"), _f32(a, (n, layer.n_v), "a")
    conv_state = _state(conv_state, (layer.conv_w.shape[1] - 1, layer.conv_dim), "conv_state")
    ssm_state = _state(ssm_state, (layer.n_v, layer.dk, layer.dv), "ssm_state")
    ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
    y = np.empty((n, nvd), dtype=np.float32)
    ptrs = [ffi.cast("float *", ffi.from_buffer(t)) for t in (mixed, z, b, a, conv_state, ssm_state, y)]
    cpu._check(lib.dd_gdn_prefill(cpu._native_level(), layer._c, n, *ptrs), "gdn_prefill")
    return y


def attention_prefill(q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """n queries, the last n of the m cache rows, each by the arithmetic of :func:`attention_decode` over
    the rows it sees (native ``dd_attn_prefill``: tiles of 16 to 64 queries x blocks of 256 cache rows at
    absolute positions, so a query's bits do not depend on the call it comes in); the twin runs
    :func:`attention_decode_np` query by query.

    Args: q, gate (n, n_head, hd) float32; k, v (m, n_kv, hd) float32 or float16 C-contiguous cache rows, or
    Q8_0 rows (m, n_kv, hd / 32 * 34) uint8; m >= n (query i sits at row m - n + i). Returns: (n, n_head * hd)
    float32. Raises: as :func:`attention_decode`.
    """
    n, m = q.shape[0], k.shape[0]
    if cpu.isa() == "numpy":
        k, v = kv_widen(k), kv_widen(v)
        return np.stack([attention_decode_np(q[i], gate[i], k[:m - n + i + 1], v[:m - n + i + 1]) for i in range(n)])
    if q.ndim != 3 or gate.shape != q.shape or n > m:
        raise ValueError(f"attention_prefill: q {q.shape}, gate {gate.shape}, k {k.shape}: expected q/gate "
                         "(n, n_head, hd) with n <= m")
    _check_cache(*_attn_args(q[0], gate[0], k, v))
    q, gate = np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(gate, dtype=np.float32)
    ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
    out = np.empty((n, q.shape[1] * q.shape[2]), dtype=np.float32)
    ptr = [ffi.cast("float *", ffi.from_buffer(t)) for t in (q, gate, k, v, out)]
    cpu._check(lib.dd_attn_prefill_kv(cpu._native_level(), q.shape[1], k.shape[1], q.shape[2], n, ptr[0], ptr[1],
                                      _KV_CODES[k.dtype], ptr[2], ptr[3], m, ptr[4]), "attention_prefill")
    return out


def _attn_args(q, gate, k, v):
    q = np.ascontiguousarray(q, dtype=np.float32)
    n_head, hd = q.shape
    m, n_kv, hd_k = k.shape
    width = hd // Q8_BLOCK * Q8_BYTES if k.dtype == np.uint8 and hd % Q8_BLOCK == 0 else hd
    if gate.shape != q.shape or v.shape != k.shape or hd_k != width or n_head % n_kv or m == 0:
        raise ValueError(f"attention_decode: q {q.shape}, gate {gate.shape}, k {k.shape}, v {v.shape}: "
                         "expected q/gate (n_head, hd), k/v (m >= 1, n_kv, hd) (Q8_0: hd / 32 * 34 bytes, hd a "
                         "multiple of 32), n_head % n_kv == 0")
    return q, np.ascontiguousarray(gate, dtype=np.float32), k, v


_KV_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint8): 2}
"""Cache dtype -> the kernels' kv_type (DD_KV_F32, DD_KV_F16, DD_KV_Q8_0: uint8 rows of Q8_0 blocks)."""


def _check_cache(q, gate, k, v):
    if (k.dtype != v.dtype or k.dtype not in _KV_CODES or not (k.flags.c_contiguous and v.flags.c_contiguous)):
        raise ValueError("attention: the cache rows must be C-contiguous float32, float16 or Q8_0 uint8 (both the "
                         "same)")
    if q.shape[1] % cpu._native_cpu.lib.DD_ATTN_LANES:
        raise ValueError(f"attention: head_dim {q.shape[1]} is not a multiple of {cpu._native_cpu.lib.DD_ATTN_LANES}")
    if q.shape[0] // k.shape[1] > cpu._native_cpu.lib.DD_ATTN_MAX_GROUP:
        raise ValueError(f"attention: {q.shape[0]} q heads on {k.shape[1]} kv heads, more than "
                         f"{cpu._native_cpu.lib.DD_ATTN_MAX_GROUP} per kv head")
    return q, gate, k, v


def attention_decode(q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query per head over the m cached positions, gated (docs/spec/qwen35.md 3.1 steps 5-6).

    Args:
        q: (n_head, hd) float32 after norm and RoPE; gate: (n_head, hd) float32.
        k, v: (m, n_kv, hd) float32 or float16 cache rows 0..m-1 (the query sits at m-1), or Q8_0 rows
            (m, n_kv, hd / 32 * 34) uint8, C-contiguous (a leading slice of ``SequenceState.k[il]`` is); a half
            or Q8_0 value is widened exactly, so such a cache gives the bits of an F32 cache holding its values.
    Returns: (n_head * hd,) float32 ``softmax(q k^T / sqrt(hd)) v * sigmoid(gate)``, q head n on kv head
        ``n // (n_head / n_kv)``.
    Raises: ValueError on mismatched shapes, hd not a multiple of 16 or more than 64 q heads per kv
        head; EngineError if the call fails.
    """
    if cpu.isa() == "numpy":
        return attention_decode_np(q, gate, k, v)
    q, gate, k, v = _check_cache(*_attn_args(q, gate, k, v))
    ffi, lib = cpu._native_cpu.ffi, cpu._native_cpu.lib
    out = np.empty(q.size, dtype=np.float32)
    ptr = [ffi.cast("float *", ffi.from_buffer(t)) for t in (q, gate, k, v, out)]
    cpu._check(lib.dd_attn_decode_kv(q.shape[0], k.shape[1], q.shape[1], ptr[0], ptr[1], _KV_CODES[k.dtype], ptr[2],
                                     ptr[3], k.shape[0], ptr[4]), "attention_decode")
    return out


def attention_decode_np(q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`attention_decode` (:func:`engine.ops.reference.gated_attention` with n = 1 over
    the cache rows widened to float32)."""
    q, gate, k, v = _attn_args(q, gate, k, v)
    return ops.gated_attention(q[None], gate[None], kv_widen(k), kv_widen(v))[0]
