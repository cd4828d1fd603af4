"""Expert pruning (engine.reap.prune, engine.reap.pruned, engine.gguf.write): statistics, the pruned file, the CLI.

Tolerances: the statistics are float64 sums of the model's own float32 expert outputs, compared with a
float64 numpy reference from the same router and expert weights: <= 1e-5 relative (measured ~1e-7, the
float32 rounding of the expert outputs). Pruned logits: the pruned model and the unpruned one with the
dropped experts' router logits at -inf do the same float32 arithmetic except the softmax normaliser,
which the top-k renormalisation cancels: <= 1e-5 relative to the largest logit.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image
from gguf import GGUFValueType

from engine.gguf import write as gguf_write
from engine.reap import prune, pruned as pruned_file
from engine.__main__ import main
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gguf.file import GGUFFile
from engine.registry import LoadedText, open_text
from engine.arch.qwen35.model import Qwen35Model
from engine.ops import reference as ops
from engine.turn.state import SequenceState
from engine.testing.synth import preset_hparams, synth, write_gguf
from engine.testing.pairs import synth_mmproj_for

VOCAB = [f"tok{i}" for i in range(64)]


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prune") / "tiny-f32.gguf"
    synth(path, "tiny", quant="f32", vocab=VOCAB, seed=3)
    return path


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prune") / "tiny-q4.gguf"
    synth(path, "tiny", quant="q4_0", vocab=VOCAB, seed=4)
    return path


def _models(text):
    yield Qwen35Model(text.hparams, text.file)
    from engine.kernels import cpu
    if cpu.available():
        from engine.arch.qwen35.cpu import NativeQwen35Model
        yield NativeQwen35Model(text.hparams, text.file)


def _reference_stats(g: LoadedText, ys: dict[int, list[np.ndarray]]) -> dict[str, np.ndarray]:
    """REAP statistics the way update_pruning_state computes them, from each MoE layer's input rows."""
    hp = g.hparams
    out = {k: np.zeros((hp.n_layer, hp.n_expert)) for k in ("frequency", "reap_sum", "ean_sum", "gate_sum")}
    for il in range(hp.n_layer):
        y = np.concatenate(ys[il]).astype(np.float64)
        logits = y @ g.file.f32(f"blk.{il}.ffn_gate_inp.weight").astype(np.float64).T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        sel = np.argsort(-p, axis=-1, kind="stable")[:, :hp.n_expert_used]
        w = p / np.take_along_axis(p, sel, -1).sum(-1, keepdims=True)
        for j in range(hp.n_expert):
            active = (sel == j).any(-1)
            if not active.any():
                continue
            gate, up, down = (g.file.expert(f"blk.{il}.ffn_{x}_exps.weight", j).astype(np.float64)
                              for x in ("gate", "up", "down"))
            a = y[active] @ gate.T
            f = (a / (1 + np.exp(-a)) * (y[active] @ up.T)) @ down.T
            norm = np.linalg.norm(f, axis=-1)
            out["frequency"][il, j] = active.sum()
            out["reap_sum"][il, j] = (norm * w[active, j]).sum()
            out["ean_sum"][il, j] = norm.sum()
            out["gate_sum"][il, j] = w[active, j].sum()
    return out


def test_statistics_match_a_numpy_reference(f32_model):
    g = open_text(f32_model)
    hp = g.hparams
    rng = np.random.default_rng(7)
    for model in _models(g):
        stats = prune.ExpertStats.for_model(g)
        model.observer = stats
        ys: dict[int, list[np.ndarray]] = {il: [] for il in range(hp.n_layer)}

        def cb(stage, il, x):
            if stage == "attn_post_norm":
                ys[il].append(x.copy())
        for n in (19, 7):  # two prompts: sums accumulate over calls
            tokens = rng.integers(0, hp.n_vocab, n)
            emb = rng.standard_normal((n, hp.n_embd)).astype(np.float32)
            model.forward(tokens, SequenceState.new(hp, n), embeddings=emb, cb=cb)
        want = _reference_stats(g, ys)
        assert stats.tokens.tolist() == [26] * hp.n_layer
        assert (stats.frequency.sum(1) == 26 * hp.n_expert_used).all()
        np.testing.assert_array_equal(stats.frequency, want["frequency"])
        for key in ("reap_sum", "ean_sum", "gate_sum"):
            got = getattr(stats, key)
            assert np.abs(got - want[key]).max() <= 1e-5 * np.abs(want[key]).max(), (type(model).__name__, key)
        want_reap = want["reap_sum"] / np.maximum(want["frequency"], 1)
        assert np.abs(stats.reap - want_reap).max() <= 1e-5 * want_reap.max()


