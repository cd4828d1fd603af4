"""``engine serve`` as an agent's backend, driven by the official ``openai`` client on loopback: ``n``
choices, tool calls, structured output and logprobs."""

from __future__ import annotations

import json
import types

import httpx
import jsonschema
import openai
import pytest

from engine.events import PrefillStats, TokenEvent
from engine.sampling import SamplingParams
from engine.openai import ServerConfig, ServerThread
from engine.openai.tool_calls import CallReader, ToolCallStream
from engine.openai.tool_grammar import call_grammar

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_n_choices_use_seed_plus_index_and_share_the_prompt(client) -> None:
    def ask(**kw):
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=1.5, top_p=1.0,
                                              extra_body={"top_k": 0}, **kw)

    many = ask(n=3, seed=11)
    singles = [ask(seed=11 + i).choices[0].message.content for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == singles
    assert len(set(singles)) > 1                                    # the seeds differ, so do the answers
    assert many.usage.completion_tokens == 18 and many.usage.prompt_tokens == ask(seed=1).usage.prompt_tokens
    streamed = list(ask(n=3, seed=11, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) for i in range(3)]
    assert texts == singles
    assert [c.choices[0].index for c in streamed if c.choices[0].finish_reason] == [0, 1, 2]


def test_n_choices_of_a_completion(client) -> None:
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=1.5, n=2,
                                    seed=3, top_p=1.0)
    one = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=1.5,
                                    seed=4, top_p=1.0)
    assert [c.index for c in got.choices] == [0, 1] and got.choices[1].text == one.choices[0].text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city over the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
FLAGS = {"type": "function", "function": {
    "name": "set_flags", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "level": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["on", "tags"]}}}
TOOLS = [WEATHER, FLAGS]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def _valid_call(call, tools=TOOLS) -> dict:
    """The call's arguments, checked against its tool's parameters schema."""
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def test_required_tool_choice_forces_a_valid_call_then_the_tool_result_is_answered(client, engine) -> None:
    engine.clear_snapshots()
    for seed in range(6):
        first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _valid_call(call)
    follow = ASK + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=6, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    as_template = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        follow[-1]]
    prompt = engine.render(as_template, tools=TOOLS)
    text = engine.tokenizer.decode(prompt)
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    assert f"<function={call.function.name}>" in text                 # the call went back through the template
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens   # the agent's prefix


def test_a_streamed_forced_call_equals_the_whole_one(client) -> None:
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=1.0)
    for seed in range(4):
        whole = client.chat.completions.create(seed=seed, **kw).choices[0]
        chunks = list(client.chat.completions.create(seed=seed, stream=True, **kw))
        pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert pieces, "no tool-call deltas"
        calls: dict[int, dict] = {}
        for piece in pieces:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name   # id and name come first
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
        assert whole.finish_reason == "tool_calls"


def test_a_named_function_is_the_one_called(client) -> None:
    for seed in range(4):
        got = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, seed=seed,
                                             temperature=1.0,
                                             tool_choice={"type": "function", "function": {"name": "set_flags"}})
        [call] = got.choices[0].message.tool_calls
        assert call.function.name == "set_flags"
        _valid_call(call)


def test_tool_choice_none_keeps_the_prompt_and_parses_no_call(client, engine) -> None:
    auto = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, temperature=0)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                          temperature=0)
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens == len(engine.render(ASK, tools=TOOLS))
    assert none.choices[0].message.tool_calls is None


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}


def test_json_schema_answers_validate_over_many_seeds(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(12):
        got = client.chat.completions.create(model="tiny", messages=HI, response_format=fmt, max_tokens=200,
                                             temperature=1.0, seed=seed)
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content), PERSON)


def test_json_object_answers_start_an_object(client) -> None:
    for seed in range(3):
        got = client.chat.completions.create(model="tiny", messages=HI, response_format={"type": "json_object"},
                                             max_tokens=40, temperature=1.0, seed=seed)
        content = got.choices[0].message.content
        assert content.startswith("{")
        if got.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)


