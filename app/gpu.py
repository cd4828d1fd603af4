"""What the window knows about the GPU, from two sources, as plain dataclasses.

The engine is the first source: after a model load and after each turn the engine worker reads
``Engine.info`` (where prefill runs and images are encoded, and why) and ``Engine.telemetry()``
(the last GPU prefill: VRAM, host-to-device copies, per-layer times) on its own thread and sends a
:class:`GpuReport`. NVML (the optional ``nvidia-ml-py`` package) is the second: the system monitor
samples the device's name, total and used VRAM and live PCIe receive rate through :class:`NvmlGpu`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

try:
    import pynvml
except ImportError:
    pynvml = None

GIB = 1 << 30
REMOTE_NOTE = ("The model runs on {url}: its VRAM, PCIe traffic and prefix snapshots are the server's and "
               "not shown here; TTFT and tok/s are measured from the stream, cached tokens come from its usage.")


@dataclass(frozen=True)
class GpuSample:
    """One NVML reading of the device: its name, VRAM in bytes (all processes), PCIe receive GB/s."""

    name: str
    vram_used: int
    vram_total: int
    h2d_gb_s: float


class GpuTelemetry(Protocol):
    """A source of :class:`GpuSample` for the system monitor (:class:`NvmlGpu`, a test fake)."""

    name: str

    def sample(self) -> GpuSample | None:
        """The current reading, or None when the GPU is gone."""


class NvmlGpu:
    """The GPU NVML numbers ``index`` (on a machine with several, CUDA may number them differently)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self.name = name

    @classmethod
    def open(cls, index: int = 0) -> "NvmlGpu | None":
        """The device, or None without nvidia-ml-py, an NVIDIA driver or such a device."""
        if pynvml is None:
            return None
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
        except pynvml.NVMLError:
            return None
        return cls(handle, name.decode() if isinstance(name, bytes) else str(name))

    def sample(self) -> GpuSample | None:
        """VRAM used / total and the PCIe receive rate (host to device) NVML measured just now."""
        try:
            memory = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            rx_kb_s = pynvml.nvmlDeviceGetPcieThroughput(self._handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        except pynvml.NVMLError:
            return None
        return GpuSample(self.name, int(memory.used), int(memory.total), rx_kb_s * 1024 / 1e9)


@dataclass(frozen=True)
class PrefillReport:
    """The last GPU prefill (from the engine's ``PrefillTelemetry``).

    Attributes:
        n_tokens: prompt tokens it ran; passes: passes over the layers; mode: "resident",
            "streamed" or "selective" (how routed experts reached the GPU).
        wall_ms: its host wall time, ms.
        vram_budget / vram_used / vram_free: bytes: the budget, the engine's allocations, the device's free memory.
        h2d_bytes / h2d_ms: expert bytes copied host to device and the copy time, ms.
        layer_ms: GPU compute time of each layer, ms.
    """

    n_tokens: int
    passes: int
    mode: str
    wall_ms: float
    vram_budget: int
    vram_used: int
    vram_free: int
    h2d_bytes: int
    h2d_ms: float
    layer_ms: tuple[float, ...]

    @property
    def h2d_gb_s(self) -> float:
        """Achieved host-to-device rate, GB/s (1e9 bytes); 0 without copies."""
        return self.h2d_bytes / self.h2d_ms / 1e6 if self.h2d_ms > 0 else 0.0

    @classmethod
    def of(cls, telemetry: Any) -> "PrefillReport":
        """Copy the fields the window shows out of an engine ``PrefillTelemetry``."""
        return cls(n_tokens=telemetry.n_tokens, passes=telemetry.passes, mode=telemetry.mode,
                   wall_ms=telemetry.wall_ms, vram_budget=telemetry.vram_budget, vram_used=telemetry.vram_used,
                   vram_free=telemetry.vram_free, h2d_bytes=telemetry.h2d_bytes, h2d_ms=telemetry.h2d_ms,
                   layer_ms=tuple(layer.compute_ms for layer in telemetry.layers))


@dataclass(frozen=True)
class GpuReport:
    """Where the engine prefills and encodes images now, and what its last GPU prefill did.

    Attributes:
        device: "cuda", "cpu" or "remote" (a remote engine: then ``note`` says what is the server's).
        note: why prefill is on the CPU when a GPU was asked for or looked for (or failed), else "".
        prefill: the last GPU prefill, or None (none yet, or on the CPU).
        vision_device: where images are encoded, "cuda" or "cpu" ("" without a vision tower); the
            GPU tower can fail mid-session, moving images to the CPU.
        vision_note: why images are encoded on the CPU when a GPU was asked for or looked for (or
            failed), else "".
    """

    device: str
    note: str
    prefill: PrefillReport | None
    vision_device: str = ""
    vision_note: str = ""


def gpu_report(engine: Any) -> GpuReport:
    """Read an engine's device, device note, last GPU prefill and vision device and note (call it on
    the engine's thread)."""
    info = engine.info
    telemetry = engine.telemetry()
    if info.remote:
        return GpuReport(device="remote", note=REMOTE_NOTE.format(url=info.remote), prefill=None)
    return GpuReport(device=info.device, note=info.device_note,
                     prefill=None if telemetry is None else PrefillReport.of(telemetry),
                     vision_device=info.vision_device, vision_note=info.vision_note)


def device_phrase(device: str, budget: int = 0, gpu_name: str = "") -> str:
    """Where prefill runs, for the model summary: "prefill on GPU (H200, budget 6.0 GiB)" / "prefill on CPU"
    / "runs on the server" (a remote engine).

    ``budget`` is the engine's VRAM budget in bytes (``ModelInfo.vram_budget``; 0 = not shown).
    """
    if device == "remote":
        return "runs on the server"
    if device != "cuda":
        return "prefill on CPU"
    details = [gpu_name.removeprefix("NVIDIA ").strip()] + ([f"budget {budget / GIB:.1f} GiB"] if budget else [])
    details = [d for d in details if d]
    return "prefill on GPU" + (f" ({', '.join(details)})" if details else "")


def vision_phrase(device: str, vision_device: str) -> str:
    """Where images are encoded, for the model summary, when it is not where prefill runs: "images on
    GPU" with GPU prefill is implied and "" is returned; "images on CPU" when prefill is on the GPU but
    the vision tower is not, "images on GPU" the other way round; "" without a vision tower.

    ``device`` and ``vision_device`` are ``ModelInfo.device`` and ``ModelInfo.vision_device``.
    """
    if not vision_device or vision_device == device:
        return ""
    return "images on GPU" if vision_device == "cuda" else "images on CPU"
