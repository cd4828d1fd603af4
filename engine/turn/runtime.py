"""One chat turn: prompt tokens -> prefix-cache lookup -> prefill -> decode loop, as events.

Prefill resumes from the deepest cached snapshot of the
prompt's prefix and checkpoints the state at the positions the caller names (message boundaries,
the assistant header), every ``snapshot_interval`` tokens (interval snapshots: the cache thins them once a
later turn goes past them), where the prompt leaves the cached paths, and at the end of the prompt (with its
logits, so a regenerate prefills nothing).
GPU prefill plugs in at :func:`prefill`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

import numpy as np

from ..channels import ChannelSplitter
from ..errors import DeviceError
from ..events import Event, PrefillProgress, PrefillStats, TokenEvent, TurnSummary
from .batch import Step, steps_answered
from .grammar import Grammar
from .prefix_cache import PrefixCache, chain_keys
from ..registry import GpuPrefill, TextModel
from ..sampling import Sampler, SamplingParams, logprobs
from .state import SequenceState
from ..prompt.tokenizer import Tokenizer

# Prompt tokens per forward call during prefill: a cancel request is seen between pieces, and the
# activations of one piece stay small. Where the pieces are cut changes no result (the model is
# split-invariant: engine.registry.TextModel).
PREFILL_PIECE = 256
PROMPT_TAIL = 16
"""Prompt tokens whose text the family's channel rule reads (the assistant header and any ``<think>``)."""


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
        cache: the prefix snapshot cache, or None for none.
        checkpoints: prompt positions to snapshot at (message boundaries, assistant header).
        snapshot_interval: also snapshot every this many prompt tokens (0 = off).
        conversation: conversation id recorded with the snapshots.
        positions: (3, n) int64 M-RoPE positions of the prompt (None = plain positions 0..n-1, as
            for text only).
        decode_positions: the family's rotary positions of decoded tokens
            (:attr:`engine.registry.TextArch.decode_positions`); None = plain positions (the cache slot).
        images: the prompt's images as (first image-pad index, (k, n_embd) float32 embeddings,
            content digest bytes); their rows replace the token embeddings of the k pads.
        gpu: the GPU prefill backend (see :func:`prefill`), or None for CPU prefill.
        gpu_min_tokens: shortest stretch of prompt worth a GPU pass.
        on_device_error: called with the message when the GPU fails (the turn goes on on the CPU).
        grammar: constrains the answer (:mod:`engine.turn.grammar`; end-of-generation ids only where it may end,
            the only ids once it has ended), or None.
        kv_type: the KV type of a fresh state (:data:`engine.turn.state.KV_TYPES`; the cache's own when it has one).
        started: ``time.perf_counter()`` when the caller began the turn (before rendering the
            template and encoding images), the origin of TTFT; None = when :func:`run_turn` starts.
        rerenders: ``rerenders(answer_ids)`` tells whether the next turn's prompt will contain
            ``prompt + answer_ids`` (answer ending with its stop token) unchanged; then the state
            after the stop token is snapshotted. None = never.
        channels: the family's ``prompt_tail -> splitter`` (:attr:`engine.registry.TextArch.channels`) that
            tags each token with its channel; None = all content.
    """

    model: TextModel
    tokenizer: Tokenizer
    prompt: Sequence[int]
    context: int
    sampling: SamplingParams
    cancel: threading.Event
    cache: PrefixCache | None = None
    checkpoints: Sequence[int] = ()
    snapshot_interval: int = 512
    conversation: str = ""
    positions: np.ndarray | None = None
    images: Sequence[tuple[int, np.ndarray, bytes]] = ()
    gpu: GpuPrefill | None = None
    gpu_min_tokens: int = 32
    on_device_error: Callable[[str], None] | None = None
    rerenders: Callable[[Sequence[int]], bool] | None = None
    channels: Callable[[str], ChannelSplitter] | None = None
    decode_positions: Callable[[np.ndarray | None, int, int], np.ndarray] | None = None
    started: float | None = None
    grammar: Grammar | None = None
    kv_type: str = "f32"

    def image_digests(self) -> dict[int, bytes]:
        """Prompt index -> content digest of the image whose embedding sits there (cache keys)."""
        return {start + k: digest for start, emb, digest in self.images for k in range(len(emb))}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _inputs(model: TextModel, tokens: Sequence[int], a: int, b: int, positions: np.ndarray | None,
            images: Sequence[tuple[int, np.ndarray, bytes]]) -> dict:
    """forward() keyword arguments for prompt slice [a, b): M-RoPE positions, image rows spliced in."""
    kw: dict = {}
    if positions is not None:
        kw["positions"] = positions[:, a:b]
    spans = [(start, emb) for start, emb, _ in images if start < b and start + len(emb) > a]
    if spans:
        rows = model.embed(np.asarray(tokens[a:b], dtype=np.int64)).copy()
        for start, emb in spans:
            lo, hi = max(a, start), min(b, start + len(emb))
            rows[lo - a:hi - a] = emb[lo - start:hi - start]
        kw["embeddings"] = rows
    return kw


def prefill_pieces(model: TextModel, tokens: Sequence[int], state: SequenceState, cancel: threading.Event,  # noqa: PLR0913
            stops: Sequence[int] = (), on_stop=None, positions: np.ndarray | None = None,
            images: Sequence[tuple[int, np.ndarray, bytes]] = (), gpu: GpuPrefill | None = None,
            gpu_min_tokens: int = 32, devices: list[str] | None = None,
            piece_tokens: int = PREFILL_PIECE) -> Iterator[PrefillProgress]:
    """Run ``tokens[state.pos:]`` through the model, in pieces; a generator.

    Yields a :class:`PrefillProgress` after every piece; its return value (``logits = yield from
    prefill_pieces(...)``) is what Returns says. :func:`prefill` is the same without progress.

    Args:
        model: the text model (the CPU path).
        tokens: (n,) the whole prompt; the state has already read ``tokens[:state.pos]``.
        state: sequence state, advanced in place to n.
        cancel: checked between pieces.
        stops: positions where a piece must end (snapshot points).
        on_stop: ``on_stop(pos, last_logits)`` called when the state reaches a position in ``stops``.
        positions: (3, n) M-RoPE positions of the whole prompt, or None for plain positions.
        images: (first pad index, (k, n_embd) embeddings, digest) per image of the prompt.
        gpu: an object with ``prefill(tokens, state, positions) -> logits`` (a
            :class:`engine.arch.qwen35.cuda.CudaPrefill`), or None. Each stretch between stops of at
            least ``gpu_min_tokens`` text tokens runs on it in one pass (each pass streams every
            routed expert once, so it is not cut into pieces); shorter stretches and stretches
            holding image rows run on the CPU in pieces of ``piece_tokens``.
        devices: when given, "cuda" or "cpu" is appended for every piece run.
        piece_tokens: CPU piece length (the cancel is checked between pieces; results do not depend on it).

    Returns:
        (n_vocab,) float32 logits of the last token, or None when cancelled.

    Raises:
        DeviceError: the GPU failed; the state is left at the end of the last finished piece.
    """
    n = len(tokens)
    logits = None
    stop_set = set(stops)
    t0 = time.perf_counter()
    bounds = sorted({p for p in stop_set if state.pos < p < n}) + [n]
    for stop in bounds:
        start = state.pos
        on_gpu = (gpu is not None and stop - start >= gpu_min_tokens
                  and not any(s < stop and s + len(e) > start for s, e, _ in images))
        ends = [stop] if on_gpu else list(range(start + piece_tokens, stop, piece_tokens)) + [stop]
        for end in ends:
            if cancel.is_set():
                return None
            a = state.pos
            piece = np.asarray(tokens[a:end], dtype=np.int64)
            kw = _inputs(model, tokens, a, end, positions, images)
            if on_gpu:
                logits = gpu.prefill(piece, state, kw.get("positions"))
            else:
                logits = model.forward(piece, state, **kw)[-1]
            if devices is not None:
                devices.append("cuda" if on_gpu else "cpu")
            yield PrefillProgress(done=state.pos, total=n, elapsed_ms=_ms(t0))
        if on_stop is not None and stop in stop_set and stop < n:
            on_stop(stop, logits)
    return logits


def prefill(*args, **kwargs) -> np.ndarray | None:
    """:func:`prefill_pieces` run to the end: the (n_vocab,) float32 logits of the last prompt
    token, or None when cancelled. Same arguments."""
    return _drain(prefill_pieces(*args, **kwargs))


def _drain(pieces: Iterator[PrefillProgress]) -> np.ndarray | None:
    """Run a :func:`prefill_pieces` generator to its end and return its value."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


AHEAD_PIECE = 32
"""CPU piece length of :func:`read_ahead`: a send that cancels it waits at most one such piece."""


def read_ahead(turn: Turn) -> PrefillStats | None:
    """Prefill ``turn.prompt``, a prefix the next turn's prompt will start with, into the prefix cache.

    Resumes from the deepest snapshot of the prefix, reads the rest in pieces of
    :data:`AHEAD_PIECE` (checking ``turn.cancel`` between them), snapshots at ``turn.checkpoints``
    and at the end of the prefix (without logits: a turn continues from there). Sampling settings
    are not used. The snapshot equals what the next turn would compute itself (prefill is
    split-invariant, :class:`engine.registry.TextModel`), so reading ahead changes no answer.

    Returns:
        PrefillStats of the work (``prompt_tokens`` = the prefix length, ``ttft_ms`` 0), or None when
        cancelled, without a cache, or for an empty prefix or one that does not fit the context.

    Raises:
        DeviceError is not raised: a GPU failure is reported to ``turn.on_device_error`` and the
        prefill goes on on the CPU.
    """
    cache, n = turn.cache, len(turn.prompt)
    if cache is None or n == 0 or n >= turn.context:
        return None
    digests = turn.image_digests()
    keys = chain_keys(cache.identity, turn.prompt, digests)
    if cache.contains(keys[n]):
        return PrefillStats(prompt_tokens=n, reused_tokens=n, prefilled_tokens=0, prefill_ms=0.0, restore_ms=0.0,
                            device="cpu", ttft_ms=0.0)
    hit = cache.lookup(turn.prompt, turn.context, images=digests, keys=keys)
    state = hit.state

    def snapshot(pos: int, last: np.ndarray | None) -> None:
        cache.put(keys[pos], state, turn.prompt[:pos], None, images=digests, conversation=turn.conversation,
                  keys=keys)

    t0 = time.perf_counter()
    devices: list[str] = []
    logits, _ = _drain(_prefill(turn, state, set(turn.checkpoints), snapshot, devices, AHEAD_PIECE))
    if logits is None:
        return None
    cache.put(keys[n], state, turn.prompt, None, images=digests, conversation=turn.conversation, keys=keys)
    return PrefillStats(prompt_tokens=n, reused_tokens=hit.reused, prefilled_tokens=n - hit.reused,
                        prefill_ms=_ms(t0), restore_ms=hit.restore_ms,
                        device="cuda" if "cuda" in devices else "cpu", ttft_ms=0.0)


Snapshot = Callable[[int, "np.ndarray | None"], None]
"""``snapshot(pos, logits)``: store the state after prompt position ``pos`` (logits: of that position, or None)."""


def _prefill(turn: Turn, state: SequenceState, stops: set[int], snapshot: Snapshot | None, devices: list[str],
             piece_tokens: int = PREFILL_PIECE) -> Generator[PrefillProgress, None, tuple[np.ndarray | None, str]]:
    """:func:`prefill_pieces` of the turn's prompt on its GPU, going on on the CPU when the GPU fails.

    Returns (through ``yield from``): the last prompt token's logits (None when cancelled) and a note
    naming the GPU failure ("" without one).
    """
    gpu, note = turn.gpu, ""
    while True:
        try:
            logits = yield from prefill_pieces(turn.model, turn.prompt, state, turn.cancel, sorted(stops), snapshot,
                                               turn.positions, turn.images, gpu, turn.gpu_min_tokens, devices,
                                               piece_tokens=piece_tokens)
            return logits, note
        except DeviceError as exc:
            note = f"GPU prefill failed, continuing on the CPU: {exc}"
            if turn.on_device_error is not None:
                turn.on_device_error(str(exc))
            gpu = None


@dataclass
class _Resumed:
    """Where a turn starts: the state restored from the deepest cached prefix (or a fresh one).

    Attributes:
        state: the sequence state, at ``reused`` positions.
        reused: prompt tokens restored. restore_ms: time the restore took.
        logits: the last prompt token's logits when the whole prompt was cached, else None.
        stops: prompt positions to cut prefill at (and snapshot after).
        digests: image digests by prompt index (cache keys). keys: the prompt's chain keys, or None without a cache.
        snapshot: stores the state after a prompt position, or None without a cache.
        turn: the cache's :attr:`~engine.turn.prefix_cache.Lookup.turn` of this turn (0 without a cache).
    """

    state: SequenceState
    reused: int
    restore_ms: float
    logits: np.ndarray | None
    stops: set[int]
    digests: dict[int, bytes]
    keys: list[bytes] | None
    snapshot: Snapshot | None
    turn: int = 0


def _resume(turn: Turn) -> _Resumed:
    """Look the prompt up in the prefix cache and pick the snapshot positions of its prefill."""
    cache, n = turn.cache, len(turn.prompt)
    if cache is None:
        return _Resumed(SequenceState.new(turn.model.hp, turn.context, turn.kv_type), 0, 0.0, None, set(), {}, None,
                        None)
    digests = turn.image_digests()
    keys = chain_keys(cache.identity, turn.prompt, digests)
    hit = cache.lookup(turn.prompt, turn.context, images=digests, keys=keys)
    stops = set(turn.checkpoints) | {hit.diverge}
    intervals: set[int] = set()
    if turn.gpu is not None:
        # one GPU pass streams every routed expert: cut only where the next turns resume
        stops = {hit.diverge} | set(list(turn.checkpoints)[-1:])
    elif turn.snapshot_interval:
        intervals = set(range(turn.snapshot_interval, n, turn.snapshot_interval)) - stops
        stops |= intervals

    def snapshot(pos: int, last: np.ndarray | None) -> None:
        cache.put(keys[pos], hit.state, turn.prompt[:pos], last, images=digests, conversation=turn.conversation,
                  keys=keys, turn=hit.turn, interval=pos in intervals)

    return _Resumed(hit.state, hit.reused, hit.restore_ms, hit.logits, stops, digests, keys, snapshot, hit.turn)


def _summary(turn: Turn, reused: int, stop_reason: str, message: str) -> TurnSummary:
    """The :class:`TurnSummary` of a turn that ended before its first token."""
    return TurnSummary.of_turn(stop_reason, message, None, (), prompt_tokens=len(turn.prompt),  # type: ignore[arg-type]
                               reused_tokens=reused)


def run_turn(turn: Turn) -> Iterator[Event | Step]:
    """Generate one answer for ``turn.prompt``.

    Yields a :class:`PrefillProgress` per prompt piece read, one :class:`PrefillStats`, a
    :class:`TokenEvent` per token, then one :class:`TurnSummary`; when advanced by a caller that answers
    decode steps (:func:`engine.turn.batch.answering_steps`), also a :class:`~engine.turn.batch.Step` before
    each decode forward, whose ``logits`` that caller sets before advancing the turn again.
    Generation stops at an end-of-generation token (with a grammar, the only tokens allowed once it has
    ended: stop reason "eos"), ``sampling.max_tokens``, a full context
    (stop_reason "context_full" with the context size in the message) or a cancel (checked before
    every forward call, so it takes effect within one token).
    """
    t_start = turn.started if turn.started is not None else time.perf_counter()
    n_prompt = len(turn.prompt)
    if n_prompt >= turn.context:
        yield _summary(turn, 0, "context_full",
                       f"The prompt is {n_prompt} tokens but the context window holds {turn.context}: "
                       "start a new conversation or raise the context size.")
        return
    resumed = _resume(turn)
    t0 = time.perf_counter()
    devices: list[str] = []
    logits, note = resumed.logits, ""
    if logits is None:
        logits, note = yield from _prefill(turn, resumed.state, resumed.stops, resumed.snapshot, devices)
        if logits is None:
            yield _summary(turn, resumed.reused, "cancelled", "Stopped during prefill.")
            return
        if turn.cache is not None:
            turn.cache.put(resumed.keys[n_prompt], resumed.state, turn.prompt, logits, images=resumed.digests,
                           conversation=turn.conversation, keys=resumed.keys, turn=resumed.turn)
    prefill_ms = _ms(t0)
    matcher = None if turn.grammar is None else turn.grammar.matcher()
    sampler, history = Sampler(turn.sampling, matcher, n_prompt), list(turn.prompt)
    t_tok = time.perf_counter()
    token = sampler.sample(logits, history)
    stats = PrefillStats(prompt_tokens=n_prompt, reused_tokens=resumed.reused,
                         prefilled_tokens=n_prompt - resumed.reused, prefill_ms=prefill_ms,
                         restore_ms=resumed.restore_ms, device="cuda" if "cuda" in devices else "cpu",
                         ttft_ms=_ms(t_start), note=note)
    yield stats
    yield from _decode(turn, resumed, sampler, history, token, logits, t_tok, stats)


class _Stepper:
    """Decodes one token at a time at the next cache slot and the rotary positions the family gives the
    k-th decoded token (``turn.decode_positions``; plain positions without one)."""

    def __init__(self, turn: Turn, state: SequenceState) -> None:
        self.model, self.state, self.turn = turn.model, state, turn
        self.k = 0

    def __call__(self, token: int) -> Generator[Step, None, np.ndarray]:
        """(n_vocab,) float32 logits after ``token`` (``yield from``): the :class:`Step` is yielded to a caller
        that answers steps (:func:`engine.turn.batch.answering_steps`), else answered here."""
        rule, turn = self.turn.decode_positions, self.turn
        pos = None if rule is None else rule(turn.positions, len(turn.prompt), self.k)
        self.k += 1
        step = Step(self.model, token, self.state, pos)
        if steps_answered():
            yield step
        return step.logits if step.logits is not None else step.answer_alone()


def _keep_answer_end(turn: Turn, resumed: _Resumed, step: _Stepper, history: list[int],
                     token: int) -> Generator[Step, None, None]:
    """Snapshot the state after an answer's stop token when the next turn's prompt re-renders the answer
    token for token (``turn.rerenders``), so that turn resumes after it."""
    cache, state = turn.cache, resumed.state
    answer = history[len(turn.prompt):] + [token]
    if cache is None or state.pos >= turn.context or turn.rerenders is None or not turn.rerenders(answer):
        return
    yield from step(token)
    history.append(token)
    keys = chain_keys(cache.identity, history, resumed.digests)
    cache.put(keys[-1], state, history, None, images=resumed.digests, conversation=turn.conversation, keys=keys)


def _decode(turn: Turn, resumed: _Resumed, sampler: Sampler, history: list[int], token: int, logits: np.ndarray,
            t_tok: float, stats: PrefillStats) -> Iterator[Event | Step]:
    """Emit ``token`` (sampled from the prompt's ``logits`` at ``t_tok``), then decode and sample token by token
    until a stop (:func:`run_turn` lists them); ends with the :class:`TurnSummary`."""
    step = _Stepper(turn, resumed.state)
    stream, stop_ids = turn.tokenizer.stream(), turn.tokenizer.eos_ids
    split = None if turn.channels is None else turn.channels(turn.tokenizer.decode(turn.prompt[-PROMPT_TAIL:]))
    pieces: list[str] = []
    token_ms: list[float] = []
    reason, message = "max_tokens", f"Reached the limit of {turn.sampling.max_tokens} tokens."
    for index in range(turn.sampling.max_tokens):
        if token in stop_ids:
            reason, message = "eos", ""
            yield from _keep_answer_end(turn, resumed, step, history, token)
            break
        if resumed.state.pos >= turn.context:
            reason, message = "context_full", (
                f"The context window of {turn.context} tokens is full: start a new conversation "
                "or raise the context size.")
            break
        history.append(token)
        text = stream.push(token)
        pieces.append(text)
        top = turn.sampling.top_logprobs
        lp, alts = (None, ()) if top is None else logprobs(logits, token, top)
        token_ms.append(_ms(t_tok))
        parts = None if split is None else tuple(split.push(text))
        yield TokenEvent(token_id=token, text=text, ms=token_ms[-1], index=index, logprob=lp, top_logprobs=alts,
                         channel="content" if split is None else split.channel, parts=parts)
        if turn.cancel.is_set():
            reason, message = "cancelled", "Stopped by the user."
            break
        if index + 1 == turn.sampling.max_tokens:
            break
        t_tok = time.perf_counter()
        logits = yield from step(token)
        token = sampler.sample(logits, history)
    pieces.append(stream.flush())
    tail = [("content", pieces[-1])] if split is None else split.push(pieces[-1]) + split.close()
    yield TurnSummary.of_turn(reason, message, stats, token_ms, "".join(pieces),  # type: ignore[arg-type]
                              parts=tuple(p for p in tail if p[1]))
