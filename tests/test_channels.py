"""The answer's channels (reasoning, content, tool calls): Qwen's rule through the registry, applied as
tokens stream, the same however the text is cut into tokens."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.arch.qwen35.channels import MARKERS, opens_reasoning, splitter
from engine.channels import ChannelSplitter
from engine.events import TokenEvent, TurnSummary
from engine.registry import text_arch

OPENED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CALL = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"


def _run(pieces: list[str], thinking: bool) -> tuple[list, list[str]]:
    """(parts of the whole answer, each token's channel) of ``pieces`` fed one by one."""
    split = splitter(OPENED if thinking else CLOSED)
    parts, channels = [], []
    for piece in pieces:
        parts += split.push(piece)
        channels.append(split.channel)
    return parts + split.close(), channels


def _merged(parts: list) -> list:
    """Adjacent text of one channel joined; each tool call stays one part."""
    out: list = []
    for channel, text in parts:
        assert text, "an empty part"
        if out and out[-1][0] == channel != "tool_call":
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))
    return out


# (answer after the prompt, thinking?) -> its parts, each derived by reading the text with the rule
CASES = [
    (("Let me see.\n</think>\n\nIt is red.", True), [("reasoning", "Let me see.\n"), ("content", "\n\nIt is red.")]),
    (("\n<think>\nhmm</think>Blue.", False), [("reasoning", "\nhmm"), ("content", "Blue.")]),
    (("Plain answer <think> inside", False), [("content", "Plain answer <think> inside")]),
    (("still thinking", True), [("reasoning", "still thinking")]),
    (("almost </thin", True), [("reasoning", "almost </thin")]),
    (("no</think>end</think>", True), [("reasoning", "no"), ("content", "end</think>")]),
    (("Hi " + CALL + " and " + CALL[:20], False),
     [("content", "Hi "), ("tool_call", CALL), ("content", " and "), ("tool_call", CALL[:20])]),
    (("Need it.\n\n" + CALL + "\n" + CALL + "\n", True), [("reasoning", "Need it.\n\n"), ("tool_call", CALL),
                                                         ("tool_call", CALL)]),
    (("Draft: " + CALL + "\n</think>\n\nDone.", True),
     [("reasoning", "Draft: " + CALL + "\n"), ("content", "\n\nDone.")]),
    (("I could " + CALL + " but no.", True), [("reasoning", "I could " + CALL + " but no.")]),
    (("Cut " + CALL[:30], True), [("reasoning", "Cut " + CALL[:30])]),
    (("a < b and <tool_c is no tag", False), [("content", "a < b and <tool_c is no tag")]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_rule_on_whole_answers(case) -> None:
    (text, thinking), want = CASES[case]
    assert _merged(_run([text], thinking)[0]) == want


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "ink>", "tool_", "call>", "\n",
             " ", "a", "xy", "<function=f>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.booleans(), st.lists(st.integers(0, 400), max_size=10))
def test_parts_do_not_depend_on_the_token_boundaries(fragments, thinking, points) -> None:
    text = "".join(fragments)
    cuts = sorted({p % (len(text) + 1) for p in points})
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert _merged(_run(pieces, thinking)[0]) == _merged(_run([text], thinking)[0])
    assert _merged(_run(list(text), thinking)[0]) == _merged(_run([text], thinking)[0])


def test_text_is_released_as_soon_as_it_cannot_be_a_marker() -> None:
    split = splitter(OPENED)
    assert split.push("I think") == [("reasoning", "I think")]
    assert split.push(" </th") == [("reasoning", " ")]                # "</th" may still become </think>
    assert split.channel == "reasoning"
    assert split.push("ink>Yes") == [("content", "Yes")]
    assert split.push("<tool") == [] and split.channel == "content"
    assert split.push("_call>x") == [] and split.channel == "tool_call"
    assert split.push("</tool_call>") == [("tool_call", "<tool_call>x</tool_call>")]


def test_a_marker_token_belongs_to_the_block_it_opens_or_closes() -> None:
    _, channels = _run(["<think>", "a", "</think>", "b", "<tool_call>", "c", "</tool_call>", "d"], False)
    assert channels == ["reasoning", "reasoning", "reasoning", "content", "tool_call", "tool_call", "tool_call",
                        "content"]


@pytest.mark.parametrize("tail, want", [(OPENED, True), (CLOSED, False), ("<|im_start|>assistant\n", False),
                                        ("<think>old</think><|im_start|>assistant\n<think>", True),
                                        ("<think>\n", True), ("", False)])
def test_the_prompt_opens_the_reasoning(tail, want) -> None:
    assert opens_reasoning(tail) is want


def test_the_family_rule_is_reached_through_the_registry() -> None:
    for name in ("qwen35", "qwen35moe"):
        split = text_arch(name, "x.gguf").channels(OPENED)
        assert isinstance(split, ChannelSplitter) and split.markers == MARKERS


def test_an_event_without_a_splitter_is_content() -> None:
    assert TokenEvent(1, "hi", 0.0, 0).parts == (("content", "hi"),)
    assert TokenEvent(1, "", 0.0, 0).parts == ()


def test_the_engine_tags_each_token(synth_model) -> None:
    from engine.api import Engine, EngineOptions
    from engine.sampling import SamplingParams
    engine = Engine.load(synth_model("tiny", "q8_0"), options=EngineOptions(context=512, prefix_cache=False))
    try:
        for thinking in (True, False):
            events = list(engine.chat([{"role": "user", "content": "Hi"}], SamplingParams.greedy(12),
                                      threading.Event(), enable_thinking=thinking))
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            summary = events[-1]
            assert isinstance(summary, TurnSummary)
            want, channels = _run([t.text for t in tokens], thinking)
            got = [p for t in tokens for p in t.parts] + list(summary.parts)
            assert _merged(got) == _merged(want) and [t.channel for t in tokens] == channels
            ms = [t.ms for t in tokens]
            assert summary.decode_tok_s == pytest.approx((len(ms) - 1) / (sum(ms[1:]) / 1e3))
    finally:
        engine.close()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.5, 500.0), max_size=12), st.integers(0, 4000),
       st.floats(0.0, 5000.0, allow_subnormal=False))
def test_the_summary_rates_come_from_one_constructor(token_ms, prefilled, prefill_ms) -> None:
    """decode tok/s = (n - 1) tokens over the time after the first (whose latency is TTFT's); TTFT and
    prefill tok/s are the prefill's."""
    from engine.events import PrefillStats
    prefill = PrefillStats(prompt_tokens=prefilled + 7, reused_tokens=7, prefilled_tokens=prefilled,
                           prefill_ms=prefill_ms, restore_ms=0.0, device="cpu", ttft_ms=prefill_ms + 3.0)
    got = TurnSummary.of_turn("eos", "", prefill, token_ms, "t")
    after_first = sum(token_ms[1:]) / 1e3
    assert got.decode_tok_s == pytest.approx((len(token_ms) - 1) / after_first if len(token_ms) > 1 else 0.0)
    assert (got.ttft_ms, got.prefill_tok_s) == (prefill.ttft_ms, prefill.prefill_tok_s)
    assert (got.prompt_tokens, got.reused_tokens, got.generated_tokens) == (prefilled + 7, 7, len(token_ms))
    bare = TurnSummary.of_turn("error", "x", None, token_ms, generated_tokens=99)
    assert (bare.ttft_ms, bare.prefill_tok_s, bare.prompt_tokens, bare.generated_tokens) == (0.0, 0.0, 0, 99)
