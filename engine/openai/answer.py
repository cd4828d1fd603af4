"""The streamed answer split as OpenAI-compatible servers return it: the thinking as ``reasoning_content``,
the rest as ``content``, ended at the first stop string.

Qwen3.5/3.6 think inside ``<think> ... </think>``; with thinking on, the chat template opens the block
in the prompt (``<|im_start|>assistant\\n<think>\\n``), so the answer starts inside it. This is the rule
of vLLM's and llama.cpp's Qwen reasoning parsers: with ``enable_thinking`` everything up to
``</think>`` is reasoning; without it only an answer that itself starts with ``<think>`` has any.
Text is held back only while it may still be the start of a tag or of a stop string, so each token's
text is sent as soon as it is known to be reasoning or content.
"""

from __future__ import annotations

from typing import Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (0 when none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class AnswerSplitter:
    """Feed it each token's text; it returns ``(kind, text)`` pieces ready to send, kind "reasoning" or
    "content" (in order, never empty).

    Args:
        thinking: the prompt opened a think block (``enable_thinking``).
        stop: strings that end the answer; the first one found in the content is cut with what follows
            (:attr:`stopped` is then True and the caller stops the engine; :attr:`stop_string` is the one found).
        raw: a raw completion: all of it is content, whitespace kept as generated (only ``stop`` applies).
            A chat answer's content and reasoning start at their first non-blank character.
    """

    def __init__(self, thinking: bool, stop: Sequence[str] = (), raw: bool = False) -> None:
        self.reasoning = thinking and not raw
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self.stop_string: str | None = None
        self._pending = ""
        self._at_start = not raw
        self._trim = not raw

    def push(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes (it may complete none and be held back)."""
        self._pending += text
        out: list[tuple[str, str]] = []
        while not self.stopped:
            if self._at_start:
                head = self._pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self.reasoning, self._pending = True, head[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(head):
                    return out  # "", "<", "<th", ...: may still open a think block
                self._at_start = False
            if self.reasoning:
                end = self._pending.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_suffix(self._pending, THINK_CLOSE)
                    self._emit(out, "reasoning", self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                self._emit(out, "reasoning", self._pending[:end])
                self._pending = self._pending[end + len(THINK_CLOSE):]
                self.reasoning, self._trim = False, True
                continue
            hits = [(i, s) for s in self.stop if (i := self._pending.find(s)) >= 0]
            if hits:
                at, self.stop_string = min(hits)
                self._emit(out, "content", self._pending[:at])
                self._pending, self.stopped = "", True
                return out
            keep = max((partial_suffix(self._pending, s) for s in self.stop), default=0)
            self._emit(out, "content", self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return out
        return out

    def close(self) -> list[tuple[str, str]]:
        """The held-back text once the answer has ended (it was no tag and no stop string after all)."""
        out: list[tuple[str, str]] = []
        if not self.stopped and self._pending:
            self._emit(out, "reasoning" if self.reasoning else "content", self._pending)
        self._pending = ""
        return out

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        if text:
            out.append((kind, text))