def test_chat_logprobs_have_the_openai_shape(client) -> None:
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    for t in content:
        assert t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert t.logprob == t.top_logprobs[0].logprob and t.token == t.top_logprobs[0].token   # greedy: the best
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    assert b"".join(bytes(t.bytes) for t in content).decode().lstrip() == got.choices[0].message.content
    streamed = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    entries = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in entries] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_have_the_openai_shape(client) -> None:
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logit_bias_forces_and_bans_tokens(client, engine) -> None:
    token = engine.tokenizer.encode_plain(" banana")[0]
    forced = client.chat.completions.create(model="tiny", messages=HI, max_tokens=3, temperature=0,
                                            logit_bias={str(token): 100})
    assert forced.choices[0].message.content == engine.tokenizer.decode([token] * 3).lstrip()
    greedy = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, temperature=0, logprobs=True)
    first = greedy.choices[0].logprobs.content[0]
    banned_id = engine.tokenizer.encode_plain(first.token)
    assert len(banned_id) == 1
    other = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, temperature=0, logprobs=True,
                                           logit_bias={str(banned_id[0]): -100})
    assert other.choices[0].logprobs.content[0].token != first.token


class _Recording:
    """The served engine, recording the arguments of each ``chat`` call."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def chat(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.engine.chat(*args, **kwargs)


@pytest.fixture(scope="module")
def recorded(engine, hold):
    rec = _Recording(engine)
    srv = ServerThread(rec, ServerConfig("tiny"), port=0, session=hold.session).start()
    yield rec, openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    srv.stop()


@pytest.mark.parametrize("extra, thinking", [
    ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "minimal"}, False),
    ({"reasoning_effort": "low"}, True), ({"reasoning_effort": "high"}, True),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True), ({}, False),
])
def test_thinking_controls_reach_the_template(recorded, extra, thinking) -> None:
    rec, client = recorded
    client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, extra_body=extra)
    assert rec.calls[-1][1]["enable_thinking"] is thinking


def test_sampling_fields_reach_the_engine(recorded) -> None:
    rec, client = recorded
    client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, frequency_penalty=1.5,
                                   logit_bias={"7": -3}, logprobs=True, top_logprobs=4, tools=TOOLS)
    args, kwargs = rec.calls[-1]
    sampling = args[1]
    assert (sampling.frequency_penalty, sampling.logit_bias, sampling.top_logprobs) == (1.5, ((7, -3.0),), 4)
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather", "set_flags"]
    assert kwargs["grammar"] is None                                         # auto, no strict tool: free answer


def _body(**kw) -> dict:
    return {"model": "tiny", "messages": HI, "max_tokens": 2} | kw


def _tool(name="t", description="d", parameters=None) -> dict:
    fn = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


CALLED = [{"role": "user", "content": "hi"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]}]


@pytest.mark.parametrize("body, param, fragment", [
    (_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}),
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    (_body(response_format={"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}),
     "response_format", '"not"'),
    (_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}}), "response_format", "look-around"),
    (_body(response_format={"type": "xml"}), "response_format", "json_schema"),
    (_body(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name", "letters"),
    (_body(tools=[_tool("a b")]), "tools[0].function.name", "letters"),
    (_body(tools=[_tool("t"), _tool("t")]), "tools[1].function.name", "twice"),
    (_body(tools=[_tool(description="x" * (10 << 20))]), "tools", "characters"),
    (_body(tools=[_tool(description="x" * (100 << 10))]), "tools[0].function.description", "at most"),
    (_body(tools=[_tool(parameters={"type": "object", "properties": {"p": {"type": "string",
                                                                           "description": "y" * (100 << 10)}}})]),
     "tools[0].function.parameters.properties.p.description", "at most"),
    (_body(tools=[_tool(parameters={"type": "array"})]), "tools[0].function.parameters", "object"),
    (_body(tools=[_tool(parameters={"type": "object", "properties": {"a>b": {}}})]), "tools[0].function.parameters",
     "property name"),
    (_body(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "other"}}),
     "tool_choice.function.name", "not among the tools"),
    (_body(tool_choice="required"), "tool_choice", "needs tools"),
    (_body(tools=[_tool()], tool_choice="always"), "tool_choice", "'auto'"),
    (_body(messages=CALLED + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]),
     "messages[2].tool_call_id", "answers no tool call"),
    (_body(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]),
     "messages[1].tool_call_id", "answers no tool call"),
    (_body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "t", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    (_body(n=1000), "n", "at most 8"),
    (_body(logprobs=True, top_logprobs=50), "top_logprobs", "[0, 20]"),
    (_body(top_logprobs=2), "top_logprobs", "logprobs: true"),
    (_body(logit_bias={"999999999": 1}), "logit_bias", "not a token id"),
    (_body(logit_bias={"-1": 1}), "logit_bias", "not a token id"),
    (_body(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (_body(frequency_penalty=3), "frequency_penalty", "[-2, 2]"),
    (_body(reasoning_effort="extreme"), "reasoning_effort", "none, minimal"),
    (_body(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}), "reasoning_effort", "contradicts"),
    (_body(chat_template_kwargs={"add_vision_id": True}), "chat_template_kwargs", "not supported"),
    (_body(parallel_tool_calls="yes"), "parallel_tool_calls", "true or false"),
    (_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        '{"items": ' * 900 + "{}" + "}" * 900)}}), "response_format.json_schema.schema", "deeper than 64"),
])
def test_bad_agent_fields_are_400_naming_the_field(server, body, param, fragment) -> None:
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"] and len(error["message"]) < 1000
    ok = httpx.post(server.url + "/chat/completions", json=_body(), timeout=60)
    assert ok.status_code == 200                                     # the server keeps serving


def test_bad_completion_logprobs_are_400(server) -> None:
    for body, param in (({"logprobs": 21}, "logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias")):
        r = httpx.post(server.url + "/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_strict_tool_arguments_are_enforced_under_auto(client, engine) -> None:
    """With ``tool_choice`` auto the model is free to answer in text; once it writes ``<tool_call>`` (pushed
    here by a logit bias, as a random model would not) a strict tool's arguments follow its schema."""
    start = engine.tokenizer.token_id("<tool_call>")
    strict = {"type": "function", "function": FLAGS["function"] | {"strict": True}}
    for seed in range(3):
        got = client.chat.completions.create(model="tiny", messages=ASK, tools=[strict], parallel_tool_calls=False,
                                             logit_bias={str(start): 100}, max_tokens=150, temperature=1.0, seed=seed)
        [call] = got.choices[0].message.tool_calls
        _valid_call(call, [strict])
        assert got.choices[0].finish_reason == "tool_calls"


