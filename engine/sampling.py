"""Token sampling: greedy, temperature, top-k, top-p, min-p, presence and repetition penalties.

Order of operations follows llama.cpp's default sampler chain (``common/sampling.cpp``):
penalties -> top-k -> top-p -> min-p -> temperature -> draw. Penalties follow their usual
definitions: repetition penalty (Keskar et al. 2019, CTRL) divides positive logits and multiplies
negative ones of tokens already seen; presence penalty (OpenAI API) subtracts a constant from
every token already seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import EngineError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax, ties to the lowest id).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability mass reaches p (1.0 = off).
        min_p: drop tokens whose probability is below min_p * p(most likely) (0 = off).
        presence_penalty: subtracted from the logit of every token already in the history.
        repetition_penalty: > 1 discourages tokens already in the history (1.0 = off).
        penalty_last_n: how many history tokens the penalties look at (0 = all).
        seed: seed of the random generator (None = fresh entropy each turn).
        max_tokens: most tokens to generate in one answer.
    """

    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_last_n: int = 256
    seed: int | None = None
    max_tokens: int = 512

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (math.isfinite(self.presence_penalty) and math.isfinite(self.temperature),
             "presence_penalty and temperature must be finite"),
            (self.penalty_last_n >= 0, "penalty_last_n must be >= 0"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
        ]
        for ok, what in checks:
            if not ok:
                raise EngineError(f"sampling parameters: {what}")

    @classmethod
    def greedy(cls, max_tokens: int = 512) -> "SamplingParams":
        """Deterministic argmax decoding."""
        return cls(temperature=0.0, top_k=0, top_p=1.0, max_tokens=max_tokens)


class Sampler:
    """Stateful sampler for one answer (holds the random generator).

    Args:
        params: the sampling settings.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def distribution(self, logits: np.ndarray, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The candidates and their probabilities after penalties, top-k, top-p, min-p, temperature.

        Args:
            logits: (n_vocab,) float32 logits of the next position.
            history: token ids already in the context (prompt and answer), oldest first.

        Returns:
            (ids, probs): (c,) int64 candidate ids, most likely first, and (c,) float64
            probabilities summing to 1. Greedy (temperature 0) gives one candidate with p = 1.

        Raises:
            EngineError: the logits hold a NaN or no finite value.
        """
        p = self.params
        x = np.asarray(logits, dtype=np.float64).copy()
        if not np.isfinite(x).any() or np.isnan(x).any():
            raise EngineError("the model produced NaN or no finite logits (a damaged or unsupported model file?)")
        recent = history[-p.penalty_last_n:] if p.penalty_last_n else history
        if len(recent) and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0):
            seen = np.unique(np.asarray(recent, dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < x.size)]
            if p.repetition_penalty != 1.0:
                v = x[seen]
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            x[seen] -= p.presence_penalty
        if p.temperature == 0.0:
            return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1)
        candidates = np.arange(x.size)
        if 0 < p.top_k < x.size:
            candidates = np.argpartition(-x, p.top_k - 1)[: p.top_k]
        order = candidates[np.lexsort((candidates, -x[candidates]))]
        z = x[order]
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        keep = order.size
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        if p.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
        keep = max(1, min(keep, order.size))
        z = z[:keep] / p.temperature
        w = np.exp(z - z[0])
        return order[:keep].astype(np.int64), w / w.sum()

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Pick the next token from :meth:`distribution` with this sampler's random generator.

        Args:
            logits: (n_vocab,) float32 logits of the next position.
            history: token ids already in the context, oldest first.

        Returns:
            The chosen token id.
        """
        ids, probs = self.distribution(logits, history)
        if ids.size == 1:
            return int(ids[0])
        return int(ids[self._rng.choice(ids.size, p=probs)])
