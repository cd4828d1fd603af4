"""The one-call native decode step (engine.arch.qwen35.cpu_step, native/cpu/runtime/step.c).

References, tightest first:

* the per-hook forward pass of the same NativeQwen35Model (the path of every prefill piece of two or
  more tokens): the step must give the **same bits**, logits and state, at every ISA level and thread
  count, since a decoded token must equal the same token read in any prefill piece (split invariance);
  so step logits are also bit-identical across levels and thread counts;
* the numpy reference model (float weights, float activations): max |step - numpy| <= 0.05 * max |numpy|
  (test_native_model.py's bound; the gap comes from the Q8_0 activations).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35.cpu import NativeQwen35Model
from engine.arch.qwen35.model import Qwen35Model
from engine.errors import ContextFullError
from engine.registry import open_text
from engine.kernels import cpu
from engine.ops import reference as ops
from engine.turn.state import SequenceState

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")

MODELS = [("tiny", "q8_0"), ("dense-tiny", "q8_0"), ("small", "q4_k_m"), ("tiny", "q4_k_m")]
"""Q8_0; Q8_0 dense; Q4_K / Q6_K / Q8_0 (the Q4_K_M mix); Q5_0 / Q5_1 / Q8_0 (the mix's fallbacks for rows of 64)."""
N = 6



def levels_and_threads():
    """Every level at 1 thread, the best one at 2, 3 and 7 too (the chunk split, hence the bits, never
    depends on the thread count; the pool is the same at every level). 3 and 7 threads cut the one-job
    product sets (qkv/z/beta/alpha, q/k/v), the pooled GDN inputs and the MoE stages into more home
    ranges, with ranges that end inside a product or an expert."""
    levels = cpu.supported_isas()
    return [(level, 1) for level in levels] + [(levels[-1], n) for n in (2, 3, 7)]


def tokens_for(model) -> np.ndarray:
    return np.random.default_rng(7).integers(0, model.hp.n_vocab, N)


def decode_each(model, tokens, capacity=N + 4):
    """Every token in its own forward call: (N, n_vocab) logits and the state."""
    state = SequenceState.new(model.hp, capacity)
    return np.concatenate([model.forward(tokens[i:i + 1], state) for i in range(len(tokens))]), state


def assert_same_state(a: SequenceState, b: SequenceState) -> None:
    assert a.pos == b.pos
    for ta, tb in ((a.conv, b.conv), (a.ssm, b.ssm)):
        for il in ta:
            assert np.array_equal(ta[il], tb[il]), f"layer {il}"
    for ta, tb in ((a.k, b.k), (a.v, b.v)):
        for il in ta:
            assert np.array_equal(ta[il][:a.pos], tb[il][:b.pos]), f"layer {il} KV"


@pytest.mark.parametrize("preset, quant", MODELS)
def test_step_is_the_per_hook_pass_bit_for_bit_at_every_level_and_thread_count(synth_model, preset, quant, isa_reset):
    gguf = open_text(synth_model(preset, quant))
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    assert model.step is not None, model.step_fallback
    tokens = tokens_for(model)
    runs = {}
    for level, threads in levels_and_threads():
        cpu.set_isa(level)
        cpu.set_threads(threads)
        stepped, state = decode_each(model, tokens)
        one_pass = SequenceState.new(model.hp, N + 4)
        whole = model.forward(tokens, one_pass, all_logits=True)        # n > 1: the hooks
        assert np.array_equal(stepped, whole), f"{level} x{threads}: max gap {np.abs(stepped - whole).max()}"
        assert_same_state(state, one_pass)
        runs[(level, threads)] = stepped
    first = next(iter(runs.values()))
    for key, got in runs.items():
        assert np.array_equal(got, first), key


@pytest.mark.parametrize("preset, quant", MODELS)
def test_step_logits_stay_near_the_numpy_reference(synth_model, preset, quant, isa_reset):
    gguf = open_text(synth_model(preset, quant))
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    tokens = tokens_for(model)
    ref, _ = decode_each(Qwen35Model(gguf.hparams, gguf.file), tokens)
    for level, threads in levels_and_threads():
        cpu.set_isa(level)
        cpu.set_threads(threads)
        got, _ = decode_each(model, tokens)
        assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max(), (level, threads)


def test_mrope_positions_and_given_embeddings_match_the_hooks(synth_model, isa_reset):
    """Distinct t/h/w positions (an image row's) and an embeddings row: the step equals the hook path
    (a stage callback sends the call through the hooks)."""
    gguf = open_text(synth_model("tiny", "q8_0"))
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, model.hp.n_vocab, 5)
    rows = rng.standard_normal((3, 1, model.hp.n_embd)).astype(np.float32) * 0.05
    positions = np.array([[5], [7], [9]])
    states = [SequenceState.new(model.hp, 16) for _ in range(2)]
    seen = []
    for state, cb in zip(states, (None, lambda stage, il, x: seen.append(stage))):
        model.forward(prompt, state)
        out = [model.forward(np.array([1]), state, embeddings=row, positions=positions + i, cb=cb)
               for i, row in enumerate(rows)]
        if cb is None:
            step_out = out
    assert seen, "the callback call did not take the hook path"
    for a, b in zip(step_out, out):
        assert np.array_equal(a, b)
    assert_same_state(*states)


