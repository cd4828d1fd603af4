"""Will a GGUF run well here? RAM, VRAM and decode speed from its header and size, before downloading it.

RAM at a context of C tokens = mapped file + weights converted at load + sequence state at C +
vocabulary + vision tower; the verdict (*fits*, *tight*, *does not fit*) is against the machine's RAM
less :data:`OS_RESERVE`. Decode tok/s is an estimate: stream bandwidth x :data:`ROOFLINE` / weight
bytes per token. Design: docs/design/model-hub.md (each term and its source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType

from ..api_types import EngineOptions
from ..errors import DeviceError, EngineError, ModelFormatError
from ..gguf.file import GGUFFile
from ..gguf.header import Header
from ..registry import LoadedText
from ..turn.state import state_nbytes

GIB = 1 << 30
OS_RESERVE = 2 * GIB
"""RAM left to the OS, the desktop and the app itself, bytes."""
SNAPSHOT_RAM = 2 * GIB
"""The prefix snapshots' RAM budget (``EngineOptions.cache_ram_bytes``' default), bytes."""
VOCAB_BYTES_PER_ENTRY = 400
"""RAM per vocabulary token plus merge once the file is open and its tokenizer built (RSS growth of
``GGUFFile.open`` + ``Tokenizer.from_gguf`` on the synth files: 191 MiB for 248320 tokens + 247587 merges)."""
HEADER_BYTES_PER_ENTRY = 22
"""Header bytes per vocabulary token plus merge (their strings, lengths, scores and types): 10947200 bytes for
the 495907 entries of the real Qwen3.5/3.6 vocabulary in the synth files; the header-only first part of
unsloth's split Qwen3.5-122B-A10B Q4_K_M is 10943552 bytes."""
ROOFLINE = (0.55, 0.65, 0.85)
"""Low, typical and high fraction of the stream-read bandwidth decode reaches (docs/perf/log/cpu-notes.md: 2-thread
decode at 55-64 % of the stream read on the Xeon VM, 82-87 % on the EPYC VM)."""
_FLOAT = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


@dataclass(frozen=True)
class Machine:
    """What the estimate is made for.

    Attributes:
        ram_bytes: total RAM. bandwidth_gbps: measured stream-read bandwidth, GB/s (1e9 B/s).
        vram_budget: the GPU's VRAM budget in bytes, None without a GPU.
    """

    ram_bytes: int
    bandwidth_gbps: float
    vram_budget: int | None = None


@dataclass(frozen=True)
class Fit:
    """The estimate for one model file (and its mmproj). Sizes in bytes, speeds in tokens/s.

    Attributes:
        context: tokens the state is sized for. weights: the file, mapped. converted: weights converted at
        load. state: KV + recurrent state at ``context``. vocab: tokenizer. vision: the projector in float32.
        ram: their sum. budget: the machine's RAM less :data:`OS_RESERVE`. bytes_per_token: weight bytes
        read per decoded token. tok_s: (low, typical, high) decode estimate. vram: the GPU prefill plan (or
        why there is none). verdict: "fits", "tight" or "does not fit".
    """

    context: int
    weights: int
    converted: int
    state: int
    vocab: int
    vision: int
    ram: int
    budget: int
    bytes_per_token: int
    tok_s: tuple[float, float, float]
    vram: str
    verdict: str

    def summary(self) -> str:
        """One line: verdict, RAM, decode estimate."""
        return (f"{self.verdict}: needs {self.ram / GIB:.1f} GiB of RAM at {self.context} tokens of context "
                f"(of {self.budget / GIB:.1f} GiB usable); decode reads {self.bytes_per_token / 2**20:.0f} MiB "
                f"a token, about {self.tok_s[1]:.1f} tok/s here ({self.tok_s[0]:.1f}-{self.tok_s[2]:.1f}, "
                "an estimate)")

    def details(self) -> list[str]:
        """The terms of the estimate, one per line."""
        m = 2**20
        return [f"mapped weights  {self.weights / m:10.0f} MiB (the whole file)",
                f"converted       {self.converted / m:10.0f} MiB (weights without a native kernel)",
                f"KV + state      {self.state / m:10.0f} MiB at {self.context} tokens",
                f"vocabulary      {self.vocab / m:10.0f} MiB", f"vision tower    {self.vision / m:10.0f} MiB",
                (f"total RAM       {self.ram / m:10.0f} MiB of {self.budget / m:.0f} MiB usable "
                 f"(+ up to {SNAPSHOT_RAM / m:.0f} MiB of prefix snapshots)"), f"GPU             {self.vram}"]


