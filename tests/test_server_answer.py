"""The answer splitter of ``engine serve`` (reasoning vs content, stop strings), for every way the text
can be cut into tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.openai.answer import AnswerSplitter


def _run(pieces, thinking=False, stop=(), raw=False) -> tuple[str, str, bool]:
    s = AnswerSplitter(thinking, stop, raw)
    out = [p for piece in pieces for p in s.push(piece)] + s.close()
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


def test_text_is_sent_as_soon_as_it_cannot_be_a_tag() -> None:
    s = AnswerSplitter(True)
    assert s.push("I think") == [("reasoning", "I think")]
    assert s.push(" </th") == [("reasoning", " ")]                # "</th" may still become </think>
    assert s.push("ink>Yes") == [("content", "Yes")]
