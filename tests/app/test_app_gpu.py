"""The GPU side of the window: the engine's report and NVML in the sidebar, the device in the banner, notes."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from PySide6.QtCore import Qt

from app import gpu as gpu_module
from app.engine_worker import summarize
from app.history import HistoryStore
from app.sidebar import GPU_LEFT, NO_GPU
from app.gpu import GpuReport, GpuSample, NvmlGpu, PrefillReport, device_phrase, vision_phrase
from app_helpers import stored
from engine.kernels.moe_stream import LayerTelemetry, PrefillTelemetry
from fake_engine import FakeEngine, fake_info

PLACEMENT = "GPU prefill placement, VRAM budget 6.00 GiB:\n  resident    0.010 GiB  attention + delta-net weights"
GPU_INFO = fake_info(device="cuda", placement=PLACEMENT, vram_budget=6 * 2**30)


class FakeGpu:
    """NVML readings of a made-up 8 GiB card."""

    name = "NVIDIA Fake 8GB"

    def sample(self):
        return GpuSample(self.name, vram_used=3 << 30, vram_total=8 << 30, h2d_gb_s=11.5)


def telemetry(h2d_bytes=1_200_000_000, h2d_ms=100.0):
    """An engine PrefillTelemetry: 947 tokens, 2 GiB of buffers, four layers."""
    layers = [LayerTelemetry(i, "gdn", "streamed", compute_ms=5.0 + i) for i in range(4)]
    return PrefillTelemetry(n_tokens=947, passes=1, mode="streamed", wall_ms=410.0, gpu_ms=400.0,
                            h2d_bytes=h2d_bytes, h2d_ms=h2d_ms, vram_budget=6 << 30, vram_used=2 << 30,
                            vram_free=5 << 30, layers=layers)


def send(qtbot, window, text):
    window.composer.editor.setPlainText(text)
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)


def test_sidebar_shows_the_engine_telemetry_and_nvml(qtbot, make_window):
    engine = FakeEngine(info=GPU_INFO)
    window = make_window(engine, gpu=FakeGpu())
    sidebar = window.sidebar
    qtbot.waitUntil(lambda: sidebar.gpu_label.text() == "NVIDIA Fake 8GB: prefill on the GPU")
    assert sidebar.vram.text == "3.0 GB / 8.0 GB" and sidebar.pcie.text == "11.5 GB/s"
    assert sidebar.gpu_prefill.isHidden() and sidebar.gpu_note.isHidden()
    assert window.banner.text().endswith(" \u00b7 prefill on GPU (Fake 8GB, budget 6.0 GiB), decode on CPU")
    assert PLACEMENT in window.banner.toolTip()

    engine.gpu_telemetry = telemetry()
    send(qtbot, window, "read this long prompt")
    qtbot.waitUntil(lambda: sidebar.vram.text == "2.0 GB / budget 6.0 GB / 8.0 GB")
    assert sidebar.vram.fraction == 0.25 and "5.0 GB free" in sidebar.vram.toolTip()
    assert sidebar.pcie.text == "12.0 GB/s" and "NVML now: 11.5 GB/s" in sidebar.pcie.toolTip()
    assert list(sidebar.layers.values) == [5.0, 6.0, 7.0, 8.0] and sidebar.layers.isVisible()
    assert sidebar.gpu_prefill.text() == "Last GPU prefill: 947 tokens in 410 ms, experts streamed, 1 pass"

    engine.gpu_telemetry = telemetry(h2d_bytes=0, h2d_ms=0.0)
    send(qtbot, window, "again")
    qtbot.waitUntil(lambda: sidebar.pcie.text == "none")


def test_gpu_report_without_nvml(qtbot, make_window):
    engine = FakeEngine(info=GPU_INFO)
    window = make_window(engine)
    sidebar = window.sidebar
    qtbot.waitUntil(lambda: sidebar.gpu_label.text() == "Prefill on the GPU")
    assert sidebar.vram.text == "after the first GPU prefill"
    assert window.banner.text().endswith(" \u00b7 prefill on GPU (budget 6.0 GiB), decode on CPU")
    engine.gpu_telemetry = telemetry()
    send(qtbot, window, "hi")
    qtbot.waitUntil(lambda: sidebar.vram.text == "2.0 GB / budget 6.0 GB")
    assert sidebar.vram.fraction == 1 / 3 and sidebar.pcie.text == "12.0 GB/s"


def test_the_gpu_failing_mid_turn_is_said_in_the_answer_sidebar_and_banner(qtbot, make_window):
    engine = FakeEngine(info=GPU_INFO)
    window = make_window(engine)
    note = "GPU prefill failed, using the CPU: out of memory"
    engine.info = replace(GPU_INFO, device="cpu", device_note=note, placement="")
    engine.note = "The GPU failed during this prompt; the CPU finished it."
    send(qtbot, window, "hi")
    answer = window.chat_view.widgets[-1]
    assert answer.stats_label.text().endswith(" \u2014 The GPU failed during this prompt; the CPU finished it.")
    stats = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-1].stats
    assert stats["note"] == engine.note and "TTFT" in answer.stats_label.text()
    qtbot.waitUntil(lambda: window.sidebar.gpu_note.text() == note)
    assert window.sidebar.gpu_label.text() == GPU_LEFT and window.sidebar.gpu_label.toolTip() == note
    assert window.sidebar.gpu_note.isVisibleTo(window.sidebar) and window.sidebar.gpu_why.isHidden()
    assert window.banner.text().endswith(" \u00b7 prefill on CPU, decode on CPU") and note in window.banner.toolTip()


def test_cpu_mode_shows_the_device_note(qtbot, make_window):
    note = "No GPU prefill (no CUDA driver): prefill runs on the CPU"
    window = make_window(FakeEngine(info=fake_info(device_note=note)))
    qtbot.waitUntil(lambda: window.sidebar.gpu_note.text() == note)
    sidebar = window.sidebar
    assert sidebar.gpu_label.text() == NO_GPU and sidebar.vram.isHidden()
    assert sidebar.gpu_why.isVisibleTo(sidebar) and sidebar.gpu_note.isHidden()       # one click away
    assert note not in sidebar.gpu_label.toolTip()
    qtbot.mouseClick(sidebar.gpu_why, Qt.LeftButton)
    assert sidebar.gpu_note.isVisibleTo(sidebar)
    assert window.banner.text().endswith(" \u00b7 prefill on CPU, decode on CPU")


def test_summary_device_phrase_and_report():
    assert device_phrase("cuda", 6 * 2**30, "NVIDIA H200") == "prefill on GPU (H200, budget 6.0 GiB)"
    assert device_phrase("cuda") == "prefill on GPU" and device_phrase("cpu", 6 * 2**30) == "prefill on CPU"
    summary = summarize(GPU_INFO)
    assert (summary.info.device, summary.info.placement) == ("cuda", PLACEMENT)
    report = PrefillReport.of(telemetry())
    assert report.h2d_gb_s == 12.0 and report.layer_ms == (5.0, 6.0, 7.0, 8.0)
    engine = FakeEngine(info=GPU_INFO)
    engine.gpu_telemetry = telemetry()
    assert gpu_module.gpu_report(engine) == GpuReport("cuda", "", report)


class FakeNvml:
    """The few pynvml calls NvmlGpu makes."""

    NVML_PCIE_UTIL_RX_BYTES = 1

    class NVMLError(Exception):
        pass

    def __init__(self, present=True):
        self.present = present

    def nvmlInit(self):
        if not self.present:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=141 << 30, used=10 << 30, free=131 << 30)

    def nvmlDeviceGetPcieThroughput(self, handle, counter):
        return 25_000_000


def test_nvml_source(monkeypatch):
    monkeypatch.setattr(gpu_module, "pynvml", None)
    assert NvmlGpu.open() is None
    monkeypatch.setattr(gpu_module, "pynvml", FakeNvml(present=False))
    assert NvmlGpu.open() is None
    monkeypatch.setattr(gpu_module, "pynvml", FakeNvml())
    device = NvmlGpu.open()
    assert device.name == "NVIDIA H200"
    assert device.sample() == GpuSample("NVIDIA H200", 10 << 30, 141 << 30, 25_000_000 * 1024 / 1e9)


def test_the_banner_says_where_images_are_encoded_when_not_where_prefill_runs(qtbot, make_window):
    note = "No GPU vision tower (out of memory): images are encoded on the CPU"
    window = make_window(FakeEngine(info=replace(GPU_INFO, has_vision=True, vision_device="cpu", vision_note=note)))
    qtbot.waitUntil(lambda: window.banner.text().endswith(", decode on CPU, images on CPU"))
    assert "prefill on GPU" in window.banner.text() and note in window.banner.toolTip()
    assert vision_phrase("cuda", "cuda") == "" and vision_phrase("cpu", "cpu") == "" and vision_phrase("cuda", "") == ""
    assert vision_phrase("cpu", "cuda") == "images on GPU"


def test_the_vision_tower_failing_mid_session_is_said_in_the_banner_and_sidebar(qtbot, make_window):
    info = replace(GPU_INFO, has_vision=True, vision_device="cuda")
    engine = FakeEngine(info=info)
    window = make_window(engine)
    qtbot.waitUntil(lambda: window.banner.text().endswith(" \u00b7 prefill on GPU (budget 6.0 GiB), decode on CPU"))
    assert window.sidebar.gpu_note.isHidden()

    note = "GPU vision tower failed, encoding images on the CPU: out of memory"
    engine.info = replace(info, vision_device="cpu", vision_note=note)
    send(qtbot, window, "what is in this picture?")
    banner = " \u00b7 prefill on GPU (budget 6.0 GiB), decode on CPU, images on CPU"
    qtbot.waitUntil(lambda: window.banner.text().endswith(banner))
    assert note in window.banner.toolTip() and PLACEMENT in window.banner.toolTip()
    assert window.sidebar.gpu_note.text() == note and window.sidebar.gpu_note.isVisibleTo(window.sidebar)
    assert window.sidebar.gpu_label.toolTip() == note

    prefill_note = "GPU prefill failed, using the CPU: out of memory"
    engine.info = replace(engine.info, device="cpu", device_note=prefill_note, placement="")
    send(qtbot, window, "and now?")
    qtbot.waitUntil(lambda: window.banner.text().endswith(" \u00b7 prefill on CPU, decode on CPU"))
    assert window.banner.toolTip().endswith(f"\n\n{prefill_note}\n\n{note}")
    assert window.sidebar.gpu_note.text() == f"{prefill_note}\n{note}"
