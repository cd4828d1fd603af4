"""CPU decode kernels (engine.kernels.cpu, native/cpu/): every ISA level this CPU runs, and the numpy twins.

References are independent of the code under test: gguf.quants quantizes and dequantizes
(ggml's reference layouts), and products are taken in float64.

Tolerance of a product (per output element): the kernels and their numpy twins take each 32-value
block's integer dot product exactly and round once per block (scale multiply + accumulate), then sum
lanes in a tree. The standard float-summation bound then gives |y - y_ref| <= (n + 16) * 2^-24 *
sum_i |w_i * a_i| with n = k // 32 blocks (test_q4q8_within_the_lane_bound checks the tighter bound of
Q4_0 and Q8_0's 16 f32 lanes). As a second check the error norm must stay within sqrt(n + 16) * 2^-24 of
the norm of those sums, the growth of roundings of random sign (assert_close).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import engine
from engine.kernels import cpu, cpu_moe
from engine.errors import EngineError
from engine.ops.reference import sigmoid, silu

LEVELS = cpu.supported_isas()
ALL = (*LEVELS, "numpy")
Q4_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0
QTYPES = {"q4_0": (Q4_0, "matmul_q4_0"), "q8_0": (Q8_0, "matmul_q8_0")}


@pytest.fixture
def level(request):
    """Activate an ISA level (parametrized by name) for one test; restore the default afterwards."""
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(None)
    cpu.set_threads()


@pytest.fixture
def rng():
    """Fresh random inputs each run; the seed is printed on failure (pytest shows captured output)."""
    seed = np.random.SeedSequence().entropy
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def random_weights(rng, rows: int, k: int, qtype) -> np.ndarray:
    """(rows, row bytes) uint8 of ``qtype`` quantized from random normal rows (gguf gives F16 as float16)."""
    w = quants.quantize((rng.standard_normal((rows, k)) * rng.uniform(0.01, 2)).astype(np.float32), qtype)
    return np.ascontiguousarray(w).view(np.uint8)


def reference_product(raw: np.ndarray, x: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(y, sum_i |w_i a_i|) in float64: dequantized weights times Q8_0-quantized activations."""
    w = quants.dequantize(raw, qtype).astype(np.float64)
    a = quants.dequantize(quants.quantize(x, Q8_0), Q8_0).astype(np.float64)
    return a @ w.T, np.abs(a) @ np.abs(w).T


