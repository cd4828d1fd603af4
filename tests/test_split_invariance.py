"""The answer never depends on the cache: prefill is split-invariant.

The mechanism is argued in :mod:`engine.arch.qwen35.model`; these tests check the property it promises:
the same prompt gives bit-identical logits and state whatever pieces it is read in (one pass, random
cuts, one token at a time = decode), on the numpy model and on the native kernels at every ISA level
this CPU runs and at 1 and 2 threads, with every KV type (each row is rounded once, when written), and a
chat session gives the same logits at every sampled token with the prefix cache on and off.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import sampling
from engine.api import Engine, EngineOptions, bundled_model
from engine.kernels import cpu
from engine.events import TokenEvent, TurnSummary
from engine.registry import open_text
from engine.arch.qwen35.model import Qwen35Model
from engine.sampling import SamplingParams
from engine.turn.state import KV_TYPES, SequenceState

CAPACITY = 96


QUANTS = ("q8_0", "q4_k_m")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny synth model (Q8_0, and the Q4_K_M mix for the native K-quant kernels) on the numpy
    path and, when built, on the native kernels: {(path, quant): model}."""
    from engine.testing.synth import synth
    out = {}
    for quant in QUANTS:
        path = tmp_path_factory.mktemp("split") / f"tiny-{quant}.gguf"
        synth(path, "tiny", quant=quant, seed=3)
        gguf = open_text(path)
        if quant == "q8_0":
            out[("numpy", quant)] = Qwen35Model(gguf.hparams, gguf.file)
        if cpu.available():
            from engine.arch.qwen35.cpu import NativeQwen35Model
            out[("native", quant)] = NativeQwen35Model(gguf.hparams, gguf.file)
    yield out
    cpu.set_isa(None)
    cpu.set_threads()


def read(model, tokens: np.ndarray, cuts: list[int], kv_type: str = "f32") -> tuple[np.ndarray, SequenceState]:
    """Prefill ``tokens`` in the pieces between ``cuts`` into a state of ``kv_type``: (last-token logits, state)."""
    state = SequenceState.new(model.hp, CAPACITY, kv_type)
    logits = None
    for a, b in zip([0] + cuts, cuts + [len(tokens)]):
        logits = model.forward(tokens[a:b], state)[-1]
    return logits, state


def assert_same_state(a: SequenceState, b: SequenceState) -> None:
    assert a.pos == b.pos
    for ta, tb in ((a.conv, b.conv), (a.ssm, b.ssm)):
        for il in ta:
            assert np.array_equal(ta[il], tb[il]), f"layer {il}: max gap {np.abs(ta[il] - tb[il]).max()}"
    for ta, tb in ((a.k, b.k), (a.v, b.v)):
        for il in ta:
            assert np.array_equal(ta[il][:a.pos], tb[il][:b.pos]), f"layer {il} KV"


def paths() -> list[tuple[tuple[str, str], str | None, int]]:
    """((model, quant), ISA level, threads): the numpy model, every native level at 1 and 2 threads."""
    out: list[tuple[tuple[str, str], str | None, int]] = [(("numpy", "q8_0"), None, 1)]
    out += [(("native", q), isa, t) for q in QUANTS for isa in cpu.supported_isas() for t in (1, 2)]
    return out


@st.composite
def prompts_and_cuts(draw):
    n = draw(st.integers(2, 70))
    tokens = np.array(draw(st.lists(st.integers(0, 248319), min_size=n, max_size=n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(8, n - 1))))
    return tokens, cuts, draw(st.sampled_from(paths())), draw(st.sampled_from(sorted(KV_TYPES)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=prompts_and_cuts())
def test_any_split_gives_the_same_bits(models, case) -> None:
    tokens, cuts, (name, isa, threads), kv_type = case
    model = models[name]
    if isa is not None:
        cpu.set_isa(isa)
        cpu.set_threads(threads)
    whole, whole_state = read(model, tokens, [], kv_type)
    logits, state = read(model, tokens, cuts, kv_type)
    gap = np.abs(logits - whole).max()
    assert np.array_equal(logits, whole), f"{name} {isa} x{threads} {kv_type}, cuts {cuts}: max gap {gap}"
    assert_same_state(state, whole_state)


@pytest.mark.parametrize("kv_type", sorted(KV_TYPES))
@pytest.mark.parametrize("name", ["numpy", "native"])
def test_one_token_at_a_time_equals_one_pass(models, name, kv_type) -> None:
    """Decode is a one-token piece: reading a prompt token by token is the same computation."""
    if (name, "q8_0") not in models:
        pytest.skip("native CPU kernels not built")
    model = models[(name, "q8_0")]
    tokens = np.random.default_rng(5).integers(0, 248320, 40)
    whole, whole_state = read(model, tokens, [], kv_type)
    logits, state = read(model, tokens, list(range(1, 40)), kv_type)
    assert np.array_equal(logits, whole)
    assert_same_state(state, whole_state)


# ---- the B18 session: 4 turns, turn 2 stopped after 5 tokens and regenerated ------------------

USERS = ["How many red circles are there?", "Where is the blue square?", "What colour is the triangle?",
         "Describe the picture in one sentence."]


def session(engine: Engine, seed: int | None) -> tuple[list[list[int]], list[np.ndarray]]:
    """The B18 chat: (tokens of every turn, the logits every sampled token was drawn from)."""
    seen: list[np.ndarray] = []
    original = sampling.Sampler.sample

    def recording(self, logits, history):
        seen.append(np.array(logits, copy=True))
        return original(self, logits, history)

    messages: list[dict] = []
    turns: list[list[int]] = []

    def turn(stop_after: int | None = None) -> str:
        params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=24)
        cancel = threading.Event()
        tokens, text = [], ""
        for event in engine.chat(messages, params, cancel=cancel):
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
                if stop_after is not None and len(tokens) >= stop_after:
                    cancel.set()
            elif isinstance(event, TurnSummary):
                text = event.text
        turns.append(tokens)
        return text

    sampling.Sampler.sample = recording
    try:
        for i, user in enumerate(USERS):
            messages.append({"role": "user", "content": user})
            if i == 1:
                turn(stop_after=5)       # stopped ...
            messages.append({"role": "assistant", "content": turn()})   # ... and regenerated
    finally:
        sampling.Sampler.sample = original
    return turns, seen


