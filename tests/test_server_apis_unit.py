"""The Responses and Messages translations on their own (no server): request bodies -> chat bodies,
chat objects and chunk streams -> Responses / Anthropic objects and events, each event validated
(``pydantic``) as the official SDK's class for its type, a member of
``openai.types.responses.ResponseStreamEvent`` or ``anthropic.types.RawMessageStreamEvent``."""

from __future__ import annotations

import json
from typing import Annotated, Any, get_args, get_origin

import anthropic.types
import openai.types.responses
import pytest

from engine.openai import messages_api, responses_api, responses_stream
from engine.openai.requests import APIError



def _by_type(union: Any) -> dict[str, type]:
    """The event classes of an SDK's event union, by their ``type`` literal."""
    while get_origin(union) is Annotated:
        union = get_args(union)[0]
    return {get_args(cls.model_fields["type"].annotation)[0]: cls for cls in get_args(union)}


class _Validator:
    """Validates an event dict against the SDK class its ``type`` names (all fields, nested objects)."""

    def __init__(self, union: Any) -> None:
        self.classes = _by_type(union)

    def validate_python(self, event: dict) -> None:
        if event == {"type": "ping"}:
            return          # Anthropic's keep-alive: the SDK skips it by its event name
        assert event["type"] in self.classes, event["type"]
        self.classes[event["type"]].model_validate(event)


RESPONSE_EVENT = _Validator(openai.types.responses.ResponseStreamEvent)
MESSAGE_EVENT = _Validator(anthropic.types.RawMessageStreamEvent)
PNG = "iVBORw0KGgo="


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_responses_input_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"},
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look up."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18 C at noon."}]},
    ]
    assert responses_api.input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
        {"role": "assistant", "content": "", "reasoning_content": "Look up.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather",
                                                                      "arguments": '{"city": "Paris"}'}},
                        {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": [{"type": "text", "text": "18 C at noon."}]},
    ]
    assert responses_api.input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    orphan = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
              {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert responses_api.input_messages(orphan) == [{"role": "user", "content": "Hi"},
                                                    {"role": "assistant", "content": "Hello."}]


@pytest.mark.parametrize("items, param", [
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "wizard", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}], "input[0].arguments"),
    ([], "input"),
])
def test_bad_input_items_name_the_field(items, param) -> None:
    with pytest.raises(APIError) as err:
        responses_api.input_messages(items)
    assert err.value.status == 400 and err.value.param == param


def test_responses_fields_map_onto_the_chat_body() -> None:
    body = {"model": "m", "input": "Hi", "instructions": "Be terse.", "max_output_tokens": 9, "temperature": 0.5,
            "top_p": 0.9, "tools": [{"type": "function", "name": "f", "description": "d",
                                     "parameters": {"type": "object"}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
            "stream": True}
    assert responses_api.chat_body(body, responses_api.ResponseStore()) == {
        "model": "m", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                                    "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "reasoning_effort": "low",
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"},
                                                                   "strict": True}},
        "stream": True, "stream_options": {"include_usage": True}}
    with pytest.raises(APIError, match="only function tools"):
        responses_api.chat_body({"model": "m", "input": "x", "tools": [{"type": "web_search"}]},
                                responses_api.ResponseStore())
    for bad, param in (({"max_output_tokens": 0}, "max_output_tokens"), ({"text": "json"}, "text"),
                       ({"reasoning": "high"}, "reasoning"), ({"text": {"format": {"type": "yaml"}}}, "text.format"),
                       ({"instructions": ["x"]}, "instructions"), ({"tool_choice": 3}, "tool_choice"),
                       ({"include": "reasoning.encrypted_content"}, "include")):
        with pytest.raises(APIError) as err:
            responses_api.chat_body({"model": "m", "input": "x", **bad}, responses_api.ResponseStore())
        assert err.value.param == param
    for refused in ({"background": True}, {"top_logprobs": 3}, {"conversation": "conv_1"},
                    {"include": ["message.output_text.logprobs"]}):
        with pytest.raises(APIError, match=next(iter(refused))):
            responses_api.chat_body({"model": "m", "input": "x", **refused}, responses_api.ResponseStore())
    assert responses_api.chat_body({"model": "m", "input": "x", "background": False, "top_logprobs": 0,
                                    "include": ["reasoning.encrypted_content"]},
                                   responses_api.ResponseStore())["messages"] == [{"role": "user", "content": "x"}]


