"""``engine serve``'s Responses, Messages and metrics routes on loopback, driven by the official ``openai``
and ``anthropic`` clients: each answer equals the chat-completions answer to the same conversation (one
engine turn behind all three), usage counts the prompt as the engine rendered it, streams rebuild the
whole answer, errors come in each API's own shape, and ``/metrics`` counts what was served."""

from __future__ import annotations

import base64
import json

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.openai import ServerConfig, ServerThread

HI = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)


def _chat(oai, messages, n: int = 8, **kw):
    return oai.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0, **kw)


def test_a_response_equals_the_chat_answer(oai, engine) -> None:
    want = _chat(oai, [{"role": "system", "content": "Be terse."}] + HI)
    got = oai.responses.create(model="tiny", instructions="Be terse.", input="Say hello.", max_output_tokens=8,
                               **GREEDY)
    assert got.output_text == want.choices[0].message.content and got.object == "response"
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"   # 8 tokens, no EOS
    assert got.usage.input_tokens == want.usage.prompt_tokens == len(engine.render(
        [{"role": "system", "content": "Be terse."}] + HI))
    assert got.usage.output_tokens == 8 and got.usage.total_tokens == got.usage.input_tokens + 8
    assert [item.type for item in got.output] == ["message"]


def test_a_streamed_response_rebuilds_the_whole(oai) -> None:
    whole = oai.responses.create(model="tiny", input=HI, max_output_tokens=8, **GREEDY)
    with oai.responses.stream(model="tiny", input=HI, max_output_tokens=8, **GREEDY) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output[0].content[0].text
    assert events[-1].response.usage.output_tokens == 8
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_reasoning_comes_back_as_a_reasoning_item(oai) -> None:
    want = _chat(oai, HI, 6, reasoning_effort="high").choices[0].message.reasoning_content
    got = oai.responses.create(model="tiny", input=HI, max_output_tokens=6, reasoning={"effort": "high"}, **GREEDY)
    assert [item.type for item in got.output] == ["reasoning"]     # this babbling model never closes its think block
    assert got.output[0].content[0].text == want
    with oai.responses.stream(model="tiny", input=HI, max_output_tokens=6, reasoning={"effort": "high"},
                              **GREEDY) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want
    assert events[-1].response.output[0].content[0].text == want


def test_previous_response_id_continues_the_conversation(oai, engine) -> None:
    engine.clear_snapshots()
    first = oai.responses.create(model="tiny", instructions="Be terse.", input="Say hello.", max_output_tokens=4,
                                 **GREEDY)
    second = oai.responses.create(model="tiny", input="Again.", previous_response_id=first.id, max_output_tokens=4,
                                  **GREEDY)
    conversation = HI + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Again."}]
    want = _chat(oai, conversation, 4)     # the instructions are not carried over (as in the OpenAI API)
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == len(engine.render(conversation))
    third = oai.responses.create(model="tiny", input="Once more.", previous_response_id=second.id,
                                 max_output_tokens=4, **GREEDY)
    longer = conversation + [{"role": "assistant", "content": second.output_text},
                             {"role": "user", "content": "Once more."}]
    assert third.usage.input_tokens == len(engine.render(longer))
    assert third.usage.input_tokens_details.cached_tokens > 0       # the conversation so far resumed from a snapshot
    with pytest.raises(openai.BadRequestError, match="not found") as err:
        oai.responses.create(model="tiny", input="x", previous_response_id="resp_nothing", max_output_tokens=2)
    assert err.value.body["code"] == "previous_response_not_found"
    unstored = oai.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="tiny", input="x", previous_response_id=unstored.id, max_output_tokens=2)


def test_responses_errors_come_in_the_openai_shape(server) -> None:
    r = httpx.post(server.url + "/responses", json={"model": "tiny", "input": [{"type": "item_reference"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type"
    r = httpx.post(server.url + "/responses", json={"model": "gpt-9", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"



@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "strnig"}}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}}, "text.format.schema"),
])
def test_responses_errors_name_the_responses_field(server, fields, param, stream) -> None:
    """The chat turn's errors name the field the client sent, not its chat-completions translation."""
    r = httpx.post(server.url + "/responses", json={"model": "tiny", "input": "x", "stream": stream} | fields)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and error["message"].startswith(f"{param} is not")


