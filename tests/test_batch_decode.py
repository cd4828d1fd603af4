"""Batched decode (``forward_batch``): N sequences, one token each, in one pass.

The reference is each sequence alone: ``forward(tokens[i:i+1], states[i], positions=positions[i])``
on a copy of its state. Row i of the batch and every array of ``states[i]`` must equal it bit for bit,
for sequences at different positions (prompts of different lengths; two restored from the prefix
cache's shared KV pages), with rotary positions of their own, F16 and F32 KV, 1 and 2 threads, over
several steps with sequences joining and leaving. One step feeds every row the same token, so a row
computed with another row's state would differ from its reference (the test checks that the
references differ). Design: docs/design/batched-decode.md.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from engine.arch.qwen35.model import Qwen35Model
from engine.errors import ContextFullError
from engine.kernels import cpu
from engine.registry import open_text
from engine.turn.prefix_cache import PrefixCache, chain_keys
from engine.turn.state import KV_PAGE_ROWS, SequenceState

CAPACITY = 400
SHARED = KV_PAGE_ROWS + 44
"""Tokens of the prefix two sequences restore from the prefix cache (one whole KV page and a partial one)."""
native = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
MODELS = [("tiny", "q8_0"), ("dense-tiny", "q8_0"), ("small", "q4_k_m")]
"""MoE with Q8_0 (GDN and attention layers); the dense qwen35 FFN; the Q4_K / Q6_K products of the Q4_K_M mix."""


def load(path, numpy_model: bool = False):
    gguf = open_text(path)
    if numpy_model:
        return Qwen35Model(gguf.hparams, gguf.file)
    from engine.arch.qwen35.cpu import NativeQwen35Model
    return NativeQwen35Model(gguf.hparams, gguf.file)


def sequences(model, kv_type: str, rng: np.random.Generator) -> dict[str, SequenceState]:
    """Five prefilled sequences: "a" and "b" restored from a snapshot of a shared 300-token prefix (its
    KV page shared) and then read on in suffixes of different lengths; "c", "d", "e" cold prompts."""
    hp = model.hp
    prefix = rng.integers(0, hp.n_vocab, SHARED).tolist()
    cache = PrefixCache(hp, "batch-test", kv_type=kv_type)
    state = SequenceState.new(hp, CAPACITY, kv_type)
    logits = model.forward(np.array(prefix), state)[-1]
    cache.put(chain_keys("batch-test", prefix)[-1], state, prefix, logits)
    out = {}
    for name, extra in (("a", 3), ("b", 11)):
        suffix = rng.integers(0, hp.n_vocab, extra).tolist()
        hit = cache.lookup(prefix + suffix, CAPACITY)
        assert hit.reused == SHARED and hit.state.pos == SHARED
        model.forward(np.array(suffix), hit.state)
        out[name] = hit.state
    for name, length in (("c", 1), ("d", 17), ("e", 40)):
        out[name] = SequenceState.new(hp, CAPACITY, kv_type)
        model.forward(rng.integers(0, hp.n_vocab, length), out[name])
    return out


def assert_same_state(got: SequenceState, want: SequenceState, what: str) -> None:
    assert got.pos == want.pos, what
    for table in ("conv", "ssm", "k", "v"):
        for il, a in getattr(want, table).items():
            b = getattr(got, table)[il]
            assert b.dtype == a.dtype and np.array_equal(b[:want.pos] if table in "kv" else b,
                                                         a[:want.pos] if table in "kv" else a), (what, table, il)


def mrope(state: SequenceState) -> np.ndarray:
    """(3, 1) rotary positions unlike the plain ``pos`` (a sequence after an image: t, h, w differ)."""
    return np.array([[state.pos - 5], [state.pos + 2], [state.pos + 9]])


STEPS = (("a", "c", "d"), ("e", "a", "b", "c", "d"), ("b", "e"), ("d", "b", "e", "a", "c"), ("c",))
"""The batch of each step: sequences join and leave, in varying order; the last is one row."""


def run_steps(model, seqs: dict[str, SequenceState], rng: np.random.Generator, hooks: bool = False) -> list:
    """Decode STEPS with ``forward_batch`` (``hooks``: the reference class's per-hook batch pass instead of the
    native batched step); each row and state against the sequence alone. Returns every step's logits."""
    batch = functools.partial(Qwen35Model.forward_batch, model) if hooks else model.forward_batch
    steps = []
    for step, names in enumerate(STEPS):
        states = [seqs[n] for n in names]
        positions = [mrope(s) if n == "d" else None for n, s in zip(names, states)]
        same_token = step == 1
        tokens = (np.full(len(names), 7) if same_token else rng.integers(0, model.hp.n_vocab, len(names)))
        alone = [s.copy() for s in states]
        want = np.concatenate([model.forward(tokens[i:i + 1], alone[i], positions=positions[i])
                               for i in range(len(names))])
        got = batch(tokens, states, positions)
        steps.append(got)
        assert got.dtype == np.float32 and got.shape == want.shape
        for i, name in enumerate(names):
            assert np.array_equal(got[i], want[i]), (step, name, np.abs(got[i] - want[i]).max())
            assert_same_state(states[i], alone[i], f"step {step} sequence {name}")
        if same_token:     # the test's power: every row's answer depends on its own state
            assert all(not np.array_equal(want[i], want[j]) for i in range(len(names)) for j in range(i))
    return steps


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_type", ["f16", "f32", "q8_0"])
@pytest.mark.parametrize("preset, quant", MODELS)
def test_each_row_is_the_sequence_alone(synth_model, isa_reset, preset, quant, kv_type, threads):
    model = load(synth_model(preset, quant))
    assert model.step is not None      # N >= 2 rows: the native batched step
    cpu.set_threads(threads)
    rng = np.random.default_rng(threads * 10 + len(preset))
    run_steps(model, sequences(model, kv_type, rng), rng)