class MaskedRouter(Qwen35Model):
    """The reference model with the router logits of ``dropped[il]`` set to -inf before top-k."""

    def __init__(self, hp, weights, dropped):
        super().__init__(hp, weights)
        self.dropped = dropped

    def moe(self, il, y, cb):
        p = f"blk.{il}."
        logits = ops.linear(y, self.w(p + "ffn_gate_inp.weight"))
        logits[:, self.dropped[il]] = -np.inf
        idx, weights = ops.topk_route(logits, self.hp.n_expert_used)
        out = np.zeros_like(y)
        for e in np.unique(idx):
            rows, slot = np.nonzero(idx == e)
            out[rows] += weights[rows, slot, None] * ops.swiglu(y[rows], *self.expert(il, int(e)))
        return out + ops.shared_expert(y, self.w(p + "ffn_gate_shexp.weight"), self.w(p + "ffn_up_shexp.weight"),
                                       self.w(p + "ffn_down_shexp.weight"), self.w(p + "ffn_gate_inp_shexp.weight"))


@pytest.mark.parametrize("keep", [2, 5])
def test_pruned_logits_equal_masked_router(f32_model, tmp_path, keep):
    g = open_text(f32_model)
    hp = g.hparams
    rng = np.random.default_rng(keep)
    kept = [sorted(rng.choice(hp.n_expert, keep, replace=False).tolist()) for _ in range(hp.n_layer)]
    out = tmp_path / "pruned.gguf"
    pruned_file.prune_file(g, out, kept, {"method": "test"})
    p = open_text(out)
    assert p.hparams == dataclasses.replace(hp, n_expert=keep)
    tokens = rng.integers(0, hp.n_vocab, 23)
    dropped = [sorted(set(range(hp.n_expert)) - set(k)) for k in kept]
    want = MaskedRouter(hp, g.file, dropped).forward(tokens, SequenceState.new(hp, 23), all_logits=True)
    got = Qwen35Model(p.hparams, p.file).forward(tokens, SequenceState.new(p.hparams, 23), all_logits=True)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    unpruned = Qwen35Model(hp, g.file).forward(tokens, SequenceState.new(hp, 23), all_logits=True)
    assert np.abs(unpruned - want).max() > 1e-3 * np.abs(want).max()  # the mask changes the model


def test_pruned_file_keeps_other_bytes_types_and_metadata(q4_model, tmp_path):
    g = open_text(q4_model)
    hp = g.hparams
    kept = [[0, 2, 3, 7], [1, 2, 4, 5], [0, 1, 6, 7], [3, 4, 5, 6]]
    out = tmp_path / "p.gguf"
    size = pruned_file.prune_file(g, out, kept, {"method": "reap", "calibration_samples": 3})
    assert size == out.stat().st_size
    p = open_text(out)
    assert p.file.tensor_names == g.file.tensor_names
    for name in g.file.tensor_names:
        a, b = g.file.info(name), p.file.info(name)
        assert a.qtype == b.qtype, name
        if pruned_file.is_expert_tensor(name):
            il = int(name.split(".")[1])
            assert b.ne == (*a.ne[:-1], 4)
            want = g.file.raw(name).reshape(hp.n_expert, -1)[kept[il]]
            np.testing.assert_array_equal(p.file.raw(name).reshape(4, -1), want)
        else:
            assert a.ne == b.ne and np.array_equal(g.file.raw(name), p.file.raw(name)), name
    changed = {f"{hp.arch}.expert_count", pruned_file.PRUNING_KEY}
    assert set(p.file.meta_keys) == set(g.file.meta_keys) | {pruned_file.PRUNING_KEY}
    for key in g.file.meta_keys:
        if key not in changed:
            assert p.file.kv_record(key) == g.file.kv_record(key), key
    note = pruned_file.pruning_note(p.file)
    assert note["method"] == "reap" and note["experts_before"] == 8 and note["experts_kept"] == 4
    assert note["kept"] == kept
    assert pruned_file.pruning_summary(p) == "4 of 8 experts kept (REAP)" and pruned_file.pruning_summary(g) == ""
    with pytest.raises(ValueError, match="same number"):
        pruned_file.prune_file(g, tmp_path / "x.gguf", [[0, 1], [0, 1, 2], [0, 1], [0, 1]], {})
    with pytest.raises(ValueError, match="distinct"):
        pruned_file.prune_file(g, tmp_path / "x.gguf", [[0, 0, 1]] * 4, {})
    with pytest.raises(ModelFormatError, match="must not be the model"):
        pruned_file.prune_file(g, q4_model, kept, {})


