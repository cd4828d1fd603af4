"""The per-ISA Gated DeltaNet kernel (native/cpu/gdn/gdn_kernel.h): the same bits at every ISA level, thread
count and split of the tokens over calls, decode included, and near the numpy twin.

Shapes are chosen to reach every path: state widths that leave a remainder after the wide column blocks
(64 / 32 / 16 columns at AVX-512 / AVX2 / baseline) and after the one-vector blocks (dv = 77, 200), conv
widths that are no multiple of 8 or exceed one 128-channel conv pass (dk = 24, 130), conv kernels of 1, 3,
4 (the inlined case) and 5, several v-heads per k-head, and token counts on both sides of the pool's
threshold for the input pass (8). Inputs are fresh random values, none zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35 import cpu_mixers
from engine.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")

SHAPES = [  # n_k, n_v, dk, dv, conv taps, tokens
    (2, 6, 24, 77, 3, 19),
    (1, 2, 130, 200, 4, 5),
    (3, 3, 40, 16, 1, 9),
    (2, 4, 128, 128, 5, 23),
    (16, 16, 128, 128, 4, 12),
]



def nonzero(rng, shape, scale=1.0):
    """Standard normal values scaled, with no exact zero."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x[x == 0] = 0.5
    return x


def make_case(shape, seed):
    nk, nv, dk, dv, taps, n = shape
    rng = np.random.default_rng(seed)
    conv_dim = 2 * nk * dk + nv * dv
    layer = cpu_mixers.GDNLayer(nk, nv, dk, dv, nonzero(rng, (conv_dim, taps), 0.5), nonzero(rng, nv, 0.1),
                                -np.exp(rng.uniform(np.log(0.5), np.log(4), nv)).astype(np.float32),
                                1 + 0.1 * nonzero(rng, dv), 1e-6)
    inputs = dict(mixed=nonzero(rng, (n, conv_dim), 2.0), z=nonzero(rng, (n, nv * dv), 3.0),
                  b=nonzero(rng, (n, nv)), a=nonzero(rng, (n, nv)))
    states = (nonzero(rng, (taps - 1, conv_dim)), nonzero(rng, (nv, dk, dv), 0.1))
    return layer, inputs, states


def prefill(layer, inputs, states, cuts=()):
    """gdn_prefill over the tokens split at ``cuts``; returns (y, conv_state, ssm_state)."""
    conv, ssm = (s.copy() for s in states)
    bounds = [0, *cuts, len(inputs["mixed"])]
    ys = [cpu_mixers.gdn_prefill(layer, *(inputs[k][t0:t1] for k in ("mixed", "z", "b", "a")), conv, ssm)
          for t0, t1 in zip(bounds, bounds[1:])]
    return np.concatenate(ys), conv, ssm


def same_bits(x, y):
    return all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(x, y))


@pytest.mark.parametrize("shape", SHAPES)
def test_every_level_thread_count_and_split_gives_the_same_bits(shape, isa_reset):
    layer, inputs, states = make_case(shape, seed=sum(shape))
    n = shape[-1]
    cpu.set_isa("scalar")
    cpu.set_threads(1)
    want = prefill(layer, inputs, states)
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            assert same_bits(prefill(layer, inputs, states), want), (level, threads)
            assert same_bits(prefill(layer, inputs, states, cuts=(1, min(8, n - 1))), want), (level, threads)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_equals_decode_token_by_token(shape, isa_reset):
    layer, inputs, states = make_case(shape, seed=7 + sum(shape))
    cpu.set_threads(2)
    y, conv, ssm = prefill(layer, inputs, states)
    conv2, ssm2 = (s.copy() for s in states)
    steps = np.stack([cpu_mixers.gdn_decode(layer, *(inputs[k][t] for k in ("mixed", "z", "b", "a")), conv2, ssm2)
                      for t in range(shape[-1])])
    assert same_bits((y, conv, ssm), (steps, conv2, ssm2))


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_stays_near_the_numpy_twin(shape, isa_reset):
    """Bound 1e-5 of the largest output / state value: the kernel keeps S and its products in float32
    where the twin rounds float64 ops to float32 (measured gaps: 0.7e-7 .. 2.3e-7 relative)."""
    layer, inputs, states = make_case(shape, seed=11 + sum(shape))
    y, conv, ssm = prefill(layer, inputs, states)
    conv2, ssm2 = (s.copy() for s in states)
    ref = np.stack([cpu_mixers.gdn_decode_np(layer, *(inputs[k][t] for k in ("mixed", "z", "b", "a")), conv2, ssm2)
                    for t in range(shape[-1])])
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(ssm - ssm2).max() <= 1e-5 * np.abs(ssm2).max()
    assert np.array_equal(conv, conv2)


def test_silu_of_extreme_conv_outputs_matches_the_twin(isa_reset):
    """Conv outputs far in both tails (|x| up to 1e4, where e^-|x| would leave the double range without
    the kernel's clamp) give SiLU's limits: x for large x, -0 for very negative x."""
    layer, inputs, states = make_case((1, 1, 16, 16, 4, 3), seed=3)
    inputs["mixed"] *= np.float32(5e3)
    for level in cpu.supported_isas():
        cpu.set_isa(level)
        y, conv, ssm = prefill(layer, inputs, states)
        conv2, ssm2 = (s.copy() for s in states)
        ref = np.stack([cpu_mixers.gdn_decode_np(layer, *(inputs[k][t] for k in ("mixed", "z", "b", "a")),
                                                 conv2, ssm2) for t in range(3)])
        assert np.all(np.isfinite(y)) and np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), level


def test_too_many_conv_taps_are_rejected():
    with pytest.raises(ValueError, match="K <= 16"):
        make_case((1, 1, 8, 8, cpu_mixers.MAX_CONV + 1, 2), seed=0)
