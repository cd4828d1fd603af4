"""Qwen35Model and SequenceState on small random models (dense and MoE, n_k != n_v).

Consistency tolerances: decode token by token, prefill in pieces and one full pass agree within
5e-5 relative to the largest logit (measured up to 1.4e-5: projections are float32 sgemm products
whose summation order depends on the batch size, the other ops round to float32 at op boundaries,
and the state S is rounded after every decode step but only once per prefill call). State
copy/restore is bit-exact.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine.errors import ContextFullError
from engine.arch.qwen35.hparams import Qwen35HParams
from engine.arch.qwen35.model import Qwen35Model
from engine.turn.state import SequenceState


class DictWeights:
    """The weights interface of engine.gguf.file.GGUFFile over a dict of float32 arrays (math shape).

    Counts every fetch so tests can check caching and expert selection.
    """

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.tensors = tensors
        self.calls: Counter = Counter()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def f32(self, name: str) -> np.ndarray:
        self.calls["f32", name] += 1
        return self.tensors[name].copy()

    def expert(self, name: str, e: int) -> np.ndarray:
        self.calls["expert", name, e] += 1
        return self.tensors[name][e].copy()

    def row(self, name: str, i: int) -> np.ndarray:
        self.calls["row", name] += 1
        return self.tensors[name][i].copy()


def make_hp(moe: bool) -> Qwen35HParams:
    """4 layers, attention at 1 and 3 (interval 2); GDN with 2 k-heads and 4 v-heads."""
    return Qwen35HParams(
        arch="qwen35moe" if moe else "qwen35", n_layer=4, nextn_predict_layers=0, n_embd=32, n_vocab=64,
        context_length=1024, rms_eps=1e-6, n_head=4, n_head_kv=2, head_dim=16, rope_theta=1e7,
        rope_dims=8, rope_sections=(2, 1, 1, 0), full_attention_interval=2, conv_kernel=4,
        head_k_dim=8, num_k_heads=2, num_v_heads=4, head_v_dim=8,
        n_expert=6 if moe else 0, n_expert_used=2 if moe else 0, n_ff_exp=12 if moe else 0,
        n_ff_shexp=12 if moe else 0, n_ff=0 if moe else 24)


def make_weights(hp: Qwen35HParams, seed: int, tied: bool) -> dict[str, np.ndarray]:
    """Random GGUF-named tensors for ``hp`` (matrices N(0, 1/in), norms near 1, ssm_a < 0)."""
    rng = np.random.default_rng(seed)

    def mat(*shape: int) -> np.ndarray:
        return rng.normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)

    def norm(d: int) -> np.ndarray:
        return rng.uniform(0.7, 1.3, d).astype(np.float32)

    d, hd = hp.n_embd, hp.head_dim
    t = {"token_embd.weight": mat(hp.n_vocab, d), "output_norm.weight": norm(d)}
    if not tied:
        t["output.weight"] = mat(hp.n_vocab, d)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"], t[p + "post_attention_norm.weight"] = norm(d), norm(d)
        if hp.is_recurrent(il):
            t.update({p + "attn_qkv.weight": mat(hp.conv_dim, d), p + "attn_gate.weight": mat(hp.value_dim, d),
                      p + "ssm_beta.weight": mat(hp.num_v_heads, d), p + "ssm_alpha.weight": mat(hp.num_v_heads, d),
                      p + "ssm_conv1d.weight": mat(hp.conv_dim, hp.conv_kernel),
                      p + "ssm_dt.bias": rng.uniform(-1, 1, hp.num_v_heads).astype(np.float32),
                      p + "ssm_a": -rng.uniform(0.02, 0.6, hp.num_v_heads).astype(np.float32),
                      p + "ssm_norm.weight": norm(hp.head_v_dim), p + "ssm_out.weight": mat(d, hp.value_dim)})
        else:
            t.update({p + "attn_q.weight": mat(2 * hp.n_head * hd, d), p + "attn_k.weight": mat(hp.n_head_kv * hd, d),
                      p + "attn_v.weight": mat(hp.n_head_kv * hd, d), p + "attn_output.weight": mat(d, hp.n_head * hd),
                      p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)})
        if hp.is_moe:
            e, ff, fs = hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
            t.update({p + "ffn_gate_inp.weight": mat(e, d), p + "ffn_gate_exps.weight": mat(e, ff, d),
                      p + "ffn_up_exps.weight": mat(e, ff, d), p + "ffn_down_exps.weight": mat(e, d, ff),
                      p + "ffn_gate_shexp.weight": mat(fs, d), p + "ffn_up_shexp.weight": mat(fs, d),
                      p + "ffn_down_shexp.weight": mat(d, fs), p + "ffn_gate_inp_shexp.weight": mat(d)})
        else:
            t.update({p + "ffn_gate.weight": mat(hp.n_ff, d), p + "ffn_up.weight": mat(hp.n_ff, d),
                      p + "ffn_down.weight": mat(d, hp.n_ff)})
    return t


def build(moe: bool, tied: bool = False, seed: int = 7) -> tuple[Qwen35HParams, Qwen35Model, DictWeights]:
    hp = make_hp(moe)
    w = DictWeights(make_weights(hp, seed, tied))
    return hp, Qwen35Model(hp, w), w


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def prompt(n: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, n)


VARIANTS = [pytest.param(True, id="moe"), pytest.param(False, id="dense")]


@pytest.mark.parametrize("moe", VARIANTS)
def test_decode_token_by_token_equals_one_pass(moe):
    hp, model, _ = build(moe)
    toks = prompt(80)
    full = model.forward(toks, SequenceState.new(hp, 128), all_logits=True)
    st = SequenceState.new(hp, 128)
    steps = np.concatenate([model.forward(toks[i:i + 1], st) for i in range(len(toks))])
    assert full.shape == steps.shape == (80, hp.n_vocab) and full.dtype == np.float32
    assert st.pos == 80
    assert rel_err(steps, full) < 5e-5


@pytest.mark.parametrize("moe", VARIANTS)
def test_prefill_in_pieces_equals_one_pass(moe):
    hp, model, _ = build(moe)
    toks = prompt(88)
    one = SequenceState.new(hp, 128)
    full = model.forward(toks, one, all_logits=True)
    st = SequenceState.new(hp, 128)
    parts = [model.forward(toks[a:b], st, all_logits=True) for a, b in ((0, 37), (37, 87), (87, 88))]
    assert rel_err(np.concatenate(parts), full) < 5e-5
    for il in one.ssm:
        assert rel_err(st.ssm[il], one.ssm[il]) < 5e-5
        assert rel_err(st.conv[il], one.conv[il]) < 5e-5
    for il in one.k:
        assert rel_err(st.k[il][:88], one.k[il][:88]) < 5e-5


@pytest.mark.parametrize("moe", VARIANTS)
def test_state_copy_restore_gives_identical_continuation(moe):
    hp, model, _ = build(moe)
    toks = prompt(60)
    st = SequenceState.new(hp, 96)
    model.forward(toks[:40], st)
    snap = st.copy()
    a = model.forward(toks[40:], st, all_logits=True)
    assert snap.pos == 40 and st.pos == 60
    b = model.forward(toks[40:], snap, all_logits=True)
    np.testing.assert_array_equal(a, b)
    for il in st.ssm:
        np.testing.assert_array_equal(st.ssm[il], snap.ssm[il])
        np.testing.assert_array_equal(st.conv[il], snap.conv[il])
    for il in st.k:
        np.testing.assert_array_equal(st.k[il], snap.k[il])
        np.testing.assert_array_equal(st.v[il], snap.v[il])


def test_state_layout_and_nbytes():
    hp = make_hp(True)
    st = SequenceState.new(hp, 50)
    assert sorted(st.conv) == sorted(st.ssm) == [0, 2] and sorted(st.k) == sorted(st.v) == [1, 3]
    assert st.conv[0].shape == (3, hp.conv_dim) and st.ssm[0].shape == (4, 8, 8)
    assert st.k[1].shape == (50, 2, 16) and st.capacity == 50 and st.pos == 0
    arrays = [*st.conv.values(), *st.ssm.values(), *st.k.values(), *st.v.values()]
    assert all(a.dtype == np.float32 for a in arrays)
    assert st.nbytes == 4 * (2 * 3 * 64 + 2 * 4 * 8 * 8 + 2 * 2 * 50 * 2 * 16)
    c = st.copy()
    c.ssm[0][...] = 1.0
    c.k[1][0] = 1.0
    assert not st.ssm[0].any() and not st.k[1].any()


def test_capacity_is_enforced():
    hp, model, _ = build(False)
    st = SequenceState.new(hp, 10)
    model.forward(prompt(8), st)
    with pytest.raises(ContextFullError):
        model.forward(prompt(3), st)
    with pytest.raises(ContextFullError):
        SequenceState.new(hp, hp.context_length + 1)


def test_bad_arguments_raise_value_error():
    hp, model, _ = build(False)
    st = SequenceState.new(hp, 10)
    with pytest.raises(ValueError):
        model.forward(np.array([hp.n_vocab]), st)
    with pytest.raises(ValueError):
        model.forward(np.array([], dtype=np.int64), st)
    with pytest.raises(ValueError):
        model.forward(prompt(2), st, positions=np.zeros((2, 2), np.int64))


def test_tied_head_uses_token_embd_and_stage_names():
    hp, model, w = build(False, tied=True)
    seen = {}
    model.forward(prompt(5), SequenceState.new(hp, 8), cb=lambda s, il, x: seen.setdefault((s, il), x))
    assert model.output_name == "token_embd.weight"
    np.testing.assert_allclose(seen["result_output", -1],
                               seen["result_norm", -1] @ w.tensors["token_embd.weight"].T, rtol=1e-6, atol=1e-6)
    for stage in ("attn_norm", "linear_attn_out", "attn_residual", "ffn_out", "l_out"):
        assert (stage, 0) in seen
    assert ("attn_out", 1) in seen and ("Qcur", 3) in seen and ("linear_attn_out", 1) not in seen
    assert ("inp_embd", -1) in seen and seen["result_norm", -1].shape == (1, hp.n_embd)


def expert_fetches(w: DictWeights, name: str) -> set[int]:
    """Experts fetched so far from tensor ``name``."""
    return {key[2] for key in w.calls if key[0] == "expert" and key[1] == name}


def test_weights_cached_and_only_selected_experts_fetched():
    hp, model, w = build(True)
    model.cache_experts = False
    topk = {}

    def record(stage: str, il: int, x: np.ndarray) -> None:
        if stage == "ffn_moe_topk":
            topk[il] = x

    model.forward(prompt(30), SequenceState.new(hp, 64), cb=record)
    for il in range(hp.n_layer):
        for part in ("gate", "up", "down"):
            assert expert_fetches(w, f"blk.{il}.ffn_{part}_exps.weight") == set(np.unique(topk[il]).tolist())
    model.forward(prompt(30, seed=4), SequenceState.new(hp, 64))
    assert all(n == 1 for key, n in w.calls.items() if key[0] == "f32")

    hp, cached, w = build(True)
    assert cached.cache_experts
    cached.forward(prompt(30), SequenceState.new(hp, 64))
    before = sum(n for key, n in w.calls.items() if key[0] == "expert")
    cached.forward(prompt(30), SequenceState.new(hp, 64))
    assert sum(n for key, n in w.calls.items() if key[0] == "expert") == before


def test_embeddings_and_positions_arguments():
    hp, model, _ = build(True)
    toks = prompt(12)
    base = model.forward(toks, SequenceState.new(hp, 16), all_logits=True)
    via_emb = model.forward(toks, SequenceState.new(hp, 16), embeddings=model.embed(toks), all_logits=True)
    pos = np.stack([np.arange(12)] * 3)
    via_pos = model.forward(toks, SequenceState.new(hp, 16), positions=pos, all_logits=True)
    np.testing.assert_array_equal(base, via_emb)
    np.testing.assert_array_equal(base, via_pos)
    pos[1:, 4:8] += 3
    moved = model.forward(toks, SequenceState.new(hp, 16), positions=pos, all_logits=True)
    np.testing.assert_array_equal(moved[:4], base[:4])
    assert not np.allclose(moved[4:], base[4:])
