"""The Qwen3.5/3.6 hybrid text model (GGUF arch ``qwen35moe`` and its dense sibling ``qwen35``).

Reads top to bottom like llama.cpp ``src/models/qwen35moe.cpp``; the math is ``docs/spec/qwen35.md``
section 3, every op the numpy reference in :mod:`engine.ops.reference`. Tensors are used as stored
(GGUF conventions: ``1 + w`` norms, ``ssm_a = -exp(A_log)``, tiled v-heads). Prefill is split-invariant:
a position's bits do not depend on the piece it is read in. Fast paths override the hooks
``linear``, ``delta_rule``, ``attend``, ``moe``. Design: docs/design/qwen35-model.md.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from engine.ops import reference as ops
from engine.turn.kv_types import kv_store, kv_widen
from engine.turn.state import SequenceState

from .hparams import Qwen35HParams

Callback = Callable[[str, int, np.ndarray], None]


class ExpertObserver(Protocol):
    """Receives each MoE layer's routing and routed expert output norms (see :attr:`Qwen35Model.observer`)."""

    def routed(self, il: int, logits: np.ndarray, idx: np.ndarray, norms: np.ndarray) -> None:
        """One MoE layer of one forward call.

        Args:
            il: layer index.
            logits: (n, n_expert) float32 router logits.
            idx: (n, k) int64 experts chosen per token (:func:`engine.ops.reference.topk_route`).
            norms: (n, k) float64 L2 norm of each chosen expert's own output ``f_e(x)`` (before the
                gate weight), same order as ``idx``.
        """

EXPERT_CACHE_LIMIT = 1 << 30
"""Routed experts are kept as float32 after first use when all of them together are below this many bytes."""