@native
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("preset, quant", MODELS)
def test_the_hooks_batch_pass_rows_are_the_sequence_alone(synth_model, isa_reset, preset, quant, kv_type):
    model = load(synth_model(preset, quant))
    cpu.set_threads(2)
    rng = np.random.default_rng(len(preset))
    run_steps(model, sequences(model, kv_type, rng), rng, hooks=True)


@native
@pytest.mark.parametrize("preset, quant, lowest", [("tiny", "q8_0", "scalar"), ("small", "q4_k_m", "ssse3")])
def test_rows_do_not_depend_on_the_isa_level(synth_model, isa_reset, preset, quant, lowest):
    """The same batched steps on every native level from ``lowest`` (the K-quant mix skips the scalar level's
    ~8 s): the same logits, each row the sequence alone there."""
    model = load(synth_model(preset, quant))
    cpu.set_threads(2)
    seqs = sequences(model, "f16", np.random.default_rng(3))
    runs = {}
    for level in (lv for lv in cpu.ISA_LEVELS[cpu.ISA_LEVELS.index(lowest):] if lv in cpu.supported_isas()):
        cpu.set_isa(level)
        runs[level] = run_steps(model, {k: s.copy() for k, s in seqs.items()}, np.random.default_rng(4))
    first = next(iter(runs.values()))
    assert len(runs) >= 2 and all(np.array_equal(a, b) for r in runs.values() for a, b in zip(r, first, strict=True))


@native
def test_rows_of_different_kv_types_share_a_step(synth_model, isa_reset):
    """One batch of F32, F16 and Q8_0 sequences at different positions: each row as the sequence alone."""
    model = load(synth_model("tiny", "q8_0"))
    rng = np.random.default_rng(11)
    states = []
    for kv_type, length in (("f32", 5), ("f16", 30), ("q8_0", 12), ("f16", 1)):
        states.append(SequenceState.new(model.hp, 64, kv_type))
        model.forward(rng.integers(0, model.hp.n_vocab, length), states[-1])
    for _ in range(3):
        tokens = rng.integers(0, model.hp.n_vocab, len(states))
        alone = [s.copy() for s in states]
        want = np.concatenate([model.forward(tokens[i:i + 1], alone[i]) for i in range(len(states))])
        got = model.forward_batch(tokens, states, [None] * len(states))
        assert np.array_equal(got, want)
        for i, (s, a) in enumerate(zip(states, alone)):
            assert_same_state(s, a, f"row {i}")


