"""The streamed answer as OpenAI-compatible servers return it: the reasoning as ``reasoning_content``, the
rest as ``content``, ended at the first stop string.

The engine has already split the answer into channels by its family's rule (:mod:`engine.channels`);
here a chat answer's reasoning and content each start at their first non-blank character (as vLLM and
llama.cpp return them), and stop strings are matched in the content. Text is held back only while it
may still be the start of a stop string, so each piece is sent as soon as it is known.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.channels import partial_suffix


class AnswerSplitter:
    """Feed it each token's ``(channel, text)`` parts; it returns the pieces ready to send, ``(channel,
    text)`` in order, never empty.

    Args:
        stop: strings that end the answer; the first one found in the content is cut with what follows
            (:attr:`stopped` is then True and the caller stops the engine; :attr:`stop_string` is the one found).
        raw: a raw completion: whitespace kept as generated (only ``stop`` applies). A chat answer's
            reasoning and content start at their first non-blank character, a tool call counting as content.
    """

    def __init__(self, stop: Sequence[str] = (), raw: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self.stop_string: str | None = None
        self._pending = ""
        self._raw = raw
        self._group: str | None = None      # "reasoning" or "content": where the last piece went
        self._trim = False

    def push(self, parts: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """The pieces ``parts`` complete (content may be held back while it may begin a stop string)."""
        out: list[tuple[str, str]] = []
        for channel, text in parts:
            if self.stopped:
                break
            if channel != "content":
                self._release(out)
                self._emit(out, channel, text)
                continue
            self._pending += text
            hits = [(i, s) for s in self.stop if (i := self._pending.find(s)) >= 0]
            if hits:
                at, self.stop_string = min(hits)
                self._emit(out, "content", self._pending[:at])
                self._pending, self.stopped = "", True
                break
            keep = max((partial_suffix(self._pending, s) for s in self.stop), default=0)
            self._emit(out, "content", self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
        return out

    def close(self) -> list[tuple[str, str]]:
        """The held-back text once the answer has ended (it was no stop string after all)."""
        out: list[tuple[str, str]] = []
        if not self.stopped:
            self._release(out)
        return out

    def _release(self, out: list[tuple[str, str]]) -> None:
        self._emit(out, "content", self._pending)
        self._pending = ""

    def _emit(self, out: list[tuple[str, str]], channel: str, text: str) -> None:
        group = "reasoning" if channel == "reasoning" else "content"
        if text and group != self._group:
            self._group, self._trim = group, not self._raw
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        if text:
            out.append((channel, text))
