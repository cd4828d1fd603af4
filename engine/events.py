"""Plain dataclasses that :meth:`engine.api.Engine.chat` yields, one turn at a time.

The app forwards them through Qt signals as they are; nothing here knows about Qt.
Order within one turn: :class:`PrefillProgress` after each piece of the prompt read (none when
nothing is prefilled), one :class:`PrefillStats`, then :class:`TokenEvent` per generated token,
then exactly one :class:`TurnSummary` (also after a cancel or a context-full stop). A turn that
stops before its first token (prompt larger than the context, cancel during prefill) yields no
:class:`PrefillStats`. Errors are raised as ``engine.errors`` exceptions, not yielded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["eos", "max_tokens", "context_full", "cancelled", "error"]
Channel = Literal["reasoning", "content", "tool_call"]
"""Where answer text belongs: the model's reasoning, the answer shown to the user, or a tool call."""
Part = tuple[Channel, str]
"""``(channel, text)``: a piece of answer text in one channel."""


@dataclass(frozen=True)
class PrefillProgress:
    """Emitted after each piece of the prompt has been read, for a progress bar.

    Attributes:
        done: prompt tokens read so far, reused ones included.
        total: prompt tokens in all.
        elapsed_ms: time since prefill started, ms.
    """

    done: int
    total: int
    elapsed_ms: float


@dataclass(frozen=True)
class PrefillStats:
    """Emitted once, when the prompt has been read and the first token is about to be sampled.

    Attributes:
        prompt_tokens: tokens in the rendered prompt.
        reused_tokens: tokens restored from the prefix cache (0 without a cache hit).
        prefilled_tokens: tokens actually run through the model (prompt_tokens - reused_tokens).
        prefill_ms: wall time of the prefill, ms (forward passes and snapshot writes).
        restore_ms: wall time to restore a cached snapshot, ms (0 without a hit).
        device: where prefill ran, "cuda" when any part of it ran on the GPU, else "cpu".
        ttft_ms: time from the call to chat() (template and image encoding included) to the first
            sampled token, ms.
        note: a plain-words remark for the user (e.g. the GPU failed and the CPU took over), or "".
    """

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    prefill_ms: float
    restore_ms: float
    device: str
    ttft_ms: float
    note: str = ""

    @property
    def prefill_tok_s(self) -> float:
        """Prefill throughput in tokens/s (0 when nothing was prefilled)."""
        return self.prefilled_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    Attributes:
        token_id: the sampled token id.
        text: the text this token completes; "" while a multi-byte UTF-8 character is still
            incomplete (the bytes are emitted with the token that completes it).
        ms: wall time spent on this token (forward + sampling), ms.
        index: 0-based index of this token within the answer.
        logprob: ``log_softmax`` of the model's raw logits at this token (before logit bias, penalties,
            grammar mask and temperature), natural log; None unless ``SamplingParams.top_logprobs`` is set.
        top_logprobs: the ``SamplingParams.top_logprobs`` most likely (token id, logprob) pairs there, most
            likely first (ties to the lowest id).
        channel: where the token is (its family's rule, :mod:`engine.channels`; markers belong to the block
            they open or close).
        parts: the answer text this token releases, by channel, markers of reasoning left out; text that
            may still begin a marker is held and released by a later token or the :class:`TurnSummary`.
            None (the default) means ``((channel, text),)``.
    """

    token_id: int
    text: str
    ms: float
    index: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    channel: Channel = "content"
    parts: tuple[Part, ...] | None = None

    def __post_init__(self) -> None:
        if self.parts is None:
            object.__setattr__(self, "parts", ((self.channel, self.text),) if self.text else ())


@dataclass(frozen=True)
class TurnSummary:
    """The last event of a turn.

    Attributes:
        stop_reason: why generation stopped.
        message: plain-words explanation for stop reasons other than "eos" (e.g. the context
            size when the context is full), else "".
        prompt_tokens / reused_tokens / generated_tokens: token counts.
        ttft_ms: time to first token, ms.
        prefill_tok_s: prompt tokens/s of the prefill (prefilled tokens only).
        decode_tok_s: generated tokens/s, excluding the first token's latency.
        text: the full answer text, as the model wrote it.
        token_ms: per-token latencies, ms, in order.
        parts: the answer text the last token left held back (see :attr:`TokenEvent.parts`).
    """

    stop_reason: StopReason
    message: str
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    text: str
    token_ms: tuple[float, ...] = field(default_factory=tuple)
    parts: tuple[Part, ...] = ()

    @classmethod
    def of_turn(cls, stop_reason: StopReason, message: str, prefill: PrefillStats | None, token_ms: Sequence[float],
                text: str = "", *, prompt_tokens: int | None = None, reused_tokens: int | None = None,
                generated_tokens: int | None = None, parts: tuple[Part, ...] = ()) -> TurnSummary:
        """The summary of a turn, its rates derived from what it measured.

        TTFT and prefill tok/s come from ``prefill`` (0 without one: nothing was prefilled); decode tok/s
        is ``(n - 1) / sum(token_ms[1:])``, the first token's latency being part of TTFT (0 for n < 2).
        Token counts default to ``prefill``'s prompt counts and ``len(token_ms)``.
        """
        decode_s = sum(token_ms[1:]) / 1e3
        prompt, reused = (prefill.prompt_tokens, prefill.reused_tokens) if prefill else (0, 0)
        return cls(stop_reason=stop_reason, message=message,
                   prompt_tokens=prompt if prompt_tokens is None else prompt_tokens,
                   reused_tokens=reused if reused_tokens is None else reused_tokens,
                   generated_tokens=len(token_ms) if generated_tokens is None else generated_tokens,
                   ttft_ms=prefill.ttft_ms if prefill else 0.0, prefill_tok_s=prefill.prefill_tok_s if prefill else 0.0,
                   decode_tok_s=(len(token_ms) - 1) / decode_s if decode_s > 0 else 0.0, text=text,
                   token_ms=tuple(token_ms), parts=parts)


Event = PrefillProgress | PrefillStats | TokenEvent | TurnSummary
