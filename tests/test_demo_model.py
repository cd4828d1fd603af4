"""The bundled demo model (assets/models, trained by training/train.py) loads and answers through the engine.

The model is weak (see training/MODEL_CARD.md): the checks are that the files load together, the
chat answer is the trained one, and the count of held-out scenes is right more often than a guess
(1 in 5) would be.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "assets" / "models"
TEXT, MMPROJ = MODELS / "deltadesk-demo.gguf", MODELS / "deltadesk-demo-mmproj.gguf"

pytestmark = pytest.mark.skipif(not (TEXT.exists() and MMPROJ.exists()), reason="demo model files absent")


@pytest.fixture(scope="module")
def demo():
    sys.path.insert(0, str(ROOT / "training"))
    import data
    import evaluate
    return data, evaluate, evaluate.load(MODELS)


def test_loads_with_vision(demo):
    _, _, engine = demo
    assert engine.info.arch == "qwen35moe" and engine.info.has_vision


def test_chat_line(demo):
    data, evaluate, engine = demo
    assert evaluate.ask(engine, "How do I load a larger model?") == data.LOAD_HINT


def test_counts_held_out_scenes(demo):
    data, evaluate, engine = demo
    right = 0
    for i in range(8):
        sc = data.scene(data.EVAL_SEED_BASE + 500_000 + i)
        q, a = data.questions(sc)["count"]
        got = evaluate.ask(engine, q, data.render(sc))
        assert got.startswith("There ") and got.endswith(".")
        right += got == a
    assert right >= 3
