"""Hostile and odd requests against ``engine serve`` on loopback: each is a 4xx in its route's own error
shape and the server keeps serving (a client's SDK or a fuzzer, not a happy path)."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.arch.qwen35.channels import splitter
from engine.turn.grammar import MAX_MESSAGE, GrammarError
from engine.openai.tool_calls import CallReader, ToolCallStream
from engine.openai.tool_grammar import call_grammar

HI = [{"role": "user", "content": "hi"}]
RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                "required": ["next"]}},
             "$ref": "#/$defs/node"}
"""A schema that compiles but whose every value nests without end: llguidance gives up while decoding."""


@pytest.fixture(scope="module")
def url(served):
    return served[2].url


def _alive(url: str) -> None:
    ok = httpx.post(url + "/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("key", ["9" * 5000, "\u00b2", "\u0661"])
def test_logit_bias_keys_that_are_not_ascii_decimal_ids_are_400(url, key) -> None:
    r = httpx.post(url + "/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1,
                                                    "logit_bias": {key: 1}}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias" and len(r.json()["error"]["message"]) < 300
    _alive(url)


def _recursive_format(route: str) -> dict:
    if route == "/chat/completions":
        return {"messages": HI, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE}}}
    if route == "/responses":
        return {"input": "hi", "max_output_tokens": 8,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": RECURSIVE}}}
    return {"messages": HI, "max_tokens": 8, "output_config": {"format": {"type": "json_schema", "schema": RECURSIVE}}}


@pytest.mark.parametrize("route", ["/chat/completions", "/responses", "/messages"])
def test_a_schema_the_parser_gives_up_on_while_decoding_is_400(url, route) -> None:
    r = httpx.post(url + route, json={"model": "tiny"} | _recursive_format(route), timeout=60)
    assert r.status_code == 400, r.text
    body = r.json()
    if route == "/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == "unsupported_schema"
    _alive(url)


def test_a_stream_whose_parser_gives_up_ends_with_an_error_event(url) -> None:
    body = {"model": "tiny", "stream": True} | _recursive_format("/chat/completions")
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as r:
        text = r.read().decode()
    assert r.status_code in (200, 400) and "unsupported_schema" in text and "server_error" not in text
    _alive(url)


DEEP = '{"a": ' * 900 + "1" + "}" * 900
"""Arguments nested 900 deep: within the JSON parser's depth, beyond what the template may recurse into."""