def gamma(n: int | np.ndarray) -> float | np.ndarray:
    """Higham's gamma_n = n u / (1 - n u), u = 2^-24: the relative error of a float32 value that passed through
    n roundings (Accuracy and Stability of Numerical Algorithms, 2nd ed., lemma 3.1)."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def assert_close(y: np.ndarray, ref: np.ndarray, abs_sum: np.ndarray, n_terms: int) -> None:
    """Every element within the worst-case summation bound ``n 2^-24 sum|w a|`` (n = n_terms + 16), and the errors
    together within ``sqrt(n) 2^-24`` of the sizes, in norm: roundings of random sign grow like the square root
    of their count (on these tests' inputs their norm stays below a tenth of it), so a kernel whose errors
    sit at the worst case everywhere fails. (Against the norm of y itself a sum that cancels to near zero could
    fail honestly, as f32 terms make the error a fraction of the terms' size, not of the result's.)"""
    assert y.dtype == np.float32 and y.shape == ref.shape
    bound = (n_terms + 16) * 2.0**-24 * abs_sum
    excess = np.abs(y - ref) - bound
    assert excess.max() <= 0, f"error above the summation bound by {excess.max():.3g}"
    assert np.linalg.norm(y - ref) <= np.sqrt(n_terms + 16) * 2.0**-24 * np.linalg.norm(abs_sum) + 1e-30


def assert_within_summation_bound(raw: np.ndarray, weights: np.ndarray, k: int, m: int, wtype, rng) -> None:
    """``raw`` (rows of the float type ``wtype``, k values each; ``weights`` their float64 values) times m random
    float32 columns, at every level and in the numpy twin, within ``2^-24 |ref| + (k / 8 + 4) 2^-53 sum|w x|`` of
    the float64 product (exact f64 products summed k / 8 to a lane, 8 lanes in a tree; test_cpu_bf16 derives it)."""
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    a = x.astype(np.float64)
    ref, abs_sum = a @ weights.T, np.abs(a) @ np.abs(weights).T
    bound = 2.0**-24 * np.abs(ref) + (k / 8 + 4) * 2.0**-53 * abs_sum
    mat = cpu.Matrix(raw, k, wtype)
    for level in (*LEVELS, "numpy"):
        cpu.set_isa(level)
        y = mat(x)
        assert y.dtype == np.float32 and y.shape == (m, raw.shape[0])
        assert (np.abs(y - ref) <= bound).all(), (level, np.max(np.abs(y - ref) - bound))


def assert_same_bits_everywhere(raw: np.ndarray, k: int, qtype, rng, x: np.ndarray | None = None) -> None:
    """``raw`` (rows of ``qtype``, k values each) times the columns x (default 5 random ones): every ISA level
    at 1-3 threads, the columns together and the last one alone, gives the numpy twin's bits (signed zeros
    included)."""
    x = rng.standard_normal((5, k)).astype(np.float32) if x is None else x
    mat = cpu.Matrix(raw, k, qtype)
    want = cpu.matmul_np(raw, x, qtype).view(np.uint32)
    try:
        for name in LEVELS:
            cpu.set_isa(name)
            for n in (1, 2, 3):
                cpu.set_threads(n)
                assert np.array_equal(mat(x).view(np.uint32), want), (name, n)
                assert np.array_equal(cpu.matmul(raw, x[-1], qtype).view(np.uint32), want[-1]), (name, n)
    finally:
        cpu.set_isa(None)
        cpu.set_threads()


# --- quantization ------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ALL, indirect=True)
def test_quantize_q8_0_matches_ggml_reference(level, rng):
    x = (rng.standard_normal((3, 32 * 37)) * 10.0 ** rng.uniform(-6, 4, size=(3, 1))).astype(np.float32)
    x[0, :32] = 0.0                                          # d == 0 block
    x[1, :32] = np.arange(-15.5, 16.5, dtype=np.float32)     # halves: x * (1/d) lands on k + 0.5
    x[1, 31] = 127.0
    x[2, :32] *= np.float32(1e-30)                           # d far below f16's smallest subnormal
    assert np.array_equal(cpu.quantize_q8_0(x), quants.quantize(x, Q8_0))
    assert np.array_equal(cpu.quantize_q8_0(x[1]), quants.quantize(x[1], Q8_0))


@pytest.mark.parametrize("level", ALL, indirect=True)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=hnp.arrays(np.float32, st.integers(1, 4).map(lambda nb: 32 * nb),
                    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True)))
def test_quantize_q8_0_bit_exact_on_any_floats(level, x):
    """Any finite floats, except blocks whose max |x| is below 2^-120 but not 0: there d = max / 127
    is so small that 1 / d overflows to inf and ggml's reference itself is undefined (inf to int8)."""
    block_max = np.abs(x.reshape(-1, 32)).max(axis=1)
    assume(np.all((block_max == 0) | (block_max >= 2.0**-120)))
    assert np.array_equal(cpu.quantize_q8_0(x), quants.quantize(x, Q8_0))