def converted_bytes(text: LoadedText) -> int:
    """Bytes of the weights converted at load (float -> float32, other types without a kernel -> Q8_0)."""
    from ..kernels.cpu import KERNEL_TYPES
    total, f = 0, text.file
    for name in text.arch.tensor_shapes(text.hparams):
        if not f.has(name) or name == "token_embd.weight" or "conv1d" in name:
            continue
        info = f.info(name)
        if len(info.ne) < 2 or (info.qtype in KERNEL_TYPES and info.ne[0] % 32 == 0):
            continue
        n = math.prod(info.ne)
        total += 4 * n if info.qtype in _FLOAT else n // 32 * 34
    return total


def state_bytes(hp: Any, context: int, kv_type: str = EngineOptions.kv_type) -> int:
    """Bytes of one sequence's state at ``context`` positions with KV rows of ``kv_type`` (the engine's default
    unless named; = ``SequenceState.new(hp, context, kv_type).nbytes``) of a model whose hyper-parameters ``hp``
    give its :class:`~engine.turn.state.StateLayout`."""
    return state_nbytes(hp.state_layout(), context, kv_type)


def vocab_bytes(f: GGUFFile) -> int:
    """RAM of the parsed vocabulary and its tokenizer (:data:`VOCAB_BYTES_PER_ENTRY` per token and merge)."""
    n = len(f.meta("tokenizer.ggml.tokens", [])) + len(f.meta("tokenizer.ggml.merges", []))
    return VOCAB_BYTES_PER_ENTRY * n


def vision_bytes(mmproj: Header | None) -> int:
    """RAM of a projector loaded for the CPU tower: every tensor in float32. Raises UnsupportedModelError
    for a projector type no vision architecture runs."""
    if mmproj is None:
        return 0
    from ..registry import vision_arch
    vision_arch(mmproj.meta.get("clip.projector_type"), mmproj.source)
    return 4 * sum(math.prod(t.ne) for t in mmproj.tensors.values())


def check_tower(text: LoadedText, mmproj: Header | None) -> None:
    """Raise ModelFormatError when ``mmproj``'s ``clip.vision.projection_dim`` is not the text model's hidden size
    (the check :func:`engine.placement.open_vision` makes at load, made here before downloading)."""
    width = mmproj.value("clip.vision.projection_dim") if mmproj is not None else None
    if isinstance(width, int) and width != text.hparams.n_embd:
        raise ModelFormatError(
            f"{mmproj.source}: clip.vision.projection_dim = {width} does not match the text model's "
            f"embedding_length = {text.hparams.n_embd} ({text.source}): not its vision tower "
            "(leave it out: --no-mmproj)")


def _vram(text: LoadedText, budget: int | None) -> str:
    if budget is None:
        return "no GPU: prefill runs on the CPU"
    if text.arch.prefill_plan is None:
        return f"no GPU prefill for {text.arch.name}"
    try:
        plan = text.arch.prefill_plan(text.hparams, text.file, budget)
    except DeviceError as exc:
        return f"prefill runs on the CPU: {exc}"
    return (f"{plan.fixed_bytes / GIB:.2f} GiB placed at load + {plan.reserve / GIB:.2f} GiB reserved, of a "
            f"{budget / GIB:.2f} GiB budget")


def _verdict(ram: int, machine: Machine) -> tuple[int, str]:
    budget = machine.ram_bytes - OS_RESERVE
    return budget, "fits" if ram + SNAPSHOT_RAM <= budget else "tight" if ram <= budget else "does not fit"


