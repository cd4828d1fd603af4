"""Qwen3.5 / Qwen3.6's channels: reasoning in ``<think> ... </think>``, tool calls in ``<tool_call>`` blocks.

With thinking on, the chat template opens the block in the prompt (``<|im_start|>assistant\\n<think>\\n``,
engine/prompt/templates/qwen35.jinja), so the answer starts inside it; with thinking off it writes an empty,
closed block there, and only an answer that itself starts with ``<think>`` has reasoning. This is the
rule of vLLM's and llama.cpp's Qwen reasoning parsers; :class:`engine.channels.ChannelSplitter` applies it.
"""

from __future__ import annotations

from engine.channels import THINK_CLOSE, THINK_OPEN, ChannelSplitter, Markers

MARKERS = Markers(THINK_OPEN, THINK_CLOSE, "<tool_call>", "</tool_call>")
TURN_START = "<|im_start|>"


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt leaves a think block open: in its last turn (the text after the last
    ``<|im_start|>``, all of ``prompt_tail`` when it has none), the last ``<think>`` is not closed."""
    turn = prompt_tail[prompt_tail.rfind(TURN_START) + 1:] if TURN_START in prompt_tail else prompt_tail
    return turn.rfind(THINK_OPEN) > turn.rfind(THINK_CLOSE)


def splitter(prompt_tail: str) -> ChannelSplitter:
    """The splitter of one answer, given the text of the prompt's last tokens (its assistant header)."""
    return ChannelSplitter(MARKERS, reasoning=opens_reasoning(prompt_tail))
