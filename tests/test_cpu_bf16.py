"""BF16 weights read as stored (native/cpu/quant/bf16.h): 2 bytes a value, times the float32 activations themselves.

Tolerance. Each product w x is exact in float64 (8 x 24 significand bits), each dot sums k / 8 of them per
lane and adds the 8 lanes in a tree of depth 3: |s - ref| <= (k / 8 + 3) 2^-53 sum|w x| (the classic bound,
with the unit roundoff 2^-53 of float64), and the rounding to float32 adds at most 2^-24 |s|. The test allows
``2^-24 |ref| + (k / 8 + 4) 2^-53 sum|w x|``: rounding the activations to BF16 or Q8_0 (what other engines
do) would miss it by orders of magnitude. Bits: the numpy twin's at every level, 1-3 threads, a column
alone or in any batch (test_cpu_kernels.assert_same_bits_everywhere, test_cpu_prefill's GEMM-vs-GEMV test).
Whole model (tiny synth, seed 0): the logits differ from the float32 numpy reference, and the numpy level
(numpy's mixers) from C's, by 2.1e-7 and 2.7e-7 of the largest logit (float32 roundings through the
layers); 1e-5 is allowed, where the Q8_0-activation types need 0.05 (test_native_model).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from test_cpu_kernels import assert_same_bits_everywhere, assert_within_summation_bound, rng  # noqa: F401 (fixture)
from test_native_model import run

from engine.arch.qwen35.cpu import NativeQwen35Model, prepare_weight
from engine.arch.qwen35.model import Qwen35Model
from engine.registry import open_text
from engine.kernels import cpu
from engine.turn.state import SequenceState

BF16 = GGMLQuantizationType.BF16
pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")


def random_bf16(rng, rows: int, k: int) -> np.ndarray:
    """(rows, 2 k) uint8: BF16 rows of mixed magnitudes, a few subnormal values (no flush to zero)."""
    w = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-3, 2, size=(rows, 1))
    w[0, :7] = rng.choice([-1, 1], 7) * 2.0 ** rng.integers(-133, -127, 7)
    return quants.quantize(w.astype(np.float32), BF16)


def as_f64(raw: np.ndarray) -> np.ndarray:
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("rows, k, m", [(1, 32, 1), (3, 64, 2), (37, 96, 5), (301, 2048, 1), (67, 1504, 13)])
def test_bf16_product_within_the_summation_bound_at_every_level(rows, k, m, rng, isa_reset):
    """Every level (and the twin) against the float64 product of the stored weights and the float32 inputs."""
    raw = random_bf16(rng, rows, k)
    assert_within_summation_bound(raw, as_f64(raw), k, m, BF16, rng)


@pytest.mark.parametrize("rows, k", [(5, 32), (37, 320), (130, 1024)])
def test_bf16_same_bits_everywhere(rows, k, rng):
    assert_same_bits_everywhere(random_bf16(rng, rows, k), k, BF16, rng)


def test_bf16_rejects_rows_that_are_not_k_values():
    raw = np.zeros((4, 2 * 48), dtype=np.uint8)
    with pytest.raises(ValueError, match="k=48"):
        cpu.Matrix(raw, 48, BF16)
    with pytest.raises(ValueError, match="BF16"):
        cpu.Matrix(np.zeros((4, 60), dtype=np.uint8), 32, BF16)


def test_bf16_model_is_mapped_runs_the_step_and_the_same_bits_everywhere(synth_model, isa_reset):
    """A BF16 file: every projection is read from the file map (no float32 copy, so RSS grows by no weight
    bytes), decode takes the one-call step, and every level and thread count gives the same logits."""
    text = open_text(synth_model("tiny", "bf16"))
    model = NativeQwen35Model(text.hparams, text.file)
    assert set(model.weight_rules) == {"BF16 mapped"}, model.weight_rules
    assert model.step_fallback is None
    f32, rule = prepare_weight(text.file, "blk.0.attn_qkv.weight", float_weights="q8_0")
    assert rule == "BF16 -> Q8_0"
    levels = cpu.supported_isas()
    cpu.set_isa(levels[-1])
    first = run(model, 3)
    for level in (*levels, "numpy"):
        cpu.set_isa(level)
        for threads in (1, 2) if level == levels[-1] else (2,):
            cpu.set_threads(threads)
            got = run(model, 3)
            if level == "numpy":   # the twins' products, numpy's mixers (rounded differently from C)
                for a, b in zip(got, first):
                    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), "numpy"
                continue
            for a, b in zip(got, first):
                assert np.array_equal(a, b), f"{level}, {threads} threads: max gap {np.abs(a - b).max()}"


def test_bf16_model_follows_the_float32_reference(synth_model):
    """Against the numpy reference (the same BF16 values widened to float32, float32 BLAS products): only
    the summation differs (float64 here), so the logits agree to float32 rounding through the layers."""
    text = open_text(synth_model("tiny", "bf16"))
    prompt = np.arange(3, 40, 3)
    for cls in (Qwen35Model, NativeQwen35Model):
        state = SequenceState.new(text.hparams, 64)
        logits = cls(text.hparams, text.file).forward(prompt, state, all_logits=True)
        if cls is Qwen35Model:
            ref = logits
    gap = np.abs(logits - ref).max() / np.abs(ref).max()
    assert gap <= 1e-5, gap
