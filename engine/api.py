"""The engine's public surface: load a model once, then chat with it turn by turn.

Usage::

    engine = Engine.load("model.gguf")
    for event in engine.chat([{"role": "user", "content": "Hello"}], SamplingParams.greedy(64)):
        ...  # PrefillStats, then TokenEvent per token, then TurnSummary

Everything here is synchronous and Qt-free, and an :class:`Engine` is not thread-safe: callers on
several threads share it through one :class:`engine.session.Session`, which runs all its work.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from . import placement
from .api_types import ChatEngine, EngineOptions, ModelInfo
from .demo_model import bundled_mmproj_for, bundled_model, default_model
from .errors import EngineError, GenerationCancelled, TemplateError, UnsupportedModelError
from .events import Event, PrefillStats
from .turn.grammar import Grammar, compile_grammar, grammar_tokenizer
from .vision.images import ImageInfo, ImageSource
from .turn.prefix_cache import PrefixCache, SnapshotInfo
from .prompt.builder import Message, Prompt, PromptBuilder, text_bytes
from .reap.pruned import pruning_summary
from .registry import GpuPrefill, LoadedText, TextModel, open_projector, open_text
from .turn.runtime import Turn, read_ahead, run_turn
from .sampling import SamplingParams
from .prompt.tokenizer import Tokenizer
from .vision.encoder import ImageEncoder
from .turn.state import check_memory

log = logging.getLogger(__name__)

__all__ = ["CHATML_NOTE", "ChatEngine", "Engine", "EngineOptions", "ModelInfo", "Prompt", "SamplingParams",
           "SnapshotInfo", "bundled_mmproj_for", "bundled_model", "default_model"]

CHATML_NOTE = "the file has no tokenizer.chat_template, so chat uses ChatML (the Qwen format)"
"""The one-line notice (:attr:`ModelInfo.template_note`) for a model whose chat falls back to ChatML."""
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello! How can I help?"},
                      {"role": "user", "content": "Say something."})
"""The conversation every chat template is rendered on at load (:meth:`Engine.load`)."""


class Engine:
    """A loaded model: GGUF file, tokenizer, chat template and text model.

    Build it with :meth:`load`. Use it from one thread at a time: a shared engine is driven by the jobs of
    its :class:`engine.session.Session` only. A turn runs as its events are read; turns of one thread may be
    read interleaved (the session's batch). Misuse is refused, not raced: :meth:`chat` and :meth:`generate` on
    another thread while a turn's events are not all read, and :meth:`prefill_ahead` and :meth:`close` while
    any is not, raise :class:`~engine.errors.EngineError` at once.
    """

    def __init__(self, text: LoadedText, tokenizer: Tokenizer, model: TextModel,
                 options: EngineOptions, vision: ImageEncoder | None = None, gpu: GpuPrefill | None = None,
                 device_note: str = "") -> None:
        self.text = text
        self.vision = vision
        self.gpu = gpu
        self.device_note = device_note
        self.tokenizer = tokenizer
        self.model = model
        self.options = options
        hp, gguf = text.hparams, text.file
        self.context = min(options.context, hp.context_length)
        self.cache = PrefixCache(hp, gguf.identity, options.cache_ram_bytes, options.cache_disk_dir,
                                 options.cache_disk_bytes, options.kv_type) if options.prefix_cache else None
        self.prompts = PromptBuilder(tokenizer, vision, gguf.source, gguf.path.name, self.context,
                                     markup=text.arch.markup)
        self._closed = False
        self._use = threading.Lock()       # guards the two fields below; held only to read or change them
        self._turns = 0                    # turns whose events are not all read (refuses overlapping use)
        self._owner: int | None = None     # the thread those turns run on
        self._grammar_tokens: Any = None                      # llguidance's token table, built on first use
        self._grammar_lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str | Path, mmproj_path: str | Path | None = None,
             options: EngineOptions = EngineOptions(), progress: Callable[[str], None] | None = None,
             cancel: threading.Event | None = None) -> "Engine":
        """Open a Qwen3.5/3.6 GGUF text model (memory-mapped), its tokenizer and optionally its
        mmproj vision tower, and place weights for GPU prefill when a GPU works.

        Args:
            progress: called with the name of each stage as it starts ("mapping tensors",
                "building the tokenizer", "preparing weights", "loading the vision tower",
                "placing weights on the GPU").
            cancel: checked between stages.

        Raises:
            ModelFormatError: a file is malformed (names the file and the key or tensor), or the
                mmproj's projection width differs from the text model's hidden size.
            UnsupportedModelError: wrong architecture or unsupported quant type.
            TokenizerError: tokenizer metadata missing or unusable (a file without a chat template
                chats in ChatML, see :meth:`render`).
            TemplateError: the chat template fails on :data:`PROBE_CONVERSATION` (the sandbox blocks
                it, it raises, it runs too long); the message names the file.
            GenerationCancelled: ``cancel`` was set.
            MemoryFitError: ``options.parallel`` states of the context (KV cache of ``options.kv_type``) plus the
                prefix cache's RAM budget need more memory than is available (:func:`engine.turn.state.check_memory`),
                checked before any weight is prepared.
            ValueError: ``options.parallel`` below 1, an unknown ``options.kv_type``, or "q8_0" on a model whose
                head_dim is not a multiple of 32.
            EngineError: ``options.weights`` unknown. MemoryFitError: also ``options.weights`` "ram" and the file
                does not fit the available memory (before it is read).

        On any exception (KeyboardInterrupt included) the GPU vision tower and GPU prefill made so far
        are released first; the memory map is released with the objects.
        """
        def stage(name: str) -> None:
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled(f"loading {Path(model_path).name} was cancelled")
            if progress is not None:
                progress(name)

        if options.device not in ("auto", "cuda", "cpu"):
            raise EngineError(f"device must be 'auto', 'cuda' or 'cpu', got {options.device!r}")
        if options.parallel < 1:
            raise ValueError(f"EngineOptions.parallel must be at least 1 turn, got {options.parallel}")
        stage("mapping tensors")
        text = open_text(model_path, placement.weights_mode(options, model_path))
        gguf = text.file
        check_memory(text.hparams.state_layout(), min(options.context, text.hparams.context_length), options.kv_type,
                     sequences=options.parallel, reserved=options.cache_ram_bytes if options.prefix_cache else 0)
        stage("building the tokenizer")
        tokenizer = Tokenizer.from_gguf(gguf.meta, gguf.source)
        if tokenizer.chat_template is not None:
            try:
                tokenizer.chat_template.render(list(PROBE_CONVERSATION), enable_thinking=False)
            except TemplateError as exc:
                raise TemplateError(f"{exc} (the chat template was tried on a probe conversation at load)") from exc
        stage("preparing weights")
        model = placement.text_model(text, options)
        vision = gpu = None
        try:
            if mmproj_path is not None:
                stage("loading the vision tower")
                vision = placement.open_vision(open_projector(mmproj_path), text, options)
            if options.device != "cpu":
                stage("placing weights on the GPU")
            gpu, note = placement.open_gpu(text, options, vision)
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled(f"loading {Path(model_path).name} was cancelled")
            return cls(text, tokenizer, model, options, vision, gpu, note)
        except BaseException:
            placement.release(gpu, vision.gpu if vision is not None else None)
            raise

    @property
    def info(self) -> ModelInfo:
        """Summary of the loaded model (see :class:`ModelInfo`)."""
        hp, gguf = self.text.hparams, self.text.file
        n_attn = sum(not hp.is_recurrent(i) for i in range(hp.n_layer))
        return ModelInfo(path=gguf.path, arch=hp.arch, n_layer=hp.n_layer, n_attn_layers=n_attn,
                         n_params=sum(math.prod(gguf.info(n).ne) for n in gguf.tensor_names),
                         quant_mix=gguf.quant_mix(),
                         bytes_per_token=self.text.bytes_per_token(), context=self.context,
                         has_vision=self.vision is not None, device="cuda" if self.gpu is not None else "cpu",
                         device_note=self.device_note,
                         placement=self.gpu.plan.text() if self.gpu is not None else "",
                         vram_budget=self.gpu.plan.budget if self.gpu is not None else 0,
                         vision_device=self.vision.device if self.vision is not None else "",
                         vision_note=self.vision.device_note if self.vision is not None else "",
                         template_note=CHATML_NOTE if self.tokenizer.chat_template is None else "",
                         pruning=pruning_summary(self.text), weights="ram" if gguf.resident else "map")

    def telemetry(self) -> Any:
        """The last GPU prefill's :class:`~engine.kernels.moe_stream.PrefillTelemetry` (H2D bytes and
        GB/s, VRAM used/free/budget, per-layer ms), or None when prefill runs on the CPU."""
        return None if self.gpu is None else self.gpu.last_telemetry

    def _gpu_failed(self, message: str) -> None:
        """A GPU prefill failed: free the GPU and prefill on the CPU from now on."""
        self.device_note = f"GPU prefill failed, using the CPU: {message}"
        log.warning(self.device_note)
        gpu, self.gpu = self.gpu, None
        try:
            gpu.close()
        except Exception as exc:  # noqa: BLE001 - a broken CUDA context must not end the CPU fallback
            log.warning("releasing the failed GPU: %s", exc)

    def render(self, messages: Sequence[Message], enable_thinking: bool = False,
               tools: Sequence[Message] | None = None) -> list[int]:
        """Render ``messages`` with the model's chat template and tokenize the prompt.

        A file without ``tokenizer.chat_template`` is rendered as ChatML, the Qwen format
        (``engine/prompt/templates/chatml.jinja``; :attr:`ModelInfo.template_note` says so). Each image part
        stays a single ``<|image_pad|>``; :meth:`prepare` expands it. Only the template's markup makes
        control ids: text in the messages is read as plain text, so ``<|im_end|>`` or ``<think>``
        typed by a user cannot open a turn or a think block
        (:meth:`engine.prompt.tokenizer.Tokenizer.escape_messages`; the text of ``tools`` too).
        ``tools``: OpenAI function tools (``{"type": "function", "function": {"name", "description",
        "parameters"}}``) the template renders (Qwen3.5/3.6: a ``# Tools`` section in the system message).

        Returns:
            Prompt token ids, ending with the assistant generation header.

        Raises:
            TemplateError: the template failed.
            ContextFullError: the messages' text is too large for the context window whatever its
                tokens (more bytes than ``context * Tokenizer.max_token_bytes``); a prompt that is
                merely longer than the window in tokens ends its turn with stop reason "context_full".
        """
        return self.prompts.render(messages, enable_thinking, tools)

    def prepare(self, messages: Sequence[Message], enable_thinking: bool = False,
                cancel: threading.Event | None = None, tools: Sequence[Message] | None = None) -> Prompt:
        """Render, tokenize and encode the images of ``messages`` (with ``tools``, see :meth:`render`): everything
        prefill needs.

        Image parts are ``{"type": "image", "image": path | bytes | PIL.Image}``; each becomes
        ``<|vision_start|>`` + one ``<|image_pad|>`` per image token + ``<|vision_end|>``, its
        embeddings from the vision tower (cached by content digest), and M-RoPE positions.

        Raises:
            TemplateError: see :meth:`render`.
            UnsupportedModelError: an image part but no vision tower loaded.
            ImageError: an image could not be read (names the file and what was expected).
        """
        return self.prompts.prepare(messages, enable_thinking, cancel, tools)

    def checkpoints(self, prompt: Sequence[int]) -> list[int]:
        """Prompt positions worth a snapshot: the start of every message (so the system prompt and
        every earlier message are a reusable prefix) and the end of the last assistant header
        ``<|im_start|>assistant\\n``, before any ``<think>`` the template appends: the next turn
        re-renders this answer without its thinking, so that is where the two prompts part.
        """
        return self.prompts.checkpoints(prompt)

    def chat(self, messages: Sequence[Message], sampling: SamplingParams = SamplingParams(),
             cancel: threading.Event | None = None, enable_thinking: bool = False,
             conversation: str = "", *, tools: Sequence[Message] | None = None,
             grammar: Grammar | None = None) -> Iterator[Event]:
        """Answer the conversation ``messages`` (the last one is usually the user's).

        The prompt resumes from the deepest prefix snapshot it shares (see
        :mod:`engine.turn.prefix_cache`); ``PrefillStats.reused_tokens`` says how many tokens that saved.

        Args:
            messages: chat messages (see docs/interfaces.md for the format).
            sampling: sampling settings.
            cancel: set from any thread to stop within one token.
            enable_thinking: let the model think (``<think>`` block) before answering.
            conversation: an id recorded with the snapshots, for the app's snapshot list.
            tools: OpenAI function tools for the chat template (see :meth:`render`).
            grammar: constrains the answer (:meth:`grammar`); with ``enable_thinking`` build it with
                ``reasoning=True``.

        Yields:
            :class:`~engine.events.PrefillStats`, then a :class:`~engine.events.TokenEvent` per
            generated token, then one :class:`~engine.events.TurnSummary`.

        Raises:
            TemplateError, UnsupportedModelError: see :meth:`render` (before any event).
        """
        started = time.perf_counter()
        self._enter("chat")
        try:
            prompt = self.prepare(messages, enable_thinking, cancel, tools)
        except BaseException:
            self._leave()
            raise

        def rerenders(answer: list[int]) -> bool:
            if prompt.images or (cancel is not None and cancel.is_set()):
                return False  # re-rendering would re-encode every image; answers after images rarely re-render
            return self.answer_rerenders(messages, prompt.tokens, answer, enable_thinking, tools)

        return self._released(self._turn(prompt.tokens, sampling, cancel, self.checkpoints(prompt.tokens),
                                         conversation, prompt, rerenders, started, grammar))

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                 cancel: threading.Event | None = None, checkpoints: Sequence[int] = (),
                 conversation: str = "", prompt: Prompt | None = None, rerenders: Any = None,
                 started: float | None = None, grammar: Grammar | None = None) -> Iterator[Event]:
        """Continue raw token ids (no chat template); same events as :meth:`chat`.

        Args:
            checkpoints: extra prompt positions to snapshot at.
            prompt: the :meth:`prepare` result the ids come from (M-RoPE positions, images).
            rerenders: see :class:`engine.turn.runtime.Turn` (snapshot the end of a finished answer).
            started: ``time.perf_counter()`` at the start of the turn (the origin of TTFT).
            grammar: constrains the answer (:meth:`grammar`).

        Raises:
            EngineError: the engine is closed, or another turn's events are not all read.
        """
        self._enter("generate")
        return self._released(self._turn(prompt_ids, sampling, cancel, checkpoints, conversation, prompt,
                                         rerenders, started, grammar))

    def _enter(self, what: str, alone: bool = False) -> None:
        """Mark a turn running, or refuse at once: the engine is closed, or a turn runs on another thread (with
        ``alone``: any turn runs)."""
        me = threading.get_ident()
        with self._use:
            if self._turns and (alone or self._owner != me):
                raise EngineError(f"{what}: another turn is still running on this engine; cancel it or read it "
                                  "to the end first (one thread at a time)")
            if self._closed:
                raise EngineError(f"{what}: the engine is closed")
            self._turns, self._owner = self._turns + 1, me

    def _leave(self) -> None:
        """A turn marked by :meth:`_enter` has ended."""
        with self._use:
            self._turns -= 1
            if not self._turns:
                self._owner = None

    def _released(self, events: Iterator[Event]) -> Iterator[Event]:
        """``events`` as an iterator that marks the engine free when it ends, is closed or is dropped (the
        generator is started here, so one never read frees it when garbage-collected)."""
        def run() -> Iterator[Any]:
            try:
                yield None
                yield from events
            finally:
                self._leave()

        held = run()
        next(held)
        return held

    def _turn(self, prompt_ids: Sequence[int], sampling: SamplingParams, cancel: threading.Event | None,
              checkpoints: Sequence[int], conversation: str, prompt: Prompt | None, rerenders: Any,
              started: float | None, grammar: Grammar | None = None) -> Iterator[Event]:
        """The turn of :meth:`generate` (its events run as they are read)."""
        turn = Turn(model=self.model, tokenizer=self.tokenizer, prompt=list(prompt_ids),
                    context=self.context, sampling=sampling, cancel=cancel or threading.Event(),
                    cache=self.cache, checkpoints=checkpoints,
                    snapshot_interval=self.options.snapshot_interval, conversation=conversation,
                    positions=None if prompt is None else prompt.positions,
                    images=() if prompt is None else prompt.images, gpu=self.gpu,
                    gpu_min_tokens=self.options.gpu_min_tokens, on_device_error=self._gpu_failed,
                    rerenders=rerenders, started=started, grammar=grammar, kv_type=self.options.kv_type,
                    channels=self.text.arch.channels, decode_positions=self.text.arch.decode_positions)
        return run_turn(turn)

    def complete(self, text: str, sampling: SamplingParams = SamplingParams(),
                 cancel: threading.Event | None = None, *, grammar: Grammar | None = None) -> Iterator[Event]:
        """Continue ``text`` as it is (raw completion: no chat template; special tokens written out in
        it, such as ``<|im_start|>``, are read as those tokens). Same events as :meth:`chat`; the turn
        stops at an end-of-generation token, ``sampling.max_tokens`` or the context's end. ``grammar``
        constrains the continuation (:meth:`grammar`).

        Raises:
            EngineError: ``text`` is empty (there is nothing to continue).
            ContextFullError: ``text`` is too large for the context window whatever its tokens (as in
                :meth:`render`); one merely longer in tokens ends its turn with stop reason "context_full".
        """
        started = time.perf_counter()
        self.prompts.check_text_fits(text_bytes(text), "The prompt", "shorten it")
        ids = self.tokenizer.encode(text, special=True)
        if not ids:
            raise EngineError("raw completion needs a prompt: the text is empty")
        return self.generate(ids, sampling, cancel, started=started, grammar=grammar)

    def prefill_ahead(self, messages: Sequence[Message], enable_thinking: bool = False,
                      cancel: threading.Event | None = None, conversation: str = "", *,
                      tools: Sequence[Message] | None = None) -> PrefillStats | None:
        """Read the conversation as the next turn will render it, up to the end of its last message, and
        snapshot it, so that the next :meth:`chat` prefills only its new message.

        Call it after a turn with the answer appended (``messages`` ending with that assistant message),
        while the user reads and types (``Session.read_ahead``); set ``cancel`` to stop it within one piece
        (:data:`engine.turn.runtime.AHEAD_PIECE` tokens). The next turn renders an earlier answer
        differently from the prompt it was generated after (Qwen's template drops the think scaffold of
        old turns), which is why the answer must be read again at all. The answer a later turn gives is
        the same with or without this call (prefill is split-invariant).

        Args:
            messages: the conversation so far (see :meth:`chat`).
            enable_thinking: as the next turn will pass it.
            cancel: set from any thread to stop between pieces.
            conversation: recorded with the snapshots.
            tools: the function tools the next turn will offer (an agent's are part of every prompt).

        Returns:
            :class:`~engine.events.PrefillStats` of the work (``prompt_tokens``: the prefix read,
            ``reused_tokens``: restored from a snapshot), or None when cancelled, without a prefix
            cache, or when the template renders earlier messages differently depending on the next one.

        Raises:
            EngineError: the engine is closed, or a turn is running. TemplateError, ImageError: as
            :meth:`prepare`.
        """
        self._enter("prefill_ahead", alone=True)
        try:
            return self._read_ahead(messages, enable_thinking, cancel or threading.Event(), tools, conversation)
        finally:
            self._leave()

    def _read_ahead(self, messages: Sequence[Message], enable_thinking: bool, cancel: threading.Event,
                    tools: Sequence[Message] | None, conversation: str) -> PrefillStats | None:
        """The body of :meth:`prefill_ahead`, with the engine marked in use."""
        if self.cache is None:
            return None
        ahead = self.prompts.ahead(messages, enable_thinking, cancel, tools)
        if ahead is None:
            return None
        follow, cut = ahead
        turn = Turn(model=self.model, tokenizer=self.tokenizer, prompt=follow.tokens[:cut], context=self.context,
                    sampling=SamplingParams(), cancel=cancel, cache=self.cache,
                    checkpoints=[p for p in self.checkpoints(follow.tokens) if p < cut],
                    conversation=conversation,
                    positions=None if follow.positions is None else follow.positions[:, :cut],
                    images=[img for img in follow.images if img[0] < cut], gpu=self.gpu,
                    gpu_min_tokens=self.options.gpu_min_tokens, on_device_error=self._gpu_failed)
        return read_ahead(turn)

    def answer_rerenders(self, messages: Sequence[Message], prompt: Sequence[int], answer: Sequence[int],
                         enable_thinking: bool = False, tools: Sequence[Message] | None = None) -> bool:
        """Whether the next turn's prompt starts with ``prompt + answer`` token for token.

        ``answer`` ends with its stop token. Only then is the state after the answer worth a
        snapshot. With the Qwen3.5/3.6 template it is False: the generation prompt opens a think
        block (empty when thinking is off) that the next turn's rendering of the answer drops.
        """
        text = self.tokenizer.decode(list(answer[:-1]))
        follow = list(messages) + [{"role": "assistant", "content": text}, {"role": "user", "content": "."}]
        try:
            nxt = self.prepare(follow, enable_thinking, tools=tools).tokens
        except EngineError:
            return False
        return nxt[:len(prompt) + len(answer)] == list(prompt) + list(answer)

    def grammar(self, *, lark: str | None = None, json_schema: Any = None, json_object: bool = False,
                reasoning: bool = False) -> Grammar:
        """Compile a grammar for this model's vocabulary, to pass to :meth:`chat` / :meth:`complete`.

        Exactly one of: ``lark`` (llguidance's lark dialect: ``%json {...}`` embeds a JSON schema, added tokens
        are named ``<tool_call>``, ``</think>``; docs/design/constrained-decoding.md), ``json_schema`` (a JSON
        Schema, enforced strictly: every keyword it uses must be enforceable), ``json_object`` (any JSON object).
        ``reasoning``: free text through the model's ``</think>`` first (the template opened ``<think>``), then
        the blank line Qwen writes, then the grammar. The token table is built on first use (1.5-3.5 s on the
        real vocabulary) and kept; a compiled grammar is immutable and may serve any number of answers.

        Raises:
            GrammarError: the grammar or schema is malformed or uses a feature llguidance cannot enforce (the
                message names it), or not exactly one kind was given.
        """
        with self._grammar_lock:
            if self._grammar_tokens is None:
                self._grammar_tokens = grammar_tokenizer(self.tokenizer)
        return compile_grammar(self._grammar_tokens, lark=lark, json_schema=json_schema, json_object=json_object,
                               reasoning=reasoning)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (added tokens: their text), e.g. for logprobs.

        Raises:
            TokenizerError: the id is outside the vocabulary.
        """
        return self.tokenizer.token_bytes(token_id)

    def snapshots(self) -> list[SnapshotInfo]:
        """The prefix snapshots held (RAM and disk), deepest first; [] without a prefix cache."""
        return [] if self.cache is None else self.cache.snapshots()

    def clear_snapshots(self, key: str | None = None) -> None:
        """Drop one prefix snapshot (``SnapshotInfo.key``) or all of them, from RAM and disk."""
        if self.cache is not None:
            self.cache.clear(key)

    def close(self) -> None:
        """Write the RAM prefix snapshots to the disk tier (when configured) and release the GPU
        (prefill and vision tower: device and pinned memory). Call it when the engine is dropped; it is
        not usable after. Each part is released even when an earlier one fails; the failure is then raised
        (a vision tower that fails to release is only logged, see :meth:`ImageEncoder.close`). A shared engine
        is closed by a job of its session (``session.call(engine.close)``), after which no turn runs.

        Raises:
            EngineError: a turn is still running (cancel it and let it end first); nothing is released.
        """
        with self._use:
            if self._turns:
                raise EngineError("close: a turn is still running on this engine; cancel it and let it end first")
            self._turns, self._closed = 1, True
        try:
            if self.cache is not None:
                self.cache.persist()
        finally:
            try:
                if self.vision is not None:
                    self.vision.close()
            finally:
                try:
                    if self.gpu is not None:
                        gpu, self.gpu = self.gpu, None
                        gpu.close()
                finally:
                    self._leave()

    def image_info(self, source: ImageSource) -> ImageInfo:
        """The size in pixels an image will have when it reaches the vision tower, and the image tokens
        (embedding rows) it takes in the prompt as its tower counts them: Qwen3.5/3.6 one per 2x2 merge
        of 16-px patches, MiniCPM-V 4.6 its pieces' tokens summed.

        Raises:
            UnsupportedModelError: no vision tower loaded. ImageError: unreadable image.
        """
        return self._vision_loaded().image_info(source)

    def _vision_loaded(self) -> ImageEncoder:
        if self.vision is None:
            raise UnsupportedModelError(f"{self.text.file.path.name}: no vision tower (mmproj file) is loaded")
        return self.vision