def test_calls_the_step_does_not_take_run_the_hooks(synth_model, isa_reset):
    gguf = open_text(synth_model("tiny", "q8_0"))
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    assert model.step.takes(1, None)
    assert not model.step.takes(2, None) and not model.step.takes(1, print)
    cpu.set_isa("numpy")
    assert not model.step.takes(1, None)
    cpu.set_isa(None)
    model.observer = object()
    assert not model.step.takes(1, None)


def test_float32_weights_fall_back_to_the_hooks(synth_model):
    """An F32 file keeps its projections as float32 (numpy BLAS): no step; its one-token calls take the
    hooks, which are split-invariant themselves; converted to Q8_0 the same file takes the step."""
    gguf = open_text(synth_model("tiny", "f32"))
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    assert model.step is None and "float32" in model.step_fallback
    tokens = tokens_for(model)[:4]
    got, state = decode_each(model, tokens)
    one_pass = SequenceState.new(model.hp, N + 4)
    assert np.array_equal(got, model.forward(tokens, one_pass, all_logits=True))
    assert_same_state(state, one_pass)
    assert NativeQwen35Model(gguf.hparams, gguf.file, float_weights="q8_0").step is not None


def test_bad_inputs_raise_clear_errors(synth_model):
    gguf = open_text(synth_model("tiny", "q8_0"))
    model = NativeQwen35Model(gguf.hparams, gguf.file)
    state = SequenceState.new(model.hp, 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward(np.array([model.hp.n_vocab]), state)
    with pytest.raises(ValueError, match="embeddings must have shape"):
        model.forward(np.array([1]), state, embeddings=np.zeros((1, 3), np.float32))
    model.forward(np.array([1]), state)
    with pytest.raises(ContextFullError):
        model.forward(np.array([1]), state)
    bad = SequenceState.new(model.hp, 4)
    il = next(iter(bad.ssm))
    bad.ssm[il] = bad.ssm[il].astype(np.float64)
    with pytest.raises(ValueError, match="sequence state"):
        model.forward(np.array([1]), bad)


@pytest.mark.parametrize("shape", [(1, 2048), (512, 2048), (7, 16, 256), (3, 5), (4, 100), (2, 1000), (33, 129)])
def test_rmsnorm_rows_has_the_reference_bits(isa_reset, shape):
    """The C RMSNorm of the prefill path against engine.ops.reference.rmsnorm, bit for bit: row lengths below 8,
    up to 128 and past it (each branch of numpy's pairwise sum), rows of 1e-20 .. 1e20, a zero row, with and
    without a weight, at 1-3 threads (the rows' chunks fall differently on the pool)."""
    rng = np.random.default_rng(list(shape))
    d = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.integers(-20, 21, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, d)[0] = 0.0
    w = (rng.standard_normal(d) + 1.0).astype(np.float32)
    for threads in (1, 2, 3):
        cpu.set_threads(threads)
        for weight in (w, None):
            want = ops.rmsnorm(x, weight, 1e-6)
            got = cpu.rmsnorm_rows(x, weight, 1e-6)
            assert got.dtype == np.float32 and got.shape == shape
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (threads, weight is None)
    with pytest.raises(ValueError, match="weight"):
        cpu.rmsnorm_rows(x, w[:-1], 1e-6)


def test_silu_mul_matches_its_twin(isa_reset):
    rng = np.random.default_rng(11)
    g = (rng.standard_normal(4099) * 6).astype(np.float32)
    u = rng.standard_normal(4099).astype(np.float32) + 0.5
    want = cpu.silu_mul_np(g, u)
    got = cpu.silu_mul(g, u)
    # silu differs from the twin's only by libm's vs numpy's exp (< 1 ulp in float64) before the float32 rounding
    assert np.abs(got - want).max() <= 2**-22 * np.abs(want).max()
    with pytest.raises(ValueError, match="differ"):
        cpu.silu_mul(g, u[:-1])
