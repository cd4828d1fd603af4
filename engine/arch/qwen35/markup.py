"""Qwen3.5/3.6's chat and image marker tokens and the rotary positions of decoded tokens."""

from __future__ import annotations

import numpy as np

from engine.registry import ChatMarkup

MARKUP = ChatMarkup(message_start="<|im_start|>", assistant_header="<|im_start|>assistant\n",
                    image_pad="<|image_pad|>", image_start="<|vision_start|>")
"""The ChatML markup of the Qwen3.5/3.6 chat template, with its image placeholder and image opener."""


def decode_positions(prompt_positions: np.ndarray | None, n_prompt: int, k: int) -> np.ndarray:
    """(3, 1) int64 M-RoPE positions of the k-th token (from 0) decoded after a prompt of ``n_prompt`` tokens.

    A text token sits at (p, p, p); the first one after the prompt at one past the prompt's largest
    position (``n_prompt`` for plain positions), HF ``get_rope_index``'s ``mrope_position_deltas``.
    """
    first = n_prompt if prompt_positions is None else int(prompt_positions.max()) + 1
    return np.full((3, 1), first + k, dtype=np.int64)
