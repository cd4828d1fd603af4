"""Sampling against a slow, loop-by-loop reference of the same chain (llama.cpp order)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.errors import EngineError
from engine.sampling import Sampler, SamplingParams


def reference_distribution(logits, history, p: SamplingParams) -> dict[int, float]:
    """Plain-Python version: penalties, top-k, top-p, min-p, temperature."""
    x = [float(v) for v in logits]
    recent = history[-p.penalty_last_n:] if p.penalty_last_n else history
    for t in set(recent):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.presence_penalty
    if p.temperature == 0:
        best = max(range(len(x)), key=lambda i: (x[i], -i))
        return {best: 1.0}
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if p.top_k:
        order = order[: p.top_k]
    m = x[order[0]]
    e = [math.exp(x[i] - m) for i in order]
    total = sum(e)
    probs = [v / total for v in e]
    keep = len(order)
    if p.top_p < 1.0:
        acc = 0.0
        for j, q in enumerate(probs):
            acc += q
            if acc >= p.top_p:
                keep = j + 1
                break
    if p.min_p > 0:
        keep = min(keep, sum(1 for q in probs if q >= p.min_p * probs[0]))
    kept = order[:keep]
    e = [math.exp((x[i] - m) / p.temperature) for i in kept]
    total = sum(e)
    return {i: v / total for i, v in zip(kept, e)}


CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=1.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5),
    SamplingParams(temperature=0.8, top_k=8, top_p=0.9, repetition_penalty=1.3, penalty_last_n=4),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_distribution_matches_reference(params: SamplingParams, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.5, 40).astype(np.float32)
    history = rng.integers(0, 40, 12).tolist()
    ids, probs = Sampler(params).distribution(logits, history)
    ref = reference_distribution(logits, history, params)
    assert set(ids.tolist()) == set(ref)
    for i, q in zip(ids.tolist(), probs.tolist()):
        assert q == pytest.approx(ref[i], rel=1e-9, abs=1e-12)


def test_draws_follow_distribution() -> None:
    """Empirical frequencies of 20,000 draws within 4 standard errors of the probabilities."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 1.0, 12).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, seed=11)
    sampler = Sampler(params)
    ids, probs = sampler.distribution(logits, [])
    n = 20_000
    draws = np.array([sampler.sample(logits, []) for _ in range(n)])
    for i, q in zip(ids, probs):
        freq = np.mean(draws == i)
        assert abs(freq - q) < 4 * math.sqrt(q * (1 - q) / n) + 1e-9
    assert set(np.unique(draws)) <= set(ids.tolist())


def test_seed_reproducible() -> None:
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=42)
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1.sample(logits, []) for _ in range(50)] == [s2.sample(logits, []) for _ in range(50)]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(repetition_penalty=0), dict(max_tokens=0), dict(top_k=-1)])
def test_bad_parameters_named(bad: dict) -> None:
    with pytest.raises(EngineError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.mark.parametrize("bad", [np.full(8, np.nan, np.float32), np.full(8, -np.inf, np.float32),
                                 np.array([0.5, np.nan, 1.0, 2.0], np.float32)])
def test_non_finite_logits_are_an_engine_error(bad) -> None:
    with pytest.raises(EngineError, match="NaN or no finite"):
        Sampler(SamplingParams(temperature=1.0)).sample(bad, [])


def test_nan_penalty_is_refused() -> None:
    with pytest.raises(EngineError, match="finite"):
        SamplingParams(presence_penalty=float("nan"))
