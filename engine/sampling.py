"""Token sampling: greedy, temperature, top-k, top-p, min-p, logit bias, penalties, grammar mask; logprobs.

Order of operations follows llama.cpp's default sampler chain (``common/sampling.cpp``) with the OpenAI
API's logit bias first and the grammar mask (:mod:`engine.turn.grammar`) after the penalties:
logit bias -> penalties -> grammar mask -> top-k -> top-p -> min-p -> temperature -> draw. Penalties follow
their usual definitions: repetition penalty (Keskar et al. 2019, CTRL) divides positive logits and
multiplies negative ones of tokens already seen; presence penalty (OpenAI API) subtracts a constant from
every token already seen; frequency penalty (OpenAI API reference, "Parameter details: frequency and
presence penalties": ``mu[j] -= c[j] * alpha_frequency`` with ``c[j]`` how often token j was sampled before
the current position) subtracts the penalty times the token's count in the answer so far.
Logprobs are ``log_softmax`` of the model's raw logits (before bias, penalties, mask and temperature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .errors import EngineError

if TYPE_CHECKING:
    from .turn.grammar import Matcher

MAX_TOP_LOGPROBS = 20
"""The most alternatives :attr:`SamplingParams.top_logprobs` may ask for (the OpenAI API's limit)."""


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
        frequency_penalty: subtracted from a token's logit once per time it occurs in the answer so far
            (OpenAI's definition, see the module docstring; the prompt does not count).
        logit_bias: (token id, bias) pairs added to those logits first; bias in [-100, 100] (the caller checks
            the ids against the vocabulary; an id outside it fails when sampling).
        top_logprobs: None = no logprobs; 0..20 = each token's logprob plus that many most likely alternatives.
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
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None

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
            (math.isfinite(self.frequency_penalty), "frequency_penalty must be finite"),
            (all(map(_bias_ok, self.logit_bias)), "logit_bias must be (token id >= 0, bias in [-100, 100]) pairs"),
            (self.top_logprobs is None or 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs must be None or 0..{MAX_TOP_LOGPROBS}"),
        ]
        for ok, what in checks:
            if not ok:
                raise EngineError(f"sampling parameters: {what}")

    @classmethod
    def greedy(cls, max_tokens: int = 512) -> "SamplingParams":
        """Deterministic argmax decoding."""
        return cls(temperature=0.0, top_k=0, top_p=1.0, max_tokens=max_tokens)


def _bias_ok(pair: object) -> bool:
    """Whether ``pair`` is one (token id >= 0, finite bias in [-100, 100]) entry of a logit bias."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        return False
    token, bias = pair
    return (isinstance(token, int) and not isinstance(token, bool) and token >= 0
            and isinstance(bias, (int, float)) and math.isfinite(bias) and -100 <= bias <= 100)


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The logprob of ``token`` and the ``top`` most likely tokens with theirs, from raw logits.

    Args:
        logits: (n_vocab,) float32 logits of the position (as the model gave them).
        token: the token drawn there.
        top: how many alternatives, 0..n_vocab.

    Returns:
        (``log_softmax(logits)[token]``, ((id, logprob), ...) most likely first, ties to the lowest id),
        float64 arithmetic, natural log.
    """
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lse = m + math.log(np.exp(x - m).sum())
    if 0 < top < x.size:
        best = np.flatnonzero(x >= np.partition(x, x.size - top)[x.size - top])  # ties at the cut all enter
    else:
        best = np.arange(x.size if top else 0)
    best = best[np.lexsort((best, -x[best]))][:top]
    return float(x[token] - lse), tuple((int(i), float(x[i] - lse)) for i in best)


class Sampler:
    """Stateful sampler for one answer (holds the random generator and the grammar's parser state).

    Args:
        params: the sampling settings.
        matcher: the answer's :class:`engine.turn.grammar.Matcher`, or None; each drawn token is accepted into it.
        answer_start: where the answer begins in the ``history`` passed to :meth:`sample` (the prompt's
            length): the frequency penalty counts tokens from there.
    """

    def __init__(self, params: SamplingParams, matcher: Matcher | None = None, answer_start: int = 0) -> None:
        self.params = params
        self.matcher = matcher
        self.answer_start = answer_start
        self._rng = np.random.default_rng(params.seed)

    def distribution(self, logits: np.ndarray, history: Sequence[int],
                     allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The candidates and their probabilities after bias, penalties, mask, top-k, top-p, min-p, temperature.

        Args:
            logits: (n_vocab,) float32 logits of the next position.
            history: token ids already in the context (prompt and answer), oldest first.
            allowed: (n_vocab,) bool grammar mask, or None for every token.

        Returns:
            (ids, probs): (c,) int64 candidate ids, most likely first, and (c,) float64
            probabilities summing to 1. Greedy (temperature 0) gives one candidate with p = 1.

        Raises:
            EngineError: the logits hold a NaN or no finite value, a logit bias names an id outside the
                vocabulary, or the mask is of another size or allows no token.
        """
        p = self.params
        x = np.asarray(logits, dtype=np.float64).copy()
        if not np.isfinite(x).any() or np.isnan(x).any():
            raise EngineError("the model produced NaN or no finite logits (a damaged or unsupported model file?)")
        self._bias_and_penalize(x, history)
        candidates = np.arange(x.size)
        if allowed is not None:
            if allowed.shape != x.shape:
                raise EngineError(f"the grammar's mask covers {allowed.size} token ids but the model has {x.size} "
                                  "(a grammar compiled for another model?)")
            candidates = np.flatnonzero(allowed)
            if candidates.size == 0:
                raise EngineError("the grammar allows no next token")
        if p.temperature == 0.0:
            return np.array([candidates[int(np.argmax(x[candidates]))]], dtype=np.int64), np.ones(1)
        if 0 < p.top_k < candidates.size:
            candidates = candidates[np.argpartition(-x[candidates], p.top_k - 1)[: p.top_k]]
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

    def _bias_and_penalize(self, x: np.ndarray, history: Sequence[int]) -> None:
        """Add the logit bias, then apply the repetition, presence and frequency penalties, to ``x`` in place."""
        p = self.params
        for token, bias in p.logit_bias:
            if token >= x.size:
                raise EngineError(f"logit_bias names token id {token}, outside the vocabulary 0..{x.size - 1}")
            x[token] += bias
        recent = history[-p.penalty_last_n:] if p.penalty_last_n else history
        if len(recent) and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0):
            seen = np.unique(np.asarray(recent, dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < x.size)]
            if p.repetition_penalty != 1.0:
                v = x[seen]
                x[seen] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            x[seen] -= p.presence_penalty
        answer = history[self.answer_start:]
        if p.frequency_penalty != 0.0 and len(answer):
            ids, counts = np.unique(np.asarray(answer, dtype=np.int64), return_counts=True)
            inside = (ids >= 0) & (ids < x.size)
            x[ids[inside]] -= p.frequency_penalty * counts[inside]

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Pick the next token from :meth:`distribution` (masked by the grammar, when there is one) with this
        sampler's random generator, and accept it into the grammar.

        Args:
            logits: (n_vocab,) float32 logits of the next position.
            history: token ids already in the context, oldest first.

        Returns:
            The chosen token id.

        Raises:
            EngineError: as :meth:`distribution`; GrammarError when the grammar's parser fails.
        """
        allowed = None if self.matcher is None else self.matcher.allowed()
        ids, probs = self.distribution(logits, history, allowed)
        token = int(ids[0]) if ids.size == 1 else int(ids[self._rng.choice(ids.size, p=probs)])
        if self.matcher is not None:
            self.matcher.accept(token)
        return token
