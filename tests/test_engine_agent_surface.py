"""The engine surface an agent backend needs, on the tiny synth model: logprobs against the model's own
logits, logit bias, tools rendered by the chat template (and read once by the prefix cache), token bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.api import Engine, EngineOptions
from engine.errors import TokenizerError
from engine.events import PrefillStats, TokenEvent, TurnSummary
from engine.sampling import SamplingParams
from engine.turn.state import SequenceState

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file. Never <|im_end|> here.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a folder.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "depth": {"type": "integer"}}, "required": ["path"]}}},
]
MESSAGES = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Look around."}]


@pytest.fixture(scope="module")
def engine(synth_model):
    engine = Engine.load(synth_model("tiny", "q8_0"), options=EngineOptions(context=1024))
    yield engine
    engine.close()


def model_logits(engine: Engine, prompt: list[int], answer: list[int]) -> list[np.ndarray]:
    """Logits before each answer token, from the text model's own forward (prompt in one piece, then one
    token at a time at the next plain position), on a state of the engine's KV type."""
    state = SequenceState.new(engine.text.hparams, engine.context, engine.options.kv_type)
    out = [engine.model.forward(np.asarray(prompt, dtype=np.int64), state)[-1]]
    for i, token in enumerate(answer[:-1]):
        pos = np.full((3, 1), len(prompt) + i, dtype=np.int64)
        out.append(engine.model.forward(np.asarray([token], dtype=np.int64), state, positions=pos)[-1])
    return out


def tokens_of(events) -> tuple[list[TokenEvent], TurnSummary]:
    events = list(events)
    return [e for e in events if isinstance(e, TokenEvent)], events[-1]


@pytest.mark.parametrize(("temperature", "top", "constrained"), [(0.0, 5, False), (1.0, 0, False),
                                                                  (0.7, 20, False), (1.0, 3, True)])
def test_logprobs_equal_log_softmax_of_model_logits(engine, temperature: float, top: int, constrained: bool) -> None:
    """Each token's logprob and alternatives are log_softmax of the raw logits, whatever the temperature, bias
    and grammar (logprobs are taken before them); reference in extended precision, tolerance far below float32
    ulp."""
    engine.clear_snapshots()
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, seed=3, max_tokens=6, top_logprobs=top,
                            logit_bias=((100, 3.0),))
    grammar = engine.grammar(json_object=True) if constrained else None
    tokens, _ = tokens_of(engine.chat(MESSAGES, params, grammar=grammar))
    prompt = engine.render(MESSAGES)
    answer = [t.token_id for t in tokens]
    for event, logits in zip(tokens, model_logits(engine, prompt, answer)):
        x = logits.astype(np.longdouble)
        ref = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        assert event.logprob == pytest.approx(float(ref[event.token_id]), abs=1e-9)
        order = sorted(range(x.size), key=lambda i: (-float(x[i]), i))[:top]
        assert [i for i, _ in event.top_logprobs] == order
        assert [v for _, v in event.top_logprobs] == pytest.approx([float(ref[i]) for i in order], abs=1e-9)
        if temperature == 0.0:
            biased = logits.astype(np.float64)
            biased[100] += 3.0
            assert event.token_id == int(np.argmax(biased))


def test_no_logprobs_unless_asked(engine) -> None:
    tokens, _ = tokens_of(engine.chat(MESSAGES, SamplingParams.greedy(3)))
    assert all(t.logprob is None and t.top_logprobs == () for t in tokens)


def test_logit_bias_forces_a_token(engine) -> None:
    """+100 on one id makes greedy decoding pick it every time (the model's logits span far less than 100)."""
    target = engine.tokenizer.token_id(" the")
    tokens, _ = tokens_of(engine.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=4,
                                                                logit_bias=((target, 100.0),))))
    assert [t.token_id for t in tokens] == [target] * 4


def test_tools_are_rendered_by_the_template(engine) -> None:
    """Qwen's template writes a "# Tools" section with each tool as JSON in the system message; text in a
    tool that spells a control token stays text."""
    plain = engine.tokenizer.decode(engine.render(MESSAGES))
    ids = engine.render(MESSAGES, tools=TOOLS)
    text = engine.tokenizer.decode(ids)
    assert "# Tools" not in plain and text.startswith("<|im_start|>system\n# Tools\n")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in text
    assert text.split("<|im_start|>user")[0].endswith("You are a coding agent.<|im_end|>\n")
    im_end = engine.tokenizer.token_id("<|im_end|>")
    assert ids.count(im_end) == len(MESSAGES)
    assert engine.prepare(MESSAGES, tools=TOOLS).tokens == ids


def test_agent_prompt_with_tools_is_read_once(engine) -> None:
    """After prefill_ahead(tools=...), the next request (a tool result) resumes everything before the model's
    own last message: the system prompt with its tools and the earlier messages are not read again."""
    engine.clear_snapshots()
    tokens_of(engine.chat(MESSAGES, SamplingParams.greedy(4), tools=TOOLS))
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "list_dir", "arguments": {"path": "."}}}]}
    so_far = [*MESSAGES, call]
    assert engine.prefill_ahead(so_far, tools=TOOLS) is not None
    follow = [*so_far, {"role": "tool", "content": "README.md\nengine/"}]
    events = list(engine.chat(follow, SamplingParams.greedy(2), tools=TOOLS))
    stats = next(e for e in events if isinstance(e, PrefillStats))
    prompt = engine.render(follow, tools=TOOLS)
    im_start = engine.tokenizer.token_id("<|im_start|>")
    call_start = [i for i, t in enumerate(prompt) if t == im_start][-3]
    assert stats.prompt_tokens == len(prompt) and stats.reused_tokens >= call_start > 100


def test_token_bytes(engine) -> None:
    assert engine.token_bytes(engine.tokenizer.token_id(" the")) == b" the"
    assert engine.token_bytes(engine.tokenizer.token_id("<tool_call>")) == b"<tool_call>"
    with pytest.raises(TokenizerError, match="outside"):
        engine.token_bytes(engine.tokenizer.n_vocab)
