"""Sampling against a slow, loop-by-loop reference of the same chain (llama.cpp order)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.errors import EngineError
from engine.sampling import Sampler, SamplingParams, logprobs


def reference_distribution(logits, history, p: SamplingParams, answer_start: int = 0,
                           allowed=None) -> dict[int, float]:
    """Plain-Python version: logit bias, penalties (frequency: OpenAI's ``mu[j] -= c[j] * alpha_frequency``
    over the answer), grammar mask, top-k, top-p, min-p, temperature."""
    x = [float(v) for v in logits]
    for t, b in p.logit_bias:
        x[t] += b
    recent = history[-p.penalty_last_n:] if p.penalty_last_n else history
    for t in set(recent):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.presence_penalty
    for t in history[answer_start:]:
        x[t] -= p.frequency_penalty
    pool = [i for i in range(len(x)) if allowed is None or allowed[i]]
    if p.temperature == 0:
        best = max(pool, key=lambda i: (x[i], -i))
        return {best: 1.0}
    order = sorted(pool, key=lambda i: (-x[i], i))
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
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, frequency_penalty=1.9, presence_penalty=0.4),
    SamplingParams(temperature=1.1, top_k=0, top_p=1.0, logit_bias=((3, 5.0), (7, -100.0), (39, 2.5))),
    SamplingParams(temperature=0.0, logit_bias=((11, 100.0),), frequency_penalty=-0.5),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, logit_bias=((0, 1.0),), frequency_penalty=0.3,
                   repetition_penalty=1.2),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_distribution_matches_reference(params: SamplingParams, seed: int, masked: bool) -> None:
    """Every case on fresh logits, a history whose last 7 tokens (with repeats) are the answer, and with or
    without a random grammar mask of about a third of the ids."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.5, 40).astype(np.float32)
    history = rng.integers(0, 40, 5).tolist() + rng.integers(0, 10, 7).tolist()
    allowed = rng.random(40) < 0.35 if masked else None
    ids, probs = Sampler(params, answer_start=5).distribution(logits, history, allowed)
    ref = reference_distribution(logits, history, params, 5, allowed)
    assert set(ids.tolist()) == set(ref)
    for i, q in zip(ids.tolist(), probs.tolist()):
        assert q == pytest.approx(ref[i], rel=1e-9, abs=1e-12)


def test_frequency_penalty_counts_answer_only() -> None:
    """Greedy between logits 1.0 (id 1) and 0.9 (id 2), penalty 0.06: three 1s in the prompt cost nothing,
    one in the answer costs 0.06 (1 still wins), three in the answer cost 0.18 (2 wins)."""
    logits = np.zeros(6, np.float32)
    logits[[1, 2]] = [1.0, 0.9]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.06)
    assert Sampler(p, answer_start=3).sample(logits, [1, 1, 1]) == 1
    assert Sampler(p, answer_start=0).sample(logits, [1, 1, 1]) == 2
    assert Sampler(p, answer_start=3).sample(logits, [1, 1, 1, 1]) == 1
    assert Sampler(p, answer_start=1).sample(logits, [1, 1, 1, 1]) == 2


def test_logit_bias_outside_vocabulary_is_named() -> None:
    with pytest.raises(EngineError, match="logit_bias names token id 40"):
        Sampler(SamplingParams(logit_bias=((40, 1.0),))).sample(np.zeros(40, np.float32), [])


def test_empty_mask_is_an_engine_error() -> None:
    with pytest.raises(EngineError, match="allows no next token"):
        Sampler(SamplingParams()).distribution(np.zeros(8, np.float32), [], np.zeros(8, bool))


def test_mask_of_another_vocabulary_is_an_engine_error() -> None:
    with pytest.raises(EngineError, match="covers 9 token ids but the model has 8"):
        Sampler(SamplingParams()).distribution(np.zeros(8, np.float32), [], np.ones(9, bool))


@pytest.mark.parametrize("top", [0, 1, 5, 40])
def test_logprobs_are_log_softmax(top: int) -> None:
    """Against ``x - log(sum(exp(x)))`` in extended precision; alternatives are the ``top`` largest logits."""
    rng = np.random.default_rng(top)
    logits = rng.normal(0, 4.0, 40).astype(np.float32)
    logits[5] = logits[6] = logits.max() + 1          # a tie: the lower id first
    x = logits.astype(np.longdouble)
    ref = x - np.log(np.exp(x).sum())
    lp, alts = logprobs(logits, 17, top)
    assert lp == pytest.approx(float(ref[17]), abs=1e-12)
    order = sorted(range(40), key=lambda i: (-float(x[i]), i))[:top]
    assert [i for i, _ in alts] == order
    for i, v in alts:
        assert v == pytest.approx(float(ref[i]), abs=1e-12)


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
                                 dict(repetition_penalty=0), dict(max_tokens=0), dict(top_k=-1),
                                 dict(frequency_penalty=float("inf")), dict(logit_bias=((1, 101.0),)),
                                 dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, float("nan")),)),
                                 dict(logit_bias=((1,),)), dict(top_logprobs=21), dict(top_logprobs=-1)])
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
