"""Per-sequence state of a hybrid recurrent/attention model: what a prefix snapshot must hold to resume.

A :class:`SequenceState`, shaped by a :class:`StateLayout`, holds per recurrent layer ``conv[il]`` and
``ssm[il]`` (fixed size, float32), per attention layer ``k[il]`` / ``v[il]`` of ``(capacity, *row)`` (rows
``[:pos]`` valid) in the state's KV type (:data:`KV_TYPES`: F32, F16 or Q8_0 rounded once when written), and
``pos``. A recurrent state cannot be rolled back: keep a :meth:`SequenceState.copy`.
Design: docs/design/prefix-cache.md (shapes, why float32); docs/design/kv-cache.md (F16 and Q8_0 rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import ContextFullError, MemoryFitError
from .kv_types import KV_TYPES, kv_dtype, kv_row_bytes, kv_row_shape

__all__ = ["KV_PAGE_ROWS", "KV_TYPES", "HasStateLayout", "SequenceState", "StateLayout", "check_memory", "kv_dtype",
           "state_nbytes"]

KV_PAGE_ROWS = 256
"""Positions per KV page of the prefix cache (:mod:`engine.turn.kv_pages`)."""

@dataclass(frozen=True)
class StateLayout:
    """What one sequence's state holds, layer by layer; a text architecture's hyper-parameters give it
    (:meth:`HasStateLayout.state_layout`), so the state and the prefix cache need no architecture.

    Attributes:
        conv: layer -> shape of its recurrent conv window (float32, fixed size).
        ssm: layer -> shape of its recurrent state matrix (float32, fixed size); the same layers as ``conv``.
        kv: layer -> shape of one position's K row (and V row) of an attention layer; the cache holds
            ``capacity`` of them (stored as :func:`engine.turn.kv_types.kv_row_shape` says).
        context_length: the most positions a state may hold. n_vocab: logits per position.
    """

    conv: Mapping[int, tuple[int, ...]]
    ssm: Mapping[int, tuple[int, ...]]
    kv: Mapping[int, tuple[int, ...]]
    context_length: int
    n_vocab: int

    def arrays(self, pos: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every array a snapshot at ``pos`` holds (``conv.IL``, ``ssm.IL``, ``k.IL``,
        ``v.IL``; KV with ``pos`` rows), in layer order."""
        out: dict[str, tuple[int, ...]] = {}
        for il in sorted({*self.conv, *self.kv}):
            if il in self.conv:
                out[f"conv.{il}"] = tuple(self.conv[il])
                out[f"ssm.{il}"] = tuple(self.ssm[il])
            else:
                out[f"k.{il}"] = out[f"v.{il}"] = (pos, *self.kv[il])
        return out


def state_nbytes(layout: StateLayout, capacity: int, kv_type: str = "f32") -> int:
    """Bytes of one sequence's state of ``capacity`` positions (= ``SequenceState.new(...).nbytes``): the
    float32 recurrent arrays plus 2 x capacity KV rows per attention layer of ``kv_type``'s elements."""
    rows = sum(2 * kv_row_bytes(s, kv_type) for s in layout.kv.values()) * capacity
    fixed = sum(int(np.prod(s)) for s in (*layout.conv.values(), *layout.ssm.values()))
    return rows + 4 * fixed


def check_memory(layout: StateLayout, capacity: int, kv_type: str, available: int | None = None,
                 sequences: int = 1, reserved: int = 0) -> int:
    """Refuse up front a context whose states cannot fit the memory available now (the KV rows are
    allocated lazily, so without this a large context would fail with an out-of-memory error hours later).

    Args: layout: the model's state. capacity: context, tokens. kv_type: a :data:`KV_TYPES` name.
        available: bytes of memory available, or None for what the OS reports (``psutil``).
        sequences: states live at once (turns decoded together), each of ``capacity`` positions.
        reserved: other bytes that may be held meanwhile (the prefix cache's RAM budget).
    Returns: the bytes counted. Raises: MemoryFitError naming the bytes per sequence, the sequences, the
        bytes available, and the largest context (and number of sequences) that fits.
    """
    per_seq = state_nbytes(layout, capacity, kv_type)
    need = sequences * per_seq + reserved
    if available is None:
        import psutil
        available = int(psutil.virtual_memory().available)
    if need > available:
        raise MemoryFitError(_fit_message(layout, capacity, kv_type, available, sequences, reserved))
    return need


