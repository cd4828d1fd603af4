"""An answer's text split into channels as it streams: reasoning, content and tool-call text.

A family gives its :class:`Markers`; :class:`ChannelSplitter` applies them token by token, holding text
back only while it may still start a marker, so the parts do not depend on how the text is cut into
tokens. Tool-call blocks are sent whole once closed. Design: docs/design/reasoning-channel.md (rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from .events import Channel, Part

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
"""The reasoning markers of Qwen, QwQ and DeepSeek-R1 alike, which OpenAI-compatible servers that send
raw text (llama-server without ``--reasoning-format``) leave in the content."""


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (0 when none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class Markers:
    """Where a family's channels begin and end in the text it writes.

    Attributes:
        think_open / think_close: the reasoning block's markers.
        call_open / call_close: a tool-call block's markers ("" when the family writes none).
    """

    think_open: str = THINK_OPEN
    think_close: str = THINK_CLOSE
    call_open: str = ""
    call_close: str = ""


class ChannelSplitter:
    """Feed it each token's text (:meth:`push`), then :meth:`close`; each returns the parts that text
    completes, ``(channel, text)`` in order, never empty, markers of reasoning left out.

    Args:
        markers: the family's markers.
        reasoning: the answer starts inside the reasoning (the prompt opened it).

    Attributes:
        channel: the channel of the last token pushed (of its last character; a marker belongs to
            the block it opens or closes; text held back to the channel it is held in).
        state: "start" (blanks before a possible opening marker), "content", "call" (inside a block),
            "reasoning", "draft" (inside a block in the reasoning) or "after" (blanks after such a block).
    """

    def __init__(self, markers: Markers, reasoning: bool = False) -> None:
        self.markers = markers
        self.state = "reasoning" if reasoning else "start"
        self.channel: Channel = "reasoning" if reasoning else "content"
        self._pending = ""
        self._drafts = ""       # reasoning tool-call blocks (and blanks between them), held to the end
        self._calls: list[str] = []

    def push(self, text: str) -> list[Part]:
        """The parts that ``text`` completes (it may complete none and be held back)."""
        self._pending += text
        out: list[Part] = []
        steps = {"start": self._start, "content": self._content, "call": self._call, "reasoning": self._reasoning,
                 "draft": self._draft, "after": self._after}
        while steps[self.state](out):      # each step consumes what it can; False: wait for more text
            pass
        if self._pending or self._drafts:
            self.channel = "tool_call" if self.state == "call" else self._home()
        return out

    def close(self) -> list[Part]:
        """The held-back text once the answer has ended: drafts that ended it are calls; a block cut short
        is sent as tool-call text; the rest goes to the channel it was held in."""
        out: list[Part] = []
        if self.state == "after" and not self._pending.strip():
            out += [("tool_call", call) for call in self._calls]
            self._drafts = self._pending = ""
        elif self.state == "call":
            self._emit(out, "tool_call", self.markers.call_open + self._pending)
            self._pending = ""
        self._emit(out, self._home(), self._drafts + self._pending)
        self._drafts, self._pending, self._calls = "", "", []
        return out

    def _home(self) -> Channel:
        return "content" if self.state in ("start", "content", "call") else "reasoning"

    def _emit(self, out: list[Part], channel: Channel, text: str) -> None:
        if text:
            out.append((channel, text))
            self.channel = channel

    def _hold(self, out: list[Part], channel: Channel, tags: tuple[str, ...]) -> bool:
        """Send the pending text but its end that may still begin one of ``tags``; False (wait for more)."""
        keep = max((partial_suffix(self._pending, t) for t in tags if t), default=0)
        self._emit(out, channel, self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _cut(self, tag: str) -> int:
        """Where ``tag`` starts in the pending text (-1 when absent or empty)."""
        return self._pending.find(tag) if tag else -1

    def _start(self, out: list[Part]) -> bool:
        head, opener = self._pending.lstrip(), self.markers.think_open
        if head.startswith(opener):
            self._pending, self.state, self.channel = head[len(opener):], "reasoning", "reasoning"
            return True
        if opener.startswith(head):
            return False
        self.state = "content"
        return True

    def _content(self, out: list[Part]) -> bool:
        at = self._cut(self.markers.call_open)
        if at < 0:
            return self._hold(out, "content", (self.markers.call_open,))
        self._emit(out, "content", self._pending[:at])
        self._pending, self.state, self.channel = self._pending[at + len(self.markers.call_open):], "call", "tool_call"
        return True

    def _call(self, out: list[Part]) -> bool:
        at = self._cut(self.markers.call_close)
        if at < 0:
            return False
        end = at + len(self.markers.call_close)
        self._emit(out, "tool_call", self.markers.call_open + self._pending[:end])
        self._pending, self.state = self._pending[end:], "content"
        return True

    def _reasoning(self, out: list[Part]) -> bool:
        close, call = self._cut(self.markers.think_close), self._cut(self.markers.call_open)
        if close >= 0 and (call < 0 or close < call):
            self._emit(out, "reasoning", self._pending[:close])
            self._pending, self.state, self.channel = self._pending[close + len(self.markers.think_close):], \
                "content", "reasoning"
            return True
        if call < 0:
            return self._hold(out, "reasoning", (self.markers.think_close, self.markers.call_open))
        self._emit(out, "reasoning", self._pending[:call])
        self._drafts, self._pending = self.markers.call_open, self._pending[call + len(self.markers.call_open):]
        self.state = "draft"
        return True

    def _draft(self, out: list[Part]) -> bool:
        at = self._cut(self.markers.call_close)
        if at < 0:
            return False
        end = at + len(self.markers.call_close)
        self._calls.append(self._drafts[self._drafts.rfind(self.markers.call_open):] + self._pending[:end])
        self._drafts += self._pending[:end]
        self._pending, self.state = self._pending[end:], "after"
        return True

    def _after(self, out: list[Part]) -> bool:
        rest = self._pending.lstrip()
        opener = self.markers.call_open
        if rest.startswith(opener):
            self._drafts += self._pending[:len(self._pending) - len(rest)] + opener
            self._pending, self.state = rest[len(opener):], "draft"
            return True
        if not rest or opener.startswith(rest):
            return False
        self._emit(out, "reasoning", self._drafts)   # thought on: the blocks were drafts
        self._drafts, self._calls, self.state = "", [], "reasoning"
        return True


def raw_text_splitter(reasoning: bool) -> ChannelSplitter:
    """The splitter of an answer from a remote server that sends the model's raw text (llama-server
    without ``--reasoning-format``, vLLM without ``--reasoning-parser``), the one place outside the
    families that reads ``<think>``: the remote model's family is not known here, and ``<think>`` /
    ``</think>`` is what every such server's reasoning models write. ``reasoning``: thinking was asked
    for, so the template may have opened the block in the prompt."""
    return ChannelSplitter(Markers(), reasoning)