def test_the_json_call_format_grammar_gives_valid_calls(engine, hold) -> None:
    """The grammar of the older templates' JSON calls, run on the engine directly (the synth model's
    template teaches the XML form, so the server would not choose this one)."""
    grammar = engine.grammar(lark=call_grammar(TOOLS, "json", "required", None, False, None))
    reader = CallReader({t["function"]["name"]: t["function"] for t in TOOLS}, "json")
    for seed in range(4):
        with hold:
            events = list(engine.chat(ASK, SamplingParams(temperature=1.0, seed=seed, max_tokens=150),
                                      tools=TOOLS, grammar=grammar))
        summary = events[-1]
        stream = ToolCallStream(reader)
        parts = [p for e in events if isinstance(e, TokenEvent) for p in e.parts] + list(summary.parts)
        pieces = stream.push(parts) + stream.close()
        [(kind, call)] = pieces
        assert kind == "call" and summary.stop_reason == "eos"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), schema)


def test_a_response_format_with_tools_is_that_json_or_calls(client) -> None:
    """Under auto the answer is the format's JSON or calls (strict tools here: their arguments follow the
    schema, and they end, which a random model's free-text argument would not)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    strict = [{"type": "function", "function": t["function"] | {"strict": True}} for t in TOOLS]
    kinds = set()
    for seed in range(6):
        got = client.chat.completions.create(model="tiny", messages=HI, tools=strict, response_format=fmt,
                                             parallel_tool_calls=False, max_tokens=80, temperature=1.0,
                                             seed=seed).choices[0]
        if got.message.tool_calls:
            [call] = got.message.tool_calls
            assert got.finish_reason == "tool_calls" and _valid_call(call, strict) is not None
        else:
            assert got.finish_reason == "stop"
            jsonschema.validate(json.loads(got.message.content), PERSON)
        kinds.add(bool(got.message.tool_calls))
    assert kinds == {False, True}, "the seeds should show both kinds of answer"


def test_server_logprobs_are_the_engines(client, engine, hold) -> None:
    from dataclasses import replace

    with hold:
        events = [e for e in engine.chat(HI, replace(SamplingParams.greedy(5), top_logprobs=2))
                  if isinstance(e, TokenEvent)]
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2).choices[0].logprobs.content
    assert [t.logprob for t in got] == [e.logprob for e in events]
    assert [[a.logprob for a in t.top_logprobs] for t in got] == [[lp for _, lp in e.top_logprobs] for e in events]
    assert [bytes(t.bytes) for t in got] == [engine.token_bytes(e.token_id) for e in events]


def test_a_call_after_the_thinking_with_thinking_on(client, engine) -> None:
    """Thinking on and a forced call: the thinking stays free up to ``</think>`` (pushed here by a logit
    bias, as a random model would not close it), then the grammar's call; streamed and whole agree."""
    close = engine.tokenizer.token_id("</think>")
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=150, temperature=1.0, seed=5, logit_bias={str(close): 100}, reasoning_effort="high")
    whole = client.chat.completions.create(**kw).choices[0]
    [call] = whole.message.tool_calls
    _valid_call(call)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    chunks = list(client.chat.completions.create(stream=True, **kw))
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.choices[0].delta.tool_calls or []))
    assert args == call.function.arguments


