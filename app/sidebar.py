"""The hardware sidebar: small QPainter widgets fed by a sampler on its own thread.

:class:`SystemMonitor` reads CPU and RAM (psutil) and, when a GPU telemetry provider is given
(NVML), the device's VRAM and PCIe throughput, once a second on a QThread, and emits a
:class:`SystemSample`. Token latencies, turn stats and the engine's own GPU report (device, its
note, the vision tower's note, the last GPU prefill's VRAM, host-to-device rate and per-layer
times) come from the engine worker's signals; the sidebar repaints the token-rate ones on the
sampler's tick, so while an answer streams the streaming message is the only widget redrawn at
token rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

import psutil
from PySide6.QtCore import QObject, QPointF, QRectF, QSize, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QLabel, QSizePolicy, QToolButton, QVBoxLayout, QWidget

from engine.events import PrefillStats, TurnSummary

from .engine_worker import human_size
from .gpu import GpuReport, GpuSample, GpuTelemetry, PrefillReport
from .snapshots import SnapshotListModel, SnapshotPanel

SAMPLE_MS = 1000
SPARK_TOKENS = 120
PCIE_SCALE_GB_S = 32.0
NO_GPU = "No NVIDIA GPU found: prompts and images are read on the CPU."
GPU_LEFT = "Prefill on the CPU (the GPU is not used)"
NO_SPEED = "\u2014 tok/s"
NO_TURN = "TTFT \u2014 \u00b7 prefill \u2014"


@dataclass(frozen=True)
class SystemSample:
    """One reading of the machine: CPU % (all cores), RAM used / total, our process's RSS, the GPU (NVML)."""

    cpu_percent: float
    ram_used: int
    ram_total: int
    process_rss: int
    gpu: GpuSample | None


@dataclass
class Figures:
    """One chat's generation figures since the model was loaded: its last prompt read, the tokens its last
    answer has, the recent token latencies (ms), and the speed and last-turn lines."""

    prefill: PrefillStats | None = None
    generated: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=SPARK_TOKENS))
    speed: str = NO_SPEED
    last_turn: str = NO_TURN


class SystemMonitor(QObject):
    """Samples the machine every :data:`SAMPLE_MS` on the thread it is moved to."""

    sampled = Signal(object)

    def __init__(self, gpu: GpuTelemetry | None = None, interval_ms: int = SAMPLE_MS) -> None:
        super().__init__()
        self._gpu = gpu
        self._interval = interval_ms
        self._timer: QTimer | None = None
        self._process = psutil.Process()

    @Slot()
    def start(self) -> None:
        """Begin sampling (call on the monitor's thread, e.g. from ``QThread.started``)."""
        psutil.cpu_percent(None)
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.sample)
        self._timer.start(self._interval)
        self.sample()

    @Slot()
    def stop(self) -> None:
        """Stop the timer (on the monitor's thread)."""
        if self._timer is not None:
            self._timer.stop()

    @Slot()
    def sample(self) -> None:
        """Take one reading and emit it."""
        memory = psutil.virtual_memory()
        gpu = self._gpu.sample() if self._gpu is not None else None
        self.sampled.emit(SystemSample(cpu_percent=psutil.cpu_percent(None), ram_used=memory.total - memory.available,
                                       ram_total=memory.total, process_rss=self._process.memory_info().rss, gpu=gpu))


class MonitorThread:
    """A :class:`SystemMonitor` on its own QThread."""

    def __init__(self, gpu: GpuTelemetry | None = None, interval_ms: int = SAMPLE_MS) -> None:
        self.gpu = gpu
        self.thread = QThread()
        self.thread.setObjectName("system-monitor")
        self.monitor = SystemMonitor(gpu, interval_ms)
        self.monitor.moveToThread(self.thread)
        self.thread.started.connect(self.monitor.start)
        self.thread.finished.connect(self.monitor.stop)
        self.thread.start()

    def stop(self) -> None:
        """Stop sampling and join the thread."""
        self.thread.quit()
        self.thread.wait()


def _color(widget: QWidget, role: QPalette.ColorRole) -> QColor:
    return widget.palette().color(role)


