"""The prompt's marker tokens and the decoded tokens' positions come from the text family (engine.registry).

The builder is given a family's :class:`~engine.registry.ChatMarkup` and must find message starts, the
assistant header and the image tokens by it; Qwen's decode positions continue one past the prompt's
largest M-RoPE position (HF ``get_rope_index``), or at the cache slot for plain positions.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.arch.qwen35 import ARCH as QWEN35
from engine.arch.qwen3vl.positions import mrope_positions
from engine.errors import UnsupportedModelError
from engine.prompt.builder import CHATML, PromptBuilder
from engine.registry import ChatMarkup


class MarkerTokenizer:
    """Added tokens get ids 100, 101, ...; every other character is its code point (below 100 here)."""

    def __init__(self, added: list[str]) -> None:
        self.added = {text: 100 + i for i, text in enumerate(added)}

    def token_id(self, text: str) -> int | None:
        return self.added.get(text)

    def encode(self, text: str, special: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            hit = next((t for t in self.added if text.startswith(t, i)), None)
            out.append(self.added[hit] if hit else ord(text[i]) % 100)
            i += len(hit) if hit else 1
        return out


MARKUP = ChatMarkup(message_start="<s>", assistant_header="<s>bot:", image_pad="<pad>", image_start="<img>")


def test_checkpoints_use_the_family_message_start_and_header():
    tok = MarkerTokenizer(["<s>", "<pad>", "<img>", "<|im_start|>"])
    builder = PromptBuilder(tok, None, "m.gguf", "m.gguf", 4096, markup=MARKUP)
    prompt = tok.encode("<s>sys<s>user hi<s>bot:")
    assert builder.message_starts(prompt) == [0, 4, 12]
    assert builder.checkpoints(prompt) == [4, 12, len(prompt)]
    chatml = PromptBuilder(tok, None, "m.gguf", "m.gguf", 4096)
    assert chatml.markup == CHATML and chatml.message_starts(prompt) == []


def test_images_need_the_family_image_tokens():
    tok = MarkerTokenizer(["<s>"])
    builder = PromptBuilder(tok, object(), "m.gguf", "m.gguf", 4096, markup=MARKUP)
    with pytest.raises(UnsupportedModelError, match="<pad> / <img>"):
        builder._vision_for_images()


def test_qwen_markup_is_chatml_with_vision_tokens():
    assert QWEN35.markup.message_start == CHATML.message_start == "<|im_start|>"
    assert (QWEN35.markup.image_pad, QWEN35.markup.image_start) == ("<|image_pad|>", "<|vision_start|>")


def test_qwen_decode_positions_continue_past_the_largest_prompt_position():
    pad, start = 9, 8
    ids = [1, 2, start] + [pad] * 6 + [3]
    positions = mrope_positions(ids, [(2, 3)], pad, start)
    assert positions.max() == 3 + 3                                          # the text after a 2x3 image
    for k in range(3):
        got = QWEN35.decode_positions(positions, len(ids), k)
        assert got.shape == (3, 1) and got.dtype == np.int64
        assert (got == positions.max() + 1 + k).all()
        assert (QWEN35.decode_positions(None, len(ids), k) == len(ids) + k).all()