def test_mtp_blocks_are_dropped(tmp_path):
    hp = dataclasses.replace(preset_hparams("tiny", n_vocab=64), nextn_predict_layers=1)
    rng = np.random.default_rng(0)
    src = tmp_path / "plain.gguf"
    synth(src, "tiny", quant="f32", vocab=VOCAB)
    g0 = GGUFFile.open(src)
    tensors = {n: g0.f32(n) for n in g0.tensor_names}
    tensors["blk.4.ffn_gate_inp.weight"] = rng.standard_normal((8, 64)).astype(np.float32)
    tensors["blk.4.nextn.eh_proj.weight"] = rng.standard_normal((64, 128)).astype(np.float32)
    path = tmp_path / "mtp.gguf"
    write_gguf(path, hp, tensors, "f32", vocab=VOCAB)
    g = open_text(path)
    out = tmp_path / "p.gguf"
    pruned_file.prune_file(g, out, [[0, 1, 2]] * 4, {})
    p = open_text(out)
    assert p.hparams.nextn_predict_layers == 0 and p.hparams.n_layer == 4 and p.file.meta("qwen35moe.block_count") == 4
    assert not any(n.startswith("blk.4.") for n in p.file.tensor_names)


def test_keep_and_model_checks(tmp_path):
    for keep, msg in ((8, "not below the model's 8 experts"), (1, "below the model's top-2")):
        with pytest.raises(ValueError, match=msg):
            prune.check_keep(keep, 8, 2)
    dense = tmp_path / "dense.gguf"
    synth(dense, "dense-tiny", quant="f32", vocab=VOCAB)
    with pytest.raises(UnsupportedModelError, match="dense"):
        pruned_file.prune_file(open_text(dense), tmp_path / "x.gguf", [], {})


def test_stats_selection_and_json(tmp_path, f32_model):
    g = open_text(f32_model)
    st = prune.ExpertStats.for_model(g, {"source": "test"})
    rng = np.random.default_rng(1)
    for il in range(4):
        st.routed(il, rng.standard_normal((30, 8)).astype(np.float32),
                  np.argsort(-rng.standard_normal((30, 8)), axis=-1)[:, :2], rng.uniform(0.1, 2, (30, 2)))
    for method in prune.METHODS:
        kept = st.kept_experts(5, method)
        s = st.scores(method)
        for il, k in enumerate(kept):
            dropped = sorted(set(range(8)) - set(k))
            assert len(k) == 5 and k == sorted(k) and s[il, dropped].max() <= s[il, k].min()
    np.testing.assert_allclose(st.usage.sum(1), 2.0)
    path = tmp_path / "s.json"
    st.save(path)
    back = prune.ExpertStats.load(path)
    for key in ("tokens", "frequency", "reap_sum", "ean_sum", "gate_sum"):
        np.testing.assert_array_equal(getattr(back, key), getattr(st, key))
    back.check_model(g.file, "s.json")
    assert back.calibration == {"source": "test"}
    d = json.loads(path.read_text())
    assert d["format"] == "deltadesk.expert_stats" and len(d["layers"]) == 4 and len(d["layers"][0]["reap"]) == 8
    d["layers"][2]["frequency"] = [1, 2]
    path.write_text(json.dumps(d))
    with pytest.raises(ModelFormatError, match=r"s\.json.*layers\[2\]\.frequency"):
        prune.ExpertStats.load(path)
    path.write_text("{not json")
    with pytest.raises(ModelFormatError, match="cannot read"):
        prune.ExpertStats.load(path)
    other = prune.ExpertStats(4, 8, 2, {"file": "other.gguf", "identity": "gguf-1-00"})
    with pytest.raises(ModelFormatError, match="other.gguf"):
        other.check_model(g.file, "s.json")


def test_calibration_file(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image", "image": "a.png"}, {"type": "text", "text": "hi"}]}]}) + "\n\n"
        + json.dumps([{"role": "user", "content": "x"}]) + "\n")
    convs = prune.calibration_set(good)
    assert len(convs) == 2 and convs[0][0]["content"][0]["image"] == str(tmp_path / "a.png")
    assert len(prune.calibration_set()) == len(prune.BUILTIN_CALIBRATION)
    assert len(prune.calibration_set(None, tmp_path)) == len(prune.BUILTIN_CALIBRATION) + 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[{"role": "user", "content": "x"}]\n{"messages": 3}\n')
    with pytest.raises(ModelFormatError, match=r"bad\.jsonl:2"):
        prune.calibration_set(bad)
    with pytest.raises(ModelFormatError, match="folder"):
        prune.calibration_set(None, tmp_path / "nope")


