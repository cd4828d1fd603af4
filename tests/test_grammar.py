"""Constrained decoding (engine.turn.grammar) on the real 248,320-token Qwen3.5/3.6 vocabulary of the tiny synth model:
answers drawn from fresh random logits always satisfy the grammar, the mask equals slow references, and the
engine's constrained answers are complete, schema-valid and the same with the prefix cache on or off."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import numpy as np
import pytest

from engine.api import Engine, EngineOptions
from engine.events import TokenEvent, TurnSummary
from engine.gguf.file import GGUFFile
from engine.turn.grammar import GrammarError, compile_grammar, grammar_tokenizer, lark_json
from engine.sampling import Sampler, SamplingParams
from engine.prompt.tokenizer import Tokenizer

# Bounded on purpose: random logits over 248k ids almost never pick a closing quote or bracket by chance,
# so strings, arrays and numbers carry limits that make every answer end within MAX_STEPS tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "integer", "minimum": -5, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                           "role": {"anyOf": [{"const": "admin"}, {"type": "null"}]}},
            "required": ["id", "role"],
            "additionalProperties": False,
        },
        "parts": {"type": "array", "maxItems": 2,
                  "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
                            "required": ["n"], "additionalProperties": False}},
    },
    "required": ["name", "kind", "size", "owner"],
    "additionalProperties": False,
}
MAX_STEPS = 400


@pytest.fixture(scope="module")
def tokenizer(synth_model) -> Tokenizer:
    gguf = GGUFFile.open(synth_model("tiny", "q8_0"))
    return Tokenizer.from_gguf(gguf.meta, gguf.source)


@pytest.fixture(scope="module")
def table(tokenizer):
    return grammar_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def engines(synth_model):
    """(with a prefix cache snapshotting every 8 tokens, without one) on the tiny synth model."""
    path = synth_model("tiny", "q8_0")
    warm = Engine.load(path, options=EngineOptions(context=512, snapshot_interval=8))
    cold = Engine.load(path, options=EngineOptions(context=512, prefix_cache=False))
    yield warm, cold
    warm.close()
    cold.close()


def draw(tokenizer, grammar, seed: int, params: SamplingParams | None = None) -> tuple[list[int], bool]:
    """Tokens drawn by the engine's Sampler from fresh N(0, 3) logits under ``grammar``, until an
    end-of-generation id; (answer ids, ended)."""
    rng = np.random.default_rng(seed)
    params = params or SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    sampler = Sampler(params, grammar.matcher())
    out: list[int] = []
    for _ in range(MAX_STEPS):
        token = sampler.sample(rng.normal(0, 3.0, tokenizer.n_vocab).astype(np.float32), out)
        if token in tokenizer.eos_ids:
            return out, True
        out.append(token)
    return out, False


@pytest.mark.parametrize("seed", range(24))
def test_schema_forces_valid_json_from_random_logits(tokenizer, table, seed: int) -> None:
    grammar = compile_grammar(table, json_schema=SCHEMA)
    ids, ended = draw(tokenizer, grammar, seed)
    assert ended, tokenizer.decode(ids)
    jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
    assert not set(ids) & set(tokenizer.added_tokens.values())


def test_json_object_is_an_object(tokenizer, table) -> None:
    """Any object is allowed; a greedy draw with the opening-brace-then-closing-brace biased on ends at once."""
    grammar = compile_grammar(table, json_object=True)
    brace, close = tokenizer.token_id("{"), tokenizer.token_id("}")
    ids, ended = draw(tokenizer, grammar, 0, SamplingParams(temperature=0.0, logit_bias=((brace, 50.0), (close, 40.0))))
    assert ended and tokenizer.decode(ids) == "{}"
    matcher = grammar.matcher()
    assert not matcher.allowed()[tokenizer.token_id("[")]


LARK = r"""
start: VERB " " item ("," item){0,2} "."
VERB: "get" | "put"
item: /[a-z]{1,4}/ | NUMBER
NUMBER: /[0-9]{1,3}/
"""


@pytest.mark.parametrize("seed", range(8))
def test_lark_grammar_from_random_logits(tokenizer, table, seed: int) -> None:
    ids, ended = draw(tokenizer, compile_grammar(table, lark=LARK), seed)
    assert ended
    assert re.fullmatch(r"(get|put) ([a-z]{1,4}|[0-9]{1,3})(,([a-z]{1,4}|[0-9]{1,3})){0,2}\.", tokenizer.decode(ids))


def test_lark_special_tokens_and_inline_json(tokenizer, table) -> None:
    """A tool-call shaped grammar: the <tool_call> token itself (not its spelling), then JSON by %json."""
    args = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
            "additionalProperties": False}
    lark = f"start: <tool_call> \"\\n\" call \"\\n\" </tool_call>\ncall: {lark_json(args)}"
    grammar = compile_grammar(table, lark=lark)
    ids, ended = draw(tokenizer, grammar, 3)
    assert ended
    call_id, end_id = tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")
    assert ids[0] == call_id and ids[-1] == end_id
    assert tokenizer.decode(ids[1:-1]) in ('\n{"city": "Paris"}\n', '\n{"city": "Oslo"}\n')
    spelled = grammar.matcher()
    assert not spelled.allowed()[tokenizer.encode_plain("<tool_call>")[0]]


# A finite language small enough to enumerate: the reference mask is "the text so far plus the token's bytes
# is a prefix of some sentence", end-of-generation "the text so far is a sentence". llguidance, where the
# grammar forces bytes (after "ma" only "ybe" can follow), allows only the tokens of their canonical
# tokenization; with "no_forcing" its mask is the plain prefix rule.
SMALL = 'start: ("yes" | "no" | "maybe") " " /[0-9]{1,2}/'
SENTENCES = {f"{w} {n}" for w in ("yes", "no", "maybe") for n in
             [str(d) for d in range(10)] + [f"{a}{b}" for a, b in itertools.product(range(10), repeat=2)]}


def reference_mask(tokenizer, text: str) -> np.ndarray:
    prefixes = {s[:i].encode() for s in SENTENCES for i in range(len(s) + 1)}
    so_far = text.encode()
    added = set(tokenizer.added_tokens.values())
    mask = np.zeros(tokenizer.n_vocab, bool)
    for i in range(tokenizer.n_vocab):
        piece = tokenizer.token_bytes(i)
        mask[i] = bool(piece) and i not in added and so_far + piece in prefixes
    mask[list(tokenizer.eos_ids)] = text in SENTENCES
    return mask


@pytest.mark.parametrize("text", ["", "ma", "maybe", "maybe ", "no 4", "no 42"])
def test_mask_equals_prefix_reference(tokenizer, table, text: str) -> None:
    want = reference_mask(tokenizer, text)
    for forcing in (False, True):
        source = SMALL if forcing else '%llguidance {"no_forcing": true}\n' + SMALL
        matcher = compile_grammar(table, lark=source).matcher()
        for t in tokenizer.encode_plain(text):
            matcher.accept(t)
        got = matcher.allowed()
        assert matcher.accepting == (text in SENTENCES) and matcher.done == (text == "no 42")
        if not forcing:
            assert np.array_equal(got, want), (np.flatnonzero(got != want)[:10], text)
            continue
        assert not (got & ~want).any() and got.any()


def test_schema_mask_equals_token_by_token_validation(tokenizer, table) -> None:
    """Inside the JSON schema, at several positions: each allowed id, and 4,000 random ids, are accepted by a
    copy of llguidance's matcher (``validate_tokens``, one token at a time) exactly when the mask allows them."""
    grammar = compile_grammar(table, json_schema=SCHEMA)
    ids, _ = draw(tokenizer, grammar, 5)
    rng = np.random.default_rng(1)
    matcher = grammar.matcher()
    for pos, token in enumerate(ids):
        if pos % 7 == 0:
            mask = matcher.allowed()
            probe = np.union1d(np.flatnonzero(mask)[:3000], rng.integers(0, tokenizer.n_vocab, 4000))
            probe = probe[~np.isin(probe, list(tokenizer.eos_ids))]
            check = matcher._m.deep_copy()
            valid = np.array([check.validate_tokens([int(t)]) == 1 for t in probe])
            assert np.array_equal(valid, mask[probe]), (pos, probe[valid != mask[probe]][:5])
        matcher.accept(token)