class _NoTemplate(_Recording):
    """The served engine as if its file had no ``tokenizer.chat_template`` (chat falls back to ChatML)."""

    @property
    def tokenizer(self):
        return types.SimpleNamespace(chat_template=None, n_vocab=self.engine.tokenizer.n_vocab)


def test_tools_are_refused_when_the_template_cannot_write_them(engine, hold) -> None:
    srv = ServerThread(_NoTemplate(engine), ServerConfig("tiny"), port=0, session=hold.session).start()
    try:
        r = httpx.post(srv.url + "/chat/completions", json=_body(tools=TOOLS), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "chat template" in r.json()["error"]["message"]
        assert httpx.post(srv.url + "/chat/completions", json=_body(), timeout=60).status_code == 200
    finally:
        srv.stop()


class _Prefills(_Recording):
    """The served engine, recording the prefill of each ``chat`` call."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.prefills = []

    def chat(self, *args, **kwargs):
        for event in super().chat(*args, **kwargs):
            if isinstance(event, PrefillStats):
                self.prefills.append(event)
            yield event


def test_n_choices_prefill_the_prompt_once(engine, hold) -> None:
    rec = _Prefills(engine)
    srv = ServerThread(rec, ServerConfig("tiny"), port=0, session=hold.session).start()
    try:
        engine.clear_snapshots()
        messages = [{"role": "user", "content": "Three answers, one prompt: " + "words " * 40}]
        r = httpx.post(srv.url + "/chat/completions", json=_body(messages=messages, n=3, seed=1, temperature=1.0),
                       timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    finally:
        srv.stop()
    first, *rest = rec.prefills
    assert len(rest) == 2 and first.prefilled_tokens == first.prompt_tokens > 40
    assert all(p.reused_tokens == p.prompt_tokens == first.prompt_tokens for p in rest)   # resumed whole
