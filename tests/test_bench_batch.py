"""``tests/bench/bench_batch_decode.py``'s byte count of a batched step (``moved``), against the file's tensor table
read by gguf-py: the routed experts a step chose, each row's delta-rule state, the rest read once."""

from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGUFReader

from engine.registry import open_text
from engine.turn.state import SequenceState

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from bench_batch_decode import moved  # noqa: E402


def test_a_step_counts_the_chosen_experts_and_each_rows_state(synth_model):
    path = synth_model("tiny", "q8_0")
    text = open_text(path)
    hp = text.hparams
    state = SequenceState.new(hp, 8)
    expert = {}   # layer -> bytes of one routed expert's tensors there
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 3:
            il = int(t.name.split(".")[1])
            expert[il] = expert.get(il, 0) + int(t.n_bytes) // hp.n_expert
    state_rw = 2 * sum(a.nbytes for a in state.ssm.values())
    assert expert and state_rw > 0 and hp.n_expert > hp.n_expert_used

    layers = [expert[il] for il in sorted(expert)]
    step, one = moved(text, state, [hp.n_expert_used] * len(layers), 1)
    assert step == one == text.bytes_per_token() + state_rw

    every = [hp.n_expert] * len(layers) + [hp.n_expert_used] * len(layers)   # two steps: all experts, then 8
    step, one = moved(text, state, every, 3)
    extra = (hp.n_expert - hp.n_expert_used) * sum(layers) / 2
    assert step == one + extra + 2 * state_rw


def test_a_dense_model_moves_its_weights_once_and_each_rows_state(synth_model):
    text = open_text(synth_model("dense-tiny", "q8_0"))
    state = SequenceState.new(text.hparams, 8)
    state_rw = 2 * sum(a.nbytes for a in state.ssm.values())
    step, one = moved(text, state, [], 4)
    assert one == text.bytes_per_token() + state_rw and step == one + 3 * state_rw