# --- products ----------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows, k", [(1, 32), (5, 64), (3, 96), (7, 32 * 47), (130, 2048), (17, 4128), (9, 32 * 257)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matmul_matches_float64_reference(level, qtype, rows, k, m, rng):
    ggml_type, name = QTYPES[qtype]
    raw = random_weights(rng, rows, k, ggml_type)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    ref, abs_sum = reference_product(raw, x, ggml_type)
    y = getattr(cpu, name)(raw, x)
    assert_close(y, ref, abs_sum, k // 32)


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows, k", [(37, 320), (19, 32 * 47), (3, 512 * 342 + 96)])
def test_matmul_vector_and_batched_columns_agree(level, qtype, rows, k, rng):
    """A (k,) input gives (rows,); for the native kernels each column of a batch is bit-identical to
    the same vector alone (the GEMM tiles run the GEMV's per-element instruction sequence). k: one short
    group of 16 blocks, full groups and a short one, and rows longer than AVX-512's unpacked-group buffer
    (341 groups of 512 values: such rows are unpacked per column block instead)."""
    ggml_type, name = QTYPES[qtype]
    raw = random_weights(rng, rows, k, ggml_type)
    x = rng.standard_normal((6, k)).astype(np.float32)
    batch = getattr(cpu, name)(raw, x)
    single = np.stack([getattr(cpu, name)(raw, v) for v in x])
    assert single.shape == batch.shape == (6, rows)
    ref, abs_sum = reference_product(raw, x, ggml_type)
    assert_close(batch, ref, abs_sum, k // 32)
    assert np.array_equal(single, batch)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [32 * 5, 32 * 18, 32 * 47, 2048 + 32, 4096])   # short last quads of 1, 2, 3 blocks
def test_q4q8_same_bits_at_every_level_as_the_twin(qtype, k, rng):
    """Q4_0 and Q8_0 sum f32 terms in 16 lanes (kernels.h): float32 rounding makes the order visible, so
    every level, thread count and column count must follow the twin's exactly; the rows include the
    largest and smallest f16 scales and a zero row."""
    ggml_type, _ = QTYPES[qtype]
    raw = random_weights(rng, 29, k, ggml_type)
    scales = raw.reshape(29, k // 32, -1)[:, :, :2].view(np.float16)
    scales[3, 0], scales[7, -1], scales[11, 1] = 65504.0, -6e-8, -65504.0
    raw[13] = 0
    assert_same_bits_everywhere(raw, k, ggml_type, rng)


@pytest.mark.parametrize("level", ALL, indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [32 * 15, 32 * 47, 32 * 256])
def test_q4q8_within_the_lane_bound(level, qtype, k, rng):
    """|y - sum_b t_b| <= gamma(ceil(nb / 16) + 5) sum_b |t_b|, t_b the exact block terms:
    one rounding per term, ceil(nb / 16) adds in its lane, 4 in the tree (kernels.h): a check of the documented
    bound (the order itself is pinned by the same-bits test above). Rows of alternating sign cancel in the tree,
    so the error is not small merely because the terms are."""
    ggml_type, name = QTYPES[qtype]
    nb = k // 32
    signs = np.where(np.arange(k) // 32 % 2 == 0, 1.0, -1.0).astype(np.float32)
    w = (np.abs(rng.standard_normal((23, k))) * signs * rng.uniform(0.5, 1.5, (23, 1))).astype(np.float32)
    raw = np.ascontiguousarray(quants.quantize(w, ggml_type)).view(np.uint8)
    x = np.abs(rng.standard_normal((4, k))).astype(np.float32) * rng.uniform(0.1, 10)
    wd = quants.dequantize(raw, ggml_type).astype(np.float64).reshape(23, nb, 32)
    ad = quants.dequantize(quants.quantize(x, Q8_0), Q8_0).astype(np.float64).reshape(4, nb, 32)
    terms = np.einsum("rbj,cbj->crb", wd, ad)                 # exact: <= 40 significant bits each
    exact, size = terms.sum(-1), np.abs(terms).sum(-1)
    y = getattr(cpu, name)(raw, x).astype(np.float64)
    bound = gamma(-(-nb // 16) + 5) * size + nb * 2.0**-53 * size
    assert (np.abs(y - exact) <= bound).all(), np.max(np.abs(y - exact) / size)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_bit_identical_for_any_thread_count(level, qtype, rng):
    ggml_type, name = QTYPES[qtype]
    raw = random_weights(rng, 301, 2048, ggml_type)          # many chunks, a ragged last one
    x = rng.standard_normal((3, 2048)).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        cpu.set_threads(n)
        results.append((getattr(cpu, name)(raw, x[0]), getattr(cpu, name)(raw, x)))
    for vec, mat in results[1:]:
        assert np.array_equal(vec, results[0][0]) and np.array_equal(mat, results[0][1])


def test_matmul_rejects_bad_shapes():
    raw = quants.quantize(np.ones((4, 64), np.float32), Q4_0)
    with pytest.raises(ValueError, match="k=96"):
        cpu.matmul_q4_0(raw, np.ones(96, np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu.matmul_q4_0(raw, np.ones(40, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu.matmul_q8_0(np.zeros((4, 136), np.uint8)[:, ::2], np.ones(64, np.float32))
    with pytest.raises(ValueError, match="uint8"):
        cpu.matmul_q4_0(raw.view(np.int8), np.ones(64, np.float32))


def test_matrix_takes_its_type_from_the_table_not_the_row_length():
    """Rows of 256 values are 144 bytes in Q4_0 and in Q4_K alike: the type is always passed in."""
    raw = quants.quantize(np.ones((3, 256), np.float32), Q4_0)
    assert cpu.Matrix(raw, 256, Q4_0).qtype == Q4_0
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        cpu.Matrix(raw, 256, Q8_0)
    with pytest.raises(ValueError, match="no CPU kernel reads TQ1_0"):
        cpu.Matrix(raw, 256, GGMLQuantizationType.TQ1_0)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
def test_kernel_ids_of_the_quant_table_match_the_c_enum():
    from engine import _native_cpu
    for qtype in cpu.KERNEL_TYPES:
        assert engine.gguf.quant.TYPES[qtype].cpu_kernel == getattr(_native_cpu.lib, f"DD_{qtype.name.upper()}")
    assert cpu.Q4_0_IL.cpu_kernel == _native_cpu.lib.DD_Q4_0_IL
    assert cpu.MXFP4_IL.cpu_kernel == _native_cpu.lib.DD_MXFP4_IL
    assert cpu.Q4_K_IL.cpu_kernel == _native_cpu.lib.DD_Q4_K_IL
    assert cpu.Q2_K_RL.cpu_kernel == _native_cpu.lib.DD_Q2_K_RL
    assert cpu.Q3_K_RL.cpu_kernel == _native_cpu.lib.DD_Q3_K_RL
    assert len(cpu.KERNEL_TYPES) + len(cpu.LAYOUTS) == _native_cpu.lib.DD_WTYPE_COUNT   # + the row-grouped layouts


# --- the MoE feed-forward ------------------------------------------------------------------------

def random_moe(rng, d=256, n_expert=16, ff=96, ff_sh=64, n_used=4, shared=True) -> cpu_moe.MoEWeights:
    def w(rows, k, qtype=Q4_0):
        return random_weights(rng, rows, k, qtype)
    router = rng.standard_normal((n_expert, d)).astype(np.float32) * 0.2
    sh = dict(sh_gate=w(ff_sh, d), sh_up=w(ff_sh, d, Q8_0), sh_down=w(d, ff_sh),
              sh_gate_inp=rng.standard_normal(d).astype(np.float32) * 0.1) if shared else {}
    qtypes = {"gate": Q4_0, "up": Q4_0, "down": Q8_0, "sh_gate": Q4_0, "sh_up": Q8_0, "sh_down": Q4_0}
    return cpu_moe.MoEWeights(router=router, gate=w(n_expert * ff, d), up=w(n_expert * ff, d),
                          down=w(n_expert * d, ff, Q8_0), n_used=n_used, qtypes=qtypes, **sh)


def route_margin(x, w) -> float:
    p = np.sort(w.router.astype(np.float64) @ x)[::-1]
    return p[w.n_used - 1] - p[w.n_used]


def one_step_bound(x, w, res) -> np.ndarray:
    """(d,) the most that one hidden value moving to its neighbouring Q8_0 step can move each output: the down
    projection quantizes each expert's hidden h = silu(gate x) * up x in blocks of 32 with scale max|h_block| / 127
    stored as float16 (ggml's quantize_row_q8_0), so a value that the two sides' SiLU roundings put on either side
    of a rounding boundary changes the output by that scale times its down-weight column, times the expert's
    routing weight (the shared expert's: its sigmoid gate). The bound allows one such value in a call, in whichever
    expert: a value
    has to fall within the two SiLUs' last-bit difference of a boundary, and two at once is that chance squared."""
    d = x.shape[0]
    ff = w.gate.shape[0] // w.router.shape[0]

    def expert(gate, up, down, n):
        h = silu(cpu.matmul_np(gate, x, w.qtypes[n + "gate"])) * cpu.matmul_np(up, x, w.qtypes[n + "up"])
        step = np.repeat((np.abs(h).reshape(-1, 32).max(axis=1) / 127).astype(np.float16).astype(np.float64), 32)
        wd = np.asarray(quants.dequantize(down, w.qtypes[n + "down"]), np.float64).reshape(d, h.shape[0])
        return (np.abs(wd) * step).max(axis=1)

    terms = [weight * expert(w.gate[e * ff:(e + 1) * ff], w.up[e * ff:(e + 1) * ff], w.down[e * d:(e + 1) * d], "")
             for e, weight in zip(res.experts, res.weights)]
    if w.sh_gate is not None:
        gate = sigmoid(np.float32(np.dot(np.asarray(w.sh_gate_inp, np.float64), x)))
        terms.append(gate * expert(w.sh_gate, w.sh_up, w.sh_down, "sh_"))
    return np.max(terms, axis=0)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_moe_swiglu_against_float64_and_alone(rng, level):
    """dd_moe_swiglu, the experts' SwiGLU, at each ISA level (its own vector width): within 16 ulp of g sigmoid(g)
    u in float64 (e = e^-|g| by its polynomial and scaling <= 6 ulp, entering twice below 0 (g e and 1 + e), then
    the multiply, the add, the divide and the multiply one rounding each; results in the subnormal range within
    2^-126), the same bits for a value alone as in a long row's body or tail and as the scalar level's, and the
    float limits: silu(+inf) = +inf, silu(-inf) = NaN (-inf times e^-inf = 0), NaN in NaN out, e^-|g| past the
    float range to zero."""
    from engine import _native_cpu
    ffi, lib = _native_cpu.ffi, _native_cpu.lib

    def swiglu(g, u, isa=cpu.ISA_LEVELS.index(level)):
        g, u = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(u, np.float32)
        h = np.empty_like(g)
        assert lib.dd_moe_swiglu(isa, ffi.from_buffer("float[]", g), ffi.from_buffer("float[]", u), g.size,
                                 ffi.from_buffer("float[]", h)) == 0
        return h

    n = 8 * 257 + 5
    g = (rng.standard_normal(n) * rng.choice([0.01, 1, 10, 40], n)).astype(np.float32)
    g[:64] = rng.uniform(-104, -80, 64)   # e^-g beyond the float range: the g < 0 branch
    u = (rng.standard_normal(n) + 0.5).astype(np.float32)
    g64 = g.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u.astype(np.float64)
    got = swiglu(g, u)
    assert np.all(np.abs(got - want) <= 16 * 2.0**-24 * np.abs(want) + 2.0**-126)
    at = [*range(0, n, 97), n - 1]   # body lanes and the last value (the padded tail's)
    alone = np.array([swiglu(g[i:i + 1], u[i:i + 1])[0] for i in at], np.float32)
    assert np.array_equal(alone.view(np.uint32), got[at].view(np.uint32))
    assert np.array_equal(swiglu(g, u, isa=0).view(np.uint32), got.view(np.uint32))
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 150.0, -150.0, 1e30, -1e30], np.float32)
    h = swiglu(special, np.ones_like(special))
    assert h[0] == np.inf and np.isnan(h[1]) and np.isnan(h[2]) and h[3] == 0 and h[4] == 0
    assert h[5] == 150.0 and h[6] == 0 and h[7] == np.float32(1e30) and h[8] == 0


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("n_expert, n_used", [(16, 4), (13, 12)])
def test_moe_ffn_matches_numpy_composition(level, shared, n_expert, n_used, rng):
    """Native MoE vs the twin built from reference ops. The routing must agree exactly (inputs with
    a near-tie at the k-th expert are redrawn); outputs within 1e-4 of the reference's max plus
    one_step_bound: the two sides compute SiLU with different exp() roundings, so a hidden value can
    round to the neighbouring Q8_0 step (usually none does: ~2e-7; one CI seed,
    26048832087639351589861755721649084657, put one of the 13-12 case's 1152 hidden values there,
    1.1e-3 of the max). 13 experts, 12
    used: the router's last row runs in dots_f32's one-row tile and is almost always among the
    weights compared (the prefill tests then hold the other tile shapes to these bits)."""
    w = random_moe(rng, n_expert=n_expert, n_used=n_used, shared=shared)
    x = rng.standard_normal(256).astype(np.float32)
    while route_margin(x, w) < 1e-3:
        x = rng.standard_normal(256).astype(np.float32)
    got, ref = cpu_moe.moe_ffn(x, w), cpu_moe.moe_ffn_np(x, w)
    assert np.array_equal(got.experts, ref.experts)
    np.testing.assert_allclose(got.weights, ref.weights, rtol=1e-5)
    np.testing.assert_allclose(np.sum(got.weights), 1.0, rtol=1e-6)
    assert (np.abs(got.out - ref.out) <= 1e-4 * np.abs(ref.out).max() + one_step_bound(x, w, ref)).all()


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_moe_ffn_bit_identical_for_any_thread_count(level, rng):
    w = random_moe(rng, d=512, n_expert=32, ff=256, ff_sh=128, n_used=8)
    x = rng.standard_normal(512).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        cpu.set_threads(n)
        results.append(cpu_moe.moe_ffn(x, w))
    for r in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(r, results[0]))


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_moe_routing_with_non_finite_router_picks_valid_experts(level, bad, rng):
    """A damaged router row (inf or NaN weights) makes logits and the softmax non-finite. The routing must
    still pick n_used distinct experts in range, the ones the twin's stable argsort picks (NaN after every
    number, NaNs by index), in decode and in prefill; the outputs may be NaN but nothing is read or written
    out of bounds (before, such a token selected expert n_expert)."""
    w = random_moe(rng)
    router = w.router.copy()
    router[5] = bad
    w = w._replace(router=router)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    one = [cpu_moe.moe_ffn(row, w) for row in x]
    many = cpu_moe.moe_prefill(x, w)
    for t, r in enumerate(one):
        assert len(set(r.experts.tolist())) == w.n_used and all(0 <= e < 16 for e in r.experts)
        with np.errstate(invalid="ignore", over="ignore"):
            assert np.array_equal(r.experts, cpu_moe.moe_ffn_np(x[t], w).experts)
        assert np.array_equal(many.experts[t], r.experts)


def test_moe_ffn_rejects_inconsistent_shapes(rng):
    w = random_moe(rng)
    with pytest.raises(ValueError, match="router"):
        cpu_moe.moe_ffn(np.ones(128, np.float32), w)
    with pytest.raises(ValueError, match="stack"):
        cpu_moe.moe_ffn(np.ones(256, np.float32), w._replace(down=w.down[:-1]))


# --- ISA selection, fallback ---------------------------------------------------------------------

def test_isa_selection(monkeypatch):
    assert cpu.available(), "native kernels not built: pip install -e . (or python setup.py build_ext --inplace)"
    assert cpu.isa() in LEVELS and LEVELS[0] == "scalar"
    monkeypatch.setenv("DELTADESK_ISA", "scalar")
    assert cpu.set_isa(None) == "scalar"
    monkeypatch.setenv("DELTADESK_ISA", "avx9000")
    with pytest.raises(EngineError, match="DELTADESK_ISA='avx9000'"):
        cpu.set_isa(None)
    monkeypatch.delenv("DELTADESK_ISA")
    assert cpu.set_isa(None) == LEVELS[-1]
    missing = [name for name in cpu.ISA_LEVELS if name not in LEVELS]
    for name in missing:
        with pytest.raises(EngineError, match="does not support"):
            cpu.set_isa(name)
    lib = cpu._native_cpu.lib
    assert lib.dd_isa_supported(len(cpu.ISA_LEVELS)) == 0
    assert lib.dd_matmul(len(cpu.ISA_LEVELS), 0, cpu._native_cpu.ffi.NULL, 0, 32,
                         cpu._native_cpu.ffi.NULL, 0, cpu._native_cpu.ffi.NULL) == -1


def test_read_bandwidth_is_measured():
    for n in (1, 2):
        cpu.set_threads(n)
        assert 0.1 < cpu.read_bandwidth(8 << 20, repeats=1) < 10_000
    cpu.set_threads()


def test_physical_cores_and_threads():
    assert 1 <= cpu.physical_cores() <= len(__import__("os").sched_getaffinity(0))
    assert cpu.set_threads(3) == cpu.threads() == 3
    assert cpu.set_threads() == cpu.physical_cores()


def test_fallback_without_the_extension(monkeypatch, rng):
    """With engine._native_cpu unimportable, a fresh copy of the module warns once and runs numpy."""
    monkeypatch.setitem(sys.modules, "engine._native_cpu", None)
    monkeypatch.delattr(engine, "_native_cpu", raising=False)
    monkeypatch.delenv("DELTADESK_ISA", raising=False)
    spec = importlib.util.spec_from_file_location("cpu_without_native", cpu.__file__)
    fallback = importlib.util.module_from_spec(spec)
    with pytest.warns(RuntimeWarning, match="numpy fallback") as caught:
        spec.loader.exec_module(fallback)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert not fallback.available() and fallback.isa() == "numpy" and fallback.supported_isas() == ()
    with pytest.raises(EngineError, match="not built"):
        fallback.set_isa("scalar")
    raw = random_weights(rng, 7, 64, Q4_0)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert np.array_equal(fallback.matmul_q4_0(raw, x), cpu.matmul_q4_0_np(raw, x))
    assert np.array_equal(fallback.quantize_q8_0(x), quants.quantize(x, Q8_0))
    assert fallback.read_bandwidth(1 << 20, repeats=1) > 0
    monkeypatch.setitem(sys.modules, "engine.kernels.cpu", fallback)   # what a fresh cpu_moe then imports
    spec = importlib.util.spec_from_file_location("cpu_moe_without_native", cpu_moe.__file__)
    fallback_moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fallback_moe)
    w = random_moe(rng)
    assert np.array_equal(fallback_moe.moe_ffn(np.ones(256, np.float32), w).out,
                          cpu_moe.moe_ffn_np(np.ones(256, np.float32), w).out)
