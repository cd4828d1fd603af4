"""A context whose state the machine cannot hold is refused at load, with the numbers, before any
weight is prepared (the KV rows are allocated lazily: without the check it fails much later)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.api import Engine, EngineOptions
from engine.errors import MemoryFitError
from engine.registry import open_text
from engine.turn.state import SequenceState, check_memory, state_nbytes


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_state_bytes_are_those_a_state_allocates(synth_model, kv_type):
    hp = open_text(synth_model("tiny")).hparams
    for capacity in (1, 77, 300):
        assert state_nbytes(hp.state_layout(), capacity, kv_type) == SequenceState.new(hp, capacity, kv_type).nbytes


def test_check_memory_refuses_with_the_numbers(synth_model):
    layout = open_text(synth_model("tiny")).hparams.state_layout()
    capacity = min(layout.context_length, 4096)
    need = state_nbytes(layout, capacity, "f16")
    assert check_memory(layout, capacity, "f16", available=need) == need
    with pytest.raises(MemoryFitError) as err:
        check_memory(layout, capacity, "f16", available=need - 1)
    per_token = state_nbytes(layout, 1, "f16") - state_nbytes(layout, 0, "f16")
    fixed = state_nbytes(layout, 0, "f16")
    assert f"{capacity:,} tokens" in str(err.value) and f"{per_token:,} bytes" in str(err.value)
    assert f"at most {(need - 1 - fixed) // per_token:,} tokens" in str(err.value)
    with pytest.raises(MemoryFitError, match="or the f16 or q8_0 KV type"):
        check_memory(layout, capacity, "f32", available=need)


@pytest.mark.parametrize("kv_type, elem_bytes", [("f32", 4), ("f16", 2), ("q8_0", 34 / 32)])
def test_a_262k_context_is_refused_by_the_bytes_of_its_kv_type(kv_type, elem_bytes):
    """The 35B-A3B's 262,144-token context on a machine with 1 byte too few for that KV type is refused with
    its numbers, and fits with exactly enough: the check counts the chosen type's bytes (K and V rows of
    n_head_kv x head_dim elements per attention layer), not another's."""
    from engine.arch.qwen35.presets import preset_hparams
    hp = preset_hparams("35b-a3b")
    layout, context = hp.state_layout(), 262_144
    assert layout.context_length >= context
    per_token = int(2 * len(layout.kv) * hp.n_head_kv * hp.head_dim * elem_bytes)
    need = state_nbytes(layout, 0, kv_type) + context * per_token
    with pytest.raises(MemoryFitError) as err:
        check_memory(layout, context, kv_type, available=need - 1)
    assert f"{context:,} tokens" in str(err.value) and f"{per_token:,} bytes of {kv_type} KV" in str(err.value)
    assert f"{need / 2**30:.2f} GiB" in str(err.value)
    assert check_memory(layout, context, kv_type, available=need) == need


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_engine_load_refuses_a_context_beyond_memory_before_preparing_weights(synth_model, monkeypatch, kv_type):
    import psutil
    path = synth_model("tiny")
    layout = open_text(path).hparams.state_layout()
    context = min(layout.context_length, 4096)
    available = state_nbytes(layout, context, kv_type) - 1
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    stages: list[str] = []
    with pytest.raises(MemoryFitError, match=f"{context:,} tokens"):
        Engine.load(path, options=EngineOptions(context=context, kv_type=kv_type), progress=stages.append)
    assert stages == ["mapping tensors"]
    engine = Engine.load(path, options=EngineOptions(context=context - 1, kv_type=kv_type))
    assert engine.context == context - 1
