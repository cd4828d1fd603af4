"""GPU prefill of a K-quant file (engine.arch.qwen35.cuda): the weights without a GEMM kernel, laid out as
Q8_0 at load, against the float reference that reads the stored blocks. The emulated-device twin and
the layout checks are ``test_emulated_prefill_of_a_k_quant_mix`` in tests/test_cuda_prefill.py; this
one needs pycuda and an NVIDIA GPU (the ``gpu`` mark skips it elsewhere)."""

from __future__ import annotations

import numpy as np

from engine.registry import open_text
from test_cuda_prefill import gpu, rel_err


@gpu
def test_gpu_prefill_of_a_k_quant_mix(tmp_path):
    """The emulated K-quant case on the GPU: Q8_0-converted matrices and experts, resident and all streamed,
    within 1e-2 of the float reference that reads the stored blocks (the conversion's rounding, see there)."""
    from engine.arch.qwen35.cuda import CudaPrefill
    from engine.arch.qwen35.model import Qwen35Model
    from engine.turn.state import SequenceState
    from engine.testing.synth import synth

    synth(tmp_path / "m.gguf", "small", layers=4, quant="q4_k_m", seed=5, vocab=[f"t{i}" for i in range(256)])
    f = open_text(tmp_path / "m.gguf")
    hp, toks = f.hparams, np.random.default_rng(0).integers(0, f.hparams.n_vocab, 40)
    want = Qwen35Model(hp, f.file).forward(toks, SequenceState.new(hp, 64))[-1]
    full = CudaPrefill(hp, f.file, plan_tokens=64)
    p = full.plan
    stream = CudaPrefill(hp, f.file, p.resident_weights + p.state + 2 * p.expert_layer_bytes + p.reserve + 1024, 64)
    try:
        assert stream.plan.streamed_experts == tuple(range(hp.n_layer))
        for label, eng in (("resident", full), ("streamed", stream)):
            assert rel_err(eng.prefill(toks, SequenceState.new(hp, 64)), want, f"q4_k_m {label}") < 1e-2
    finally:
        full.close()
        stream.close()
