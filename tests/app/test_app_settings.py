"""Settings: persistence, the dialog, and what changes when they are applied."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QDialog

from app.settings import Settings
from app.settings_dialog import SettingsDialog
from engine.sampling import SamplingParams
from fake_engine import FakeEngine


def test_settings_round_trip_and_bad_values_fall_back(tmp_path):
    ini = QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)
    assert Settings.read(ini) == Settings()
    custom = Settings(model_path="/m/a.gguf", context=4096, threads=3, device="cuda", vram_budget_gib=6.5,
                      weights="map", temperature=0.0, top_k=0, seed=42, system_prompt="Be brief.\nUse metric units.",
                      thinking=True)
    custom.write(ini)
    assert Settings.read(QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)) == custom
    assert custom.sampling() == SamplingParams(temperature=0.0, top_k=0, top_p=0.8, seed=42, max_tokens=2048)

    ini.setValue("preferences/top_p", "7")
    ini.setValue("preferences/context", "lots")
    ini.setValue("preferences/image_max_pixels", "3")
    ini.setValue("preferences/threads", "-2")
    ini.setValue("preferences/device", "tpu")
    ini.setValue("preferences/vram_budget_gib", "nan")
    ini.setValue("preferences/weights", "disk")
    broken = Settings.read(ini)
    assert (broken.threads, broken.device, broken.vram_budget_gib, broken.weights) == (0, "auto", 0.0, "auto")
    assert broken.top_p == Settings().top_p and broken.seed == -1 and broken.context == Settings().context
    assert broken.image_max_pixels == Settings().image_max_pixels
    assert broken.model_path == "/m/a.gguf" and broken.system_prompt == custom.system_prompt


def test_the_dialog_edits_every_setting(qtbot):
    dialog = SettingsDialog(Settings(image_max_pixels=700 * 700))
    qtbot.addWidget(dialog)
    assert dialog.image_size.currentText() == "700 \u00d7 700 (478 tokens)"
    dialog.model.edit.setText(" /models/q.gguf ")
    dialog.context.setValue(16384)
    assert dialog.threads.text().startswith("physical cores (") and dialog.vram_budget.text() == "automatic"
    dialog.threads.setValue(2)
    dialog.device.setCurrentIndex(dialog.device.findData("cpu"))
    assert not dialog.vram_budget.isEnabled()
    dialog.device.setCurrentIndex(dialog.device.findData("cuda"))
    assert dialog.vram_budget.isEnabled()
    assert "image" in dialog.device.toolTip() and "prefill and image encoding" in dialog.vram_budget.toolTip()
    dialog.vram_budget.setValue(6.0)
    assert dialog.weights.currentData() == "auto" and "70 %" in dialog.weights.toolTip()
    dialog.weights.setCurrentIndex(dialog.weights.findData("ram"))
    dialog.image_size.setCurrentIndex(dialog.image_size.findData(512 * 512))
    dialog.temperature.setValue(0.0)
    assert dialog.temperature.text() == "0 (greedy)"
    dialog.top_k.setValue(40)
    dialog.top_p.setValue(0.95)
    dialog.min_p.setValue(0.05)
    dialog.presence.setValue(1.5)
    dialog.repetition.setValue(1.1)
    dialog.seed.setValue(7)
    dialog.max_tokens.setValue(4096)
    dialog.system_prompt.setPlainText("  You are terse.  ")
    dialog.thinking.setChecked(True)
    assert dialog.settings() == Settings(
        model_path="/models/q.gguf", context=16384, image_max_pixels=512 * 512, threads=2, device="cuda",
        vram_budget_gib=6.0, weights="ram", temperature=0.0, top_k=40,
        top_p=0.95, min_p=0.05, presence_penalty=1.5, repetition_penalty=1.1, seed=7, max_tokens=4096,
        system_prompt="You are terse.", thinking=True)
    dialog.restore_defaults()
    assert dialog.settings() == Settings(model_path="/models/q.gguf")
    assert dialog.seed.text() == "random" and dialog.top_k.value() == 20
    assert dialog.device.currentText().startswith("Auto") and dialog.threads.value() == 0
    reopened = SettingsDialog(Settings(device="cpu", threads=1, vram_budget_gib=2.5, weights="map"))
    qtbot.addWidget(reopened)
    assert reopened.weights.currentData() == "map"
    assert (reopened.device.currentData(), reopened.threads.value(), reopened.vram_budget.value()) == ("cpu", 1, 2.5)
    assert not reopened.vram_budget.isEnabled()


def test_sampling_system_prompt_and_thinking_reach_the_engine_and_persist(qtbot, make_window):
    engine = FakeEngine()
    window = make_window(engine)
    wanted = replace(window.prefs, temperature=0.0, top_k=5, seed=3, max_tokens=64, system_prompt="Be brief.",
                     thinking=True)
    window.apply_settings(wanted)
    assert window.composer.think_box.isChecked() and len(engine.loads) == 1
    window.composer.editor.setPlainText("hi")
    with qtbot.waitSignal(window.controller.busy_changed, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    assert engine.samplings[-1] == SamplingParams(temperature=0.0, top_k=5, seed=3, max_tokens=64)
    assert engine.calls[-1][0] == {"role": "system", "content": "Be brief."} and engine.thinking == [True]
    assert engine.conversations == [str(window.controller.conversation_id)]
    window.composer.think_box.setChecked(False)
    window.close()
    again = make_window(engine)
    assert again.prefs == replace(wanted, thinking=False) and not again.composer.think_box.isChecked()


def test_changing_load_options_reloads_the_model(qtbot, make_window, paths):
    engine = FakeEngine()
    window = make_window(engine)
    assert engine.loads[-1].context == 8192 and engine.loads[-1].cache_dir == paths.cache / "snapshots"
    window.apply_settings(replace(window.prefs, context=2048, image_max_pixels=512 * 512))
    qtbot.waitUntil(lambda: len(engine.loads) == 2 and window.model is not None)
    assert (engine.loads[-1].context, engine.loads[-1].image_max_pixels) == (2048, 512 * 512)
    assert engine.loads[-1].model_path is None
    assert (engine.loads[-1].threads, engine.loads[-1].device, engine.loads[-1].vram_budget) == (None, "auto", None)
    window.apply_settings(replace(window.prefs, threads=3, device="cuda", vram_budget_gib=1.5))
    qtbot.waitUntil(lambda: len(engine.loads) == 3 and window.model is not None)
    assert (engine.loads[-1].threads, engine.loads[-1].device, engine.loads[-1].vram_budget) == (3, "cuda", 3 << 29)
    assert engine.loads[-1].weights == "auto"
    window.apply_settings(replace(window.prefs, weights="map"))
    qtbot.waitUntil(lambda: len(engine.loads) == 4 and window.model is not None)
    assert engine.loads[-1].weights == "map"


def test_the_settings_menu_opens_the_dialog(qtbot, make_window, monkeypatch):
    window = make_window()

    def accept_with_a_system_prompt(dialog):
        dialog.system_prompt.setPlainText("Answer in French.")
        return QDialog.Accepted

    monkeypatch.setattr(SettingsDialog, "exec", accept_with_a_system_prompt)
    action = next(a for a in window.menuBar().actions()[0].menu().actions() if a.text() == "&Settings\u2026")
    action.trigger()
    assert window.prefs.system_prompt == "Answer in French." == window.controller.settings.system_prompt