class Meter(QWidget):
    """A labelled horizontal bar: ``title``, a value text, and a fill fraction."""

    def __init__(self, title: str) -> None:
        super().__init__()
        self.title = title
        self.text = "\u2014"
        self.fraction = 0.0
        self.setAccessibleName(title)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)

    def sizeHint(self) -> QSize:
        """One text line above a thin bar."""
        return QSize(200, self.fontMetrics().height() + 12)

    def set_value(self, fraction: float, text: str) -> None:
        """Show ``text`` and fill ``fraction`` (clamped to 0..1) of the bar."""
        self.fraction = min(max(fraction, 0.0), 1.0)
        self.text = text
        self.setAccessibleDescription(text)
        self.update()

    def paintEvent(self, _event) -> None:
        """Title left, value right, bar under them."""
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        fm = self.fontMetrics()
        width = self.width()
        p.setPen(_color(self, QPalette.WindowText))
        p.drawText(QRectF(0, 0, width, fm.height()), Qt.AlignLeft | Qt.AlignVCenter, self.title)
        p.drawText(QRectF(0, 0, width, fm.height()), Qt.AlignRight | Qt.AlignVCenter, self.text)
        bar = QRectF(0, fm.height() + 3, width, 6)
        p.setPen(Qt.NoPen)
        p.setBrush(_color(self, QPalette.Midlight))
        p.drawRoundedRect(bar, 3, 3)
        p.setBrush(_color(self, QPalette.Highlight))
        p.drawRoundedRect(QRectF(bar.x(), bar.y(), bar.width() * self.fraction, bar.height()), 3, 3)


class Sparkline(QWidget):
    """Recent values in ms (token latencies, layer times) as a line, with its maximum."""

    def __init__(self, name: str = "Per-token latency", empty: str = "no tokens yet", size: int = SPARK_TOKENS) -> None:
        super().__init__()
        self.values: deque[float] = deque(maxlen=size)
        self.empty = empty
        self.setAccessibleName(name)
        self.setMinimumHeight(56)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)

    def sizeHint(self) -> QSize:
        """A short strip."""
        return QSize(200, 64)

    def paintEvent(self, _event) -> None:
        """Draw the line scaled to the largest latency shown."""
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        rect = QRectF(self.rect()).adjusted(1, 1, -1, -1)
        p.setPen(QPen(_color(self, QPalette.Mid), 1))
        p.setBrush(Qt.NoBrush)
        p.drawRect(rect)
        if len(self.values) < 2:
            p.setPen(_color(self, QPalette.PlaceholderText))
            p.drawText(rect, Qt.AlignCenter, self.empty)
            return
        top = max(self.values) or 1.0
        p.setPen(_color(self, QPalette.PlaceholderText))
        p.drawText(rect.adjusted(4, 1, -4, 0), Qt.AlignTop | Qt.AlignLeft, f"max {top:.0f} ms")
        plot = rect.adjusted(0, self.fontMetrics().height() + 2, 0, -2)
        step = plot.width() / (self.values.maxlen - 1)
        start = plot.right() - step * (len(self.values) - 1)
        path = QPainterPath()
        for i, v in enumerate(self.values):
            point = QPointF(start + i * step, plot.bottom() - (v / top) * plot.height())
            path.lineTo(point) if i else path.moveTo(point)
        p.setPen(QPen(_color(self, QPalette.Highlight), 1.5))
        p.drawPath(path)

CONTEXT_PARTS = (("cached", "#3fa34d"), ("prefilled", "#3b7dd8"), ("generated", "#d9822b"))


class ContextBar(QWidget):
    """The context window split into cached / newly prefilled / generated / free tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.context = 0
        self.parts = (0, 0, 0)
        self.setAccessibleName("Context window")
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)

    def sizeHint(self) -> QSize:
        """A bar plus a legend line."""
        return QSize(200, 3 * self.fontMetrics().height() + 20)

    def set_parts(self, context: int, cached: int | None, prefilled: int | None, generated: int) -> None:
        """Set the window size and the three used parts, in tokens (None: not known, e.g. a remote server's
        prompt counts until its ``usage`` arrives; left out of the bar and the legend)."""
        self.context = context
        self.parts = (cached, prefilled, generated)
        used = sum(n or 0 for n in self.parts)
        self.setAccessibleDescription(f"{used} of {context} tokens used")
        self.update()

    def _known(self) -> list[tuple[tuple[str, str], int]]:
        return [(part, n) for part, n in zip(CONTEXT_PARTS, self.parts) if n is not None]

    def legend(self) -> list[str]:
        """The legend's entries as drawn, e.g. ["cached 12", "prefilled 40", "generated 8"]."""
        return [f"{name} {n}" for (name, _), n in self._known()]

    def paintEvent(self, _event) -> None:
        """Title and use line, the stacked bar, then the legend."""
        p = QPainter(self)
        fm = self.fontMetrics()
        width = self.width()
        used = sum(n or 0 for n in self.parts)
        known = self._known()
        p.setPen(_color(self, QPalette.WindowText))
        line = QRectF(0, 0, width, fm.height())
        p.drawText(line, Qt.AlignLeft | Qt.AlignVCenter, "Context")
        p.drawText(line, Qt.AlignRight | Qt.AlignVCenter, f"{used} / {self.context or '?'} tokens")
        bar = QRectF(0, fm.height() + 3, width, 8)
        p.fillRect(bar, _color(self, QPalette.Midlight))
        x = 0.0
        for (name, color), n in known:
            w = width * n / self.context if self.context else 0.0
            p.fillRect(QRectF(x, bar.y(), min(w, width - x), bar.height()), QColor(color))
            x += w
        x, y = 0.0, bar.bottom() + 4
        p.setPen(_color(self, QPalette.WindowText))
        for (name, color), n in known:
            label = f"{name} {n}"
            item = 11 + fm.horizontalAdvance(label)
            if x > 0 and x + item > width:
                x, y = 0.0, y + fm.height() + 2
            p.fillRect(QRectF(x, y + fm.height() / 2 - 4, 8, 8), QColor(color))
            p.drawText(QPointF(x + 11, y + fm.ascent()), label)
            x += item + 8