def test_the_store_drops_the_least_recently_used() -> None:
    store = responses_api.ResponseStore(max_responses=2)
    for name in "ab":
        store.put(name, [{"role": "user", "content": name}])
    assert store.conversation("a") == [{"role": "user", "content": "a"}]     # a is now the most recent
    store.put("c", [{"role": "user", "content": "c"}])
    with pytest.raises(APIError) as err:
        store.conversation("b")
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    assert store.conversation("a") and store.conversation("c")
    held = store.conversation("a")
    held.append({"role": "user", "content": "changed"})                    # a copy: the store is unchanged
    assert len(store.conversation("a")) == 1
    one = len(json.dumps([{"role": "user", "content": "x" * 100}]))
    small = responses_api.ResponseStore(max_bytes=2 * one)
    for name in "xyz":
        small.put(name, [{"role": "user", "content": "x" * 100}])
    with pytest.raises(APIError):
        small.conversation("x")
    assert small.conversation("z")


def _completion(message: dict, finish: str, usage: dict) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}], "usage": usage}


USAGE = {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
         "prompt_tokens_details": {"cached_tokens": 20}}
ANSWER = {"role": "assistant", "content": "Checking.", "reasoning_content": "Need both.",
          "tool_calls": [_call("c1", "weather", {"city": "Paris"}), _call("c2", "time", {"zone": "CET"})]}


def _chunks(message: dict, finish: str) -> list[dict]:
    """The chat.completion.chunk stream of ``message``, each text cut in two-character pieces and each call's
    arguments in three-character pieces, as agent-chat's route streams them."""
    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                "usage": None}

    out = [chunk({"role": "assistant", "content": ""})]
    for key in ("reasoning_content", "content"):
        text = message.get(key) or ""
        out += [chunk({key: text[i:i + 2]}) for i in range(0, len(text), 2)]
    for index, call in enumerate(message.get("tool_calls") or ()):
        out.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        args = call["function"]["arguments"]
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": args[i:i + 3]}}]})
                for i in range(0, len(args), 3)]
    out.append(chunk({}, finish))
    return out + [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [], "usage": USAGE}]


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("finish, status", [("tool_calls", "completed"), ("length", "incomplete")])
def test_streamed_response_events_rebuild_the_whole_response(finish, status) -> None:
    shell = responses_api.Shell({"model": "m", "input": "x"}, {"model": "m"})
    whole = responses_api.response_object(shell, _completion(ANSWER, finish, USAGE))
    events = responses_stream.ResponseEvents(shell)
    stream = events.start()
    for chunk in _chunks(ANSWER, finish):
        stream += events.feed(chunk)
    closing, final = events.end()
    stream += closing
    for event in stream:
        RESPONSE_EVENT.validate_python(event)
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    assert [e["type"] for e in stream[:2]] == ["response.created", "response.in_progress"]
    assert stream[-1]["type"] == f"response.{status}" and final["status"] == status == whole["status"]
    assert _without_ids(final["output"]) == _without_ids(whole["output"])
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["usage"] == whole["usage"] == {
        "input_tokens": 30, "input_tokens_details": {"cached_tokens": 20, "cache_write_tokens": 0}, "output_tokens": 12,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 42}
    for kind, key in (("response.output_text.delta", "content"), ("response.reasoning_text.delta",
                                                                  "reasoning_content")):
        assert "".join(e["delta"] for e in stream if e["type"] == kind) == ANSWER[key]
    for index, call in enumerate(ANSWER["tool_calls"]):
        item_id = final["output"][2 + index]["id"]
        pieces = [e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta"
                  and e["item_id"] == item_id]
        assert "".join(pieces) == call["function"]["arguments"]
    added = [e["output_index"] for e in stream if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in stream if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]


def test_a_failed_stream_ends_with_response_failed() -> None:
    events = responses_stream.ResponseEvents(responses_api.Shell({"model": "m"}, {"model": "m"}))
    stream = events.start() + events.feed(_chunks({"content": "abc"}, "stop")[1])
    stream += events.fail(APIError(500, "engine broke", type="server_error"))
    for event in stream:
        RESPONSE_EVENT.validate_python(event)
    assert stream[-1]["type"] == "response.failed"
    assert stream[-1]["response"]["error"] == {"code": "server_error", "message": "engine broke"}


def test_the_stored_conversation_is_the_input_and_the_answer() -> None:
    store = responses_api.ResponseStore()
    chat = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]}
    shell = responses_api.Shell({"model": "m", "instructions": "Be terse."}, {"model": "m"})
    response = responses_api.response_object(shell, _completion(ANSWER, "tool_calls", USAGE))
    store.keep(chat, response)
    assert store.conversation(response["id"]) == [{"role": "user", "content": "Hi"}, ANSWER]
    unstored = responses_api.Shell({"model": "m", "store": False}, {"model": "m"})
    store.keep(chat, responses_api.response_object(unstored, _completion(ANSWER, "stop", USAGE)))
    with pytest.raises(APIError):
        store.conversation(unstored.id)


