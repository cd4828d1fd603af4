"""engine.prompt.templates/qwen35.jinja rendered by engine.prompt.template.ChatTemplate, and the sandbox.

Expected prompts are written out by hand from the Qwen3.5/3.6 chat template's rendered text
(docs/spec/qwen35.md section 5):
  * every turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the system prompt comes first;
  * the generation prompt is ``<|im_start|>assistant\\n<think>\\n`` (thinking on, the default) or
    ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` (``enable_thinking=False``);
  * past assistant turns are ``<|im_start|>assistant\\n{content}<|im_end|>\\n`` (reasoning dropped) unless
    they come after the last real user query, then ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``;
  * each image part is ``<|vision_start|><|image_pad|><|vision_end|>``, in place among the text parts;
  * tools: a system block ``# Tools ... <tools>\\n{json per tool}\\n</tools> ...`` (the "..." is the
    template's fixed instruction text, copied below as TOOLS_INSTRUCTIONS), calls as
    ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``,
    results in a user turn as ``<tool_response>\\n...\\n</tool_response>``.
"""

from __future__ import annotations

import datetime
import hashlib
import json

import pytest

from engine.errors import TemplateError
from engine.prompt.template import ChatTemplate
from engine.arch.qwen35.vocab import QWEN35_CHAT_TEMPLATE