def estimate_from_size(arch: str, shape: str, file_size: int, context: int, machine: Machine,
                       kv_type: str = EngineOptions.kv_type, parallel: int = EngineOptions.parallel) -> Fit:
    """The fit of a file known only by its size and its model's shapes (the synth preset ``shape`` with the
    real dimensions, named in the catalogue): for the catalogue before any header is read; ``parallel``
    states (the engine's default turns at once) with KV rows of ``kv_type`` (:func:`state_bytes`).

    Assumed where the header would tell: every weight has the file's mean bits (so the bytes read per token
    are the file size less the header (:data:`HEADER_BYTES_PER_ENTRY`) x the share of weights a token reads: routed
    experts ``n_expert_used`` of ``n_expert``, one row of ``token_embd`` when ``output`` exists), no weight is converted
    at load, and the vocabulary has about as many merges as tokens (Qwen3.5/3.6: 248320 tokens, 247587 merges).

    Raises:
        ValueError: an unknown ``shape``. UnsupportedModelError: an ``arch`` the engine does not run.
    """
    from ..arch.qwen35.presets import preset_hparams
    from ..registry import text_arch
    hp = preset_hparams(shape)
    shapes = text_arch(arch, shape).tensor_shapes(hp)
    total = read = 0
    for name, ne in shapes.items():
        n = math.prod(ne)
        total += n
        if len(ne) == 3:
            read += n * hp.n_expert_used // hp.n_expert
        elif name == "token_embd.weight" and "output.weight" in shapes:
            read += ne[0]
        else:
            read += n
    context = min(context, hp.context_length)
    parts = {"weights": file_size, "converted": 0, "state": parallel * state_bytes(hp, context, kv_type),
             "vocab": VOCAB_BYTES_PER_ENTRY * 2 * hp.n_vocab, "vision": 0}
    ram = sum(parts.values())
    budget, verdict = _verdict(ram, machine)
    per_token = max(file_size - HEADER_BYTES_PER_ENTRY * 2 * hp.n_vocab, 0) * read // total
    rate = machine.bandwidth_gbps * 1e9 / per_token
    return Fit(context=context, ram=ram, budget=budget, bytes_per_token=per_token,
               tok_s=tuple(rate * r for r in ROOFLINE), vram="not estimated from the size alone",
               verdict=verdict, **parts)


def estimate(text: LoadedText, file_size: int, context: int, machine: Machine, mmproj: Header | None = None,
             kv_type: str = EngineOptions.kv_type, parallel: int = EngineOptions.parallel) -> Fit:
    """The fit of model ``text`` (opened, or from a remote header) of ``file_size`` bytes at ``context`` tokens,
    ``parallel`` states (the engine's default turns at once) with KV rows of ``kv_type`` (:func:`state_bytes`).

    Raises:
        EngineError: ``context`` < 1. UnsupportedModelError: the projector's type is not supported.
        ModelFormatError: the projector is another model's (:func:`check_tower`).
    """
    if context < 1:
        raise EngineError(f"context must be at least 1 token, got {context}")
    check_tower(text, mmproj)
    context = min(context, text.hparams.context_length)
    parts = {"weights": file_size, "converted": converted_bytes(text),
             "state": parallel * state_bytes(text.hparams, context, kv_type), "vocab": vocab_bytes(text.file),
             "vision": vision_bytes(mmproj)}
    ram = sum(parts.values())
    budget, verdict = _verdict(ram, machine)
    per_token = text.bytes_per_token()
    rate = machine.bandwidth_gbps * 1e9 / per_token
    return Fit(context=context, ram=ram, budget=budget, bytes_per_token=per_token,
               tok_s=tuple(rate * r for r in ROOFLINE), vram=_vram(text, machine.vram_budget), verdict=verdict,
               **parts)


VERDICT_ORDER = {"fits": 0, "tight": 1, "does not fit": 2}


def recommend(fits: dict[str, Fit]) -> str | None:
    """The file to recommend among ``name -> Fit`` of one model: the largest that fits, else the smallest
    that is tight, else None."""
    ok = [n for n, f in fits.items() if f.verdict == "fits"]
    if ok:
        return max(ok, key=lambda n: fits[n].weights)
    tight = [n for n, f in fits.items() if f.verdict == "tight"]
    return min(tight, key=lambda n: fits[n].weights) if tight else None
