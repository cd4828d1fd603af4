"""A context whose state the machine cannot hold is refused at load, with the numbers, before any
weight is prepared (the KV rows are allocated lazily: without the check it fails much later)."""

from __future__ import annotations

from dataclasses import replace
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
    one = {"kv_type": kv_type, "parallel": 1, "prefix_cache": False}
    with pytest.raises(MemoryFitError, match=f"{context:,} tokens"):
        Engine.load(path, options=EngineOptions(context=context, **one), progress=stages.append)
    assert stages == ["mapping tensors"]
    engine = Engine.load(path, options=EngineOptions(context=context - 1, **one))
    assert engine.context == context - 1


@pytest.mark.parametrize("sequences", [1, 3, 4])
def test_check_memory_counts_every_live_sequence_and_names_what_fits(synth_model, sequences):
    """``sequences`` states of the context plus the reserved bytes must fit; the refusal names the bytes per
    sequence, the count, the memory available, and a context and a sequence count that do fit (the largest:
    one more of either is refused)."""
    layout = open_text(synth_model("tiny")).hparams.state_layout()
    capacity, reserved = min(layout.context_length, 4096), 3 << 20
    per_seq = state_nbytes(layout, capacity, "f16")
    need = sequences * per_seq + reserved
    assert check_memory(layout, capacity, "f16", available=need, sequences=sequences, reserved=reserved) == need
    available = need - 1
    with pytest.raises(MemoryFitError) as err:
        check_memory(layout, capacity, "f16", available=available, sequences=sequences, reserved=reserved)
    text = str(err.value)
    assert f"{per_seq:,} bytes of state per sequence" in text and f"x {sequences} + " in text
    assert f"{available / 2**30:.2f} GiB of memory is available" in text
    most_tokens = int(text.split("at most ")[1].split(" tokens")[0].replace(",", ""))
    most_seqs = int(text.split("at most ")[2].split(" sequence")[0])
    fits = {"available": available, "reserved": reserved}
    check_memory(layout, most_tokens, "f16", sequences=sequences, **fits)
    with pytest.raises(MemoryFitError):
        check_memory(layout, most_tokens + 1, "f16", sequences=sequences, **fits)
    assert most_seqs == sequences - 1
    if most_seqs:
        check_memory(layout, capacity, "f16", sequences=most_seqs, **fits)


def test_engine_load_counts_its_parallel_states_and_the_prefix_cache_budget(synth_model, monkeypatch):
    """``EngineOptions.parallel`` states of the context plus ``cache_ram_bytes`` must fit at load: one byte too
    few is refused before any weight is prepared; one turn fewer, or no prefix cache, fits that memory."""
    import psutil
    path = synth_model("tiny")
    layout = open_text(path).hparams.state_layout()
    context, cache = min(layout.context_length, 4096), 5 << 20
    available = 4 * state_nbytes(layout, context, "f16") + cache - 1
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    opts = EngineOptions(context=context, kv_type="f16", parallel=4, cache_ram_bytes=cache)
    stages: list[str] = []
    with pytest.raises(MemoryFitError, match=f"x 4 \\+ {cache / 2**30:.2f} GiB of prefix cache"):
        Engine.load(path, options=opts, progress=stages.append)
    assert stages == ["mapping tensors"]
    assert Engine.load(path, options=replace(opts, parallel=3)).options.parallel == 3
    assert Engine.load(path, options=replace(opts, prefix_cache=False)).options.parallel == 4
    with pytest.raises(ValueError, match="EngineOptions.parallel"):
        Engine.load(path, options=replace(opts, parallel=0))


def test_the_session_runs_the_turns_the_engine_was_loaded_for(synth_model):
    """The server's own session and the CLI's take the engine's ``parallel`` (the count its memory was checked
    for); an engine without load options (a remote one) gets the default."""
    from engine.openai import ServerConfig, ServerThread
    from engine.session import DEFAULT_PARALLEL, engine_parallel
    engine = Engine.load(synth_model("tiny"), options=EngineOptions(context=256, parallel=3))
    srv = ServerThread(engine, ServerConfig("tiny"), port=0)
    try:
        assert srv.session.parallel == engine_parallel(engine) == 3
    finally:
        srv.session.close()
    assert engine_parallel(object()) == DEFAULT_PARALLEL