TOOLS_INSTRUCTIONS = (
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city, °C",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen():
    return ChatTemplate(QWEN35_CHAT_TEMPLATE, origin="qwen35.jinja")


def test_template_is_qwen36_which_is_qwen35_plus_two_changes():
    """Provenance: reverting Qwen3.6's two edits gives byte-for-byte the Qwen3.5 template
    (sha256 of mlx-community/Qwen3.5-35B-A3B-4bit chat_template.jinja)."""
    qwen36_keep = ("{%- if (preserve_thinking is defined and preserve_thinking is true) or "
                   "(loop.index0 > ns.last_query_index) %}")
    qwen36_args = ("{%- set args_value = args_value | string if args_value is string else "
                   "args_value | tojson | safe %}")
    qwen35 = QWEN35_CHAT_TEMPLATE.replace(qwen36_keep, "{%- if loop.index0 > ns.last_query_index %}").replace(
        qwen36_args, "{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is "
                     "sequence and args_value is not string) else args_value | string %}")
    assert qwen35 != QWEN35_CHAT_TEMPLATE
    assert hashlib.sha256(qwen35.encode()).hexdigest() == (
        "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715")


def test_system_and_user_thinking_on(qwen):
    text = qwen.render([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi!"}])
    assert text == ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")


def test_thinking_off_closes_an_empty_think_block(qwen):
    text = qwen.render([{"role": "user", "content": "Hi!"}], enable_thinking=False)
    assert text == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_no_generation_prompt(qwen):
    assert qwen.render([{"role": "user", "content": "Hi!"}], add_generation_prompt=False) == (
        "<|im_start|>user\nHi!<|im_end|>\n")


def test_multi_turn_drops_earlier_reasoning(qwen):
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                {"role": "user", "content": "And 3+3?"}]
    assert qwen.render(messages) == ("<|im_start|>system\nS<|im_end|>\n"
                                     "<|im_start|>user\n2+2?<|im_end|>\n"
                                     "<|im_start|>assistant\n4<|im_end|>\n"
                                     "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                                     "<|im_start|>assistant\n<think>\n")


def test_reasoning_kept_after_the_last_user_query(qwen):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "\nAdd them.\n"}]
    assert qwen.render(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n")
    # reasoning written inline in the content is split out the same way
    inline = [{"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}]
    assert qwen.render(inline, add_generation_prompt=False) == qwen.render(messages, add_generation_prompt=False)


def test_next_turn_shares_the_prompt_up_to_the_assistant_header(qwen):
    """Pitfall 9: turn N+1 re-renders turn N's answer without its reasoning, so the common prefix
    of the two prompts ends right after ``<|im_start|>assistant\\n``."""
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    prompt1 = qwen.render(first)
    prompt2 = qwen.render(first + [{"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                                   {"role": "user", "content": "Bye"}])
    common = next(i for i, (a, b) in enumerate(zip(prompt1, prompt2)) if a != b)
    assert prompt1[:common].endswith("<|im_start|>assistant\n") and prompt1[common:] == "<think>\n"


def test_image_parts_become_vision_placeholders(qwen):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "},
                                             {"type": "image"}, {"type": "text", "text": " and "},
                                             {"type": "image"}, {"type": "text", "text": "."}]}]
    assert qwen.render(messages, enable_thinking=False) == (
        "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|image_pad|><|vision_end|>.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_image_only_message(qwen):
    text = qwen.render([{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=False)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"


def test_tools_call_and_response(qwen):
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Paris", "days": 3}}}]},
                {"role": "tool", "content": '{"temp": 21}'}]
    tool_json = json.dumps(WEATHER, ensure_ascii=False)        # HF tojson: ", " / ": ", non-ASCII kept
    assert "°C" in tool_json
    assert qwen.render(messages, tools=[WEATHER]) == (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
        f"<tools>\n{tool_json}\n</tools>\n\n{TOOLS_INSTRUCTIONS}\n\nS<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        # after the last user query: think block (empty reasoning), then the call
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_tools_without_system_prompt_and_call_after_text(qwen):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me check.",
                 "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]
    text = qwen.render(messages, tools=[WEATHER], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\n") and text.count("<|im_start|>system") == 1
    assert f"{TOOLS_INSTRUCTIONS}<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.\n\n<tool_call>\n"
                         "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                         "</tool_call><|im_end|>\n")


@pytest.mark.parametrize(("messages", "message"), [
    ([], "No messages provided"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "System message must be at the beginning"),
    ([{"role": "wizard", "content": "a"}], "No user query found"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], "Unexpected message role"),
    ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "a"}],
     "System message cannot contain images"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "Unexpected item type in content"),
])
def test_template_refusals_are_template_errors(qwen, messages, message):
    with pytest.raises(TemplateError, match=f"^qwen35.jinja: the template refused the conversation: {message}"):
        qwen.render(messages)


# ------------------------------------------------------------------------------- HF conventions


def test_hf_environment_conventions():
    template = ChatTemplate("  {% if true %}\n{{ {'k': '<é>'}|tojson }}\n  {% endif %}\n"
                            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                            "{% endfor %}|{{ strftime_now('%Y') }}")
    year = datetime.datetime.now().strftime("%Y")
    # trim_blocks + lstrip_blocks strip the block lines; tojson keeps "<" and non-ASCII; loopcontrols
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) in (
        f'{{"k": "<é>"}}\na|{year}', f'{{"k": "<é>"}}\na|{int(year) + 1}')


def test_syntax_error_names_origin():
    with pytest.raises(TemplateError, match=r"^model.gguf: tokenizer.chat_template: syntax error at line 2"):
        ChatTemplate("ok\n{% if %}", origin="model.gguf: tokenizer.chat_template")


# ------------------------------------------------------------------------------- sandbox

ESCAPES = {
    "class": "{{ ''.__class__ }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "item_syntax": "{{ ''['__class__'] }}",
    "attr_filter": "{{ messages|attr('__class__') }}",
    "format_string": "{{ '{0.__class__}'.format(messages) }}",
    "globals_of_global": "{{ raise_exception.__globals__ }}",
    "cycler_init": "{{ cycler.__init__.__globals__.os }}",
    "lipsum": "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "code_object": "{{ strftime_now.__code__ }}",
    "self_reference": "{{ self.__init__ }}",
    "mutate_input": "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "dict_mutation": "{{ messages[0].update({'role': 'system'}) }}",
    "class_in_condition": "{% if messages.__class__ is defined %}x{% endif %}",
}


@pytest.mark.parametrize("source", ESCAPES.values(), ids=ESCAPES.keys())
def test_sandbox_escapes_raise_template_error(source):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="^t: blocked by the sandbox"):
        ChatTemplate(source, origin="t").render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


RUNAWAY = {
    "nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested_lists": "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
    "exponential_macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
}


@pytest.mark.parametrize("source", RUNAWAY.values(), ids=RUNAWAY.keys())
def test_endless_templates_stop(source):
    with pytest.raises(TemplateError, match="^t: the template runs too long"):
        ChatTemplate(source, origin="t", max_steps=50_000).render([{"role": "user", "content": "hi"}])


def test_endless_template_stops_with_default_budget():
    with pytest.raises(TemplateError, match="runs too long"):
        ChatTemplate(RUNAWAY["nested_lists"]).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("source", "message"), [
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "^t: output exceeds 4194304 characters"),
    ("{{ 'x' * 10**10 }}", "^t: blocked by the sandbox: '\\*' would build"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "^t: blocked by the sandbox: a value of 8388608 items"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "^t: blocked by the sandbox: a value of 8388608 items"),
    ("{{ 7 ** (2 ** 40) }}", "^t: blocked by the sandbox: '\\*\\*' on integers"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "^t: recursion too deep"),
])
def test_huge_output_and_values_are_refused(source, message):
    with pytest.raises(TemplateError, match=message):
        ChatTemplate(source, origin="t").render([{"role": "user", "content": "hi"}])


def test_render_errors_become_template_errors():
    with pytest.raises(TemplateError, match="^t: render failed: UndefinedError"):
        ChatTemplate("{{ nothing() }}", origin="t").render([{"role": "user", "content": "hi"}])
    with pytest.raises(TemplateError, match="^t: render failed: ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}", origin="t").render([{"role": "user", "content": "hi"}])


def test_long_real_conversation_fits_the_default_budget(qwen):
    turn = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]},
            {"role": "assistant", "content": "ok", "reasoning_content": "r",
             "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]
    text = qwen.render(turn * 2000 + [{"role": "user", "content": "end"}])
    assert text.count("<|image_pad|>") == 2000 and text.endswith("<|im_start|>assistant\n<think>\n")
