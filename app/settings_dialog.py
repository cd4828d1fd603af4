"""The settings dialog: model files, load and device options, sampling, system prompt and thinking."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import psutil
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog,
                               QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton,
                               QSpinBox, QTabWidget, QVBoxLayout, QWidget)

from .connections import ConnectionsTab, KeyStore
from .settings import MIN_CONTEXT, Settings

IMAGE_SIDES = (256, 384, 512, 768, 1024, 1280, 1536, 2048)
DEVICE_CHOICES = (("Auto (the GPU when one works)", "auto"), ("GPU", "cuda"), ("CPU", "cpu"))
WEIGHTS_CHOICES = (("Auto (in memory when it fits)", "auto"), ("In memory", "ram"), ("Read from the file", "map"))


def image_size_label(pixels: int) -> str:
    """E.g. "1024 \u00d7 1024 (1024 tokens)" for an area bound of 1024\u00b2 pixels."""
    side = round(pixels ** 0.5)
    return f"{side} \u00d7 {side} ({pixels // 1024} tokens)"


class PathField(QWidget):
    """A file path: a line edit (its placeholder says what empty means) and a Browse button."""

    def __init__(self, path: str, empty_means: str, title: str) -> None:
        super().__init__()
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        self.edit = QLineEdit(path)
        self.edit.setPlaceholderText(empty_means)
        self.edit.setClearButtonEnabled(True)
        self.edit.setAccessibleName(title)
        browse = QPushButton("Browse\u2026")
        browse.setAccessibleName(f"Browse for the {title.lower()}")
        browse.clicked.connect(lambda: self._browse(title))
        row.addWidget(self.edit, 1)
        row.addWidget(browse)

    def _browse(self, title: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, title, self.edit.text(), "GGUF files (*.gguf)")
        if path:
            self.edit.setText(path)

    def path(self) -> str:
        """The path typed or picked, stripped ("" when empty)."""
        return self.edit.text().strip()


def _spin(low: int, high: int, value: int, name: str, step: int = 1) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setValue(value)
    box.setAccessibleName(name)
    return box


def _real(low: float, high: float, value: float, name: str, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setDecimals(decimals)
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setValue(value)
    box.setAccessibleName(name)
    return box


NO_GPU_TIP = "No NVIDIA GPU was found on this computer: the prompt and images are read on the CPU."


def loaded_context_text(info: Any, asked: int) -> str:
    """The line under the context field: what the loaded model reads at once (``info.context``, the asked
    ``asked`` tokens capped at the model's own limit), or that a server sets it, or that none is loaded."""
    if info is None:
        return "No model is loaded."
    if info.remote:
        return (f"The server's model reads {info.context:,} tokens at once (set by the server)." if info.context
                else "The server sets the context; it did not say how long it is.")
    capped = " (the model's own limit)" if info.context < asked else ""
    return f"The loaded model reads {info.context:,} tokens at once{capped}."


class SettingsDialog(QDialog):
    """Edits a copy of the settings; :meth:`settings` returns what the user set.

    Changing the model files, the context, the image size, the CPU threads, the device, the VRAM
    budget or the weights mode reloads the model when accepted (the window does that); the other settings apply from
    the next answer. ``loaded``: the loaded model's :class:`engine.api.ModelInfo` (its context is shown
    under the asked one), or None; without ``has_gpu`` (no NVIDIA GPU found) the GPU-only fields are
    disabled and say why.
    """

    def __init__(self, settings: Settings, parent: QWidget | None = None, keys: KeyStore | None = None,
                 loaded: Any = None, has_gpu: bool = True) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(520)
        self._base = settings
        self._has_gpu = has_gpu
        tabs = QTabWidget()
        tabs.addTab(self._model_tab(settings), "Model")
        self.loaded_context.setText(loaded_context_text(loaded, settings.context))
        tabs.addTab(self._sampling_tab(settings), "Sampling")
        tabs.addTab(self._chat_tab(settings), "Chat")
        self.connections = ConnectionsTab(settings, keys or KeyStore())
        tabs.addTab(self.connections, "Connections")
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel | QDialogButtonBox.RestoreDefaults)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        buttons.button(QDialogButtonBox.RestoreDefaults).clicked.connect(self.restore_defaults)
        layout = QVBoxLayout(self)
        layout.addWidget(tabs)
        layout.addWidget(buttons)

    def _model_tab(self, s: Settings) -> QWidget:
        page = QWidget()
        form = QFormLayout(page)
        self.model = PathField(s.model_path, "the bundled default model", "Model file")
        self.mmproj = PathField(s.mmproj_path, "none (the default model brings its own)", "Vision tower file")
        self.context = _spin(MIN_CONTEXT, 262144, s.context, "Context length", 1024)
        self.context.setSuffix(" tokens")
        self.image_size = QComboBox()
        self.image_size.setAccessibleName("Largest image size")
        self._set_image_pixels(s.image_max_pixels)
        form.addRow("Model (GGUF):", self.model)
        form.addRow("Vision tower (mmproj):", self.mmproj)
        self.loaded_context = QLabel()
        self.loaded_context.setAccessibleName("Context of the loaded model")
        self.loaded_context.setEnabled(False)
        form.addRow("Context length:", self.context)
        form.addRow("", self.loaded_context)
        form.addRow("Largest image:", self.image_size)
        physical = psutil.cpu_count(logical=False) or 1
        self.threads = _spin(0, psutil.cpu_count(logical=True) or physical, s.threads, "CPU threads")
        self.threads.setSpecialValueText(f"physical cores ({physical})")
        self.threads.setToolTip("Threads of the CPU kernels (decode always runs on the CPU).")
        self.device = QComboBox()
        self.device.setAccessibleName("Prefill and image device")
        for label, value in DEVICE_CHOICES:
            self.device.addItem(label, value)
        self.device.setToolTip("Where the prompt is read and images are encoded. Answers are always written "
                               "on the CPU; a GPU that fails hands over to the CPU.")
        self.vram_budget = _real(0.0, 1024.0, s.vram_budget_gib, "VRAM budget", 0.5, 1)
        self.vram_budget.setSuffix(" GiB")
        self.vram_budget.setSpecialValueText("automatic")
        self.vram_budget.setToolTip("GPU memory prefill and image encoding may use together; the image "
                                    "encoder takes its part first and is left on the CPU when prefill would "
                                    "not fit the rest. Expert weights that do not fit stream from RAM over "
                                    "PCIe. Automatic: the free memory less a margin.")
        self.device.currentIndexChanged.connect(
            lambda: self.vram_budget.setEnabled(self._has_gpu and self.device.currentData() != "cpu"))
        if not self._has_gpu:
            self.device.model().item(self.device.findData("cuda")).setEnabled(False)
            for field in (self.device, self.vram_budget):
                field.setToolTip(NO_GPU_TIP)
        self._set_device(s.device)
        self.weights = QComboBox()
        self.weights.setAccessibleName("Model weights")
        for label, value in WEIGHTS_CHOICES:
            self.weights.addItem(label, value)
        self.weights.setCurrentIndex(self.weights.findData(s.weights))
        self.weights.setToolTip("In memory: the model file is read into RAM when it loads (answers come faster "
                                "and steadier). Read from the file: its pages are read as needed and shared with "
                                "other programs. Auto: in memory when the file takes at most 70 % of the available "
                                "memory and the GPU does not read the prompt.")
        form.addRow("CPU threads:", self.threads)
        form.addRow("Model weights:", self.weights)
        form.addRow("Prefill and images on:", self.device)
        form.addRow("VRAM budget:", self.vram_budget)
        note = QLabel("Changing these reloads the model. Images larger than the largest size are scaled "
                      "down before the model sees them; each image's thumbnail shows the tokens it costs "
                      "(Qwen3.5/3.6: one per 32 \u00d7 32 pixels).")
        note.setWordWrap(True)
        note.setEnabled(False)
        form.addRow(note)
        return page

    def _set_image_pixels(self, pixels: int) -> None:
        self.image_size.clear()
        choices = sorted({side * side for side in IMAGE_SIDES} | {pixels})
        for area in choices:
            self.image_size.addItem(image_size_label(area), area)
        self.image_size.setCurrentIndex(choices.index(pixels))

    def _set_device(self, device: str) -> None:
        self.device.setCurrentIndex(self.device.findData(device))
        self.vram_budget.setEnabled(self._has_gpu and device != "cpu")

    def _sampling_tab(self, s: Settings) -> QWidget:
        page = QWidget()
        form = QFormLayout(page)
        self.temperature = _real(0.0, 2.0, s.temperature, "Temperature", 0.05)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.top_k = _spin(0, 1000, s.top_k, "Top-k")
        self.top_k.setSpecialValueText("off")
        self.top_p = _real(0.01, 1.0, s.top_p, "Top-p", 0.05)
        self.min_p = _real(0.0, 1.0, s.min_p, "Min-p", 0.01)
        self.min_p.setSpecialValueText("off")
        self.presence = _real(-2.0, 2.0, s.presence_penalty, "Presence penalty", 0.1)
        self.repetition = _real(0.5, 2.0, s.repetition_penalty, "Repetition penalty", 0.05)
        self.seed = _spin(-1, 2**31 - 1, s.seed, "Seed")
        self.seed.setSpecialValueText("random")
        self.max_tokens = _spin(1, 131072, s.max_tokens, "Longest answer", 256)
        self.max_tokens.setSuffix(" tokens")
        rows = (("Temperature:", self.temperature, "Randomness of each pick; 0 always takes the most likely token."),
                ("Top-k:", self.top_k, "Pick among the k most likely tokens only."),
                ("Top-p:", self.top_p, "Pick among the most likely tokens that together hold this probability."),
                ("Min-p:", self.min_p, "Drop tokens less likely than this fraction of the most likely one."),
                ("Presence penalty:", self.presence, "Discourage every token already written (positive values)."),
                ("Repetition penalty:", self.repetition, "Above 1 makes tokens already written less likely."),
                ("Seed:", self.seed, "A fixed seed repeats the same answer to the same prompt."),
                ("Longest answer:", self.max_tokens, "Stop an answer after this many tokens."))
        for label, widget, tip in rows:
            widget.setToolTip(tip)
            form.addRow(label, widget)
        return page

    def _chat_tab(self, s: Settings) -> QWidget:
        page = QWidget()
        column = QVBoxLayout(page)
        column.addWidget(QLabel("System prompt (sent first in every conversation):"))
        self.system_prompt = QPlainTextEdit(s.system_prompt)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("none")
        column.addWidget(self.system_prompt, 1)
        self.thinking = QCheckBox("Think before answering")
        self.thinking.setChecked(s.thinking)
        self.thinking.setAccessibleName("Think before answering")
        column.addWidget(self.thinking)
        return page

    def settings(self) -> Settings:
        """The settings as the dialog shows them."""
        return replace(
            self._base, model_path=self.model.path(), mmproj_path=self.mmproj.path(), context=self.context.value(),
            image_max_pixels=int(self.image_size.currentData()), threads=self.threads.value(),
            device=self.device.currentData(), vram_budget_gib=round(self.vram_budget.value(), 1),
            weights=self.weights.currentData(),
            temperature=round(self.temperature.value(), 4),
            top_k=self.top_k.value(), top_p=round(self.top_p.value(), 4), min_p=round(self.min_p.value(), 4),
            presence_penalty=round(self.presence.value(), 4), repetition_penalty=round(self.repetition.value(), 4),
            seed=self.seed.value(), max_tokens=self.max_tokens.value(),
            system_prompt=self.system_prompt.toPlainText().strip(), thinking=self.thinking.isChecked(),
            **self.connections.values())

    def accept(self) -> None:
        """Keep the remote engine's API key (in the keyring), then close."""
        self.connections.save_key()
        super().accept()

    def restore_defaults(self) -> None:
        """Put every field but the model files and the connections back to its default."""
        d = Settings()
        self.context.setValue(d.context)
        self._set_image_pixels(d.image_max_pixels)
        self.threads.setValue(d.threads)
        self._set_device(d.device)
        self.weights.setCurrentIndex(self.weights.findData(d.weights))
        self.vram_budget.setValue(d.vram_budget_gib)
        for box, value in ((self.temperature, d.temperature), (self.top_k, d.top_k), (self.top_p, d.top_p),
                           (self.min_p, d.min_p), (self.presence, d.presence_penalty),
                           (self.repetition, d.repetition_penalty), (self.seed, d.seed),
                           (self.max_tokens, d.max_tokens)):
            box.setValue(value)
        self.system_prompt.setPlainText(d.system_prompt)
        self.thinking.setChecked(d.thinking)
