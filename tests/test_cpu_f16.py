"""F16 weights read as stored (native/cpu/quant/bf16.h's F16 rows): IEEE halves times the float32 activations.

Tolerance. A half widens to float32 exactly (subnormals included) and its 11-bit significand times a float32's
24 bits is exact in float64; each dot sums k / 8 products per lane and adds the 8 lanes in a tree of depth 3:
|s - ref| <= (k / 8 + 3) 2^-53 sum|w x|, and the rounding to float32 adds at most 2^-24 |s|. The test allows
``2^-24 |ref| + (k / 8 + 4) 2^-53 sum|w x|`` (the BF16 kernels' bound, test_cpu_bf16). Bits: the numpy twin's
at every level, 1-3 threads, a column alone or in any batch (test_cpu_kernels.assert_same_bits_everywhere; the
GEMM-vs-GEMV test of test_cpu_prefill covers F16 as a kernel type). Memory: a synth F16 file's projections are
views of the file map, and loading them adds no anonymous memory of the order of their bytes (a float32 copy
would add twice their bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_cpu_kernels import assert_same_bits_everywhere, assert_within_summation_bound, rng  # noqa: F401 (fixture)
from test_native_model import run

from engine.arch.qwen35.cpu import NativeQwen35Model, prepare_weight, projection_names
from engine.arch.qwen35.model import Qwen35Model
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.state import SequenceState

F16 = GGMLQuantizationType.F16
pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")


def random_f16(rng, rows: int, k: int) -> np.ndarray:
    """(rows, 2 k) uint8: F16 rows of mixed magnitudes (up to ~1e4), a few subnormal halves and signed zeros."""
    w = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-3, 3, size=(rows, 1))
    w[0, :7] = rng.choice([-1, 1], 7) * 2.0 ** rng.integers(-24, -14, 7)
    w[-1, :2] = [0.0, -0.0]
    return w.astype(np.float16).view(np.uint8)


def anon_kib() -> int:
    """This process's anonymous resident memory (RssAnon of /proc/self/status), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


@pytest.mark.parametrize("rows, k, m", [(1, 32, 1), (3, 64, 2), (37, 96, 5), (301, 2048, 1), (67, 1504, 13)])
def test_f16_product_within_the_summation_bound_at_every_level(rows, k, m, rng, isa_reset):
    """Every level (and the twin) against the float64 product of the stored halves and the float32 inputs."""
    raw = random_f16(rng, rows, k)
    assert_within_summation_bound(raw, raw.view("<f2").astype(np.float64), k, m, F16, rng)


@pytest.mark.parametrize("rows, k", [(5, 32), (37, 320), (130, 1024)])
def test_f16_same_bits_everywhere(rows, k, rng):
    assert_same_bits_everywhere(random_f16(rng, rows, k), k, F16, rng)


def test_f16_rejects_rows_that_are_not_k_values():
    with pytest.raises(ValueError, match="k=48"):
        cpu.Matrix(np.zeros((4, 2 * 48), dtype=np.uint8), 48, F16)
    with pytest.raises(ValueError, match="F16"):
        cpu.Matrix(np.zeros((4, 60), dtype=np.uint8), 32, F16)


def test_f16_model_is_mapped_without_a_widened_copy(synth_model, isa_reset):
    """A synth F16 file: every projection is read from the file map, loading adds far less anonymous memory
    than the projections' bytes (a float32 copy adds twice them), decode takes the one-call step, and every
    level and thread count gives the same logits."""
    text = open_text(synth_model("small", "f16"))
    weight_bytes = sum(text.file.raw(n).nbytes for n in projection_names(text.hparams, text.file))
    before = anon_kib()
    model = NativeQwen35Model(text.hparams, text.file)
    grown = (anon_kib() - before) * 1024
    assert set(model.weight_rules) == {"F16 mapped"}, model.weight_rules
    assert grown < weight_bytes / 4, (grown, weight_bytes)
    assert model.step_fallback is None
    _, rule = prepare_weight(text.file, "blk.0.attn_qkv.weight", float_weights="q8_0")
    assert rule == "F16 -> Q8_0"
    levels = cpu.supported_isas()
    cpu.set_isa(levels[-1])
    first = run(model, 3)
    for level in levels:
        cpu.set_isa(level)
        for threads in (1, 2):
            cpu.set_threads(threads)
            for a, b in zip(run(model, 3), first):
                assert np.array_equal(a, b), f"{level}, {threads} threads: max gap {np.abs(a - b).max()}"


def test_f16_model_follows_the_float32_reference(synth_model):
    """Against the numpy reference (the same halves widened to float32, float32 BLAS products): only the
    summation differs (float64 here), so the logits agree to float32 rounding through the layers."""
    text = open_text(synth_model("tiny", "f16"))
    prompt = np.arange(3, 40, 3)
    logits = {}
    for cls in (Qwen35Model, NativeQwen35Model):
        state = SequenceState.new(text.hparams, 64)
        logits[cls] = cls(text.hparams, text.file).forward(prompt, state, all_logits=True)
    ref = logits[Qwen35Model]
    gap = np.abs(logits[NativeQwen35Model] - ref).max() / np.abs(ref).max()
    assert gap <= 1e-5, gap