def test_per_layer_expert_counts_are_unsupported(tmp_path, q4_model):
    g = open_text(q4_model)
    hp = g.hparams
    counts = [8, 8, 6, 8]
    recs = [gguf_write.kv_record("qwen35moe.expert_count", counts, GGUFValueType.ARRAY, GGUFValueType.UINT32)
            if k == "qwen35moe.expert_count" else g.file.kv_record(k) for k in g.file.meta_keys]
    tensors = [gguf_write.TensorOut(n, g.file.info(n).ne, int(g.file.info(n).qtype), g.file.info(n).nbytes,
                                    lambda n=n: (g.file.raw(n).reshape(-1),)) for n in g.file.tensor_names]
    path = tmp_path / "nonuniform.gguf"
    gguf_write.write(path, recs, tensors, g.file.alignment)
    with pytest.raises(UnsupportedModelError, match=r"nonuniform\.gguf.*per-layer expert counts \[6, 8\]"):
        open_text(path)
    # a uniform per-layer array is one count
    recs[list(g.file.meta_keys).index("qwen35moe.expert_count")] = gguf_write.kv_record(
        "qwen35moe.expert_count", [8] * 4, GGUFValueType.ARRAY, GGUFValueType.UINT32)
    gguf_write.write(path, recs, tensors, g.file.alignment)
    assert open_text(path).hparams == hp
    # one layer stores fewer experts than expert_count says
    small = pruned_file.prune_file(g, tmp_path / "six.gguf", [list(range(6))] * 4, {})
    assert small > 0
    six = GGUFFile.open(tmp_path / "six.gguf")
    mixed = [t if not t.name.startswith("blk.1.") else gguf_write.TensorOut(
        t.name, six.info(t.name).ne, t.type_id, six.info(t.name).nbytes,
        lambda n=t.name: (six.raw(n).reshape(-1),)) for t in tensors]
    gguf_write.write(path, [g.file.kv_record(k) for k in g.file.meta_keys], mixed, g.file.alignment)
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_gate_inp\.weight holds 6 experts"):
        open_text(path)


def test_cli_prune_calibrates_once_and_reuses_the_statistics(synth_model, tmp_path, capsys):
    model = synth_model("tiny", "q8_0")
    mmproj = synth_mmproj_for(tmp_path / "tiny-mmproj.gguf", "tiny")
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(images / "a.png")
    stats = tmp_path / "tiny.stats.json"
    out = tmp_path / "p6.gguf"
    assert main(["prune", str(model), "--keep", "6", "-o", str(out), "--stats", str(stats), "--images", str(images),
                 "--mmproj", str(mmproj), "--max-tokens", "96"]) == 0
    err = capsys.readouterr().err
    assert "[calibrating]" in err and f"saved to {stats}" in err and "8 -> 6 experts" in err
    st = prune.ExpertStats.load(stats)
    assert st.calibration["samples"] == len(prune.BUILTIN_CALIBRATION) + 1 and 0 < st.calibration["tokens"]
    assert st.calibration["tokens"] <= 96 * (len(prune.BUILTIN_CALIBRATION) + 1)
    assert (st.tokens == st.calibration["tokens"]).all()
    assert st.kept_experts(6, "reap") == pruned_file.pruning_note(GGUFFile.open(out))["kept"]

    out4 = tmp_path / "p4.gguf"
    assert main(["prune", str(model), "--keep", "4", "--method", "frequency", "-o", str(out4),
                 "--stats", str(stats)]) == 0
    err = capsys.readouterr().err
    assert "[calibrating]" not in err and f"expert statistics from {stats}" in err
    assert pruned_file.pruning_note(GGUFFile.open(out4))["kept"] == st.kept_experts(4, "frequency")
    assert main(["info", str(out4)]) == 0
    assert "4 experts, top-2, expert FFN 32, shared expert FFN 32 (4 of 8 experts kept (frequency))" in \
        capsys.readouterr().out
    assert pruned_file.pruning_summary(open_text(out4)) == "4 of 8 experts kept (frequency)"

    for keep, msg in (("8", "not below"), ("1", "top-2")):
        assert main(["prune", str(model), "--keep", keep, "-o", str(tmp_path / "x.gguf")]) == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