def _fit_message(layout: StateLayout, capacity: int, kv_type: str, available: int, sequences: int,
                 reserved: int) -> str:
    """The refusal of :func:`check_memory`: what is needed, what is available, and what would fit."""
    per_seq, fixed = state_nbytes(layout, capacity, kv_type), state_nbytes(layout, 0, kv_type)
    per_token = state_nbytes(layout, 1, kv_type) - fixed
    free = max(available - reserved, 0)
    need = sequences * per_seq + reserved
    cache = f" + {reserved / 2**30:.2f} GiB of prefix cache RAM budget" if reserved else ""
    return (f"a context of {capacity:,} tokens with {sequences} sequence(s) at once needs {need / 2**30:.2f} GiB: "
            f"{per_seq:,} bytes of state per sequence ({per_token:,} bytes of {kv_type} KV cache per token) "
            f"x {sequences}{cache}, but {available / 2**30:.2f} GiB of memory is available: choose a context of "
            f"at most {max(free // sequences - fixed, 0) // per_token:,} tokens at {sequences} sequence(s), or "
            f"at most {free // per_seq} sequence(s) at once at this context"
            + {"f32": ", or the f16 or q8_0 KV type", "f16": ", or the q8_0 KV type"}.get(kv_type, ""))


class HasStateLayout(Protocol):
    """Hyper-parameters that know their model's :class:`StateLayout` (e.g. ``Qwen35HParams``)."""

    def state_layout(self) -> StateLayout:
        """The per-layer state of this model."""


@dataclass
class SequenceState:
    """Conv + delta-rule state per GDN layer, KV cache per attention layer, and the position.

    Build with :meth:`new`. Arrays are owned by this object; the model updates them in place.
    """

    capacity: int
    pos: int = 0
    kv_type: str = "f32"
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    ssm: dict[int, np.ndarray] = field(default_factory=dict)
    k: dict[int, np.ndarray] = field(default_factory=dict)
    v: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def new(cls, hp: HasStateLayout, capacity: int, kv_type: str = "f32") -> "SequenceState":
        """A fresh (all-zero, pos 0) state of ``hp.state_layout()`` holding up to ``capacity`` positions,
        its KV rows of ``kv_type`` (:data:`KV_TYPES`).

        Raises:
            ContextFullError: ``capacity`` is < 1 or larger than the model's context_length.
            ValueError: an unknown ``kv_type``, or q8_0 with a head_dim not a multiple of 32.
        """
        dtype = kv_dtype(kv_type)
        layout = hp.state_layout()
        rows = {il: kv_row_shape(shape, kv_type) for il, shape in layout.kv.items()}
        if not 1 <= capacity <= layout.context_length:
            raise ContextFullError(
                f"state capacity {capacity} is outside 1..{layout.context_length} (the model's context_length)")
        state = cls(capacity=capacity, kv_type=kv_type)
        for il in sorted({*layout.conv, *layout.kv}):
            if il in layout.conv:
                state.conv[il] = np.zeros(layout.conv[il], np.float32)
                state.ssm[il] = np.zeros(layout.ssm[il], np.float32)
            else:
                state.k[il] = np.zeros((capacity, *rows[il]), dtype)
                state.v[il] = np.zeros((capacity, *rows[il]), dtype)
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
            kv_type=self.kv_type,
            conv={il: a.copy() for il, a in self.conv.items()},
            ssm={il: a.copy() for il, a in self.ssm.items()},
            k=kv(self.k),
            v=kv(self.v),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays held (the KV caches counted at full capacity)."""
        return sum(a.nbytes for d in (self.conv, self.ssm, self.k, self.v) for a in d.values())
