"""The command line does things in the order a user relies on: ``serve`` binds before it says it serves (and
before the model loads), ``generate --image`` checks the file before loading, ``chat`` attaches images with
``/image``, ``bench -p 0`` skips the prompt test, ``prune`` keeps its statistics beside its output."""

from __future__ import annotations

import builtins
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from engine.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def _png(path: Path) -> Path:
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(path)
    return path


def test_serve_on_a_port_in_use_fails_before_loading(synth_model, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(synth_model("tiny", "q8_0")), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"could not listen on 127.0.0.1:{port}" in err
    assert "[serving" not in err and "[loaded" not in err


def test_serve_says_it_serves_once_it_listens_on_the_real_port(synth_model):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(synth_model("tiny", "q8_0")),
                             "--port", "0", "--context", "512"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or not lines[-1].startswith("[serving"):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        url = re.search(r"on (http://127\.0\.0\.1:\d+/v1) ", lines[-1]).group(1)
        assert not url.endswith(":0/v1")
        response = httpx.get(url + "/models", timeout=30)      # at once: the printed address answers
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "tiny-q8_0"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_generate_checks_the_image_before_loading(synth_model, tmp_path, capsys):
    from engine.testing.pairs import synth_mmproj_for
    mmproj = synth_mmproj_for(tmp_path / "tiny-mmproj.gguf", "tiny")
    assert main(["generate", "--model", str(synth_model("tiny", "q8_0")), "--mmproj", str(mmproj),
                 "--image", str(tmp_path / "missing.png"), "--prompt", "what is it?"]) == 2
    err = capsys.readouterr().err
    assert f"--image {tmp_path / 'missing.png'}: no such file" in err and "[loaded" not in err



def test_generate_says_when_the_model_caps_the_context(synth_model, capsys):
    """An explicit ``--context`` above the file's limit is named; the default (8192) is capped quietly."""
    from engine.registry import open_text
    path = synth_model("tiny", "q8_0")
    limit = open_text(path).hparams.context_length
    for asked, noted in ((limit, False), (limit * 64, True), (None, False)):
        context = [] if asked is None else ["--context", str(asked)]
        assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "1", *context]) == 0
        err = capsys.readouterr().err
        assert (f"is above {path.name}'s own limit: the context window holds {limit} tokens" in err) is noted

def _chat(monkeypatch, capsys, argv: list[str], lines: list[str]) -> str:
    feed = iter(lines)
    monkeypatch.setattr(builtins, "input", lambda _prompt="": next(feed))
    assert main(["chat", *argv, "--max-tokens", "2", "--temp", "0", "--context", "512"]) == 0
    return capsys.readouterr().err


def test_chat_attaches_an_image_with_a_slash_command(synth_model, tmp_path, monkeypatch, capsys):
    from engine.api import Engine, EngineOptions
    from engine.testing.pairs import synth_mmproj_for
    model, mmproj = synth_model("tiny", "q8_0"), synth_mmproj_for(tmp_path / "tiny-mmproj.gguf", "tiny")
    image = _png(tmp_path / "pic.png")
    err = _chat(monkeypatch, capsys, ["--model", str(model), "--mmproj", str(mmproj)],
                ["/help", f"/image {image}", "what is it?", "and now?", ""])
    assert "/image PATH   attach an image to your next message" in err and "/help" in err
    engine = Engine.load(model, mmproj, options=EngineOptions(context=512))
    try:
        tokens = engine.image_info(image).tokens
    finally:
        engine.close()
    assert f"[image {image}: " in err and f"{tokens} image tokens; attached to your next message]" in err
    first, second = [int(n) for n in re.findall(r"\[prompt (\d+) tok", err)]
    assert first > tokens and second > first          # the image stays in the history


def test_chat_without_a_vision_tower_says_how_to_load_one(synth_model, tmp_path, monkeypatch, capsys):
    err = _chat(monkeypatch, capsys, ["--model", str(synth_model("tiny", "q8_0"))],
                [f"/image {_png(tmp_path / 'pic.png')}", ""])
    assert "no vision tower is loaded" in err and "--mmproj FILE" in err


def test_bench_with_no_prompt_test(synth_model, capsys):
    from engine.kernels import cpu
    if not cpu.available():
        pytest.skip("native CPU kernels not built")
    assert main(["bench", str(synth_model("tiny", "q8_0")), "-p", "0", "-n", "2", "-d", "-r", "1", "-t", "1",
                 "--stream-gib", "0.015625", "--stream-runs", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"deltadesk .* 1 thr: pp -, tg \d", out), out
    assert "pp0" in out and "Traceback" not in out


@pytest.mark.parametrize("runs", ["0", "-1", "two"])
def test_bench_refuses_a_stream_run_count_that_is_not_positive(runs, capsys):
    """Each round's roofline divides by the median of its stream runs: none is an argument error, not a crash."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "model.gguf", "--stream-runs", runs])
    assert exc.value.code == 2 and f"expected a positive integer, got {runs!r}" in capsys.readouterr().err


def test_prune_keeps_its_statistics_beside_the_output(synth_model, tmp_path, monkeypatch, capsys):
    model = synth_model("tiny", "q8_0")
    work, out_dir = tmp_path / "cwd", tmp_path / "out"
    work.mkdir()
    out_dir.mkdir()
    monkeypatch.chdir(work)
    assert main(["prune", str(model), "--keep", "6", "-o", str(out_dir / "p6.gguf"), "--max-tokens", "48"]) == 0
    stats = out_dir / f"{model.stem}.expert-stats.json"
    assert f"saved to {stats}" in capsys.readouterr().err
    assert stats.is_file() and list(work.iterdir()) == [] and not (model.parent / stats.name).exists()
