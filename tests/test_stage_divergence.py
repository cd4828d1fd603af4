"""The fast paths report the reference forward's stage names, so a fast-vs-reference comparison names the
first stage where they part (engine.ops.stages).

* CPU hooks (NativeQwen35Model): every reference stage but the fused calls' insides (FUSED_STAGES), within
  0.05 of the reference on the dense model (activations quantized to 8 bits; measured ~0.025; the MoE
  model's top-k choices can flip under that rounding, so its stages are not compared to the reference);
  a fault injected into one layer's FFN is named as that layer's ``ffn_out``.
* C step: its input row and logits, bit-identical to the hooks' ``inp_embd`` and ``result_output``.
* GPU prefill on the emulated device (tests/cuda_fakes.py): the values between kernels, within 1e-4 of the
  reference (the emulated kernels compute in float32 as the reference does, tests/test_cuda_prefill.py);
  a corrupted norm weight on the device is named as that layer's ``attn_post_norm``.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35.cpu import FUSED_STAGES, NativeQwen35Model
from engine.arch.qwen35.cpu_step import STAGES as STEP_STAGES
from engine.arch.qwen35.cuda import STAGES as GPU_STAGES
from engine.arch.qwen35.model import Qwen35Model
from engine.kernels import cpu
from engine.registry import open_text
from engine.ops.stages import Divergence, StageTrace, first_divergence, shared_stages
from engine.turn.state import SequenceState
from test_cuda_prefill import emulated, tiny_files  # noqa: F401  (fixtures)

native = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")


def _trace(model, tokens, **kwargs) -> StageTrace:
    trace = StageTrace()
    model.forward(tokens, SequenceState.new(model.hp, 64), cb=trace, **kwargs)
    return trace


def test_first_divergence_walks_the_reference_order():
    ref, fast = StageTrace(), StageTrace()
    for trace, bump in ((ref, 0.0), (fast, 1.0)):
        trace("a", 0, np.ones(3))
        trace("b", 0, np.ones(3) * (1 + bump))
        trace("c", 1, np.ones(3) * (1 + bump))
    ref("only_ref", 1, np.zeros(2))
    assert shared_stages(ref, fast) == [("a", 0), ("b", 0), ("c", 1)]
    assert first_divergence(ref, fast, 0.5) == Divergence("b", 0, 1.0)
    assert "'b' (layer 0)" in str(first_divergence(ref, fast, 0.5))
    assert first_divergence(ref, fast, 1.0) is None
    fast("a", 0, np.ones(2))                                          # a second piece's rows are appended
    assert fast.values[("a", 0)].shape == (5,) and first_divergence(ref, fast, 1.0).stage == "a"


@native
def test_cpu_hooks_name_every_stage_but_the_fused_ones(synth_model):
    t = open_text(synth_model("tiny", "q8_0"))
    tokens = np.random.default_rng(0).integers(0, t.hparams.n_vocab, 12)
    ref, fast = _trace(Qwen35Model(t.hparams, t.file), tokens), _trace(NativeQwen35Model(t.hparams, t.file), tokens)
    assert shared_stages(ref, fast) == [k for k in ref.stages() if k[0] not in FUSED_STAGES]
    assert {k[0] for k in ref.stages()} & FUSED_STAGES == FUSED_STAGES


@native
def test_cpu_hooks_follow_the_reference_and_a_fault_is_named(synth_model, monkeypatch):
    t = open_text(synth_model("dense-tiny", "q8_0"))
    tokens = np.random.default_rng(1).integers(0, t.hparams.n_vocab, 12)
    ref = _trace(Qwen35Model(t.hparams, t.file), tokens)
    model = NativeQwen35Model(t.hparams, t.file)
    assert first_divergence(ref, _trace(model, tokens), 0.05) is None
    ffn = model.ffn
    monkeypatch.setattr(model, "ffn", lambda il, y: ffn(il, y) * (2.0 if il == 2 else 1.0))
    got = first_divergence(ref, _trace(model, tokens), 0.05)
    assert (got.stage, got.layer) == ("ffn_out", 2) and got.error > 0.5


@native
def test_c_step_reports_its_input_and_logits_as_the_hooks_do(synth_model):
    t = open_text(synth_model("tiny", "q8_0"))
    model = NativeQwen35Model(t.hparams, t.file)
    assert model.step is not None
    token = np.array([7])
    hooks = _trace(model, token)
    step = StageTrace()
    model.step.forward(token, SequenceState.new(model.hp, 64), cb=step)
    assert shared_stages(hooks, step) == [(s, -1) for s in STEP_STAGES]
    assert first_divergence(hooks, step, 0.0) is None


@pytest.mark.parametrize("preset", ["tiny", "dense-tiny"])
def test_gpu_prefill_reports_the_reference_stages_and_a_fault_is_named(emulated, tiny_files, preset):  # noqa: F811
    t = tiny_files[preset]
    hp, f = t.hparams, t.file
    tokens = np.random.default_rng(2).integers(0, hp.n_vocab, 40)
    ref = _trace(Qwen35Model(hp, f), tokens)
    eng = emulated(t, plan_tokens=64)
    gpu = StageTrace()
    eng.prefill(tokens, SequenceState.new(hp, 64), cb=gpu)
    assert shared_stages(ref, gpu) == [k for k in ref.stages() if k[0] in GPU_STAGES]
    assert first_divergence(ref, gpu, 1e-4) is None
    name = "blk.1.post_attention_norm.weight"
    eng._drv.memcpy_htod(eng.vec[name], f.f32(name) * np.float32(3.0))
    gpu = StageTrace()
    eng.prefill(tokens, SequenceState.new(hp, 64), cb=gpu)
    got = first_divergence(ref, gpu, 1e-4)
    assert (got.stage, got.layer) == ("attn_post_norm", 1)
