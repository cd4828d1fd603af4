"""End to end: the window on the real engine, with the tiny synthetic model (random weights) and with
the bundled demo model (a dropped scene image, a question, the streamed answer)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QMimeData, QObject, Qt, QUrl, Slot

from app.engine_worker import load_real_engine
from app.history import HistoryStore
from app_helpers import stored
from test_app_loading import drop

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    synth = pytest.importorskip("engine.testing.synth")
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    synth.synth(path, "tiny", quant="q8_0", seed=0)
    return path


@pytest.mark.slow
def test_default_model_streams_stops_and_keeps_its_snapshots(qtbot, make_window, tiny_model, monkeypatch, paths):
    from engine import api

    monkeypatch.setattr(api, "default_model", lambda: (tiny_model, None))
    window = make_window(loader=load_real_engine, load=False)
    window.load_model(None)
    qtbot.waitUntil(lambda: window.model is not None, timeout=60000)
    assert window.model.line.startswith("tiny.gguf: qwen35moe") and "text only" in window.model.line
    window.composer.editor.setPlainText("Hello")
    with qtbot.waitSignal(window.controller.busy_changed, timeout=60000, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
        qtbot.waitUntil(lambda: window.controller.live is not None and len(window.controller.live.text) > 0,
                        timeout=60000)
        qtbot.keyClick(window, Qt.Key_Escape)
    answer = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-1]
    assert answer.state == "stopped" and answer.content
    assert answer.stats["generated_tokens"] >= 1 and answer.stats["prompt_tokens"] > 5
    qtbot.waitUntil(lambda: window.snapshots.rowCount() > 0)
    # the snapshot names the conversation it was taken in, shown by its title
    assert "\u201cHello\u201d" in window.snapshots.index(0).data(Qt.ToolTipRole)
    window.close()
    assert list((paths.cache / "snapshots").rglob("*.snap"))


def test_a_bad_model_file_is_reported_in_plain_words(qtbot, make_window, tmp_path):
    pytest.importorskip("engine.api")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUX" + bytes(64))
    window = make_window(loader=load_real_engine, load=False)
    window.load_model(str(bad))
    qtbot.waitUntil(lambda: "could not be loaded" in window.banner.text(), timeout=30000)
    assert "broken.gguf" in window.banner.text() and "Traceback" not in window.banner.text()


class _StreamSpy(QObject):
    """Lives on the GUI thread; sees each token batch right after the controller has taken it in."""

    def __init__(self, controller) -> None:
        super().__init__()
        self.controller = controller
        self.live_texts: list[str] = []
        self.tokens = 0

    @Slot(str, list)
    def on_tokens(self, _text: str, token_ms: list) -> None:
        live = self.controller.live
        self.live_texts.append(live.text if live is not None else "")
        self.tokens += len(token_ms)


@pytest.mark.slow
def test_the_demo_model_counts_the_shapes_of_a_dropped_image(qtbot, make_window, tmp_path, monkeypatch):
    from app import engine_worker
    from engine import api

    model, mmproj = api.default_model()
    if model.name != "deltadesk-demo.gguf" or mmproj is None:
        pytest.skip("the bundled demo model is absent")
    monkeypatch.syspath_prepend(str(ROOT / "training"))
    import data

    # a held-out scene whose own count question is the one typed below
    sc = data.scene(data.EVAL_SEED_BASE + 700_000 + 5)
    question, want = data.questions(sc)["count"]
    assert (question, want) == ("How many shapes are there?", "There are 4 shapes.")
    png = tmp_path / "scene.png"
    data.render(sc).save(png)

    window = make_window(loader=load_real_engine, load=False)
    # the default sampling, with a fixed seed so a rare unlucky draw cannot make the test flaky
    window.apply_settings(replace(window.prefs, seed=1234))
    window.load_model(None)
    qtbot.waitUntil(lambda: window.model is not None, timeout=60000)
    assert window.model.line.startswith("deltadesk-demo.gguf: qwen35moe") and window.controller.has_vision

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(png))])
    drop(window.composer, mime)
    qtbot.waitUntil(lambda: len(window.composer.attachments) == 1)
    [attachment] = window.composer.attachments
    assert (attachment.width, attachment.height) == data.render(sc).size
    assert Path(attachment.path).read_bytes() == png.read_bytes()
    [thumb] = window.composer.thumbnails()
    qtbot.waitUntil(lambda: thumb.model_size.text().startswith("model sees"))

    # one token batch per token (the whole answer is shorter than one 40 ms batch), so the
    # streaming can be seen piece by piece
    monkeypatch.setattr(engine_worker, "BATCH_SECONDS", 0.0)
    spy = _StreamSpy(window.controller)
    window.engine.worker.tokens.connect(spy.on_tokens)
    window.composer.editor.setPlainText(question)
    with qtbot.waitSignal(window.controller.busy_changed, timeout=60000, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    assert window.composer.attachments == [] and window.composer.editor.toPlainText() == ""

    user, answer = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-2:]
    assert (user.role, user.content, user.images) == ("user", question, (attachment.path,))
    assert answer.role == "assistant" and answer.content.strip() == want
    assert answer.state == "complete" and answer.stats["stop_reason"] == "eos"
    # streamed: the live answer grew piece by piece while the turn was still running
    texts = spy.live_texts
    assert len(texts) >= 3 and texts[0] and texts[0] != answer.content and texts[-1] == answer.content
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert spy.tokens == answer.stats["generated_tokens"] > 1
    # the image went through the vision tower: the prompt holds its tokens besides the question's
    assert answer.stats["prompt_tokens"] > 64
    assert window.chat_view.widgets[-1].raw == answer.content


@pytest.mark.slow
def test_a_minicpmv_pair_opens_counts_its_image_tokens_and_streams(qtbot, make_window, synth_model, tmp_path,
                                                                    monkeypatch):
    """The MiniCPM-V 4.6 synth pair (dense qwen35 text + minicpmv4_6 tower) in the window: a dropped
    700x700 picture is sliced 2x2 plus the overview, 5 pieces of 64 tokens (HF's processor counts the
    same: tests/test_minicpmv.py), which its thumbnail shows; the question is answered and stored."""
    from PIL import Image

    from engine import api
    from engine.testing.pairs import synth_mmproj_for

    text = synth_model("minicpmv46-tiny", "q8_0")
    tower = synth_mmproj_for(tmp_path / "m-mmproj.gguf", "minicpmv46-tiny")
    monkeypatch.setattr(api, "default_model", lambda: (text, tower))
    window = make_window(loader=load_real_engine, load=False)
    # random weights: a short, seeded answer, so it ends (max_tokens) well inside the context
    window.apply_settings(replace(window.prefs, seed=1234, max_tokens=24))
    window.load_model(None)
    qtbot.waitUntil(lambda: window.model is not None, timeout=60000)
    assert window.controller.has_vision
    png = tmp_path / "square.png"
    Image.new("RGB", (700, 700), (200, 40, 40)).save(png)
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(png))])
    drop(window.composer, mime)
    qtbot.waitUntil(lambda: len(window.composer.thumbnails()) == 1)
    [thumb] = window.composer.thumbnails()
    qtbot.waitUntil(lambda: thumb.model_size.text().startswith("model sees"))
    assert thumb.model_size.text().endswith(f" + 4 slices \u00b7 {5 * 64} tokens")     # an overview and 2x2 slices
    window.composer.editor.setPlainText("What is in the picture?")
    with qtbot.waitSignal(window.controller.busy_changed, timeout=120000, check_params_cb=lambda busy: not busy):
        qtbot.keyClick(window.composer.editor, Qt.Key_Return)
    user, answer = stored(window.history, HistoryStore.active_path, window.controller.conversation_id)[-2:]
    assert user.images and answer.role == "assistant" and answer.state == "complete"
    assert answer.stats["generated_tokens"] >= 1 and answer.stats["prompt_tokens"] > 5 * 64
    window.close()
