"""Our numpy Qwen35Model against HF transformers goldens (numpy only; no torch needed here).

The fixtures ``tests/fixtures/reference/{qwen35moe,qwen35}_tiny.npz`` come from
``tests/fixtures/reference/make_fixtures.py`` (see its docstring and ``versions.json``): tiny
random transformers models (init std 0.15, randomised norms / A_log / dt_bias, 8 layers with
attention at 3 and 7, 2 k-heads vs 4 v-heads, rope theta 1e7, partial rotary 0.25, interleaved
mrope [3, 3, 2]) converted to GGUF names and conventions. Errors are relative to the largest
|logit| (about 5.6 MoE, 6.7 dense).

Measured (numpy 2.4, float32 projections, float64 inside the other ops): prefill of 100 tokens vs
HF 1.7e-5 (MoE) and 6.4e-6 (dense); our decode vs our prefill up to 1.4e-5 (SELF_TOL 5e-5). HF's
own float32 rounding is about 1e-5 at this scale, so HF_TOL = 1e-4 leaves a 6x margin; a
convention bug gives 1e-1 or more.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from engine.arch.qwen35.hparams import from_metadata
from engine.arch.qwen35.model import Qwen35Model
from engine.turn.state import SequenceState

FIXTURES = Path(__file__).parent / "fixtures" / "reference"
HF_TOL = 1e-4
SELF_TOL = 5e-5


class NpzWeights:
    """The GGUFFile weights interface over the fixture's ``w/<gguf name>`` arrays (f16 or f32)."""

    def __init__(self, npz) -> None:
        self.t = {k[2:]: npz[k] for k in npz.files if k.startswith("w/")}

    def has(self, name: str) -> bool:
        return name in self.t

    def f32(self, name: str) -> np.ndarray:
        return self.t[name].astype(np.float32)

    def expert(self, name: str, e: int) -> np.ndarray:
        return self.t[name][e].astype(np.float32)

    def row(self, name: str, i: int) -> np.ndarray:
        return self.t[name][i].astype(np.float32)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@functools.cache
def load(arch: str):
    """(hparams, model, goldens) of one fixture; hparams built by engine.arch.qwen35.hparams from its GGUF keys."""
    z = np.load(FIXTURES / f"{arch}_tiny.npz")
    meta = json.loads(str(z["meta"]))
    hp = from_metadata(meta.get, None, f"{arch}_tiny.npz")
    gold = {k: z[k] for k in z.files if not k.startswith("w/")}
    return hp, Qwen35Model(hp, NpzWeights(z)), gold


@pytest.fixture(params=["qwen35moe", "qwen35"])
def fixture(request):
    return load(request.param)


def test_fixture_is_what_it_claims(fixture):
    hp, model, gold = fixture
    assert hp.n_layer == 8 and [il for il in range(8) if not hp.is_recurrent(il)] == [3, 7]
    assert hp.num_k_heads != hp.num_v_heads and hp.rope_sections[:3] == (3, 3, 2)
    assert len(gold["prompt"]) >= 80 and len(gold["prompt"]) > 64
    assert model.output_name == ("output.weight" if hp.is_moe else "token_embd.weight")


def test_prefill_logits_match_hf(fixture):
    hp, model, gold = fixture
    logits = model.forward(gold["prompt"], SequenceState.new(hp, 128), all_logits=True)
    assert rel_err(logits, gold["logits"]) <= HF_TOL


def test_greedy_continuation_matches_hf(fixture):
    """Greedy ids identical; each step's logits match HF's cached (recurrent) decode."""
    hp, model, gold = fixture
    st = SequenceState.new(hp, 128)
    logits = model.forward(gold["prompt"], st)[0]
    ids = []
    for step in range(len(gold["greedy"])):
        assert rel_err(logits, gold["greedy_logits"][step]) <= HF_TOL
        ids.append(int(np.argmax(logits)))
        logits = model.forward(np.array(ids[-1:]), st)[0]
    assert ids == gold["greedy"].tolist()


def test_mrope_positions_match_hf():
    """Distinct t/h/w positions (a fake image grid): checks the interleaved section assignment."""
    hp, model, gold = load("qwen35moe")
    logits = model.forward(gold["prompt"], SequenceState.new(hp, 128), positions=gold["mrope_positions"],
                           all_logits=True)
    tail = gold["mrope_logits"]
    assert rel_err(logits[-len(tail):], tail) <= HF_TOL
    assert rel_err(logits[-len(tail):], gold["logits"][-len(tail):]) > 1e-2


def test_decode_token_by_token_equals_prefill(fixture):
    hp, model, gold = fixture
    prompt = gold["prompt"]
    full = model.forward(prompt, SequenceState.new(hp, 128), all_logits=True)
    st = SequenceState.new(hp, 128)
    steps = np.concatenate([model.forward(prompt[i:i + 1], st) for i in range(len(prompt))])
    assert rel_err(steps, full) <= SELF_TOL