def test_a_message_equals_the_chat_answer(claude, oai, engine) -> None:
    want = _chat(oai, [{"role": "system", "content": "Be terse.\nReally."}] + HI)
    got = claude.messages.create(model="tiny", max_tokens=8, system=[{"type": "text", "text": "Be terse."},
                                                                     {"type": "text", "text": "Really."}],
                                 messages=HI, extra_body=GREEDY)
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == want.choices[0].message.content
    assert got.stop_reason == "max_tokens" and got.usage.output_tokens == 8
    prompt = len(engine.render([{"role": "system", "content": "Be terse.\nReally."}] + HI))
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == prompt
    assert got.usage.cache_read_input_tokens == prompt      # the chat turn above left the whole prompt's snapshot


def test_a_streamed_message_rebuilds_the_whole(claude) -> None:
    whole = claude.messages.create(model="tiny", max_tokens=8, messages=HI, extra_body=GREEDY)
    with claude.messages.stream(model="tiny", max_tokens=8, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_thinking_comes_back_as_thinking_blocks(claude, oai) -> None:
    want = _chat(oai, HI, 6, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    thinking = {"type": "enabled", "budget_tokens": 1024}
    got = claude.messages.create(model="tiny", max_tokens=6, messages=HI, thinking=thinking, extra_body=GREEDY)
    assert [b.type for b in got.content] == ["thinking"]       # this babbling model never closes its think block
    assert got.content[0].thinking == want.choices[0].message.reasoning_content and got.content[0].signature
    with claude.messages.stream(model="tiny", max_tokens=6, messages=HI, thinking=thinking,
                                extra_body=GREEDY) as stream:
        pieces = [e.thinking for e in stream if e.type == "thinking"]
        final = stream.get_final_message()
    assert "".join(pieces) == got.content[0].thinking and final.content[0].signature == got.content[0].signature


def test_stop_sequences_end_the_message_and_are_named(claude, oai, server) -> None:
    text = _chat(oai, HI, 12).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    ask = {"model": "tiny", "max_tokens": 12, "messages": HI, "stop_sequences": [stop, "never in it"],
           "extra_body": GREEDY}
    got = claude.messages.create(**ask)
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
    assert got.content[0].text == text[:text.find(stop)]
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                              got.content[0].text)
    raw = httpx.post(server.url + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": HI, "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert raw["choices"][0]["stop_reason"] == stop                  # vLLM's field, which the translation reads
    assert "stop_reason" not in _chat(oai, HI, 12).choices[0].model_extra   # absent when no stop string ended it


def test_count_tokens_is_the_rendered_prompt(claude, engine) -> None:
    counted = claude.messages.count_tokens(model="tiny", system="Be terse.", messages=HI)
    assert counted.input_tokens == len(engine.render([{"role": "system", "content": "Be terse."}] + HI))
    thinking = claude.messages.count_tokens(model="tiny", messages=HI, thinking={"type": "enabled",
                                                                                 "budget_tokens": 1024})
    assert thinking.input_tokens == len(engine.render(HI, enable_thinking=True)) != len(engine.render(HI))


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize("body, status, kind, fragment", [
    ({"model": "tiny", "messages": HI}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "other", "max_tokens": 4, "messages": HI}, 404, "not_found_error", "'tiny'"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
     400, "invalid_request_error", "base64"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 600}]}, 400,
     "invalid_request_error", "context window holds 512"),
    ({"model": "tiny", "max_tokens": 4, "messages": HI, "tools": [{"name": "f", "input_schema": {"type": "strnig"}}]},
     400, "invalid_request_error", "tools[0].input_schema is not a valid JSON Schema"),
    ({"model": "tiny", "max_tokens": 4, "messages": HI,
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "strnig"}}}},
     400, "invalid_request_error", "output_config.format.schema is not a valid JSON Schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_messages_errors_come_in_anthropic_shape(server, body, status, kind, fragment, stream) -> None:
    r = httpx.post(server.url + "/messages", json=body | {"stream": stream},
                   headers={"anthropic-version": "2023-06-01"})
    assert fragment in _anthropic_error(r, status, kind)


