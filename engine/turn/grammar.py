"""Constrained decoding: a grammar masks the logits so only tokens that keep the answer valid are drawn.

Backed by llguidance. :func:`grammar_tokenizer` builds its token table once per engine (every added
token is a special token); :func:`lark_json` embeds a JSON schema in lark; :class:`Grammar` is compiled
once and immutable; :class:`Matcher` is one answer's state (``allowed()`` -> ``(n_vocab,)`` bool mask,
``accept(id)``). End-of-generation ids are allowed exactly where the grammar may end.
Design: docs/design/grammar.md; docs/design/constrained-decoding.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema
import llguidance
import numpy as np

from ..errors import EngineError
from ..prompt.tokenizer import Tokenizer

THINK_END = "</think>"
"""The token that closes the model's thinking (Qwen3.5/3.6); ``reasoning=True`` grammars let free text run up to it."""

ANSWER_GAP = "\n\n"
"""What the Qwen3.5/3.6 template writes between ``</think>`` and the answer (``'\\n</think>\\n\\n' + content``)."""

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON compile options: one fixed layout, ``{"a": 1, "b": [2, 3]}`` (the separators Python's ``json``
and Qwen's chat template use), so whitespace cannot grow without end and every answer has one spelling."""

_SPECIAL_MARK = b"\xff"  # llguidance's prefix of a special token's bytes (never valid UTF-8, so text cannot match it)


class GrammarError(EngineError):
    """A grammar or JSON schema that is malformed or uses what llguidance cannot enforce (the message names it)."""


class _TokenizerBridge:
    """The engine tokenizer in the shape ``llguidance.TokenizerWrapper`` reads: per-id bytes (added tokens marked
    special), end-of-generation ids, and an encode callable for text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        added = set(tokenizer.added_tokens.values())
        self.eos_token_id = min(tokenizer.eos_ids)
        self.bos_token_id = None
        self.special_token_ids = sorted(added)
        self.tokens = [_SPECIAL_MARK + tokenizer.token_bytes(i) if i in added else tokenizer.token_bytes(i)
                       for i in range(tokenizer.n_vocab)]
        self._encode = tokenizer.encode_plain

    def __call__(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text (llguidance tokenizes forced text with it)."""
        if not isinstance(text, str):
            raise TypeError("the grammar tokenizer bridge encodes str only")
        return self._encode(text)


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's token table for ``tokenizer`` (seconds on a 248,320-token vocabulary: build it once).

    Ids and bytes are the engine tokenizer's (:meth:`Tokenizer.token_bytes`); added tokens are special tokens
    (bytes prefixed with 0xFF, named ``<...>`` in lark), unused ids have no bytes and are never allowed;
    ``Tokenizer.eos_ids`` end the answer.
    """
    bridge = _TokenizerBridge(tokenizer)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(bridge), n_vocab=tokenizer.n_vocab,
                                  eos_token=sorted(tokenizer.eos_ids))


def _check_schema(schema: Any) -> None:
    """Raise GrammarError unless ``schema`` is a JSON Schema document (checked against its draft's meta-schema)."""
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise GrammarError(f"the JSON schema is not valid JSON Schema at {where}: {exc.message}") from None


def json_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    """:data:`JSON_OPTIONS` overridden by ``schema``'s own ``x-guidance`` object.

    Raises:
        GrammarError: ``x-guidance`` is there but not an object.
    """
    own = schema.get("x-guidance", {})
    if not isinstance(own, Mapping):
        raise GrammarError(f"the JSON schema's x-guidance must be an object of llguidance options, "
                           f"got {type(own).__name__}")
    return {**JSON_OPTIONS, **own}


def _json_grammar(schema: Any, name: str) -> dict:
    """An llguidance grammar entry enforcing ``schema`` with :data:`JSON_OPTIONS` (the schema's own
    ``x-guidance`` wins)."""
    if isinstance(schema, Mapping):
        schema = {**schema, "x-guidance": json_options(schema)}
    return {"name": name, "json_schema": schema}


def lark_json(schema: Any) -> str:
    """``%json {...}`` for a lark grammar: ``schema`` checked, with :data:`JSON_OPTIONS` (its own ``x-guidance``
    wins), so JSON inside a lark grammar (e.g. a tool call's arguments) has the same fixed layout.

    Raises:
        GrammarError: ``schema`` is not valid JSON Schema.
    """
    _check_schema(schema)
    return "%json " + json.dumps(_json_grammar(schema, "")["json_schema"])


def grammar_source(*, lark: str | None = None, json_schema: Any = None, json_object: bool = False,
                   reasoning: bool = False) -> str:
    """The llguidance grammar (JSON text) for exactly one of ``lark`` / ``json_schema`` / ``json_object``.

    ``reasoning``: free text up to and including :data:`THINK_END`, then :data:`ANSWER_GAP`, then the grammar
    (the chat template has opened ``<think>`` in the prompt).

    Raises:
        GrammarError: not exactly one kind given, or ``json_schema`` is not valid JSON Schema.
    """
    given = [k for k, v in (("lark", lark), ("json_schema", json_schema), ("json_object", json_object or None))
             if v is not None]
    if len(given) != 1:
        raise GrammarError(f"a grammar needs exactly one of lark, json_schema, json_object; got {given or 'none'}")
    if lark is not None:
        if not isinstance(lark, str) or not lark.strip():
            raise GrammarError("the lark grammar must be a non-empty string")
        body: dict = {"name": "answer", "lark_grammar": lark}
    else:
        schema = {"type": "object"} if json_object else json_schema
        _check_schema(schema)
        body = _json_grammar(schema, "answer")
    if not reasoning:
        return json.dumps({"grammars": [body]})
    top = {"lark_grammar": f"start: /(.|\\n)*/ {THINK_END} {json.dumps(ANSWER_GAP)} @answer"}
    return json.dumps({"grammars": [top, body]})


MAX_MESSAGE = 2000
"""Longest llguidance message passed on, characters (its grammar excerpt; a panic's backtrace is cut off)."""


def _library_message(message: str) -> str:
    """llguidance's error ``message`` without the backtrace of a panic (native frames and build paths, no use
    to a client), at most :data:`MAX_MESSAGE` characters."""
    text = message.split("\n<backtrace>", 1)[0]
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + " ..."


class Grammar:
    """A compiled grammar for one token table: immutable, shared by every answer it constrains.

    Build it with :meth:`engine.api.Engine.grammar` (or :func:`compile_grammar`); start each answer with
    :meth:`matcher`.

    Attributes:
        source: the llguidance grammar (JSON text). n_vocab: ids of the token table.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, source: str) -> None:
        """Compile ``source`` (from :func:`grammar_source`) for ``tokenizer``.

        Raises:
            GrammarError: the grammar does not compile; the message is llguidance's (it names the unsupported
                keyword, format or regex feature, or the lark line).
        """
        self.source = source
        self.n_vocab = tokenizer.vocab_size
        self._tokenizer = tokenizer
        self._initial = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if self._initial.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {_library_message(self._initial.get_error())}")

    def matcher(self) -> Matcher:
        """A fresh parser state at the start of the answer."""
        return Matcher(self._initial.deep_copy(), self.n_vocab)


class Matcher:
    """One answer's position in a :class:`Grammar`.

    ``allowed()`` gives the next token's mask, ``accept(t)`` moves past token ``t``. Both depend only on the
    tokens accepted so far, so an answer is the same however its prompt was prefilled.
    """

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._m = matcher
        self.n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype="<i4")

    @property
    def done(self) -> bool:
        """Nothing but an end-of-generation token may follow (the grammar has ended, or failed: see :meth:`allowed`)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The tokens so far form a complete answer (an end-of-generation token is allowed here)."""
        return self._m.is_accepting()

    def allowed(self, out: np.ndarray | None = None) -> np.ndarray:
        """The (n_vocab,) bool mask of tokens allowed next (end-of-generation ids where the grammar may end).

        Args:
            out: an (n_vocab,) bool array to write into, or None for a new one.

        Raises:
            GrammarError: the parser hit one of llguidance's limits (a grammar too ambiguous to follow).
        """
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._raise_on_error()
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
        if out is None:
            return bits
        out[:] = bits
        return out

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (one of :meth:`allowed`'s tokens).

        Raises:
            GrammarError: the token is not allowed here (the matcher is then unusable).
        """
        if not self._m.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} is not allowed by the grammar here: "
                               f"{_library_message(self._m.get_error())}")

    def _raise_on_error(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"constrained decoding stopped: {_library_message(self._m.get_error())}")


def compile_grammar(tokenizer: llguidance.LLTokenizer, *, lark: str | None = None, json_schema: Any = None,
                    json_object: bool = False, reasoning: bool = False) -> Grammar:
    """:func:`grammar_source` compiled for ``tokenizer`` (see :meth:`engine.api.Engine.grammar`).

    Raises:
        GrammarError: as :func:`grammar_source` and :class:`Grammar`.
    """
    return Grammar(tokenizer, grammar_source(lark=lark, json_schema=json_schema, json_object=json_object,
                                             reasoning=reasoning))