class Qwen35Model:
    """Numpy forward pass of one ``qwen35moe`` / ``qwen35`` text model.

    Non-expert weights are dequantized to float32 on first use and cached. Routed experts are
    fetched one selected expert at a time (and cached when all experts fit in
    :data:`EXPERT_CACHE_LIMIT`). The token embedding is read row by row unless the tied LM head
    has already made it a cached float32 matrix.
    """

    def __init__(self, hp: Qwen35HParams, weights: Any) -> None:
        self.hp = hp
        self.weights = weights
        self.output_name = "output.weight" if weights.has("output.weight") else "token_embd.weight"
        expert_bytes = 4 * hp.n_layer * hp.n_expert * 3 * hp.n_ff_exp * hp.n_embd
        self.cache_experts = hp.is_moe and expert_bytes < EXPERT_CACHE_LIMIT
        self._w: dict[str, np.ndarray] = {}
        self._experts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.observer: ExpertObserver | None = None

    # ---- weights -------------------------------------------------------------------------------

    def w(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 in math shape, dequantized once and cached."""
        t = self._w.get(name)
        if t is None:
            t = np.ascontiguousarray(self.weights.f32(name), dtype=np.float32)
            self._w[name] = t
        return t

    def expert(self, il: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Routed expert ``e`` of layer ``il``: (gate (ff, d), up (ff, d), down (d, ff)) float32."""
        mats = self._experts.get((il, e))
        if mats is None:
            mats = tuple(np.asarray(self.weights.expert(f"blk.{il}.ffn_{part}_exps.weight", e), dtype=np.float32)
                         for part in ("gate", "up", "down"))
            if self.cache_experts:
                self._experts[(il, e)] = mats
        return mats

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """Projection ``x W^T`` by weight ``name``: x (n, in) float32 -> (n, out) float32, one row
        at a time (:func:`engine.ops.reference.linear_rows`)."""
        return ops.linear_rows(x, self.w(name))

    def linears(self, x: np.ndarray, names: list[str]) -> list[np.ndarray]:
        """:meth:`linear` of several weights that read the same x: [(n, out_i) float32], in the order of names."""
        return [self.linear(x, name) for name in names]

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """RMSNorm of x's last axis with weight ``name`` (:func:`engine.ops.reference.rmsnorm`): (..., d)
        float32 -> (..., d) float32."""
        return ops.rmsnorm(x, self.w(name), self.hp.rms_eps)

    def token_ids(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` as a flat int64 array. Raises ValueError for an id outside 0..n_vocab-1."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        bad = tokens[(tokens < 0) | (tokens >= self.hp.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary 0..{self.hp.n_vocab - 1}")
        return tokens

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Token embeddings ``E[tokens]``: (n, n_embd) float32, unscaled.

        Raises ValueError for an id outside 0..n_vocab-1.
        """
        tokens = self.token_ids(tokens)
        table = self._w.get("token_embd.weight")
        if table is not None:
            return table[tokens]
        return np.stack([np.asarray(self.weights.row("token_embd.weight", int(t)), dtype=np.float32)
                         for t in tokens])

    # ---- the forward pass ----------------------------------------------------------------------

    def forward(self, tokens: np.ndarray, state: SequenceState, embeddings: np.ndarray | None = None,
                positions: np.ndarray | None = None, all_logits: bool = False,
                cb: Callback | None = None) -> np.ndarray:
        """Run n new positions through the model, updating ``state`` in place.

        Args:
            tokens: (n,) int token ids.
            state: the sequence's state; ``state.pos`` is the cache index of ``tokens[0]`` and
                advances by n.
            embeddings: (n, n_embd) float32 input rows used instead of ``embed(tokens)`` (e.g.
                token embeddings with image rows merged in); ``tokens`` must still have n entries.
            positions: (3, n) int t/h/w M-RoPE positions; default ``state.pos + arange(n)`` for all three.
            all_logits: return logits for every position, else for the last one only.
            cb: called as ``cb(stage, il, x)`` with every named intermediate (il = -1 outside layers).
        Returns:
            (n or 1, n_vocab) float32 logits.
        Raises:
            ContextFullError: ``state.pos + n`` exceeds ``state.capacity``.
            ValueError: n == 0, mismatched lengths, or a token id outside the vocabulary.
        Split-invariant (module docstring): ``forward(a + b)`` leaves the same state and gives the
        same last logits as ``forward(a)`` then ``forward(b)``, bit for bit.
        """
        hp = self.hp
        tokens, positions = state.chunk_inputs(tokens, positions, hp.n_vocab)
        n = tokens.shape[0]
        if embeddings is None:
            h = self.embed(tokens)
        else:
            h = np.asarray(embeddings, dtype=np.float32)
            if h.shape != (n, hp.n_embd):
                raise ValueError(f"embeddings must have shape ({n}, {hp.n_embd}), got {h.shape}")
        cb = cb or _no_cb
        cb("inp_embd", -1, h)

        for il in range(hp.n_layer):
            x = self.norm(h, f"blk.{il}.attn_norm.weight")
            cb("attn_norm", il, x)
            if hp.is_recurrent(il):
                x = self.gated_delta_net(il, x, state, cb)
                cb("linear_attn_out", il, x)
            else:
                x = self.gated_attention(il, x, state, positions, cb)
                cb("attn_out", il, x)
            h = h + x
            cb("attn_residual", il, h)
            y = self.norm(h, f"blk.{il}.post_attention_norm.weight")
            cb("attn_post_norm", il, y)
            y = self.moe(il, y, cb) if hp.is_moe else self.ffn(il, y)
            cb("ffn_out", il, y)
            h = h + y
            cb("l_out", il, h)

        state.pos += n
        if not all_logits:
            h = h[-1:]
        h = self.norm(h, "output_norm.weight")
        cb("result_norm", -1, h)
        logits = self.linear(h, self.output_name)
        cb("result_output", -1, logits)
        return logits

    def forward_batch(self, tokens: np.ndarray, states: list[SequenceState],
                      positions: list[np.ndarray | None]) -> np.ndarray:
        """One new token for each of N sequences in one pass (batched decode).

        The dense products, the routed experts (grouped by expert over the rows) and the LM head run on
        all N rows at once; each GDN layer's conv + delta rule and each attention layer's KV append and
        attention run per sequence on its own state. Row i and ``states[i]`` come out bit for bit as
        ``forward(tokens[i:i+1], states[i], positions=positions[i])`` leaves them (every op follows the
        row rule, docs/design/batched-decode.md).

        Args: tokens (N,) int ids; states: N distinct SequenceState objects (any positions, KV types);
            positions: N entries, each None or that token's (3, 1) M-RoPE positions.
        Returns: (N, n_vocab) float32 logits. Raises: ValueError (a bad id, named; mismatched lengths; a
            state given twice, or two sharing an array: their rows would read and write one state),
            ContextFullError: checked for every row before any state changes.
        """
        tokens, pos = self.batch_inputs(tokens, states, positions)
        hp = self.hp
        h = self.embed(tokens)
        for il in range(hp.n_layer):
            x = self.norm(h, f"blk.{il}.attn_norm.weight")
            if hp.is_recurrent(il):
                x = self._gdn_rows(il, x, states)
            else:
                x = self._attention_rows(il, x, states, pos)
            h = h + x
            y = self.norm(h, f"blk.{il}.post_attention_norm.weight")
            h = h + (self.moe(il, y, _no_cb) if hp.is_moe else self.ffn(il, y))
        for state in states:
            state.pos += 1
        return self.linear(self.norm(h, "output_norm.weight"), self.output_name)

    def batch_inputs(self, tokens: np.ndarray, states: list[SequenceState],
                     positions: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
        """Check a :meth:`forward_batch` call before it touches any state.

        Returns: (tokens (N,) int64, positions (3, N), column i the rotary positions of row i).
        Raises: ValueError / ContextFullError as :meth:`forward_batch` documents.
        """
        tokens = np.asarray(tokens)
        n = len(states)
        if tokens.shape != (n,) or len(positions) != n or n == 0:
            raise ValueError(f"forward_batch: {tokens.shape} tokens, {n} states and {len(positions)} positions: "
                             "expected one token and one positions entry per state, at least one")
        if len({id(s) for s in states}) != n:
            raise ValueError("forward_batch: a sequence state appears twice in the batch")
        arrays = [id(a) for s in states for table in (s.conv, s.ssm, s.k, s.v) for a in table.values()]
        if len(set(arrays)) != len(arrays):
            raise ValueError("forward_batch: two sequence states share an array (a shallow copy?); each row needs "
                             "a state of its own (SequenceState.copy)")
        checked = [state.chunk_inputs(tokens[i:i + 1], positions[i], self.hp.n_vocab)
                   for i, state in enumerate(states)]
        return np.concatenate([t for t, _ in checked]), np.concatenate([p for _, p in checked], axis=1)

    def _gdn_rows(self, il: int, x: np.ndarray, states: list[SequenceState]) -> np.ndarray:
        """:meth:`gated_delta_net` for N rows of N sequences: products over all rows, the recurrence per state."""
        p = f"blk.{il}."
        mixed, z = self.linear(x, p + "attn_qkv.weight"), self.linear(x, p + "attn_gate.weight")
        b, a = self.linear(x, p + "ssm_beta.weight"), self.linear(x, p + "ssm_alpha.weight")
        y = np.concatenate([self.delta_rule(il, mixed[i:i + 1], z[i:i + 1], b[i:i + 1], a[i:i + 1], state, _no_cb)
                            for i, state in enumerate(states)])
        return self.linear(y, p + "ssm_out.weight")

    def _attention_rows(self, il: int, x: np.ndarray, states: list[SequenceState], positions: np.ndarray
                        ) -> np.ndarray:
        """:meth:`gated_attention` for N rows of N sequences: products, norms and RoPE over all rows (row i
        at its own positions), the KV append and the attention per state over its own cache."""
        hp, p, n, hd = self.hp, f"blk.{il}.", x.shape[0], self.hp.head_dim
        qg = self.linear(x, p + "attn_q.weight").reshape(n, hp.n_head, 2 * hd)
        k = self.linear(x, p + "attn_k.weight").reshape(n, hp.n_head_kv, hd)
        v = self.linear(x, p + "attn_v.weight").reshape(n, hp.n_head_kv, hd)
        q = self.norm(qg[..., :hd], p + "attn_q_norm.weight")
        k = self.norm(k, p + "attn_k_norm.weight")
        q = ops.rope_multi(q, positions, hp.rope_dims, hp.rope_theta, hp.rope_sections)
        k = ops.rope_multi(k, positions, hp.rope_dims, hp.rope_theta, hp.rope_sections)
        out = []
        for i, state in enumerate(states):
            end = state.pos + 1
            kv_store(state.k[il], state.pos, k[i:i + 1])
            kv_store(state.v[il], state.pos, v[i:i + 1])
            out.append(self.attend(q[i:i + 1], qg[i:i + 1, :, hd:], state.k[il][:end], state.v[il][:end]))
        return self.linear(np.concatenate(out), p + "attn_output.weight")

    # ---- mixers --------------------------------------------------------------------------------

    def gated_delta_net(self, il: int, x: np.ndarray, state: SequenceState, cb: Callback) -> np.ndarray:
        """Gated DeltaNet layer (docs/spec/qwen35.md 3.2): x (n, n_embd) -> (n, n_embd); updates conv/ssm state."""
        p = f"blk.{il}."
        # mixed (n, conv_dim) raw, pre-conv; z (n, n_v * dv); b and a (n, n_v)
        mixed, z, b, a = self.linears(x, [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                          p + "ssm_alpha.weight"])
        cb("linear_attn_qkv_mixed", il, mixed)
        y = self.delta_rule(il, mixed, z, b, a, state, cb)
        cb("final_output", il, y)
        return self.linear(y, p + "ssm_out.weight")

    def delta_rule(self, il: int, mixed: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
                   state: SequenceState, cb: Callback) -> np.ndarray:
        """GDN steps 2-6 from the raw projections: conv, SiLU, L2 norms, gated delta rule, gated norm.

        mixed (n, conv_dim), z (n, n_v*dv), b and a (n, n_v) float32 -> (n, n_v*dv) float32;
        updates ``state.conv[il]`` and ``state.ssm[il]``.
        """
        hp = self.hp
        p = f"blk.{il}."
        n = mixed.shape[0]
        nk, nv, dk, dv = hp.num_k_heads, hp.num_v_heads, hp.head_k_dim, hp.head_v_dim
        z = z.reshape(n, nv, dv)
        beta = ops.sigmoid(b)                                             # (n, nv)
        g = self.w(p + "ssm_a") * ops.softplus(a + self.w(p + "ssm_dt.bias"))   # log-decay <= 0
        cb("beta", il, beta)
        cb("gate", il, g)

        conv, new_conv = ops.causal_conv1d(mixed, self.w(p + "ssm_conv1d.weight"), state.conv[il])
        state.conv[il][...] = new_conv
        u = ops.silu(conv)
        cb("conv_output_silu", il, u)
        q = ops.l2norm(u[:, :nk * dk].reshape(n, nk, dk), hp.rms_eps) * np.float32(dk ** -0.5)
        k = ops.l2norm(u[:, nk * dk:2 * nk * dk].reshape(n, nk, dk), hp.rms_eps)
        v = u[:, 2 * nk * dk:].reshape(n, nv, dv)

        o = np.empty((n, nv, dv), dtype=np.float32)
        s = state.ssm[il]
        for t in range(n):        # the recurrent step, token by token: the state is rounded as decode rounds it
            o[t], s = ops.gdn_step(q[t], k[t], v[t], g[t], beta[t], s)
        state.ssm[il][...] = s
        cb("attn_output", il, o)

        return ops.gated_rmsnorm(o, self.w(p + "ssm_norm.weight"), z, hp.rms_eps).reshape(n, nv * dv)

    def gated_attention(self, il: int, x: np.ndarray, state: SequenceState, positions: np.ndarray,
                        cb: Callback) -> np.ndarray:
        """Gated full attention (docs/spec/qwen35.md 3.1): x (n, n_embd) -> (n, n_embd); appends K/V to the cache."""
        hp = self.hp
        p = f"blk.{il}."
        n = x.shape[0]
        hd = hp.head_dim

        qg, k, v = self.linears(x, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
        qg = qg.reshape(n, hp.n_head, 2 * hd)                                       # per head [q | gate]
        q, gate = qg[..., :hd], qg[..., hd:]
        k = k.reshape(n, hp.n_head_kv, hd)
        v = v.reshape(n, hp.n_head_kv, hd)
        q = self.norm(q, p + "attn_q_norm.weight")
        k = self.norm(k, p + "attn_k_norm.weight")
        q = ops.rope_multi(q, positions, hp.rope_dims, hp.rope_theta, hp.rope_sections)
        k = ops.rope_multi(k, positions, hp.rope_dims, hp.rope_theta, hp.rope_sections)
        cb("Qcur", il, q)
        cb("Kcur", il, k)
        cb("Vcur", il, v)

        end = state.pos + n
        kv_store(state.k[il], state.pos, k)
        kv_store(state.v[il], state.pos, v)
        o = self.attend(q, gate, state.k[il][:end], state.v[il][:end])
        cb("attn_gated", il, o)
        return self.linear(o, p + "attn_output.weight")

    def attend(self, q: np.ndarray, gate: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Causal gated GQA attention of n queries over m cache rows of the state's KV type, widened to float32
        (:func:`engine.ops.reference.gated_attention`)."""
        return ops.gated_attention(q, gate, kv_widen(k), kv_widen(v))

    # ---- feed-forward --------------------------------------------------------------------------

    def moe(self, il: int, y: np.ndarray, cb: Callback) -> np.ndarray:
        """Routed top-k experts plus the sigmoid-gated shared expert (docs/spec/qwen35.md 3.3): (n, d) -> (n, d)."""
        p = f"blk.{il}."
        logits = ops.linear_rows(y, self.w(p + "ffn_gate_inp.weight"))
        cb("ffn_moe_logits", il, logits)
        idx, weights = ops.topk_route(logits, self.hp.n_expert_used)
        cb("ffn_moe_topk", il, idx)
        cb("ffn_moe_weights_norm", il, weights)
        out = np.zeros_like(y)
        norms = np.zeros(idx.shape) if self.observer is not None else None
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            h = ops.swiglu(y[rows], *self.expert(il, int(e)))
            if norms is not None:
                norms[rows, slot] = np.linalg.norm(h.astype(np.float64), axis=-1)
            out[rows] += weights[rows, slot, None] * h
        if self.observer is not None:
            self.observer.routed(il, logits, idx, norms)
        cb("ffn_moe_out", il, out)
        if self.weights.has(p + "ffn_gate_shexp.weight"):
            sh = ops.shared_expert(y, self.w(p + "ffn_gate_shexp.weight"), self.w(p + "ffn_up_shexp.weight"),
                                   self.w(p + "ffn_down_shexp.weight"), self.w(p + "ffn_gate_inp_shexp.weight"))
            cb("ffn_shexp", il, sh)
            out = out + sh
        return out

    def ffn(self, il: int, y: np.ndarray) -> np.ndarray:
        """Dense SwiGLU FFN of ``qwen35`` files: (n, d) -> (n, d)."""
        p = f"blk.{il}."
        return ops.swiglu(y, self.w(p + "ffn_gate.weight"), self.w(p + "ffn_up.weight"),
                          self.w(p + "ffn_down.weight"))


def _no_cb(stage: str, il: int, x: np.ndarray) -> None:
    """The default stage callback: ignores everything."""