def test_reasoning_runs_free_text_through_think_end(tokenizer, table) -> None:
    """Thinking accepts any text (a spelled-out "</think>" too) but no end of generation; the </think> token
    ends it, then the blank line, then the schema."""
    grammar = compile_grammar(table, json_schema=SCHEMA, reasoning=True)
    matcher = grammar.matcher()
    for t in tokenizer.encode_plain("Let me think. </think> is just text here {"):
        assert matcher.allowed()[t]
        matcher.accept(t)
    mask = matcher.allowed()
    assert not mask[list(tokenizer.eos_ids)].any() and mask.sum() > 200_000
    matcher.accept(tokenizer.token_id("</think>"))
    mask = matcher.allowed()
    assert mask[tokenizer.token_id("\n\n")] and not mask[tokenizer.token_id("{")]
    matcher.accept(tokenizer.token_id("\n\n"))
    assert [tokenizer.token_bytes(int(i)) for i in np.flatnonzero(matcher.allowed())] == [b'{"']  # forced, canonical


@pytest.mark.parametrize(("kw", "named"), [
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json_schema": {"not": {"type": "string"}}}, "not"),
    ({"json_schema": {"type": "string", "pattern": "(?=a)b"}}, "look-around"),
    ({"json_schema": {"type": "string", "format": "colour"}}, "colour"),
    ({"json_schema": {"type": "number", "minimum": "3"}}, "not valid JSON Schema at minimum"),
    ({"json_schema": [1, 2]}, "must be an object"),
    ({"lark": "start: undefined_rule"}, "undefined_rule"),
    ({"lark": "start: <no_such_token>"}, "no_such_token"),
    ({"lark": "start: \"a\"", "json_object": True}, "exactly one"),
    ({}, "exactly one"),
])
def test_unsupported_or_malformed_grammar_is_named(table, kw: dict, named: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(named)):
        compile_grammar(table, **kw)