def _heading(text: str) -> QLabel:
    label = QLabel(f"<b>{text}</b>")
    label.setContentsMargins(0, 6, 0, 0)
    return label


class Sidebar(QWidget):
    """The right column: machine, GPU, generation speed, last turn, context and prefix snapshots."""

    def __init__(self, snapshots: SnapshotListModel) -> None:
        super().__init__()
        self.setAccessibleName("Hardware and speed")
        self.setMinimumWidth(220)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 8, 6)
        layout.addWidget(_heading("Machine"))
        self.cpu = Meter("CPU")
        self.ram = Meter("RAM")
        self.rss = QLabel()
        self.rss.setEnabled(False)
        for w in (self.cpu, self.ram, self.rss):
            layout.addWidget(w)
        layout.addWidget(_heading("GPU"))
        self.gpu_label = QLabel(NO_GPU)
        self.gpu_label.setWordWrap(True)
        self.gpu_note = QLabel()
        self.gpu_note.setWordWrap(True)
        self.gpu_note.setEnabled(False)
        self.vram = Meter("VRAM")
        self.pcie = Meter("PCIe H2D")
        self.gpu_prefill = QLabel()
        self.gpu_prefill.setWordWrap(True)
        self.layers = Sparkline("Prefill time per layer", "no GPU prefill yet", 64)
        self.gpu_why = QToolButton()
        self.gpu_why.setText("Why?")
        self.gpu_why.setAccessibleName("Why no GPU is used")
        self.gpu_why.setCheckable(True)
        self.gpu_why.setAutoRaise(True)
        self.gpu_why.toggled.connect(lambda _on: self._show_gpu())
        for w in (self.gpu_label, self.gpu_why, self.gpu_note, self.vram, self.pcie, self.gpu_prefill, self.layers):
            layout.addWidget(w)
            w.hide()
        self.gpu_label.show()
        self._gpu_seen = False
        self._gpu_report: GpuReport | None = None
        self._nvml: GpuSample | None = None
        layout.addWidget(_heading("Generation"))
        self.speed = QLabel(NO_SPEED)
        self.spark = Sparkline()
        self.last_turn = QLabel(NO_TURN)
        self.last_turn.setWordWrap(True)
        for w in (self.speed, self.spark, self.last_turn):
            layout.addWidget(w)
        self.context_bar = ContextBar()
        layout.addWidget(self.context_bar)
        layout.addWidget(_heading("Prefix snapshots"))
        self.snapshots = SnapshotPanel(snapshots)
        layout.addWidget(self.snapshots, 1)
        self._context = 0
        self._figures: dict[int | None, Figures] = {}
        self._shown: int | None = None
        self._running: int | None = None
        self._dirty = False

    def clear_model(self) -> None:
        """Forget the figures of the model that was loaded (a new load began)."""
        self._context = 0
        self._figures.clear()
        self._gpu_report = None
        self._paint_figures()
        self._show_gpu()

    def set_context(self, context: int, remote: bool = False) -> None:
        """The loaded model's context window, tokens, and whether it runs on a remote server (whose prefix
        snapshots are not seen here)."""
        self._context = context
        self.snapshots.set_remote(remote)
        self._paint_figures()

    def show_conversation(self, conversation: int | None) -> None:
        """Show the generation and context figures of ``conversation``'s last turn (blank when it had none
        since the model was loaded)."""
        self._shown = conversation
        self._paint_figures()

    def turn_started(self, conversation: int | None) -> None:
        """The engine began a turn of ``conversation``: the prefill, token and summary figures that follow are
        that chat's."""
        self._running = conversation

    def _turn(self) -> Figures:
        return self._figures.setdefault(self._running, Figures())

    def _paint_figures(self) -> None:
        """Show the shown chat's figures now."""
        figures = self._figures.get(self._shown) or Figures()
        self.spark.values = figures.latencies
        self.speed.setText(figures.speed)
        self.last_turn.setText(figures.last_turn)
        p = figures.prefill
        if p is None:
            self.context_bar.set_parts(self._context, 0, 0, 0)
        else:
            known = p.device != "remote" or bool(p.prompt_tokens)
            self.context_bar.set_parts(self._context, p.reused_tokens if known else None,
                                       p.prefilled_tokens if known else None, figures.generated)
        self.spark.update()
        self._dirty = False

    @Slot(object)
    def on_system(self, sample: SystemSample) -> None:
        """Show a machine reading and repaint what the last tokens changed."""
        self.cpu.set_value(sample.cpu_percent / 100, f"{sample.cpu_percent:.0f} %")
        self.ram.set_value(sample.ram_used / sample.ram_total if sample.ram_total else 0.0,
                           f"{human_size(sample.ram_used)} / {human_size(sample.ram_total)}")
        self.rss.setText(f"DeltaDesk uses {human_size(sample.process_rss)}")
        self._nvml = sample.gpu
        self._show_gpu()
        if self._dirty:
            self._paint_figures()

    @Slot(object)
    def on_gpu_report(self, report: GpuReport) -> None:
        """The engine's device, its note, its last GPU prefill and its vision note (after a load or a turn)."""
        self._gpu_report = report
        prefill = report.prefill
        if prefill is not None:
            self.layers.values.clear()
            self.layers.values.extend(prefill.layer_ms)
            self.layers.update()
        self._show_gpu()

    @property
    def gpu_report(self) -> GpuReport | None:
        """The engine's last GPU report (None before one)."""
        return self._gpu_report

    def _show_gpu(self) -> None:
        """Compose the GPU section from the engine's report (first) and the NVML reading (second)."""
        report, nvml = self._gpu_report, self._nvml
        if report is not None and report.device == "remote":
            nvml = None  # this machine's GPU is not the one answering
        on_gpu = report is not None and report.device == "cuda"
        prefill = report.prefill if report is not None else None
        self._gpu_seen = self._gpu_seen or on_gpu
        none_found = not (on_gpu or nvml is not None or self._gpu_seen or
                          (report is not None and report.device == "remote"))
        if report is not None and report.device == "remote":
            self.gpu_label.setText("Remote engine")
        elif on_gpu:
            self.gpu_label.setText(f"{nvml.name}: prefill on the GPU" if nvml else "Prefill on the GPU")
        else:
            self.gpu_label.setText(f"{nvml.name}: prefill on the CPU" if nvml else NO_GPU if none_found else GPU_LEFT)
        notes = (report.note, report.vision_note) if report is not None else ()
        note = "\n".join(n for n in notes if n)
        self.gpu_note.setText(note)
        self.gpu_why.setVisible(none_found and bool(note))        # no GPU: the technical reason one click away
        self.gpu_note.setVisible(bool(note) and (not none_found or self.gpu_why.isChecked()))
        self.gpu_label.setToolTip("" if none_found else note)
        shown = on_gpu or nvml is not None
        self.vram.setVisible(shown)
        self.pcie.setVisible(shown)
        self.gpu_prefill.setVisible(prefill is not None)
        self.layers.setVisible(prefill is not None)
        if not shown:
            return
        if prefill is None and nvml is None:
            self.vram.set_value(0.0, "after the first GPU prefill")
            self.pcie.set_value(0.0, "\u2014")
            return
        self._show_vram(prefill, nvml)
        self._show_pcie(prefill, nvml)
        if prefill is not None:
            passes = f"{prefill.passes} pass{'es' if prefill.passes > 1 else ''}"
            self.gpu_prefill.setText(f"Last GPU prefill: {prefill.n_tokens} tokens in {prefill.wall_ms:.0f} ms, "
                                     f"experts {prefill.mode}, {passes}")

    def _show_vram(self, prefill: PrefillReport | None, nvml: GpuSample | None) -> None:
        """VRAM used / budget / total: DeltaDesk's buffers and budget from the engine, the total from NVML."""
        used = prefill.vram_used if prefill is not None else nvml.vram_used
        budget = prefill.vram_budget if prefill is not None else 0
        total = nvml.vram_total if nvml is not None else 0
        parts = [human_size(used)] + ([f"budget {human_size(budget)}"] if budget else []) + (
            [human_size(total)] if total else [])
        self.vram.set_value(used / (total or budget) if total or budget else 0.0, " / ".join(parts))
        tips = []
        if prefill is not None:
            tips.append(f"DeltaDesk's GPU buffers after the last prefill: {human_size(prefill.vram_used)} of a "
                        f"{human_size(prefill.vram_budget)} budget; "
                        f"{human_size(prefill.vram_free)} free on the device.")
        if nvml is not None:
            tips.append(f"NVML: {human_size(nvml.vram_used)} used of {human_size(nvml.vram_total)} by all programs.")
        self.vram.setToolTip("\n".join(tips))

    def _show_pcie(self, prefill: PrefillReport | None, nvml: GpuSample | None) -> None:
        """Host-to-device rate of the last prefill (engine counters), else NVML's live reading."""
        if prefill is not None and prefill.h2d_bytes:
            rate, tip = prefill.h2d_gb_s, (f"Last prefill copied {human_size(prefill.h2d_bytes)} of expert weights "
                                           f"in {prefill.h2d_ms:.0f} ms (engine counters).")
            text = f"{rate:.1f} GB/s"
        elif prefill is not None:
            rate, text, tip = 0.0, "none", "The last prefill found every expert in VRAM: nothing was copied."
        else:
            rate, tip = nvml.h2d_gb_s, "Live PCIe receive rate of the device (NVML)."
            text = f"{rate:.1f} GB/s"
        if nvml is not None and prefill is not None:
            tip += f"\nNVML now: {nvml.h2d_gb_s:.1f} GB/s."
        self.pcie.set_value(rate / PCIE_SCALE_GB_S, text)
        self.pcie.setToolTip(tip)

    @Slot(object)
    def on_prefill(self, stats: PrefillStats) -> None:
        """A new turn's prompt has been read (a remote server's counts come with its ``usage``, at the end)."""
        figures = self._turn()
        figures.prefill = stats
        figures.generated = 0
        if stats.device == "remote":
            figures.last_turn = f"TTFT {stats.ttft_ms:.0f} ms (measured here, the network included)"
        else:
            restored = f", restored in {stats.restore_ms:.0f} ms" if stats.reused_tokens else ""
            figures.last_turn = (f"TTFT {stats.ttft_ms:.0f} ms \u00b7 prefill {stats.prefill_tok_s:.0f} tok/s "
                                 f"({stats.prefilled_tokens} tokens on {stats.device}, {stats.reused_tokens} reused"
                                 f"{restored})")
        self._changed(figures)

    @Slot(str, list)
    def on_tokens(self, _text: str, token_ms: Sequence[float]) -> None:
        """Record a batch of token latencies; drawn on the next sampler tick."""
        figures = self._turn()
        figures.latencies.extend(token_ms)
        figures.generated += len(token_ms)
        recent = list(figures.latencies)[-32:]
        figures.speed = f"{1000 * len(recent) / sum(recent):.1f} tok/s" if sum(recent) else figures.speed
        self._changed(figures)

    @Slot(object)
    def on_summary(self, summary: TurnSummary) -> None:
        """The turn ended: show its final numbers now."""
        figures = self._turn()
        figures.generated = summary.generated_tokens
        figures.speed = f"{summary.decode_tok_s:.1f} tok/s"
        p = figures.prefill
        if p is not None and p.device == "remote":
            figures.prefill = replace(p, prompt_tokens=summary.prompt_tokens, reused_tokens=summary.reused_tokens,
                                      prefilled_tokens=max(0, summary.prompt_tokens - summary.reused_tokens))
            counts = (f"{summary.reused_tokens} of {summary.prompt_tokens} prompt tokens cached on the server"
                      if summary.prompt_tokens else "prompt tokens not reported by the server")
            figures.last_turn = f"TTFT {summary.ttft_ms:.0f} ms (measured here) \u00b7 {counts}"
        if self._running == self._shown:
            self._paint_figures()

    def _changed(self, figures: Figures) -> None:
        """The running turn's figures changed: repainted on the next sampler tick when its chat is shown."""
        if self._running == self._shown:
            self.last_turn.setText(figures.last_turn)
            self._dirty = True
