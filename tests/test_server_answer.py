"""The answer splitter of ``engine serve`` (blanks at the start of reasoning and content, stop strings) on
the channels Qwen's rule gives, for every way the text can be cut into tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.arch.qwen35.channels import splitter
from engine.events import TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.openai.answer import AnswerSplitter
from engine.openai.choices import Choice
from engine.openai.requests import TurnRequest

OPENED, CLOSED = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _run(pieces, thinking=False, stop=(), raw=False) -> tuple[str, str, bool]:
    """(reasoning, content, stopped) of ``pieces`` through the engine's channels and the server's splitter."""
    channels, s = splitter(OPENED if thinking else CLOSED), AnswerSplitter(stop, raw)
    out = [p for piece in pieces for p in s.push([("content", piece)] if raw else channels.push(piece))]
    out += s.push([] if raw else channels.close()) + s.close()
    assert all(text for _, text in out)
    return ("".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content"), s.stopped)


def _cuts(text: str, points: list[int]) -> list[str]:
    points = sorted({p % (len(text) + 1) for p in points})
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


CASES = [
    # (text, thinking, stop, raw) -> (reasoning, content, stopped), each derived by reading the text
    (("Let me see.\n</think>\n\nIt is red.", True, (), False), ("Let me see.\n", "It is red.", False)),
    (("\n<think>\nhmm</think>Blue.", False, (), False), ("hmm", "Blue.", False)),
    (("Plain answer <think> inside", False, (), False), ("", "Plain answer <think> inside", False)),
    (("still thinking", True, (), False), ("still thinking", "", False)),
    (("a</think>one, two. three", True, (". ",), False), ("a", "one, two", True)),
    (("  keep spaces END more", False, ("END",), True), ("", "  keep spaces ", True)),
    (("<think>x</think> raw", False, (), True), ("", "<think>x</think> raw", False)),
    (("almost </thin", True, (), False), ("almost </thin", "", False)),
    (("ab", False, ("abc",), False), ("", "ab", False)),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 200), max_size=8))
def test_splitting_does_not_depend_on_the_token_boundaries(case, points) -> None:
    (text, thinking, stop, raw), want = case
    assert _run(_cuts(text, points), thinking, stop, raw) == want


def test_text_is_sent_as_soon_as_it_cannot_be_a_stop_string() -> None:
    s = AnswerSplitter(("END",))
    assert s.push([("reasoning", "\n I think END")]) == [("reasoning", "I think END")]   # not in reasoning
    assert s.push([("content", "\n\nIt is E")]) == [("content", "It is ")]       # "E" may still become END
    assert s.push([("content", "N")]) == [] and not s.stopped
    assert s.push([("content", "D more"), ("content", "x")]) == [] and s.stopped and s.stop_string == "END"
    assert s.close() == []


def test_a_tool_call_ends_a_held_stop_string_and_is_not_searched() -> None:
    s = AnswerSplitter(("END",))
    assert s.push([("content", "a E"), ("tool_call", "<tool_call>END</tool_call>")]) == [
        ("content", "a "), ("content", "E"), ("tool_call", "<tool_call>END</tool_call>")]
    assert not s.stopped


def test_the_server_reads_channels_not_markers() -> None:
    """Markers in a part are its channel's text: the family's rule decided, the server does not parse."""
    s = AnswerSplitter()
    assert s.push([("content", " <think>a</think> b"), ("reasoning", "r")]) == [
        ("content", "<think>a</think> b"), ("reasoning", "r")]


def _choice_text(prompt: str | None, events: list[TokenEvent], summary_parts=()) -> dict:
    messages = None if prompt is not None else [{"role": "user", "content": "x"}]
    choice = Choice(0, TurnRequest("m", messages, prompt, SamplingParams()))
    for event in events:
        choice.push(event)
    text = "".join(e.text for e in events)
    choice.close(TurnSummary("eos", "", 1, 0, len(events), 0.0, 0.0, 0.0, text, (), tuple(summary_parts)))
    return choice.whole()


def test_a_choice_maps_the_channels_and_a_raw_completion_takes_the_text() -> None:
    events = [TokenEvent(0, "hmm", 0.0, 0, channel="reasoning"),
              TokenEvent(1, "</think>\n\nRed <tool_call>", 0.0, 1, channel="tool_call",
                         parts=(("content", "\n\nRed "),)),
              TokenEvent(2, "x</tool_call>", 0.0, 2, channel="tool_call",
                         parts=(("tool_call", "<tool_call>x</tool_call>"),))]
    chat = _choice_text(None, events, [("content", " end")])
    assert chat["message"] == {"role": "assistant", "reasoning_content": "hmm",
                               "content": "Red <tool_call>x</tool_call> end"}      # no tools offered: text
    raw = _choice_text("p", events, [("content", " end")])
    assert raw["text"] == "hmm</think>\n\nRed <tool_call>x</tool_call>"       # held parts are in the text already


class _StoppingExchange:
    """A turn of a server that is stopping: ``items`` come one by one, as from the session."""

    def __init__(self, items: list) -> None:
        from types import SimpleNamespace
        self.items, self.stopping = list(items), True
        self.turn = SimpleNamespace(stop_choice=lambda index: None)

    async def next(self, index: int = 0):
        return self.items.pop(0)

    def error_of(self, exc: BaseException):
        raise AssertionError(f"no error expected, got {exc!r}")


def _run_choices(items: list, stop: tuple[str, ...]) -> list:
    import asyncio
    from engine.openai.app import _choices
    req = TurnRequest("m", None, "x", SamplingParams(), stop=stop)

    async def drain() -> list:
        return [what async for what, _, _ in _choices(_StoppingExchange(items), req, [], lambda i: Choice(i, req))]
    return asyncio.run(drain())


def test_an_answer_a_stop_string_ended_is_whole_while_the_server_stops() -> None:
    """A stop string ends a choice through its cancel flag, so its summary says "cancelled"; arriving after the
    server began to stop, it is still the whole answer, not a 503 "cut off"."""
    from engine.openai.requests import APIError
    events = [TokenEvent(0, "a ", 0.0, 0), TokenEvent(1, "END", 0.0, 1)]
    summary = TurnSummary("cancelled", "", 1, 0, 2, 0.0, 0.0, 0.0, "a END")
    assert _run_choices([*events, summary], ("END",))[-1] == "end"
    with pytest.raises(APIError, match="cut off after 2 tokens"):
        _run_choices([*events, summary], ())


def test_a_cancel_the_stopping_server_caused_is_its_503() -> None:
    """A turn cancelled before its first token (e.g. while an image is encoded) answers 503 ``server_stopping``
    when the server is stopping; a job the closed session never started keeps its own 503; else a cancel is
    the engine's error."""
    from types import SimpleNamespace
    from engine.errors import GenerationCancelled
    from engine.openai.app import _Exchange
    from engine.session import SessionClosedError
    stopping, running = SimpleNamespace(stopping=True), SimpleNamespace(stopping=False)
    assert _Exchange.error_of(stopping, GenerationCancelled("image encoding cancelled")).code == "server_stopping"
    assert _Exchange.error_of(stopping, SessionClosedError("closed")).code == "model_unavailable"
    assert _Exchange.error_of(running, GenerationCancelled("image encoding cancelled")).code != "server_stopping"
