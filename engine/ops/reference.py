"""Plain numpy versions of every op of the Qwen3.5/3.6 text model: the executable spec.

Each function is written to be read next to ``docs/spec/qwen35.md`` (section numbers below)
and is what the fast CPU/CUDA kernels are tested against.

Precision rule: every op takes float32 (or any real) arrays, computes in **float64** and returns
**float32**. Rounding therefore happens only at op boundaries, and transformers' float32 reference
itself carries about 1e-5 of rounding.

Row rule: the ops the model applies to a batch of positions (norms, RoPE, :func:`linear_rows`,
:func:`swiglu`, :func:`shared_expert`, :func:`gated_attention`, :func:`topk_route`, the elementwise
functions) give the same float32 bits for a row whether it is called on one position or inside a
batch. Reductions run along a row's own contiguous axis; products that BLAS would block
differently for another batch size (its vector-matrix and matrix-matrix kernels sum in different
orders, and a row's place in a block changes its kernel) are taken one row at a time with the same
vector-matrix call whatever the batch. That is what makes the model's prefill independent of how
a prompt is cut into pieces (:mod:`engine.arch.qwen35.model`). :func:`linear` (BLAS on the whole batch)
and :func:`gdn_chunked` do not follow it; the vision tower and the GPU's reference use them.

Head layouts are those of the GGUF files (llama.cpp ``convert_hf_to_gguf.py``): in particular the
Gated DeltaNet v-heads are *tiled*, so v-head ``h`` reads q/k head ``h mod n_k`` (docs/spec/qwen35.md section 2, item
3).

Sources, per op: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with
Delta Rule" (2024) for the delta rule and its chunked (WY/UT) form; llama.cpp ``src/models/qwen35moe.cpp``,
``src/models/delta-net-base.cpp``, ``src/llama-graph.cpp`` (build_moe_ffn) and ggml ``src/ggml-cpu/ops.cpp``
(ssm_conv, gated_delta_net, l2_norm, rope/imrope); transformers
``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` (Qwen3_5MoeRMSNorm, Qwen3_5MoeRMSNormGated,
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, Qwen3_5MoeTextRotaryEmbedding,
Qwen3_5MoeTopKRouter, Qwen3_5MoeSparseMoeBlock).
"""

from __future__ import annotations

import numpy as np

GDN_CHUNK = 64
"""Chunk length C of the chunked Gated DeltaNet form (llama.cpp, transformers and FLA all use 64)."""


def _d(x: np.ndarray) -> np.ndarray:
    """As float64 (no copy if already float64)."""
    return np.asarray(x, dtype=np.float64)


