"""How a turn splits prefill between a GPU backend and the CPU, and falls back when the GPU fails.

The GPU backend is a stand-in that runs the CPU model (the real one, engine.arch.qwen35.cuda, is
tested against the CPU reference in tests/test_cuda_prefill.py on a GPU machine): these tests
check the runtime's routing, not GPU numerics.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import Engine, EngineOptions
from engine.errors import DeviceError
from engine.events import PrefillProgress, PrefillStats, TokenEvent, TurnSummary
from engine.sampling import SamplingParams


class StandInGPU:
    """``prefill(tokens, state, positions)`` like CudaPrefill, computed by the CPU model; records calls."""

    def __init__(self, model, fail_after: int | None = None) -> None:
        self.model = model
        self.calls: list[tuple[int, int]] = []
        self.fail_after = fail_after
        self.closed = False
        self.last_telemetry = None

    def prefill(self, tokens, state, positions=None):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise DeviceError("out of GPU memory while prefilling (stand-in)")
        self.calls.append((state.pos, state.pos + len(tokens)))
        return self.model.forward(np.asarray(tokens), state, positions=positions)[-1]

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def tiny(synth_model):
    return synth_model("tiny", "q8_0")


def turn(engine, messages):
    events = [e for e in engine.chat(messages, SamplingParams.greedy(6)) if not isinstance(e, PrefillProgress)]
    return events[0], [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


LONG = [{"role": "system", "content": "You answer about shapes. " * 6},
        {"role": "user", "content": "Which shape has three sides? Explain briefly, please."}]


def test_auto_without_a_gpu_runs_on_the_cpu_and_says_why(tiny) -> None:
    engine = Engine.load(tiny, options=EngineOptions(device="auto"))
    info = engine.info
    if info.device == "cpu":
        assert info.device_note and "CPU" in info.device_note
    assert Engine.load(tiny, options=EngineOptions(device="cpu")).info.device_note == ""


def test_long_stretch_goes_to_the_gpu_in_one_pass_and_matches_cpu(tiny) -> None:
    cpu = Engine.load(tiny, options=EngineOptions(device="cpu", prefix_cache=False))
    engine = Engine.load(tiny, options=EngineOptions(device="cpu"))
    engine.gpu = StandInGPU(engine.model)
    stats, ids, _ = turn(engine, LONG)
    prompt = engine.render(LONG)
    header = engine.checkpoints(prompt)[-1]
    assert stats.device == "cuda"
    assert engine.gpu.calls == [(0, header)]           # one pass up to the assistant header, the rest on the CPU
    assert [s.pos for s in engine.snapshots()] == [len(prompt), header]
    assert ids == turn(cpu, LONG)[1]


def test_short_stretches_stay_on_the_cpu(tiny) -> None:
    engine = Engine.load(tiny, options=EngineOptions(device="cpu", gpu_min_tokens=10_000))
    engine.gpu = StandInGPU(engine.model)
    stats, _, _ = turn(engine, LONG)
    assert stats.device == "cpu" and engine.gpu.calls == []


def test_gpu_failure_falls_back_to_the_cpu_with_a_note(tiny) -> None:
    cpu = Engine.load(tiny, options=EngineOptions(device="cpu", prefix_cache=False))
    engine = Engine.load(tiny, options=EngineOptions(device="cpu"))
    gpu = StandInGPU(engine.model, fail_after=0)
    engine.gpu = gpu
    stats, ids, summary = turn(engine, LONG)
    assert isinstance(stats, PrefillStats) and stats.device == "cpu"
    assert "GPU prefill failed" in stats.note and "out of GPU memory" in stats.note
    assert isinstance(summary, TurnSummary) and summary.stop_reason in ("eos", "max_tokens")
    assert ids == turn(cpu, LONG)[1]
    assert engine.gpu is None and gpu.closed and "out of GPU memory" in engine.info.device_note


def test_unknown_device_is_a_named_error(tiny) -> None:
    from engine.errors import EngineError
    with pytest.raises(EngineError, match="device"):
        Engine.load(tiny, options=EngineOptions(device="tpu"))
