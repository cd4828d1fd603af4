"""The bundled demo model (assets/models, trained by training/train.py) loads and answers through the engine.

The checks: the files load together, the chat answer is the trained one, and on 8 fixed held-out
scenes per question type the greedy answers are exactly right at least as often as the model card's
500-scene accuracy makes near-certain (count 1.00 -> >= 7 of 8; colour 0.90, shape 0.86 -> >= 5 of 8;
P(<= 4 of 8) is under 1 % at 0.86) and far above a guess (1 in 6 shapes, 1 in 10 colours, 1 in 5 counts).
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


@pytest.mark.parametrize(("kind", "least"), [("count", 7), ("colour", 5), ("shape", 5)])
def test_answers_held_out_scenes(demo, kind, least):
    data, evaluate, engine = demo
    scenes = (data.scene(data.EVAL_SEED_BASE + 500_000 + i) for i in range(100))
    asked = [(sc, data.questions(sc)[kind]) for sc in scenes if kind in data.questions(sc)][:8]
    right = 0
    for sc, (q, a) in asked:
        got = evaluate.ask(engine, q, data.render(sc))
        assert got.startswith(a.split()[0]) and got.endswith("."), got
        right += got == a
    assert right >= least, f"{kind}: {right} of 8 held-out answers right"