def _f(x: np.ndarray) -> np.ndarray:
    """As float32, the result type of every op."""
    return np.asarray(x, dtype=np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``y = x W^T``: x (n, in), w (out, in) in math shape (a GGUF ``ne={in,out}`` tensor) -> (n, out) float32.

    Every projection of the model goes through this op (the fast backends replace it with their
    quantized matmuls). It multiplies in float32 (BLAS sgemm, float32 accumulation): a float64
    copy of every weight on every call would cost more than the product itself (a 248320 x 2048
    LM head is 4 GB in float64). The other ops compute in float64 inside.
    """
    return np.asarray(x, np.float32) @ np.asarray(w, np.float32).T


def linear_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`linear` one row at a time: x (n, in), w (out, in) -> (n, out) float32, row i equal to
    the product of ``x[i]`` alone (one float32 vector-matrix BLAS call per row, whatever n).

    The model's projections use it so that a position's result does not depend on the batch it is
    in (module docstring, row rule); it reads ``w`` once per row, so batched prefill on the numpy
    path costs about what decoding the same tokens costs in the projections.
    """
    x = np.asarray(x, np.float32)
    wt = np.asarray(w, np.float32).T
    out = np.empty((x.shape[0], wt.shape[1]), dtype=np.float32)
    for i in range(x.shape[0]):
        out[i] = x[i] @ wt
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function 1 / (1 + e^-x), elementwise -> float32; stable for large |x|."""
    return _f(_sigmoid(_d(x)))


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU (swish) x * sigmoid(x), elementwise -> float32."""
    x = _d(x)
    return _f(x * _sigmoid(x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), elementwise -> float32; as max(x, 0) + log1p(e^-|x|) (no overflow, exact for large x)."""
    x = _d(x)
    return _f(np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x))))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along ``axis`` -> float32, with the maximum subtracted first."""
    return _f(_softmax(_d(x), axis))


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * w``.

    Args:
        x: (..., d) float32.
        w: (d,) float32 weight *as stored in the GGUF* (already ``1 + w_hf`` for the zero-centred
            norms, docs/spec/qwen35.md section 2 item 1), or None for no weight.
        eps: attention.layer_norm_rms_epsilon (1e-6).
    Returns: (..., d) float32.
    Source: transformers Qwen3_5MoeRMSNorm; llama.cpp build_norm(LLM_NORM_RMS).
    """
    y = _rmsnorm(_d(x), eps)
    return _f(y if w is None else y * _d(w))


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """L2 normalisation over the last axis: ``x / sqrt(sum(x^2) + eps)`` (transformers/FLA form).

    llama.cpp uses ``x / max(||x||, eps)``; the two differ only for ||x|| near sqrt(eps).
    Args: x (..., d) float32; eps the model's rms eps (1e-6). Returns (..., d) float32.
    """
    x = _d(x)
    return _f(x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps))


def gated_rmsnorm(o: np.ndarray, w: np.ndarray, z: np.ndarray, eps: float) -> np.ndarray:
    """The GDN output norm (section 3.2 step 6): ``rmsnorm(o, eps) * w * silu(z)`` per v-head.

    Args:
        o: (..., dv) float32 delta-rule outputs; z: (..., dv) float32 gate (``attn_gate`` projection).
        w: (dv,) float32 ``ssm_norm.weight``, used as stored (it is *not* +1-shifted).
    Returns: (..., dv) float32.
    Source: transformers Qwen3_5MoeRMSNormGated (norm before gate).
    """
    z = _d(z)
    return _f(_rmsnorm(_d(o), eps) * _d(w) * z * _sigmoid(z))


def rope_tables(positions: np.ndarray, rope_dims: int, theta: float,
                sections: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The cos and sin of :func:`rope_multi`'s angles: pair ``i`` of position ``j`` turns by
    ``p_i[j] * theta^(-2i/rope_dims)`` radians, ``p_i`` the M-RoPE component of pair i (see there).

    Args: positions (3, n) integer t/h/w positions, or (n,) for all three; rope_dims, theta, sections
    as for :func:`rope_multi`. Returns: (cos, sin), each (n, rope_dims // 2) float64. The native decode
    step takes these tables, so its rotation uses the same numpy cos/sin as this reference.
    """
    pos = _d(positions)
    if pos.ndim == 1:
        pos = np.broadcast_to(pos, (3, pos.shape[0]))
    half = rope_dims // 2
    i = np.arange(half)
    component = np.zeros(half, dtype=np.int64)
    component[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    component[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    angle = pos[component, :].T * theta ** (-2.0 * i / rope_dims)     # (n, half)
    return np.cos(angle), np.sin(angle)


def rope_multi(x: np.ndarray, positions: np.ndarray, rope_dims: int, theta: float,
               sections: tuple[int, ...]) -> np.ndarray:
    """Partial NEOX (rotate-half) RoPE with interleaved M-RoPE positions (section 3.1 step 4).

    Only the first ``rope_dims`` values of each head rotate; the rest pass through. Inside that
    slice, pair ``i`` (i < rope_dims/2) couples dims ``i`` and ``i + rope_dims/2`` and turns by
    angle ``p_i * theta^(-2i/rope_dims)`` (radians). The position ``p_i`` comes from one of the
    three components of ``positions`` by the interleaved rule (llama.cpp ``GGML_ROPE_TYPE_IMROPE``,
    transformers ``Qwen3_5MoeTextRotaryEmbedding.recomposition_frequencies``): component h if
    ``i % 3 == 1 and i < 3*sections[1]``, w if ``i % 3 == 2 and i < 3*sections[2]``, else t.
    For text, t = h = w = the token index and this is plain partial RoPE.

    Args:
        x: (n, n_heads, head_dim) float32 (q or k after their per-head RMSNorm).
        positions: (3, n) integer t/h/w positions, or (n,) used for all three.
        rope_dims: rotated dims per head (even, <= head_dim).
        theta: rope.freq_base.
        sections: rope.dimension_sections, in rotation pairs (only [1] and [2] matter).
    Returns: (n, n_heads, head_dim) float32.
    """
    half = rope_dims // 2
    cos, sin = rope_tables(positions, rope_dims, theta, sections)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = np.array(x, dtype=np.float32)
    x1, x2 = _d(out[..., :half]), _d(out[..., half:rope_dims])
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rope_dims] = x1 * sin + x2 * cos
    return out


def gated_attention(q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal GQA softmax attention over a KV cache, gated by sigmoid (section 3.1 steps 5-6).

    The n queries are the *last* n positions of the cache: query row ``i`` sits at cache index
    ``m - n + i`` and attends to cache rows ``0 .. m - n + i``. Scale ``1/sqrt(head_dim)``;
    q head ``h`` reads kv head ``h // (n_head / n_kv)`` (block mapping, unlike the GDN tiling).

    Args:
        q: (n, n_head, head_dim) float32, after norm and RoPE.
        gate: (n, n_head, head_dim) float32, the gate half of ``attn_q``.
        k, v: (m, n_kv, head_dim) float32, the valid cache rows (m >= n), k after norm and RoPE.
    Returns: (n, n_head * head_dim) float32, ``attn(q,k,v) * sigmoid(gate)``, heads concatenated.
    Source: transformers Qwen3_5MoeAttention / eager_attention_forward; llama.cpp build_attn.
    """
    n, n_head, hd = q.shape
    m, n_kv, _ = k.shape
    group = n_head // n_kv
    kh, vh = _d(k).transpose(1, 0, 2)[:, None], _d(v).transpose(1, 0, 2)[:, None]   # (n_kv, 1, m, hd)
    out = np.empty((n, n_head * hd), dtype=np.float32)
    for i in range(n):            # one query at a time over exactly the rows it sees (row rule)
        end = m - n + i + 1
        qh = _d(q[i]).reshape(n_kv, group, 1, hd)
        scores = (qh @ kh[:, :, :end].swapaxes(-1, -2)) / np.sqrt(hd)   # (n_kv, group, 1, end)
        o = (_softmax(scores) @ vh[:, :, :end]).reshape(n_head * hd)
        out[i] = _f(o * _sigmoid(_d(gate[i]).reshape(n_head * hd)))
    return out


def causal_conv1d(x: np.ndarray, w: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over time, no bias, no activation (section 3.2 step 2).

    ``y_t[c] = sum_j w[c, j] * m_{t-K+1+j}[c]``, j = K-1 multiplying the current input and the
    inputs before the sequence taken from ``state`` (zeros for a fresh sequence).

    Args:
        x: (n, C) float32 raw projections (pre-conv, pre-SiLU) of the n new tokens.
        w: (C, K) float32 ``ssm_conv1d.weight``, column 0 the oldest tap.
        state: (K-1, C) float32, the previous K-1 raw projections, oldest first.
    Returns: (y (n, C) float32, new_state (K-1, C) float32 = the last K-1 rows of [state; x]).
    Source: llama.cpp ggml_ssm_conv; transformers causal_conv1d_fn / causal_conv1d_update.
    """
    n, k_size = x.shape[0], w.shape[1]
    full = np.concatenate([_f(state), _f(x)], axis=0)
    hist, wd = _d(full), _d(w)
    y = sum(hist[j:j + n] * wd[:, j] for j in range(k_size))
    return _f(y), full[n:].copy()


def _tile_heads(x: np.ndarray, n_v: int) -> np.ndarray:
    """(..., n_k, d) -> (..., n_v, d) with v-head h reading head h mod n_k (the GGUF tiled order)."""
    reps = [1] * x.ndim
    reps[-2] = n_v // x.shape[-2]
    return np.tile(x, reps)


def gdn_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
             state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token of the gated delta rule (section 3.2 step 5), all v-heads at once.

    Per v-head h (q/k head ``h mod n_k``)::

        S <- exp(g_h) S ;  d <- beta_h (v_h - S^T k) ;  S <- S + k d^T ;  o_h <- S^T q

    Args:
        q, k: (n_k, dk) float32, L2-normalised; q also scaled by 1/sqrt(dk).
        v: (n_v, dv) float32.  g: (n_v,) log-decay (<= 0).  beta: (n_v,) in (0, 1).
        state: (n_v, dk, dv) float32 S (transformers layout; llama.cpp stores the transpose).
    Returns: (o (n_v, dv) float32, new state (n_v, dk, dv) float32); the input state is not modified.
    Source: Yang et al. 2024 (gated delta rule); transformers torch_recurrent_gated_delta_rule.
    """
    o, s = _gdn_step(_d(q), _d(k), _d(v), _d(g), _d(beta), _d(state))
    return _f(o), _f(s)


def _gdn_step(q, k, v, g, beta, s):
    n_v = v.shape[0]
    qh, kh = _tile_heads(q, n_v), _tile_heads(k, n_v)
    s = s * np.exp(g)[:, None, None]
    d = (v - np.einsum("hkv,hk->hv", s, kh)) * beta[:, None]
    s = s + kh[:, :, None] * d[:, None, :]
    return np.einsum("hkv,hk->hv", s, qh), s


def gdn_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                  state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule as a token loop (the oracle for :func:`gdn_chunked`).

    Args: q, k (n, n_k, dk); v (n, n_v, dv); g, beta (n, n_v); state (n_v, dk, dv); all float32,
    normalised as for :func:`gdn_step`. Returns (o (n, n_v, dv) float32, final state float32).
    """
    q, k, v, g, beta = _d(q), _d(k), _d(v), _d(g), _d(beta)
    out = np.empty(v.shape)
    s = _d(state)
    for t in range(v.shape[0]):
        out[t], s = _gdn_step(q[t], k[t], v[t], g[t], beta[t], s)
    return _f(out), _f(s)


def _forward_substitute(lower: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve ``(I + L) X = B`` for X, L strictly lower triangular; batched over leading axes.

    lower: (..., C, C); rhs: (..., C, d). Row i: X_i = B_i - L_i,:i X_:i (unit diagonal).
    """
    x = np.array(rhs, copy=True)
    for i in range(1, x.shape[-2]):
        x[..., i, :] -= np.einsum("...j,...jd->...d", lower[..., i, :i], x[..., :i, :])
    return x


def gdn_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                state: np.ndarray, chunk: int = GDN_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule in chunked (UT-transform) form, for prefill (section 3.2, chunked form).

    Args: q, k (n, n_k, dk); v (n, n_v, dv); g, beta (n, n_v); state (n_v, dk, dv), all float32
    (q, k normalised as for :func:`gdn_step`); ``chunk`` = C. Returns (o (n, n_v, dv) float32,
    final state (n_v, dk, dv) float32), equal to :func:`gdn_recurrent` up to rounding; v-head h
    reads q/k head ``h mod n_k``.

    Tokens are split into chunks of ``chunk``; the last one is padded with q = k = v = 0, beta = 0
    and **g = 0**, so its last cumulative decay is that of the last real token and the final
    state is exact. Per chunk (G = inclusive cumsum of g)::

        Gam = exp(G_i - G_j) for j <= i else 0     (masked BEFORE exp, never exp(G_i) exp(-G_j))
        A = (diag(beta) K K^T) * Gam ;  T = (I + strict_lower(A))^-1   (forward substitution)
        U = T diag(beta) V ;  W = T diag(beta exp(G)) K ;  P = (Q K^T) * Gam
        Vn = U - W S ;  O = diag(exp(G)) Q S + P Vn ;  S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T Vn

    Source: Yang et al. 2024, section 3 (chunkwise parallel form); transformers
    torch_chunk_gated_delta_rule; llama.cpp delta-net-base.cpp.
    """
    n, n_v, dv = v.shape
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def chunked(x: np.ndarray) -> np.ndarray:
        """(n, n_v, ...) -> zero-padded (n_v, n_chunks, C, ...), float64, C-contiguous.

        Contiguous on purpose: numpy's batched matmul falls back to a naive loop (no BLAS) on
        strided operands, which made this function ~50x slower.
        """
        x = np.concatenate([_d(x), np.zeros((pad,) + x.shape[1:])])
        return np.ascontiguousarray(np.moveaxis(x.reshape((n_chunks, chunk) + x.shape[1:]), 2, 0))

    qc, kc = chunked(_tile_heads(q, n_v)), chunked(_tile_heads(k, n_v))
    vc, bc, gcum = chunked(v), chunked(beta), np.cumsum(chunked(g), axis=-1)

    causal = np.tril(np.ones((chunk, chunk), dtype=bool))
    gam = np.exp(np.where(causal, gcum[..., :, None] - gcum[..., None, :], -np.inf))   # (n_v, nc, C, C)
    lower = np.tril(bc[..., :, None] * (kc @ kc.swapaxes(-1, -2)) * gam, -1)
    uw = _forward_substitute(lower, np.concatenate(
        [bc[..., None] * vc, (bc * np.exp(gcum))[..., None] * kc], axis=-1))
    u, w = np.ascontiguousarray(uw[..., :dv]), np.ascontiguousarray(uw[..., dv:])
    p = (qc @ kc.swapaxes(-1, -2)) * gam
    q_dec = qc * np.exp(gcum)[..., None]
    k_dec_t = np.ascontiguousarray((kc * np.exp(gcum[..., -1:] - gcum)[..., None]).swapaxes(-1, -2))
    chunk_dec = np.exp(gcum[..., -1])                                                   # (n_v, nc)

    s = _d(state)
    out = np.empty((n_v, n_chunks, chunk, dv))
    for c in range(n_chunks):
        vn = u[:, c] - w[:, c] @ s
        out[:, c] = q_dec[:, c] @ s + p[:, c] @ vn
        s = s * chunk_dec[:, c, None, None] + k_dec_t[:, c] @ vn
    o = np.moveaxis(out, 0, 2).reshape(n_chunks * chunk, n_v, dv)[:n]
    return _f(o), _f(s)


def topk_route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax router with top-k selection and renormalisation (section 3.3).

    ``p = softmax(logits)`` over all experts; the k largest are selected (ties: lower index first)
    and their weights renormalised to sum to 1 (llama.cpp clamps the sum at >= 6.1e-5, which a
    softmax's top entries never reach; kept for parity).

    Args: logits (n, n_expert) float32; k = expert_used_count.
    Returns: (idx (n, k) int64 in descending probability, weights (n, k) float32).
    Source: transformers Qwen3_5MoeTopKRouter; llama.cpp build_moe_ffn (softmax gating, norm_w).
    """
    p = _softmax(_d(logits))
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(p, idx, axis=-1)
    return idx, _f(top / np.maximum(top.sum(axis=-1, keepdims=True), 6.103515625e-5))


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU feed-forward ``W_down (silu(W_gate x) * (W_up x))`` (section 3.3; dense qwen35 FFN).

    Args: x (n, d); w_gate, w_up (ff, d); w_down (d, ff); all float32 in math shape (out, in).
    Returns: (n, d) float32.  Source: transformers Qwen3_5MoeMLP; llama.cpp build_ffn(LLM_FFN_SILU, PAR).
    """
    return _f(_swiglu(_d(x), w_gate, w_up, w_down))


def _swiglu(x, w_gate, w_up, w_down):
    """float64 SwiGLU of each row of x (n, d) on its own (row rule): (n, d) float64."""
    gate_t, up_t, down_t = _d(w_gate).T, _d(w_up).T, _d(w_down).T
    out = np.empty((x.shape[0], down_t.shape[1]))
    for i in range(x.shape[0]):
        a = x[i] @ gate_t
        out[i] = (a * _sigmoid(a) * (x[i] @ up_t)) @ down_t
    return out


def shared_expert(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                  w_shgate: np.ndarray) -> np.ndarray:
    """Sigmoid-gated shared expert: ``swiglu(x) * sigmoid(w_shgate . x)`` per token (section 3.3).

    Args: x (n, d); w_gate, w_up (ff_sh, d); w_down (d, ff_sh); w_shgate (d,) ``ffn_gate_inp_shexp``.
    Returns: (n, d) float32.  Source: transformers Qwen3_5MoeSparseMoeBlock (shared_expert_gate).
    """
    x = _d(x)
    w_shgate = _d(w_shgate).reshape(-1)
    gate = np.array([row @ w_shgate for row in x])
    return _f(_swiglu(x, w_gate, w_up, w_down) * _sigmoid(gate)[:, None])
