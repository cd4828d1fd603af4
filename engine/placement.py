"""Where a model runs: the CPU text model, the GPU vision tower and GPU prefill under one VRAM budget,
and their release when loading fails. A device failure is never raised from here: the part runs on
the CPU and a note says why.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DeviceBudgetError, DeviceError, EngineError, ModelFormatError
from .gguf import resident
from .gguf.file import GGUFFile
from .registry import GpuPrefill, LoadedText, LoadedVision, TextModel
from .vision.encoder import ImageEncoder

if TYPE_CHECKING:
    from .api_types import EngineOptions

log = logging.getLogger(__name__)


def text_model(text: LoadedText, options: EngineOptions) -> TextModel:
    """The CPU text model ``options.kernels`` asks for (the numpy reference when the native kernels are not built).

    Raises:
        EngineError: ``options.kernels`` is not "native" or "numpy".
    """
    if options.kernels not in ("native", "numpy"):
        raise EngineError(f"kernels must be 'native' or 'numpy', got {options.kernels!r}")
    from .kernels import cpu
    cpu.set_threads(options.threads)
    if options.kernels == "native" and cpu.available():
        # "auto" reads the file into memory only where no GPU prefill will copy the weights (weights_mode)
        repack = options.device == "cpu" or options.weights == "auto" or not _gpu_present()
        model = text.arch.native_model(text.hparams, text.file, repack=repack)
        interleave_experts(text.file)
        return model
    return text.arch.reference_model(text.hparams, text.file)


def weights_mode(options: EngineOptions, path: str | Path) -> str:
    """The weights mode ``options.weights`` gives for the file ``path``: "map" or "ram" as asked; "auto" is "ram"
    when the file fits beside the rest (:func:`engine.gguf.resident.fits`), POSIX ``readv`` exists and no GPU
    prefill will copy the weights to pinned host memory of its own (``device`` "cpu", or CUDA does not start),
    else "map" (a path that cannot be read too: its open then says why).

    Raises:
        EngineError: ``options.weights`` is not "auto", "map" or "ram".
    """
    if options.weights not in resident.WEIGHTS_MODES:
        raise EngineError(f"weights must be one of {', '.join(resident.WEIGHTS_MODES)}, got {options.weights!r}")
    if options.weights != "auto":
        return options.weights
    try:
        size = os.path.getsize(path)
    except OSError:
        return "map"
    if not (resident.supported() and resident.fits(size)):
        return "map"
    return "ram" if options.device == "cpu" or not _gpu_present() else "map"


def _gpu_present() -> bool:
    """True when CUDA starts and sees a GPU (:func:`engine.kernels.cuda_kernels.load_driver`)."""
    from .kernels.cuda_kernels import load_driver
    try:
        load_driver()
    except DeviceError:
        return False
    return True


def interleave_experts(gguf: GGUFFile) -> int:
    """Interleave the mapped pages of the routed-expert tensors (GGUF names ``*_exps.*``) over the host's
    NUMA nodes (:func:`engine.kernels.numa.interleave`; nothing on one node). Returns the bytes placed."""
    from .kernels import numa
    return numa.interleave(gguf.raw(n) for n in gguf.tensor_names if "_exps." in n)


def open_vision(projector: LoadedVision, text: LoadedText, options: EngineOptions) -> ImageEncoder:
    """Check the opened projector fits the text model, and put its tower on the GPU when one works.

    Raises:
        ModelFormatError: its projection width is not the text model's hidden size.
    """
    mm = projector.projector
    if mm.hparams.out_dim != text.hparams.n_embd:
        raise ModelFormatError(
            f"{mm.path}: clip.vision.projection_dim = {mm.hparams.out_dim} does not match the text "
            f"model's embedding_length = {text.hparams.n_embd} ({text.source}): not its vision tower")
    tower, note = open_vision_gpu(projector, options)
    try:
        vision = ImageEncoder(projector, max_pixels=options.image_max_pixels, gpu=tower, device_note=note)
    except BaseException:
        release(tower)
        raise
    if vision.max_pixels < options.image_max_pixels:
        log.info("images are resized to at most %d pixels (the bound %s stores)", vision.max_pixels,
                 Path(mm.path).name)
    return vision


def open_vision_gpu(projector: LoadedVision, options: EngineOptions) -> tuple[Any, str]:
    """The GPU vision tower and "", or None and why not; a device failure is never raised.

    The tower (its architecture's ``cuda_tower``) reserves activation buffers for the largest image
    ``options.image_max_pixels`` allows and must fit ``options.vram_budget`` (weights included).
    """
    if options.device == "cpu":
        return None, ""
    try:
        tower = projector.arch.cuda_tower(projector.projector, options.image_max_pixels, options.vram_budget)
    except DeviceError as exc:
        note = f"No GPU vision tower ({exc}): images are encoded on the CPU"
        if options.device == "cuda":
            log.warning(note)
        return None, note
    log.info("GPU vision tower: %.2f GiB of VRAM (weights %.2f GiB)", tower.vram_bytes / 2**30,
             tower.weight_bytes / 2**30)
    return tower, ""


def open_gpu(text: LoadedText, options: EngineOptions, vision: ImageEncoder | None) -> tuple[GpuPrefill | None, str]:
    """The GPU prefill backend and "", or None and why not; a device failure is never raised.

    The GPU vision tower of ``vision`` (when there is one) has taken its part of ``options.vram_budget``
    (of the free memory when None) already. When what is left is too small for GPU prefill
    (:class:`~engine.errors.DeviceBudgetError`), prefill wins: the tower is released, images go to the
    CPU (``vision.device_note`` says why) and prefill is placed again with the whole budget.
    """
    if options.device == "cpu":
        return None, ""
    tower = vision.gpu if vision is not None else None
    reserved = tower.vram_bytes if tower is not None else 0
    budget = None if options.vram_budget is None else options.vram_budget - reserved
    try:
        try:
            gpu = text.arch.cuda_prefill(text.hparams, text.file, budget)
        except DeviceBudgetError as exc:
            if tower is None:
                raise
            vision.close()
            vision.device_note = (f"The GPU vision tower was released so that GPU prefill fits the VRAM budget "
                                  f"({exc}): images are encoded on the CPU")
            log.warning(vision.device_note)
            gpu = text.arch.cuda_prefill(text.hparams, text.file, options.vram_budget)
    except DeviceError as exc:
        note = f"No GPU prefill ({exc}): prefill runs on the CPU"
        if options.device == "cuda":
            log.warning(note)
        return None, note
    log.info("GPU prefill placement:\n%s", gpu.plan.text())
    return gpu, ""


def release(*parts: Any) -> None:
    """Close each GPU backend in ``parts`` that is not None (closing twice is harmless), logging a failure
    instead of raising it: used while another exception is on its way out."""
    for part in parts:
        if part is None:
            continue
        try:
            part.close()
        except Exception as exc:  # noqa: BLE001 - the original exception is the one to report
            log.warning("releasing %s after a failed load: %s", type(part).__name__, exc)
