"""One chat turn: prompt tokens -> prefill -> decode loop, as a stream of events.

See ../DESIGN.md "One turn, as data". This is the CPU path everything else is checked against;
the prefix cache (issue 5) and GPU prefill (issue 4) plug in before :func:`prefill`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .events import Event, PrefillStats, TokenEvent, TurnSummary
from .models.qwen35 import Qwen35Model
from .sampling import Sampler, SamplingParams
from .state import SequenceState
from .tokenizer import Tokenizer

# Prompt tokens per forward call during prefill: a cancel request is seen between pieces, and the
# activations of one piece stay small. A multiple of the GDN chunk (64) so pieces split no chunk.
PREFILL_PIECE = 256


@dataclass
class Turn:
    """Everything one turn needs.

    Attributes:
        model: the text model.
        tokenizer: the model's tokenizer (for stop ids and streaming detokenization).
        prompt: (n,) prompt token ids.
        context: the context window in tokens (state capacity).
        sampling: sampling settings.
        cancel: set from any thread to stop within one token.
    """

    model: Qwen35Model
    tokenizer: Tokenizer
    prompt: Sequence[int]
    context: int
    sampling: SamplingParams
    cancel: threading.Event


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def prefill(model: Qwen35Model, tokens: Sequence[int], state: SequenceState,
            cancel: threading.Event) -> np.ndarray | None:
    """Run ``tokens`` through the model in pieces of :data:`PREFILL_PIECE`.

    Args:
        model: the text model.
        tokens: (n,) token ids, n >= 1.
        state: sequence state, advanced in place by n positions.
        cancel: checked between pieces.

    Returns:
        (n_vocab,) float32 logits of the last token, or None when cancelled.
    """
    logits = None
    for start in range(0, len(tokens), PREFILL_PIECE):
        if cancel.is_set():
            return None
        piece = np.asarray(tokens[start:start + PREFILL_PIECE], dtype=np.int64)
        logits = model.forward(piece, state)[-1]
    return logits


def run_turn(turn: Turn) -> Iterator[Event]:
    """Generate one answer for ``turn.prompt``.

    Yields one :class:`PrefillStats`, a :class:`TokenEvent` per token, then one :class:`TurnSummary`.
    Generation stops at an end-of-generation token, ``sampling.max_tokens``, a full context
    (stop_reason "context_full" with the context size in the message) or a cancel (checked before
    every forward call, so it takes effect within one token).
    """
    t_start = time.perf_counter()
    n_prompt = len(turn.prompt)
    empty = dict(prompt_tokens=n_prompt, reused_tokens=0, generated_tokens=0, ttft_ms=0.0,
                 prefill_tok_s=0.0, decode_tok_s=0.0, text="")
    if n_prompt >= turn.context:
        yield TurnSummary(stop_reason="context_full", message=(
            f"The prompt is {n_prompt} tokens but the context window holds {turn.context}: "
            "start a new conversation or raise the context size."), **empty)
        return
    state = SequenceState.new(turn.model.hp, turn.context)
    t0 = time.perf_counter()
    logits = prefill(turn.model, turn.prompt, state, turn.cancel)
    prefill_ms = _ms(t0)
    if logits is None:
        yield TurnSummary(stop_reason="cancelled", message="Stopped during prefill.", **empty)
        return
    sampler = Sampler(turn.sampling)
    history = list(turn.prompt)
    t_tok = time.perf_counter()
    token = sampler.sample(logits, history)
    stats = PrefillStats(prompt_tokens=n_prompt, reused_tokens=0, prefilled_tokens=n_prompt,
                         prefill_ms=prefill_ms, restore_ms=0.0, device="cpu", ttft_ms=_ms(t_start))
    yield stats

    stream = turn.tokenizer.stream()
    stop_ids = turn.tokenizer.eos_ids
    pieces: list[str] = []
    token_ms: list[float] = []
    reason, message = "max_tokens", f"Reached the limit of {turn.sampling.max_tokens} tokens."
    for index in range(turn.sampling.max_tokens):
        if token in stop_ids:
            reason, message = "eos", ""
            break
        history.append(token)
        text = stream.push(token)
        pieces.append(text)
        ms = _ms(t_tok)
        token_ms.append(ms)
        yield TokenEvent(token_id=token, text=text, ms=ms, index=index)
        if turn.cancel.is_set():
            reason, message = "cancelled", "Stopped by the user."
            break
        if state.pos >= turn.context:
            reason, message = "context_full", (
                f"The context window of {turn.context} tokens is full: start a new conversation "
                "or raise the context size.")
            break
        if index + 1 == turn.sampling.max_tokens:
            break
        t_tok = time.perf_counter()
        logits = turn.model.forward(np.asarray([token], dtype=np.int64), state)[-1]
        token = sampler.sample(logits, history)
    tail = stream.flush()
    pieces.append(tail)
    decode_s = sum(token_ms[1:]) / 1e3
    yield TurnSummary(
        stop_reason=reason,  # type: ignore[arg-type]
        message=message,
        prompt_tokens=n_prompt,
        reused_tokens=0,
        generated_tokens=len(token_ms),
        ttft_ms=stats.ttft_ms,
        prefill_tok_s=stats.prefill_tok_s,
        decode_tok_s=(len(token_ms) - 1) / decode_s if decode_s > 0 else 0.0,
        text="".join(pieces),
        token_ms=tuple(token_ms),
    )
