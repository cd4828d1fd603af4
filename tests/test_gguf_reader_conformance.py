"""Our synth GGUF files read by an independent reader: transformers' own GGUF loader.

Goldens: tests/fixtures/gguf_reader/make_fixtures.py (see its docstring; transformers 5.24, f32
eager). The test rewrites the same ``synth --preset tiny --seed 0`` file, checks it is byte-identical
to the one transformers read (else the writer changed and the goldens must be regenerated), runs
our numpy reference model on it and compares. This checks our writer, our loader, our tokenizer
and our forward pass against code nobody here wrote.

Tolerance: 1e-4 relative to the largest |logit| (measured 4.6e-6 at f32 and 1.5e-6 at q8_0, top-1 equal at
every one of the 68 positions over the whole vocabulary: both
sides dequantize q8_0 exactly, so the quantized file agrees as closely as the float one); the
argmax over the whole 248,320-token vocabulary must agree wherever the golden top-1 margin is
clear of float32 noise.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from engine.registry import open_text
from engine.arch.qwen35.model import Qwen35Model
from engine.turn.state import SequenceState
from engine.testing.synth import synth
from engine.prompt.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_reader"
TOL = 1e-4


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_transformers_reading_our_file_agrees(quant, tmp_path) -> None:
    gold = np.load(FIXTURES / f"tiny_{quant}.npz")
    path = tmp_path / f"tiny-{quant}.gguf"
    synth(path, "tiny", quant=quant, seed=0)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == str(gold["sha256"]), "engine.testing.synth output changed: regenerate the gguf_reader goldens"
    f = open_text(path)
    tok = Tokenizer.from_gguf(f.file.meta, f.file.source)
    prompt = tok.encode(str(gold["text"]), special=True)
    assert prompt == gold["prompt"].tolist() == gold["hf_prompt"].tolist()   # both tokenizers agree
    model = Qwen35Model(f.hparams, f.file)
    logits = model.forward(np.asarray(prompt), SequenceState.new(f.hparams, 128), all_logits=True)
    sub = logits[:, gold["vocab_ids"]]
    scale = float(np.abs(gold["logits_subset"]).max())
    assert float(np.abs(sub - gold["logits_subset"]).max()) / scale <= TOL
    np.testing.assert_allclose(logits.max(-1), gold["max"], rtol=0, atol=TOL * scale)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 10 * TOL * scale
    assert clear.sum() > len(prompt) // 2
    assert (logits.argmax(-1)[clear] == gold["argmax"][clear]).all()
