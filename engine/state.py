"""Per-sequence state of the hybrid model: what a prefix snapshot must hold to resume decoding.

One :class:`SequenceState` per sequence (spec 3.2 "Recurrent state to snapshot"):

* every Gated DeltaNet layer ``il`` keeps ``conv[il]``: the last K-1 *raw* projections ``W_qkv x``
  (pre-conv, pre-SiLU), oldest first, ``(K-1, conv_dim)`` float32, and ``ssm[il]``: the delta-rule
  state S, ``(n_v, head_k_dim, head_v_dim)`` float32 in the transformers layout (S^T is llama.cpp's);
* every full-attention layer keeps ``k[il]`` / ``v[il]``: ``(capacity, n_head_kv, head_dim)`` float32,
  preallocated, K after its RMSNorm and RoPE; only rows ``[:pos]`` are valid;
* ``pos``: the number of positions already processed (the next token's cache index).

A recurrent state cannot be rolled back: to resume at an earlier position, keep a :meth:`copy`
taken exactly there. Everything is float32 (a bf16/f16 state drifts; spec pitfall 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ContextFullError
from .arch.qwen35.hparams import Qwen35HParams


@dataclass
class SequenceState:
    """Conv + delta-rule state per GDN layer, KV cache per attention layer, and the position.

    Build with :meth:`new`. Arrays are owned by this object; the model updates them in place.
    """

    capacity: int
    pos: int = 0
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    ssm: dict[int, np.ndarray] = field(default_factory=dict)
    k: dict[int, np.ndarray] = field(default_factory=dict)
    v: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def new(cls, hp: Qwen35HParams, capacity: int) -> "SequenceState":
        """A fresh (all-zero, pos 0) state for ``hp`` holding up to ``capacity`` positions.

        Raises:
            ContextFullError: ``capacity`` is < 1 or larger than the model's context_length.
        """
        if not 1 <= capacity <= hp.context_length:
            raise ContextFullError(
                f"state capacity {capacity} is outside 1..{hp.context_length} (the model's context_length)")
        state = cls(capacity=capacity)
        for il in range(hp.n_layer):
            if hp.is_recurrent(il):
                state.conv[il] = np.zeros((hp.conv_kernel - 1, hp.conv_dim), np.float32)
                state.ssm[il] = np.zeros((hp.num_v_heads, hp.head_k_dim, hp.head_v_dim), np.float32)
            else:
                state.k[il] = np.zeros((capacity, hp.n_head_kv, hp.head_dim), np.float32)
                state.v[il] = np.zeros((capacity, hp.n_head_kv, hp.head_dim), np.float32)
        return state

    def chunk_inputs(self, tokens: np.ndarray, positions: np.ndarray | None,
                     n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """Check n new tokens to be appended at ``pos`` and return them with their M-RoPE positions.

        Args:
            tokens: n int token ids. positions: (3, n) int t/h/w positions, or None for
                ``pos + arange(n)`` in all three rows. n_vocab: the model's vocabulary size.

        Returns:
            (tokens (n,) int64, positions (3, n)).

        Raises:
            ValueError: n == 0, a token id outside 0..n_vocab-1, or ``positions`` not of shape (3, n).
            ContextFullError: ``pos + n`` exceeds ``capacity``.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("a model step needs at least one token")
        if self.pos + n > self.capacity:
            raise ContextFullError(f"{self.pos} + {n} positions do not fit the state's capacity of {self.capacity}")
        bad = tokens[(tokens < 0) | (tokens >= n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary 0..{n_vocab - 1}")
        if positions is None:
            positions = np.broadcast_to(self.pos + np.arange(n), (3, n))
        positions = np.asarray(positions)
        if positions.shape != (3, n):
            raise ValueError(f"positions must have shape (3, {n}), got {positions.shape}")
        return tokens, positions

    def copy(self) -> "SequenceState":
        """A deep, bit-exact copy: continuing from it gives exactly what continuing from self gives.

        KV rows past ``pos`` are not part of the state; they are zero in the copy.
        """
        def kv(cache: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
            out = {}
            for il, a in cache.items():
                b = np.zeros_like(a)
                b[:self.pos] = a[:self.pos]
                out[il] = b
            return out

        return SequenceState(
            capacity=self.capacity,
            pos=self.pos,
            conv={il: a.copy() for il, a in self.conv.items()},
            ssm={il: a.copy() for il, a in self.ssm.items()},
            k=kv(self.k),
            v=kv(self.v),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays held (the KV caches counted at full capacity)."""
        return sum(a.nbytes for d in (self.conv, self.ssm, self.k, self.v) for a in d.values())