@pytest.mark.parametrize("kernels, kv_type", [("native", "f16"), ("numpy", "f16"), ("native", "q8_0")])
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_b18_session_is_the_same_with_the_cache_on_and_off(kernels, seed, kv_type) -> None:
    if kernels == "native" and not cpu.available():
        pytest.skip("native CPU kernels not built")
    bundled = bundled_model()
    if bundled is None:
        pytest.skip("the bundled demo model is absent")
    # snapshot_interval 5 cuts the prompts into many more pieces than the message checkpoints alone
    on = Engine.load(bundled[0], options=EngineOptions(kernels=kernels, snapshot_interval=5, threads=2,
                                                       kv_type=kv_type))
    off = Engine.load(bundled[0], options=EngineOptions(kernels=kernels, prefix_cache=False, threads=2,
                                                        kv_type=kv_type))
    turns_on, logits_on = session(on, seed)
    turns_off, logits_off = session(off, seed)
    assert sum(len(t) for t in turns_on) > 40
    mismatches = sum(a != b for x, y in zip(turns_on, turns_off) for a, b in zip(x, y))
    assert mismatches == 0 and [len(t) for t in turns_on] == [len(t) for t in turns_off]
    assert len(logits_on) == len(logits_off)
    assert all(np.array_equal(a, b) for a, b in zip(logits_on, logits_off))
    assert on.snapshots(), "the cache was used"


# ---- item 7: turn N+1 reads only the new message -----------------------------------------------------

def test_reading_ahead_leaves_only_the_new_message_to_read_and_changes_no_answer() -> None:
    bundled = bundled_model()
    if bundled is None:
        pytest.skip("the bundled demo model is absent")
    plain = Engine.load(bundled[0], options=EngineOptions(threads=2))
    ahead = Engine.load(bundled[0], options=EngineOptions(threads=2))
    tok = ahead.tokenizer
    histories: dict[str, list[dict]] = {"plain": [], "ahead": []}
    for i, user in enumerate(USERS + ["Is there anything on the left?"]):
        answers = {}
        for name, engine in (("plain", plain), ("ahead", ahead)):
            messages = histories[name]
            messages.append({"role": "user", "content": user})
            summary = list(engine.chat(messages, SamplingParams.greedy(24)))[-1]
            answers[name] = summary.text
            messages.append({"role": "assistant", "content": summary.text})
            if name == "ahead":
                new = tok.encode_rendered(f"<|im_start|>user\n{user}<|im_end|>\n"
                                          "<|im_start|>assistant\n<think>\n\n</think>\n\n")
                if i > 0:
                    assert summary.prompt_tokens - summary.reused_tokens == len(new)
                stats = engine.prefill_ahead(messages)
                assert stats is not None and stats.prefilled_tokens > 0
                again = engine.prefill_ahead(messages)          # already read: nothing to do
                assert again.prefilled_tokens == 0
        assert answers["plain"] == answers["ahead"]


def test_reading_ahead_is_cancelled_between_pieces() -> None:
    bundled = bundled_model()
    if bundled is None:
        pytest.skip("the bundled demo model is absent")
    engine = Engine.load(bundled[0], options=EngineOptions(threads=2))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 200}]
    cancel = threading.Event()
    cancel.set()
    assert engine.prefill_ahead(messages, cancel=cancel) is None
    assert engine.prefill_ahead(messages) is not None        # the engine is free again