def test_the_anthropic_client_raises_on_errors(claude) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model="tiny", messages=HI, max_tokens=4, extra_body={"max_tokens": None})
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HI)


def test_the_key_may_come_as_x_api_key_or_bearer(engine, served) -> None:
    srv = ServerThread(engine, ServerConfig("tiny", api_key="s3cret"), port=0, session=served[1].session).start()
    base = srv.url.removesuffix("/v1")
    try:
        ok = anthropic.Anthropic(base_url=base, api_key="s3cret", max_retries=0, timeout=60)
        assert ok.messages.create(model="tiny", max_tokens=1, messages=HI).usage.output_tokens == 1
        bearer = anthropic.Anthropic(base_url=base, auth_token="s3cret", max_retries=0, timeout=60)
        assert bearer.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=1, messages=HI)
        r = httpx.post(srv.url + "/messages/count_tokens", json={"model": "tiny", "messages": HI})
        _anthropic_error(r, 401, "authentication_error")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0).responses.create(model="tiny", input="x")
        assert httpx.get(base + "/metrics").status_code == 401
        scraped = httpx.get(base + "/metrics", headers={"Authorization": "Bearer s3cret"})
        assert scraped.status_code == 200
        counts = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(scraped.text)
                  for s in f.samples if s.name == "deltadesk_requests_total"}
        assert counts[(("route", "/v1/messages"), ("status", "200"))] == 1       # this server's registry only
        assert counts[(("route", "/v1/messages"), ("status", "401"))] == 1
    finally:
        srv.stop()


def _png() -> bytes:
    import io

    from PIL import Image, ImageDraw
    im = Image.new("RGB", (64, 48), (240, 240, 240))
    ImageDraw.Draw(im).ellipse((8, 8, 40, 40), fill=(200, 30, 30))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def test_an_image_block_is_read_and_counted(served_vision) -> None:
    srv, eng = served_vision
    png = _png()
    claude = anthropic.Anthropic(base_url=srv.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(png).decode()}},
               {"type": "text", "text": "Colour?"}]
    want = len(eng.prepare([{"role": "user", "content": [{"type": "image", "image": png},
                                                         {"type": "text", "text": "Colour?"}]}]).tokens)
    assert claude.messages.count_tokens(model="tiny-vl", messages=[{"role": "user", "content": content}]) \
        .input_tokens == want
    got = claude.messages.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": content}],
                                 extra_body=GREEDY)
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want
    assert want > len(eng.render([{"role": "user", "content": "Colour?"}])) + 2