@native
def test_a_batch_larger_than_the_state_cache(synth_model):
    """More sequences than the step keeps state tables for: building the batch's tables drops the first
    ones from the cache, which the call must still hold (each row as the sequence alone)."""
    from engine.arch.qwen35.cpu_step import STATE_CACHE
    model = load(synth_model("tiny", "q8_0"))
    states = fresh(model, STATE_CACHE + 4, capacity=32)
    for step in range(2):
        tokens = np.arange(len(states)) + 3 * step
        alone = [s.copy() for s in states]
        want = np.concatenate([model.forward(tokens[i:i + 1], alone[i]) for i in range(len(states))])
        assert np.array_equal(model.forward_batch(tokens, states, [None] * len(states)), want)


@native
def test_a_batch_larger_than_the_state_cache_builds_its_tables_once(synth_model, monkeypatch):
    """A batch of more sequences than :data:`STATE_CACHE` builds its state tables on its first step only;
    later steps reuse them (an LRU of the default size would rebuild every one, every step)."""
    from engine.arch.qwen35.cpu_step import STATE_CACHE
    model = load(synth_model("tiny", "q8_0"))
    states = fresh(model, STATE_CACHE + 4, capacity=32)
    builds: list[str] = []
    monkeypatch.setattr(cpu._native_cpu, "ffi", _NewSpy(cpu._native_cpu.ffi, builds))
    model.forward_batch(np.arange(len(states)), states, [None] * len(states))
    assert 0 < builds.count("dd_step_state *") <= len(states)
    builds.clear()
    for step in range(1, 3):
        model.forward_batch(np.arange(len(states)) + step, states, [None] * len(states))
    assert builds.count("dd_step_state *") == 0


@native
def test_several_rows_take_one_batched_native_call(synth_model, monkeypatch):
    model = load(synth_model("tiny", "q8_0"))
    states = fresh(model, 3)
    calls: list[str] = []
    monkeypatch.setattr(cpu._native_cpu, "lib", _Spy(cpu._native_cpu.lib, calls))
    model.forward_batch(np.array([4, 5, 6]), states, [None] * 3)
    assert calls.count("dd_step_batch") == 1
    assert not {"dd_step", "dd_matmul", "dd_moe_prefill", "dd_gdn_prefill", "dd_attn_prefill_kv"} & set(calls)


class _NewSpy:
    """The native library's ffi with the C type of every ``new`` appended to ``made``."""

    def __init__(self, ffi, made: list[str]) -> None:
        self._ffi, self._made = ffi, made

    def new(self, ctype: str, *args):
        self._made.append(ctype)
        return self._ffi.new(ctype, *args)

    def __getattr__(self, attr: str):
        return getattr(self._ffi, attr)


class _Spy:
    """The native library with the name of every function called through it appended to ``calls``."""

    def __init__(self, lib, calls: list[str]) -> None:
        self._lib, self._calls = lib, calls

    def __getattr__(self, attr: str):
        value = getattr(self._lib, attr)
        if not callable(value):
            return value
        return lambda *a: self._calls.append(attr) or value(*a)


@pytest.mark.parametrize("preset", ["tiny", "dense-tiny"])
def test_numpy_model_rows_are_the_sequence_alone(synth_model, preset):
    model = load(synth_model(preset, "q8_0"), numpy_model=True)
    rng = np.random.default_rng(5)
    run_steps(model, sequences(model, "f32", rng), rng)