def test_anthropic_blocks_become_chat_messages() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    body = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be terse."},
                                                      {"type": "text", "text": "Use tools."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}, image]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Ask the tool.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "weather", "input": {"city": "Rome"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18 C"}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "down", "is_error": True},
                    {"type": "text", "text": "Thanks."}]}],
            "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "stop_sequences": ["END"], "top_k": 5,
            "stream": True}
    assert messages_api.chat_body(body) == {
        "model": "m", "max_tokens": 5, "messages": [
            {"role": "system", "content": "Be terse.\nUse tools."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Ask the tool.",
             "tool_calls": [_call("t1", "weather", {"city": "Paris"}), _call("t2", "weather", {"city": "Rome"})]},
            {"role": "tool", "tool_call_id": "t1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "t2", "content": "Error: down"},
            {"role": "user", "content": "Thanks."}],
        "top_k": 5, "stop": ["END"],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                    "description": "d"}}],
        "tool_choice": "required", "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": True},
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("change, param, fragment", [
    ({"max_tokens": None}, "max_tokens", "Field required"),
    ({"max_tokens": 0}, "max_tokens", "positive"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                           "url": "http://x/a.png"}}]}]},
     "messages[0].content[0].source", "base64"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0]", "document"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]", "server tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice", "auto, any, tool or none"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "positive integer"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers", "not supported"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]},
     "messages[1]", "prefilled"),
])
def test_bad_messages_fields_name_the_field(change, param, fragment) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(APIError) as err:
        messages_api.chat_body(body)
    assert err.value.status == 400 and err.value.param == param and fragment in err.value.message
    assert messages_api.error_body(err.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                             "message": err.value.message}}


def test_a_chat_completion_becomes_a_message() -> None:
    message = messages_api.message_object(_completion(ANSWER, "tool_calls", USAGE))
    anthropic.types.Message.model_validate(message)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert message["content"][2]["input"] == {"city": "Paris"} and message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 10, "output_tokens": 12, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 20}
    stopped = _completion({"role": "assistant", "content": "a"}, "stop", USAGE)
    assert messages_api.message_object(stopped, ("END",))["stop_reason"] == "end_turn"
    stopped["choices"][0]["stop_reason"] = "END"
    got = messages_api.message_object(stopped, ("END",))
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", "END")
    assert messages_api.message_object(_completion({"content": "a"}, "length", USAGE))["stop_reason"] == "max_tokens"


def test_streamed_message_events_rebuild_the_whole_message() -> None:
    events = messages_api.MessageEvents("m")
    stream = events.start()
    for chunk in _chunks(ANSWER, "tool_calls"):
        stream += events.feed(chunk)
    stream += events.end()
    for event in stream:
        MESSAGE_EVENT.validate_python(event)
    assert [e["type"] for e in stream[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in stream[-2:]] == ["message_delta", "message_stop"]
    whole = messages_api.message_object(_completion(ANSWER, "tool_calls", USAGE))
    starts = [e for e in stream if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == list(range(len(whole["content"])))
    assert [e["index"] for e in stream if e["type"] == "content_block_stop"] == list(range(len(whole["content"])))
    for block, start in zip(whole["content"], starts):
        deltas = [e["delta"] for e in stream if e["type"] == "content_block_delta" and e["index"] == start["index"]]
        if block["type"] == "thinking":
            assert "".join(d.get("thinking", "") for d in deltas) == block["thinking"]
            assert deltas[-1] == {"type": "signature_delta", "signature": block["signature"]}
        elif block["type"] == "text":
            assert "".join(d["text"] for d in deltas) == block["text"]
        else:
            assert (start["content_block"]["id"], start["content_block"]["name"]) == (block["id"], block["name"])
            assert json.loads("".join(d["partial_json"] for d in deltas)) == block["input"]
    assert stream[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert stream[-2]["usage"] == whole["usage"]


def test_an_empty_answer_is_one_empty_message_streamed_or_not() -> None:
    shell = responses_api.Shell({"model": "m"}, {"model": "m"})
    whole = responses_api.response_object(shell, _completion({"role": "assistant", "content": ""}, "stop", USAGE))
    events = responses_stream.ResponseEvents(shell)
    stream = events.start()
    for chunk in _chunks({"content": ""}, "stop"):
        stream += events.feed(chunk)
    closing, final = events.end()
    for event in stream + closing:
        RESPONSE_EVENT.validate_python(event)
    assert _without_ids(final["output"]) == _without_ids(whole["output"]) == [
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}]