def _metrics(base: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_was_served(server, oai) -> None:
    base = server.url.removesuffix("/v1")
    before = _metrics(base)
    answer = _chat(oai, [{"role": "user", "content": "Count the metrics."}], 5)
    httpx.get(server.url + "/nowhere")
    httpx.post(server.url + "/messages", json={"model": "tiny", "messages": HI})          # no max_tokens: 400
    httpx.post(server.url + "/messages/count_tokens", json={"model": "tiny", "messages": HI})
    after = _metrics(base)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("deltadesk_requests_total", route="/v1/chat/completions", status="200") == 1
    assert grew("deltadesk_requests_total", route="other", status="404") == 1
    assert grew("deltadesk_requests_total", route="/v1/messages", status="400") == 1
    assert grew("deltadesk_requests_total", route="/v1/messages/count_tokens", status="200") == 1
    assert grew("deltadesk_requests_total", route="/metrics", status="200") == 1     # the first scrape
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert grew("deltadesk_prompt_tokens_total", source="resumed") == cached
    assert grew("deltadesk_prompt_tokens_total", source="prefilled") == answer.usage.prompt_tokens - cached
    assert grew("deltadesk_generated_tokens_total") == 5
    assert grew("deltadesk_time_to_first_token_seconds_count") == 1
    ttft = grew("deltadesk_time_to_first_token_seconds_sum")
    parts = grew("deltadesk_prefill_seconds_total") + grew("deltadesk_snapshot_restore_seconds_total")
    assert 0 < parts <= ttft                                 # both happen before the first token
    assert grew("deltadesk_decode_tokens_per_second_count") == 1
    assert after[("deltadesk_queue_length", ())] == 0


def test_queue_length_counts_requests_waiting_for_the_engine(server, served) -> None:
    import threading
    import time

    base, hold = server.url.removesuffix("/v1"), served[1]
    waiting = []

    def ask() -> None:
        waiting.append(httpx.post(server.url + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": HI, "max_tokens": 1}).status_code)

    def queue() -> float:
        return _metrics(base)[("deltadesk_queue_length", ())]

    with hold:          # the engine is busy (the app's own turn): both requests wait
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while queue() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert queue() == 2
    for t in threads:
        t.join(60)
    assert waiting == [200, 200] and queue() == 0


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
               "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                                 "parameters": WEATHER, "strict": True}}]
ASK = "Weather in Paris?"


def _called(calls: list[tuple[str, str, dict]]) -> list[dict]:
    """The conversation of a tool loop in the engine's format (arguments as objects, as the template reads
    them): the question, the calls ``(id, name, arguments)``, a result "18 C" for each."""
    return ([{"role": "user", "content": ASK},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                 for i, name, args in calls]}]
            + [{"role": "tool", "tool_call_id": i, "content": "18 C"} for i, _, _ in calls])


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_loop_through_responses(oai, engine, stream) -> None:
    """``tool_choice: required`` makes the grammar force a valid call whatever the random weights say; its
    output goes back as a ``function_call_output`` item after ``previous_response_id``."""
    import jsonschema

    ask = {"model": "tiny", "input": ASK, "tools": FLAT_TOOLS, "tool_choice": "required", "max_output_tokens": 60,
           **GREEDY}
    if stream:
        with oai.responses.stream(**ask) as events:
            kinds = [e.type for e in events]
            first = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    else:
        first = oai.responses.create(**ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) >= 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = oai.responses.create(model="tiny", previous_response_id=first.id, tools=FLAT_TOOLS, max_output_tokens=4,
                                  input=[{"type": "function_call_output", "call_id": c.call_id, "output": "18 C"}
                                         for c in calls], **GREEDY)
    conversation = _called([(c.call_id, c.name, json.loads(c.arguments)) for c in calls])
    assert second.usage.input_tokens == len(engine.render(conversation, tools=CHAT_TOOLS))
    assert second.usage.input_tokens_details.cached_tokens > 0 and second.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_loop_through_messages(claude, engine, stream) -> None:
    import jsonschema

    tools = [{"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER}]
    ask = {"model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": ASK}], "tools": tools,
           "tool_choice": {"type": "tool", "name": "get_weather"} if stream else {"type": "any"},
           "extra_body": GREEDY}
    if stream:
        with claude.messages.stream(**ask) as events:
            kinds = [e.type for e in events]
            first = events.get_final_message()
        assert "input_json" in kinds
    else:
        first = claude.messages.create(**ask)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": [{"type": "text", "text": "18 C"}]}
               for u in uses]
    conversation = ask["messages"] + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                                       for b in first.content]},
                                      {"role": "user", "content": results}]
    second = claude.messages.create(model="tiny", max_tokens=4, messages=conversation, tools=tools,
                                    extra_body=GREEDY)
    rendered = engine.render(_called([(u.id, u.name, u.input) for u in uses]), tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                          "description": "The weather of a city"}}])
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == len(rendered)
    assert second.usage.cache_read_input_tokens > 0 and second.content
    counted = claude.messages.count_tokens(model="tiny", messages=conversation, tools=tools)
    assert counted.input_tokens == len(rendered)


def test_structured_output_through_both_apis(oai, claude) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
              "required": ["answer"], "additionalProperties": False}
    for seed in range(3):
        got = oai.responses.create(model="tiny", input="Answer in JSON.", max_output_tokens=40, temperature=1.0,
                                   extra_body={"seed": seed}, text={"format": {"type": "json_schema", "name": "a",
                                                                               "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(got.output_text), schema)
        message = claude.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "JSON."}],
                                         output_config={"format": {"type": "json_schema", "schema": schema}},
                                         extra_body={"temperature": 1.0, "seed": seed})
        jsonschema.validate(json.loads(message.content[0].text), schema)