def answer(engine, grammar, seed: int, max_tokens: int = 120, top_logprobs=None):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed, max_tokens=max_tokens,
                            top_logprobs=top_logprobs)
    events = list(engine.chat([{"role": "user", "content": "Describe a file as JSON."}], params, grammar=grammar))
    return [e for e in events if isinstance(e, TokenEvent)], events[-1]


@pytest.mark.parametrize("seed", range(4))
def test_engine_answer_is_schema_valid_and_cache_invariant(engines, seed: int) -> None:
    """The random-weight model's answer under the schema ends by itself ("eos"), validates, and is token for
    token the same from an engine whose prompt came (partly) from snapshots as from one without a cache."""
    warm, cold = engines
    results = []
    for engine in (warm, warm, cold):
        tokens, summary = answer(engine, engine.grammar(json_schema=SCHEMA), seed)
        assert isinstance(summary, TurnSummary) and summary.stop_reason == "eos"
        jsonschema.validate(json.loads(summary.text), SCHEMA)
        results.append([t.token_id for t in tokens])
    assert results[0] == results[1] == results[2]


def test_grammar_is_reusable_across_answers(engines) -> None:
    warm, _ = engines
    grammar = warm.grammar(lark=LARK)
    texts = [answer(warm, grammar, seed)[1].text for seed in (1, 2, 1)]
    assert texts[0] == texts[2] and all(re.fullmatch(r"(get|put) \S+\.", t) for t in texts)


def test_max_tokens_cuts_a_constrained_answer(engines) -> None:
    warm, _ = engines
    tokens, summary = answer(warm, warm.grammar(json_schema=SCHEMA), 0, max_tokens=3)
    assert summary.stop_reason == "max_tokens" and len(tokens) == 3 and summary.text.startswith('{"')


def test_grammar_error_from_engine(engines) -> None:
    warm, _ = engines
    with pytest.raises(GrammarError, match="contains"):
        warm.grammar(json_schema={"type": "array", "contains": {"type": "integer"}})


def test_raw_completion_under_a_grammar(engines) -> None:
    """Engine.complete continues raw text under the grammar: any JSON object here, ended by the grammar."""
    warm, _ = engines
    brace = warm.tokenizer.token_id("{")
    events = list(warm.complete("Answer in JSON: ", SamplingParams(temperature=0.0, max_tokens=40,
                                                                    logit_bias=((brace, 30.0),)),
                                grammar=warm.grammar(json_object=True)))
    summary = events[-1]
    assert summary.stop_reason == "eos" and isinstance(json.loads(summary.text), dict)