@pytest.mark.parametrize("route, body", [
    ("/chat/completions", {"messages": HI + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "a", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}], "max_tokens": 1}),
    ("/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "a", "arguments": DEEP},
                              {"type": "function_call_output", "call_id": "c1", "output": "x"}],
                    "max_output_tokens": 1}),
    ("/messages", {"messages": HI + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "a", "input": "INPUT"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "x"}]}],
        "max_tokens": 1}),
    ("/messages/count_tokens", {"messages": HI + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "a", "input": "INPUT"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "x"}]}]}),
])
def test_deeply_nested_call_arguments_in_the_history_are_400(url, route, body) -> None:
    text = json.dumps({"model": "tiny"} | body).replace('"INPUT"', DEEP)
    r = httpx.post(url + route, content=text, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "deeper than" in r.text
    _alive(url)


LOOKUP = {"name": "lookup", "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                           "required": ["code"]}}


def _call_text(value: str) -> str:
    return f"<function=lookup>\n<parameter=code>\n{value}\n</parameter>\n</function>"


@pytest.mark.parametrize("value", ["<b>x</parameter>y</b>", "a</parameter>\nb", "x</parameter>", ""])
def test_a_value_holding_the_closing_tag_reads_whole(value) -> None:
    call = CallReader({"lookup": LOOKUP}, "xml").read(_call_text(value))
    assert call is not None and json.loads(call.arguments) == {"code": value}


def _grammar_takes(engine, grammar, value: str) -> bool:
    """Whether the forced-call grammar lets the model write a call to lookup whose code is ``value``
    (spelled with plain tokens; the block's own tags are the special tokens)."""
    tok = engine.tokenizer
    ids = ([tok.token_id("<tool_call>")] + tok.encode_plain("\n" + _call_text(value) + "\n")
           + [tok.token_id("</tool_call>")])
    matcher = grammar.matcher()
    for token in ids:
        if not matcher.allowed()[token]:
            return False
        matcher.accept(token)
    return matcher.accepting


@pytest.fixture(scope="module")
def forced_lookup(served):
    tools = ({"type": "function", "function": LOOKUP},)
    return served[0], served[0].grammar(lark=call_grammar(tools, "xml", "required", None, False, None))


@pytest.mark.parametrize("value", ["Paris", "two\nlines", "a < b", "x</parameter>y", "ends with </parameter", ""])
def test_a_forced_free_text_value_can_be_closed(forced_lookup, value) -> None:
    """A free-text lexeme that read ``\n</parameter`` could not end there (the lexer does not look back),
    so the grammar refused the closing ``>`` and no model could finish a string argument it had no
    maxLength for."""
    assert _grammar_takes(*forced_lookup, value)


def test_a_forced_string_value_cannot_end_the_call_block_early(forced_lookup) -> None:
    """The reader ends a block at the first ``</tool_call>`` text: the grammar must not let a value spell it,
    or an enforced call would come back as content."""
    assert not _grammar_takes(*forced_lookup, "x</tool_call>y")
    assert not _grammar_takes(*forced_lookup, "</parameter> first")  # read as an empty value, then garbage
    reader = CallReader({"lookup": LOOKUP}, "xml")
    stream = ToolCallStream(reader)
    channels = splitter("<|im_start|>assistant\n")
    pieces = stream.push(channels.push("<tool_call>\n" + _call_text("x</tool_call>y") + "\n</tool_call>"))
    assert all(kind != "call" for kind, _ in pieces + stream.push(channels.close()) + stream.close())  # now forbidden



LONE = '"a\\ud800b"'
"""A JSON string holding an unpaired UTF-16 surrogate: valid JSON, not Unicode text."""


@pytest.mark.parametrize("route, template", [
    ("/chat/completions", '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": %s}]}'),
    ("/chat/completions", '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], '
                          '"tools": [{"type": "function", "function": {"name": "a", "description": %s}}]}'),
    ("/completions", '{"model": "tiny", "max_tokens": 1, "prompt": %s}'),
    ("/responses", '{"model": "tiny", "max_output_tokens": 1, "input": %s}'),
    ("/messages", '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": %s}]}'),
    ("/messages/count_tokens", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}'),
])
def test_an_unpaired_surrogate_is_400(url, route, template) -> None:
    r = httpx.post(url + route, content=template % LONE, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.text
    _alive(url)


def test_a_surrogate_pair_is_the_character_it_encodes(url) -> None:
    """``json.dumps`` (ensure_ascii) sends an emoji as an escaped pair: that is text, and is served."""
    body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi \U0001F600"}]})
    assert "\\ud83d" in body
    r = httpx.post(url + "/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"x-guidance": "loose"}}}},
    {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "x-guidance": 5}}}}}], "tool_choice": "required"},
])
def test_an_x_guidance_that_is_not_an_object_is_400(url, body) -> None:
    r = httpx.post(url + "/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1} | body,
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsupported_schema" and "x-guidance" in r.json()["error"]["message"]
    _alive(url)


def test_an_orphan_tool_result_is_named_in_the_messages_terms(url) -> None:
    body = {"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "a", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                     {"type": "tool_result", "tool_use_id": "t9", "content": "?"}]}],
        "tools": [{"name": "a", "input_schema": {"type": "object"}}]}
    r = httpx.post(url + "/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages[2].content[1].tool_use_id 't9'" in r.json()["error"]["message"]
    _alive(url)


def test_an_orphan_function_call_output_is_named_in_the_responses_terms(url) -> None:
    first = httpx.post(url + "/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1}, timeout=60)
    items = [{"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": "function_call_output", "call_id": "c9", "output": "?"}]
    for extra in ({}, {"previous_response_id": first.json()["id"]}):
        r = httpx.post(url + "/responses", json={"model": "tiny", "input": items, "max_output_tokens": 1} | extra,
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[2].call_id", r.text
    r = httpx.post(url + "/responses", json={"model": "tiny", "input": "more", "max_output_tokens": 1,
                                             "previous_response_id": first.json()["id"]}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("schema", [{"type": "string", "enum": []}, {"enum": []}, {"type": "string", "const": None},
                                    {"type": "string", "enum": [1, 2]}])
def test_a_forced_string_parameter_whose_enum_allows_nothing_is_400(url, schema) -> None:
    """Such a value could never be written: the call was left as free text, so nothing was enforced."""
    tool = {"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": schema}, "required": ["x"]}}}
    r = httpx.post(url + "/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 1,
                                                    "tools": [tool], "tool_choice": "required"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "unsupported_schema" and "holds no string" in r.json()["error"]["message"]
    _alive(url)


def test_a_forced_string_enum_keeps_its_strings(served) -> None:
    """``{"type": "string", "enum": ["a", 1]}``: only "a" is a string the call can hold (the enum was dropped)."""
    engine = served[0]
    fn = {"name": "lookup", "parameters": {"type": "object", "properties": {"code": {"type": "string",
                                                                                     "enum": ["a", 1]}}}}
    grammar = engine.grammar(lark=call_grammar(({"type": "function", "function": fn},), "xml", "required", None,
                                               False, None))
    assert _grammar_takes(engine, grammar, "a") and not _grammar_takes(engine, grammar, "b")


def test_a_grammar_the_library_panics_on_is_named_without_its_backtrace(served) -> None:
    """llguidance answers a grammar of over 65,525 symbols with a panic whose message carries the native
    backtrace (frames, build paths): the client gets the assertion only."""
    rules = 66000
    lark = ("start: " + " | ".join(f"r{i}" for i in range(rules)) + "\n"
            + "\n".join(f'r{i}: "a"' for i in range(rules)))
    with pytest.raises(GrammarError) as err:
        served[0].grammar(lark=lark)
    message = str(err.value)
    assert "assertion failed" in message and "backtrace" not in message and len(message) <= MAX_MESSAGE + 100


@pytest.mark.parametrize("route, body", [
    ("/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/messages", {"messages": HI, "max_tokens": 1}),
])
@pytest.mark.parametrize("stream", ["false", 1])
def test_a_stream_flag_that_is_not_a_boolean_is_400(url, route, body, stream) -> None:
    """``"stream": "false"`` was read as true: a client got server-sent events it had not asked for."""
    r = httpx.post(url + route, json={"model": "tiny", "stream": stream} | body, timeout=60)
    assert r.status_code == 400 and "stream must be true or false" in r.text, r.text


def test_a_file_url_that_is_not_an_image_leaks_none_of_its_bytes(served_vision, tmp_path) -> None:
    """The error named the file and quoted its first 12 bytes: any local client could read the start of any
    file the server's user can read (``/etc/shadow`` aside, a key file, a token)."""
    secret = tmp_path / "token.txt"
    secret.write_text("s3cr3t-token-value")
    r = httpx.post(served_vision[0].url + "/chat/completions", json={"model": "tiny-vl", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": secret.as_uri()}}]}]}, timeout=60)
    assert r.status_code == 400 and "not an image" in r.text, r.text
    assert "s3cr3t" not in r.text


def test_text_between_parameters_is_not_swallowed_into_a_value() -> None:
    """A call with stray text between its parameters does not parse (content, as before): the first value
    must not run on over the next parameter to a later ``</parameter>``."""
    inside = ("<function=lookup>\n<parameter=code>\nfoo.py\n</parameter>\nSome words\n"
              "<parameter=code>\nbar\n</parameter>\n</function>")
    assert CallReader({"lookup": LOOKUP}, "xml").read(inside) is None