def test_an_unknown_tool_choice_is_an_error_in_each_shape(server) -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    r = httpx.post(server.url + "/messages", json={"model": "tiny", "max_tokens": 4, "messages": HI, "tools": tools,
                                                   "tool_choice": {"type": "tool", "name": "nope"}})
    assert "nope" in _anthropic_error(r, 400, "invalid_request_error")
    r = httpx.post(server.url + "/responses", json={"model": "tiny", "input": "x", "tools": FLAT_TOOLS,
                                                    "tool_choice": {"type": "function", "name": "nope"}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_a_messages_client_that_leaves_while_queued_is_not_an_error(server, served) -> None:
    import time

    base, hold = server.url.removesuffix("/v1"), served[1]
    before = _metrics(base)
    with hold:          # the engine is busy: the request waits, and its client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/messages", timeout=0.5, json={"model": "tiny", "max_tokens": 2, "messages": HI})
        deadline = time.monotonic() + 30
        key = ("deltadesk_requests_total", (("route", "/v1/messages"), ("status", "499")))
        while _metrics(base).get(key, 0.0) == before.get(key, 0.0) and time.monotonic() < deadline:
            time.sleep(0.05)
    after = _metrics(base)
    assert after[key] - before.get(key, 0.0) == 1
    failed = ("deltadesk_requests_total", (("route", "/v1/messages"), ("status", "500")))
    assert after.get(failed, 0.0) == before.get(failed, 0.0)


class _Pausing:
    """The served engine whose turns stop after three tokens until their cancel flag is set (the third
    argument of ``chat``) or 60 s pass, recording each turn's summary: a turn running when its client leaves."""

    def __init__(self, engine) -> None:
        self.engine, self.summaries = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def chat(self, *args, **kwargs):
        from engine.events import TokenEvent, TurnSummary

        tokens = 0
        for event in self.engine.chat(*args, **kwargs):
            if isinstance(event, TurnSummary):
                self.summaries.append(event)
            yield event
            tokens += isinstance(event, TokenEvent)
            if tokens == 3:
                args[2].wait(60)


@pytest.mark.parametrize("path, body", [
    ("/messages", {"max_tokens": 400, "messages": HI}),
    ("/responses", {"max_output_tokens": 400, "input": "Say hello."}),
])
def test_a_stream_whose_client_leaves_stops_its_turn(engine, served, path, body) -> None:
    import time

    paused = _Pausing(engine)
    srv = ServerThread(paused, ServerConfig("tiny"), port=0, session=served[1].session).start()
    try:
        with httpx.stream("POST", srv.url + path, timeout=60,
                          json={"model": "tiny", "stream": True, "temperature": 0, **body}) as r:
            for n, _line in enumerate(r.iter_lines()):
                if n >= 6:
                    break
        deadline = time.monotonic() + 60
        while not paused.summaries and time.monotonic() < deadline:
            time.sleep(0.01)
        assert paused.summaries[0].stop_reason == "cancelled" and paused.summaries[0].generated_tokens < 400
    finally:
        srv.stop()


def test_metrics_report_the_prefix_cache(served, oai) -> None:
    engine, hold, server = served
    _chat(oai, [{"role": "user", "content": "Keep a snapshot of this."}], 2)
    with hold:                                               # no turn changes the cache while it is read here
        scraped = _metrics(server.url.removesuffix("/v1"))
        ram, snaps = engine.cache.ram_bytes, engine.snapshots()
    assert ram > 0 and scraped[("deltadesk_prefix_cache_ram_bytes", ())] == ram
    for tier in ("ram", "disk"):
        assert scraped[("deltadesk_prefix_cache_snapshots", (("tier", tier),))] == sum(s.tier == tier for s in snaps)
    assert sum(s.tier == "ram" for s in snaps) >= 1
