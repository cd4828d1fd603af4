"""``scripts/run --model X`` while DeltaDesk runs: the second launch hands its files to the running window,
which opens them (or says why not, keeping its model)."""

from __future__ import annotations

from app.__main__ import follow_launches
from app.engine_worker import load_real_engine
from app.single_instance import SingleInstance
from fake_engine import FakeEngine, loader_for


def test_a_second_launch_hands_its_model_to_the_running_window(qtbot, make_window, paths, tmp_path, monkeypatch):
    engine = FakeEngine()
    window = make_window(loader=loader_for(engine))
    first = SingleInstance(paths.data)
    assert first.acquire()
    follow_launches(first, window)
    (tmp_path / "models").mkdir()
    for name in ("other.gguf", "other-mmproj.gguf"):
        (tmp_path / "models" / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path / "models")                   # relative paths, as typed in another folder
    with qtbot.waitSignal(first.open_requested):
        assert not SingleInstance(paths.data).acquire("other.gguf", "other-mmproj.gguf")
    qtbot.waitUntil(lambda: window.model is not None and len(engine.loads) == 2)
    assert engine.loads[-1].model_path == str(tmp_path / "models" / "other.gguf")
    assert engine.loads[-1].mmproj_path == str(tmp_path / "models" / "other-mmproj.gguf")
    first.release()


def test_a_handed_file_that_cannot_be_opened_is_said_and_the_model_kept(qtbot, make_window, paths, synth_model,
                                                                         tmp_path):
    window = make_window(loader=load_real_engine, load=False)
    window.load_model(str(synth_model("tiny", "q8_0")))
    qtbot.waitUntil(lambda: window.model is not None)
    first = SingleInstance(paths.data)
    assert first.acquire()
    follow_launches(first, window)
    with qtbot.waitSignal(first.raise_requested):
        assert not SingleInstance(paths.data).acquire(str(tmp_path / "missing.gguf"))
    qtbot.waitUntil(lambda: "Could not open missing.gguf" in window.statusBar().currentMessage())
    assert "missing.gguf" in window.statusBar().currentMessage().split(":", 1)[1]
    assert window.model is not None and not window.composer.unavailable
    first.release()


def test_a_handed_hub_name_that_is_not_downloaded_is_said(qtbot, make_window, paths, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    engine = FakeEngine()
    window = make_window(loader=loader_for(engine))
    first = SingleInstance(paths.data)
    assert first.acquire()
    follow_launches(first, window)
    with qtbot.waitSignal(first.open_requested, check_params_cb=lambda m, _p: m == "someone/some-model:Q4_K_M"):
        assert not SingleInstance(paths.data).acquire("someone/some-model:Q4_K_M")
    qtbot.waitUntil(lambda: "someone/some-model" in window.statusBar().currentMessage())
    assert len(engine.loads) == 1 and window.model is not None          # nothing else was loaded
    first.release()
