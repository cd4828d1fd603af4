"""Batched decode: one forward call for one new token of each of several sequences.

A turn's decode loop (:func:`engine.turn.runtime.run_turn`) asks for each token's logits with a :class:`Step`.
Run alone it answers the step itself; run by a scheduler that answers steps (:func:`answering_steps`, the
engine session) it yields the step, and the scheduler answers the steps of all its running turns with one
:func:`forward_batch`. A row of the batch equals the single forward bit for bit, so batching changes no
answer. Design: docs/design/engine-session.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..registry import TextModel

__all__ = ["Step", "answering_steps", "forward_batch", "forward_rows", "steps_answered"]


@dataclass(eq=False)
class Step:
    """A decode step a turn asks for: the logits after ``token`` at the next position of ``state``.

    Attributes:
        model: the text model. token: the new token id. state: the sequence's own state, advanced by the step.
        positions: (3, 1) int64 rotary positions of the token, or None for plain positions.
        logits: (n_vocab,) float32, set by whoever answers the step before the turn resumes.
    """

    model: TextModel
    token: int
    state: Any
    positions: np.ndarray | None
    logits: np.ndarray | None = None

    def answer_alone(self) -> np.ndarray:
        """Run the step on its own (``model.forward``) and keep its logits."""
        out = self.model.forward(np.asarray([self.token], dtype=np.int64), self.state, positions=self.positions)
        self.logits = out[-1]
        return self.logits


def forward_batch(model: TextModel, tokens: np.ndarray, states: Sequence[Any],
                  positions: Sequence[np.ndarray | None]) -> np.ndarray:
    """One new token for each of N sequences: (N, n_vocab) float32 logits, row i that of sequence i.

    ``tokens`` (N,) int64; ``states[i]`` sequence i's own state, advanced by one position; ``positions[i]`` its
    (3, 1) rotary positions or None. Uses ``model.forward_batch`` when the model has one (its rows are bit-identical
    to single forwards), else calls ``model.forward`` once per sequence.
    """
    batched = getattr(model, "forward_batch", None)
    if batched is not None:
        return batched(np.asarray(tokens, dtype=np.int64), list(states), list(positions))
    rows = [model.forward(np.asarray([t], dtype=np.int64), s, positions=p)[-1]
            for t, s, p in zip(tokens, states, positions, strict=True)]
    return np.stack(rows).astype(np.float32, copy=False)


def forward_rows(steps: Sequence[Step]) -> list[BaseException | None]:
    """Answer ``steps`` (all of one model) with one :func:`forward_batch`; each step's outcome: None (its
    ``logits`` set) or the exception that failed it. Without ``model.forward_batch`` each step runs alone, so one
    sequence's failure is its own; a batched call that raises, or gives another number of rows than steps (a
    ValueError), fails every step of the batch."""
    if getattr(steps[0].model, "forward_batch", None) is None:
        outcomes: list[BaseException | None] = []
        for step in steps:
            try:
                step.answer_alone()
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 - the failure is this sequence's, handed to its turn
                outcomes.append(exc)
        return outcomes
    try:
        logits = forward_batch(steps[0].model, np.asarray([s.token for s in steps], dtype=np.int64),
                               [s.state for s in steps], [s.positions for s in steps])
    except Exception as exc:  # noqa: BLE001 - handed to every turn of the batch
        return [exc] * len(steps)
    if len(logits) != len(steps):
        error = ValueError(f"the model's forward_batch gave {len(logits)} rows for {len(steps)} sequences")
        return [error] * len(steps)
    for step, row in zip(steps, logits, strict=True):
        step.logits = row
    return [None] * len(steps)


_local = threading.local()


@contextmanager
def answering_steps() -> Iterator[None]:
    """While in this block, turns advanced on this thread yield their :class:`Step` s instead of answering them."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def steps_answered() -> bool:
    """Whether the caller advancing this thread's turn answers their steps (:func:`answering_steps`)."""
    return getattr(_local, "on", False)
