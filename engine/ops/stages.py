"""Stage traces of a forward pass and the first stage where two traces part, free of any family.

A reference forward names its intermediates through ``cb(stage, il, x)`` (e.g.
:meth:`engine.arch.qwen35.model.Qwen35Model.forward`); a fast path reports the same names for the values
it materialises. Recording both and walking the reference's order finds the first stage, and layer,
whose values differ beyond a tolerance, so a failed comparison names where the paths part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

StageKey = tuple[str, int]
"""(stage name, layer index; -1 outside layers)."""


@dataclass
class StageTrace:
    """A ``cb(stage, il, x)`` that keeps a copy of every value, in call order.

    A stage seen again (a prompt run in pieces or passes) gets the new rows appended along axis 0.

    Attributes:
        values: (stage, il) -> the recorded array, keys in first-call order.
    """

    values: dict[StageKey, np.ndarray] = field(default_factory=dict)

    def __call__(self, stage: str, il: int, x: np.ndarray) -> None:
        """Record ``x`` (copied: the caller may overwrite its buffer) under ``(stage, il)``."""
        key, x = (stage, il), np.array(x, copy=True)
        self.values[key] = x if key not in self.values else np.concatenate([self.values[key], x])

    def stages(self) -> list[StageKey]:
        """The recorded keys in the order they were first seen."""
        return list(self.values)


@dataclass(frozen=True)
class Divergence:
    """Where a fast trace first leaves its reference.

    Attributes:
        stage, layer: the reference's name of the intermediate and its layer (-1 outside layers).
        error: max |fast - reference| / max |reference| there (inf for a shape mismatch or a non-finite value).
    """

    stage: str
    layer: int
    error: float

    def __str__(self) -> str:
        where = f"layer {self.layer}" if self.layer >= 0 else "outside the layers"
        return f"first divergence at stage {self.stage!r} ({where}): relative error {self.error:.3g}"


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| in float64; inf when the shapes differ or ``got`` is not finite."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


def first_divergence(reference: StageTrace, fast: StageTrace, rtol: float) -> Divergence | None:
    """The first stage, in the reference's order, that both traces hold and whose relative error exceeds ``rtol``.

    Stages only one trace holds (values a fused kernel never materialises) are skipped; compare
    ``shared_stages`` to know what was checked. None when every shared stage is within ``rtol``.
    """
    for key in reference.stages():
        if key in fast.values:
            err = relative_error(fast.values[key], reference.values[key])
            if not err <= rtol:
                return Divergence(key[0], key[1], err)
    return None


def shared_stages(reference: StageTrace, fast: StageTrace) -> list[StageKey]:
    """The stages both traces hold, in the reference's order."""
    return [key for key in reference.stages() if key in fast.values]
