"""The tool-call parser on a corpus of Qwen3.6 answers written from its chat template's own call format
(engine/prompt/templates/qwen35.jinja), and on the older JSON-in-``<tool_call>`` form: fed whole and token by
token, the reasoning, content and calls come out the same."""

from __future__ import annotations

import json
import random

import pytest

from engine.arch.qwen35.channels import splitter
from engine.arch.qwen35.vocab import QWEN35_CHAT_TEMPLATE
from engine.events import TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.openai.choices import Choice
from engine.openai.requests import TurnRequest
from engine.openai.tool_calls import CallReader, call_format, convert

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
        "options": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "ratio": {"type": "number"}}}}},
]


def _call(name: str, **params: str) -> str:
    """A call block exactly as the template's instructions write it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = _call("get_weather", city="Paris", days="5")
# (answer text after the prompt's "<think>\n", thinking?, expected reasoning, content, calls)
CORPUS = [
    ("The user wants the weather; I'll call get_weather.\n</think>\n\n" + WEATHER, True,
     "The user wants the weather; I'll call get_weather.\n", "", [("get_weather", {"city": "Paris", "days": 5})]),
    ("Two cities.\n</think>\n\n" + WEATHER + "\n" + _call("get_weather", city="Rome", metric="false"), True,
     "Two cities.\n", "", [("get_weather", {"city": "Paris", "days": 5}),
                          ("get_weather", {"city": "Rome", "metric": False})]),
    (_call("configure", options='{"retry": {"count": 3, "on": ["timeout", "5xx"]}, "verbose": true}',
           tags='["a", "b"]', ratio="0.25"), False, "", "",
     [("configure", {"options": {"retry": {"count": 3, "on": ["timeout", "5xx"]}, "verbose": True},
                     "tags": ["a", "b"], "ratio": 0.25})]),
    (_call("lookup", code="007", limit="null"), False, "", "", [("lookup", {"code": "007", "limit": None})]),
    (_call("lookup", code="line one\nline two\n"), False, "", "", [("lookup", {"code": "line one\nline two\n"})]),
    ("Let me check that.\n\n" + WEATHER, False, "", "Let me check that.",
     [("get_weather", {"city": "Paris", "days": 5})]),
    ("Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", True,
     "Checking.\n", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
    ("I could call " + WEATHER + " but first I think more.\n</think>\n\nIt is sunny.", True,
     "I could call " + WEATHER + " but first I think more.\n", "It is sunny.", []),
    ("Draft: " + WEATHER + "\n</think>\n\nDone.", True, "Draft: " + WEATHER + "\n", "Done.", []),
    ("I need the weather.\n\n" + WEATHER + "\n", True, "I need the weather.\n\n",
     "", [("get_weather", {"city": "Paris", "days": 5})]),
    (_call("delete_everything", path="/"), False, "", _call("delete_everything", path="/"), []),
    ("<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>", False, "",
     "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>", []),
    ("No tools needed: 2 + 2 = 4.\n", False, "", "No tools needed: 2 + 2 = 4.\n", []),
    ("a < b and <tool_c is not a tag", False, "", "a < b and <tool_c is not a tag", []),
    (WEATHER + "\n\nThe forecast is coming.", False, "", "The forecast is coming.",
     [("get_weather", {"city": "Paris", "days": 5})]),
]


def _request(thinking: bool) -> TurnRequest:
    return TurnRequest("m", [{"role": "user", "content": "x"}], None, SamplingParams(), thinking, tools=tuple(TOOLS))


def _run(text: str, thinking: bool, pieces: list[str], fmt: str = "xml", stop_reason: str = "eos"):
    """Feed ``pieces`` (which join to ``text``) through a choice: (reasoning, content, calls, finish, deltas)."""
    assert "".join(pieces) == text
    choice = Choice(0, _request(thinking), CallReader({t["function"]["name"]: t["function"] for t in TOOLS}, fmt))
    channels = splitter("<|im_start|>assistant\n<think>\n" + ("" if thinking else "\n</think>\n\n"))
    deltas = []
    for i, piece in enumerate(pieces):
        parts = tuple(channels.push(piece))
        deltas += choice.deltas(choice.push(TokenEvent(i, piece, 0.0, i, channel=channels.channel, parts=parts)))
    summary = TurnSummary(stop_reason, "", 10, 0, len(pieces), 0.0, 0.0, 0.0, text, (), tuple(channels.close()))
    deltas += choice.deltas(choice.close(summary))
    message = choice.message()
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return message.get("reasoning_content", ""), message["content"] or "", calls, choice.finish_reason, deltas


def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("case", range(len(CORPUS)))
def test_the_corpus_parses_the_same_whole_and_streamed(case) -> None:
    text, thinking, reasoning, content, calls = CORPUS[case]
    whole = _run(text, thinking, [text])
    assert whole[:3] == (reasoning, content, calls)
    assert whole[3] == ("tool_calls" if calls else "stop")
    rng = random.Random(case)
    for pieces in ([c for c in text], _split(text, rng), _split(text, rng)):
        streamed = _run(text, thinking, pieces)
        assert streamed[:4] == whole[:4]
        got = "".join(d.get("content", "") for d in streamed[4])
        assert got == content


def test_streamed_calls_come_as_openai_deltas() -> None:
    text = "Two cities.\n</think>\n\n" + WEATHER + "\n" + _call("lookup", code="12")
    deltas = [d["tool_calls"][0] for d in _run(text, True, list(text))[4] if "tool_calls" in d]
    assert [set(d) for d in deltas] == [{"index", "id", "type", "function"}, {"index", "function"}] * 2
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["type"] == "function"
    assert deltas[0]["id"].startswith("call_") and deltas[0]["id"] != deltas[2]["id"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Paris", "days": 5}
    assert json.loads(deltas[3]["function"]["arguments"]) == {"code": "12"}


def test_a_call_cut_by_max_tokens_is_content_and_finishes_with_length() -> None:
    text = WEATHER[:-5]
    reasoning, content, calls, finish, _ = _run(text, False, list(text), stop_reason="max_tokens")
    assert (content, calls, finish) == (text, [], "length")


def test_json_format_of_older_qwen_templates() -> None:
    text = ('Sure.\n<tool_call>\n{"name": "lookup", "arguments": {"code": "42", "limit": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')
    for pieces in ([text], list(text)):
        _, content, calls, finish, _ = _run(text, False, pieces, fmt="json")
        assert content == "Sure." and finish == "tool_calls"
        assert calls == [("lookup", {"code": "42", "limit": 3}), ("get_weather", {"city": "Oslo"})]
    bad = '<tool_call>\n{"name": "lookup", "arguments": {"code": </tool_call>'
    assert _run(bad, False, list(bad), fmt="json")[1:3] == (bad, [])


def test_the_format_is_chosen_from_the_template() -> None:
    assert call_format(QWEN35_CHAT_TEMPLATE) == "xml"
    assert call_format('{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}" }}') \
        == "json"


@pytest.mark.parametrize("text, schema, want", [
    ("5", {"type": "integer"}, 5), ("5", {"type": "string"}, "5"), ("-12", {"type": "number"}, -12),
    ("2.5e3", {"type": "number"}, 2500.0), ("True", {"type": "boolean"}, True), ("5", {}, 5),
    ("five", {"type": "integer"}, "five"), ("[1, 2]", {"type": "array"}, [1, 2]), ("hi", None, "hi"),
    ("3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3), ("null", {"type": ["string", "null"]}, "null"),
    ("red", {"enum": ["red", "blue"]}, "red"), ('{"a": 1}', {"type": "object"}, {"a": 1}),
    ("true", {"type": "number"}, "true"),
])
def test_values_follow_their_schema_type(text, schema, want) -> None:
    got = convert(text, schema)
    assert got == want and type(got) is type(want)
