"""``engine serve`` as an agent's backend, driven by the official ``openai`` client on loopback: ``n``
choices, tool calls, structured output and logprobs."""

from __future__ import annotations

import openai
import pytest

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(served):
    return served[2]


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
