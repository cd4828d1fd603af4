"""CPU prompt processing (native/cpu/quant/gemm_tiles.h's GEMM walk, moe_prefill.c's dd_moe_prefill): results
bit-identical to the one-token paths, so prefill and decode agree and a prompt's split into pieces
changes nothing.

* A product with m columns gives each column exactly the bits of that column alone (the GEMV), for
  every weight type with a kernel, every ISA level, 1 and 2 threads, odd row and block counts,
  column counts across the GEMM's 32-column blocks with a ragged last tile.
* The MoE of n tokens grouped by expert gives each token exactly what dd_moe_ffn gives it alone:
  routing (ties included: two experts with the same router row tie on every token, the lower
  index wins), weights and output, for prompt pieces and for a batched decode step's 1-9 tokens
  (whose router logits are cut by router rows instead of by tokens).

Weights are random blocks with nonzero scales; activations are standard normal (no zeros).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_cpu_kernels import random_moe, random_weights, rng  # noqa: F401 (fixture)
from test_cpu_kquants import random_kquant
from test_cpu_lowbit import random_lowbit

from engine.gguf import quant
from engine.kernels import cpu, cpu_moe, lowbit_twins

Q = GGMLQuantizationType
LEVELS = cpu.supported_isas()
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@pytest.fixture
def restore():
    yield
    cpu.set_isa(None)
    cpu.set_threads()


def random_blocks(rng, rows: int, k: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """(rows, row bytes) uint8 of ``qtype``: K-quants and low-bit types as test_cpu_kquants / test_cpu_lowbit
    draw them, types gguf can write quantized from random floats, any other type random bytes with random
    nonzero f16 scales."""
    if qtype in K_QUANTS:
        return random_kquant(rng, rows, k, qtype)
    if qtype in lowbit_twins.LOW_BIT:
        return random_lowbit(rng, rows, k, qtype)
    if qtype in quant.WRITABLE_TYPES:
        return random_weights(rng, rows, k, qtype)
    raw = rng.integers(0, 256, size=(rows, quant.row_bytes(qtype, k)), dtype=np.uint8)
    blocks = raw.view(quant.BLOCK_DTYPES[qtype])
    for field, (dtype, _) in quant.BLOCK_DTYPES[qtype].fields.items():
        if dtype == np.float16:
            shape = blocks[field].shape
            blocks[field] = (rng.choice([-1, 1], shape) * rng.uniform(0.5, 1, shape)
                             * 2.0 ** rng.integers(-12, -6, shape)).astype(np.float16)
    return raw


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("qtype", sorted(cpu.KERNEL_TYPES), ids=lambda t: t.name)
def test_gemm_columns_bit_identical_to_gemv(qtype, rng, restore):
    """301 rows (several thread chunks, a ragged last one), an odd number of blocks, 70 columns
    (two full 32-column blocks and a 6-column one: 4-column tiles and a 2-column tail)."""
    block = max(quant.TYPES[qtype].block_values, 32)   # BF16: values of 2 bytes, k a multiple of 32
    k = block * (47 if block == 32 else 5)
    raw = random_blocks(rng, 301, k, qtype)
    x = (rng.standard_normal((70, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_columns_match_gemv(cpu.Matrix(raw, k, qtype), x, [slice(None), slice(5, 38)])


def assert_columns_match_gemv(mat: cpu.Matrix, x: np.ndarray, pieces: list[slice]) -> None:
    """At every level, 1 and 2 threads: mat's product with each piece of x's columns equals, bit
    for bit, the GEMV of each column alone."""
    for name in LEVELS:
        cpu.set_isa(name)
        cpu.set_threads(1)
        single = np.stack([mat(x[c:c + 1])[0] for c in range(len(x))])
        assert np.all(np.isfinite(single)) and np.any(single != 0)
        for n in (1, 2):
            cpu.set_threads(n)
            for piece in pieces:
                assert np.array_equal(mat(x[piece]), single[piece]), (name, n, piece)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n_super", [(1, 1), (37, 3), (301, 8), (9, 74), (3, 300)])
def test_kquant_gemm_bit_identical_to_gemv(qtype, rows, n_super, rng, restore):
    """The K-quant GEMMs, which unpack a row range once per call (AVX-512: kq_gemm_avx512.h; AVX2:
    kquants.h's dd_kq_gemm_unpacked; SSSE3 and scalar walk), give every column the GEMV's bits: odd
    row counts (the AVX-512 last row's zero partner), thread chunks with an odd last one (301 rows),
    1-8 super-blocks per row, 74 (more than the AVX-512 scratch holds: that level's tile walk) and
    300 (the same at AVX2); m = 2 .. 71, not multiples of 4 or 32."""
    k = 256 * n_super
    x = (rng.standard_normal((71, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    assert_columns_match_gemv(cpu.Matrix(random_kquant(rng, rows, k, qtype), k, qtype), x,
                              [slice(0, m) for m in (2, 3, 5, 33, 71)])


def tied_moe(rng, kquants: bool, shared: bool) -> cpu_moe.MoEWeights:
    """random_moe's layer (or one with a Q4_K_M-like mix), expert 5's router row a copy of expert 2's."""
    if kquants:
        d, n_expert, ff, ff_sh = 512, 12, 256, 256
        w = cpu_moe.MoEWeights(
            router=rng.standard_normal((n_expert, d)).astype(np.float32) * 0.2,
            gate=random_kquant(rng, n_expert * ff, d, Q.Q4_K), up=random_kquant(rng, n_expert * ff, d, Q.Q5_K),
            down=random_kquant(rng, n_expert * d, ff, Q.Q6_K), n_used=3,
            qtypes={"gate": Q.Q4_K, "up": Q.Q5_K, "down": Q.Q6_K, "sh_gate": Q.Q4_K, "sh_up": Q.Q8_0,
                    "sh_down": Q.Q6_K},
            **(dict(sh_gate=random_kquant(rng, ff_sh, d, Q.Q4_K), sh_up=random_weights(rng, ff_sh, d, Q.Q8_0),
                    sh_down=random_kquant(rng, d, ff_sh, Q.Q6_K),
                    sh_gate_inp=rng.standard_normal(d).astype(np.float32) * 0.1) if shared else {}))
    else:
        w = random_moe(rng, d=256, n_expert=16, ff=96, ff_sh=64, n_used=4, shared=shared)
    router = w.router.copy()
    router[5] = router[2]
    return w._replace(router=router)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("kquants", [False, True], ids=["q4_0-q8_0", "k-quants"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no-shared"])
def test_moe_prefill_bit_identical_to_per_token(kquants, shared, rng, restore):
    w = cpu_moe.PreparedMoE(tied_moe(rng, kquants, shared))
    d = w.d
    x = rng.standard_normal((37, d)).astype(np.float32)
    ties = 0
    for name in LEVELS:
        cpu.set_isa(name)
        cpu.set_threads(1)
        alone = [cpu_moe.moe_ffn(row, w) for row in x]
        ties = sum(2 in r.experts and 5 in r.experts for r in alone)
        for n in (1, 2):
            cpu.set_threads(n)
            for piece in (slice(0, 37), slice(3, 20)):
                got = cpu_moe.moe_prefill(x[piece], w)
                want = alone[piece]
                assert np.array_equal(got.experts, np.stack([r.experts for r in want])), (name, n)
                assert np.array_equal(got.weights, np.stack([r.weights for r in want])), (name, n)
                assert np.array_equal(got.out, np.stack([r.out for r in want])), (name, n)
    for r in alone:    # the tie rule: expert 2 always comes before its twin 5, and right before it
        if 5 in r.experts:
            assert list(r.experts).index(5) == list(r.experts).index(2) + 1
    print(f"{ties} of 37 tokens chose both tied experts")


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no-shared"])
def test_moe_prefill_decode_batches(shared, rng, restore):
    """1-9 tokens, a batched decode step's sizes (up to 8 the router is cut by router rows, each chunk meeting
    every token; 9 by tokens): each token gets the bits of dd_moe_ffn alone. 45 experts at d = 256 make two
    chunks of router rows (32 and an odd 13); expert 40 copies expert 2's router row across the two chunks."""
    w = random_moe(rng, n_expert=45, n_used=4, shared=shared)
    router = w.router.copy()
    router[40] = router[2]
    w = cpu_moe.PreparedMoE(w._replace(router=router))
    x = rng.standard_normal((9, 256)).astype(np.float32)
    x[5] = x[1]   # two rows of one batch alike: both route and sum as that row alone
    for name in LEVELS:
        cpu.set_isa(name)
        cpu.set_threads(1)
        alone = [cpu_moe.moe_ffn(row, w) for row in x]
        for threads in (1, 2):
            cpu.set_threads(threads)
            for n in range(1, 10):
                got, want = cpu_moe.moe_prefill(x[:n], w), alone[:n]
                assert np.array_equal(got.experts, np.stack([r.experts for r in want])), (name, threads, n)
                assert np.array_equal(got.weights, np.stack([r.weights for r in want])), (name, threads, n)
                assert np.array_equal(got.out, np.stack([r.out for r in want])), (name, threads, n)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
def test_moe_prefill_odd_expert_count(rng, restore):
    """13 experts and routing chunks of an odd token count: the router dots' edge tiles (dots_f32's one-row
    and one-token tiles) give each token the bits of the 2 x 2 tiles and of the one-token call."""
    w = cpu_moe.PreparedMoE(random_moe(rng, n_expert=13, n_used=3))
    x = rng.standard_normal((37, 256)).astype(np.float32)
    for name in LEVELS:
        cpu.set_isa(name)
        cpu.set_threads(1)
        alone = [cpu_moe.moe_ffn(row, w) for row in x]
        for n in (1, 2):
            cpu.set_threads(n)
            got = cpu_moe.moe_prefill(x, w)
            assert np.array_equal(got.experts, np.stack([r.experts for r in alone])), (name, n)
            assert np.array_equal(got.weights, np.stack([r.weights for r in alone])), (name, n)
            assert np.array_equal(got.out, np.stack([r.out for r in alone])), (name, n)


def test_moe_prefill_twin_and_shapes(rng, restore):
    w = random_moe(rng)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    cpu.set_isa("numpy")
    got = cpu_moe.moe_prefill(x, w)
    for t in range(3):
        one = cpu_moe.moe_ffn_np(x[t], w)
        assert all(np.array_equal(a[t], b) for a, b in zip(got, one))
    assert cpu_moe.moe_prefill(x[:0], w).out.shape == (0, 256)
    with pytest.raises(ValueError, match=r"expected \(n, 256\)"):
        cpu_moe.moe_prefill(x[:, :128], w)