@native
def test_one_row_takes_the_one_call_step(synth_model, monkeypatch):
    model = load(synth_model("tiny", "q8_0"))
    assert model.step is not None
    calls = []
    real = model.step.forward
    monkeypatch.setattr(model.step, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    state = SequenceState.new(model.hp, 8)
    alone = state.copy()
    got = model.forward_batch(np.array([5]), [state], [None])
    assert calls == [1]
    assert np.array_equal(got, Qwen35Model.forward(model, np.array([5]), alone))
    assert_same_state(state, alone, "one row")


def fresh(model, n: int, capacity: int = 16) -> list[SequenceState]:
    states = [SequenceState.new(model.hp, capacity, "f16") for _ in range(n)]
    for i, s in enumerate(states):
        model.forward(np.arange(1, i + 2), s)
    return states


@pytest.mark.parametrize("numpy_model", [False, True], ids=["native", "numpy"])
@pytest.mark.parametrize("bad", [-1, "n_vocab", 10**12])
def test_a_token_out_of_range_is_named_and_no_state_moves(synth_model, numpy_model, bad):
    if not numpy_model and not cpu.available():
        pytest.skip("native CPU kernels not built")
    model = load(synth_model("tiny", "q8_0"), numpy_model)
    bad = model.hp.n_vocab if bad == "n_vocab" else bad
    states = fresh(model, 3)
    before = [s.copy() for s in states]
    with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
        model.forward_batch(np.array([3, bad, 4]), states, [None] * 3)
    for s, b in zip(states, before):
        assert_same_state(s, b, "after a refused batch")
        for il in b.k:
            assert not s.k[il][s.pos:].any(), "a KV row was written past pos"


@native
def test_malformed_batches_are_refused_before_any_state_moves(synth_model):
    model = load(synth_model("tiny", "q8_0"))
    states = fresh(model, 2)
    full = SequenceState.new(model.hp, 2)
    model.forward(np.array([1, 2]), full)
    before = [s.copy() for s in (*states, full)]
    cases = [
        (ValueError, "one token and one positions entry per state", (np.array([1, 2, 3]), states, [None] * 2)),
        (ValueError, "one token and one positions entry per state", (np.array([1, 2]), states, [None])),
        (ValueError, "at least one", (np.array([], dtype=np.int64), [], [])),
        (ValueError, "appears twice", (np.array([1, 2]), [states[0], states[0]], [None] * 2)),
        (ValueError, r"positions must have shape \(3, 1\)", (np.array([1, 2]), states, [None, np.zeros((3, 2))])),
        (ContextFullError, "capacity of 2", (np.array([1, 2, 3]), [*states, full], [None] * 3)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            model.forward_batch(*args)
    for s, b in zip((*states, full), before):
        assert_same_state(s, b, "after a refused batch")


@pytest.mark.parametrize("numpy_model", [False, True], ids=["native", "numpy"])
@pytest.mark.parametrize("share", ["all", "one"])
def test_states_sharing_an_array_are_refused_before_any_state_moves(synth_model, numpy_model, share):
    """Two state objects over the same arrays (a shallow copy: ``dataclasses.replace``), or one layer's array
    in two states: a row would read and write another row's state (in the native step, at the same time)."""
    if not numpy_model and not cpu.available():
        pytest.skip("native CPU kernels not built")
    model = load(synth_model("tiny", "q8_0"), numpy_model)
    states = fresh(model, 2)
    if share == "all":
        states.append(dataclasses.replace(states[0]))
    else:
        states.append(states[1].copy())
        il = next(iter(states[2].ssm))
        states[2].ssm[il] = states[0].ssm[il]
    before = [s.copy() for s in states]
    with pytest.raises(ValueError, match="share an array"):
        model.forward_batch(np.array([3, 4, 5]), states, [None] * 3)
    for s, b in zip(states, before):
        assert_same_state(s, b, "after a refused batch")


@native
def test_a_state_missing_a_layer_is_named_and_no_state_moves(synth_model):
    """A state without one layer's arrays (a state of a shallower model) in a batch and alone: a ValueError
    naming the layer from the native step's state check, not a bare KeyError, and no state moves."""
    model = load(synth_model("tiny", "q8_0"))
    states = fresh(model, 3)
    il = max(states[1].ssm)
    del states[1].conv[il], states[1].ssm[il]
    before = [s.copy() for s in states]
    with pytest.raises(ValueError, match=f"no array of layer {il}"):
        model.forward_batch(np.array([3, 4, 5]), states, [None] * 3)
    with pytest.raises(ValueError, match=f"no array of layer {il}"):
        model.forward(np.array([3]), states[1])
    for s, b in zip(states, before):
        assert_same_state(s, b, "after a refused batch")
