"""``training/import_gguf.py``: the engine's GGUF files back to the HF training model (inverse of export.py).

Reference-venv tests (torch, transformers, safetensors), skipped where they are absent, as in CI. A small
random model is exported at f32 and q8_0 and imported back; renames and reshapes must be bit-exact, the
``1 + w`` norms and ``ssm_a`` within half an ulp / float32 exp's error, Q8_0 within about 0.562 of a step,
logits within 1e-5 of the largest. Design: docs/design/training.md (each tolerance's derivation).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "training"), str(ROOT / "tests" / "fixtures")]

import data  # noqa: E402
import export  # noqa: E402
import import_gguf  # noqa: E402
import train  # noqa: E402
from hf_to_gguf import randomise, text_to_gguf, vision_to_gguf  # noqa: E402
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration  # noqa: E402

from engine.gguf.file import GGUFFile  # noqa: E402
from engine.arch.qwen3vl.mmproj import load_mmproj, write_mmproj  # noqa: E402
from engine.testing.synth import write_gguf  # noqa: E402
from engine.arch.qwen35.vocab import GGUFVocab  # noqa: E402

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
         "language_model.norm.weight")


def small_config() -> Qwen3_5MoeConfig:
    """``train.model_config`` shrunk: every Q8_0 row a whole number of 32-blocks, the 3:1 layer pattern kept,
    and 3 V heads per K head (with 2 K heads a wrong tiled <-> grouped inverse would not show: with
    r = n_k the reorder is its own inverse)."""
    d = train.model_config(data.load_vocab()).to_dict()
    d["text_config"].update(
        hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)
    d["vision_config"].update(depth=2, hidden_size=64, num_heads=2, intermediate_size=128,
                              num_position_embeddings=64, out_hidden_size=64)
    return Qwen3_5MoeConfig.from_dict(d)


@pytest.fixture(scope="module")
def original() -> Qwen3_5MoeForConditionalGeneration:
    torch.set_num_threads(2)
    model = Qwen3_5MoeForConditionalGeneration(small_config()).float().eval()
    randomise(model, np.random.default_rng(7))
    return model


@pytest.fixture(scope="module")
def exported(original, tmp_path_factory):
    """quant -> (text GGUF, mmproj GGUF, imported model), made once per quant."""
    made = {}

    def get(quant: str):
        if quant not in made:
            text, mmproj = export.export(original, tmp_path_factory.mktemp(quant), quant)
            made[quant] = (text, mmproj, import_gguf.load_gguf_run(text, mmproj))
        return made[quant]

    return get


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """What export.export writes for ``model`` (before quantization): GGUF name -> float32 array."""
    return text_to_gguf(model, model.config.text_config, prefix="model.language_model.") | \
        vision_to_gguf(model.model.visual)


def exp_rel_error(x: np.ndarray) -> np.ndarray:
    """Relative error of numpy's float32 exp at each float32 ``x``, against float64 exp."""
    return np.exp(x).astype(np.float64) / np.exp(x.astype(np.float64)) - 1.0


def a_log_bound(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``|ln(1 + e_a)| + |ln(1 + e_x)|`` (module docstring), plus 1e-15 for evaluating it in float64."""
    return np.abs(np.log1p(exp_rel_error(a))) + np.abs(np.log1p(exp_rel_error(x))) + 1e-15


def test_f32_round_trip_is_exact(original, exported):
    text, mmproj, imported = exported("f32")
    assert imported.config.to_dict() == original.config.to_dict()
    got, want = imported.state_dict(), original.state_dict()
    assert list(got) == list(want)
    for name, w in want.items():
        g, w = got[name].numpy(), w.numpy()
        assert g.dtype == np.float32 and g.shape == w.shape, name
        if name.endswith(NORMS):
            s = (np.float32(1) + w).astype(np.float64)
            half_ulp = (np.spacing(s.astype(np.float32)) / 2).astype(np.float64)
            assert np.all(np.abs(g.astype(np.float64) - w) <= half_ulp), name
        elif name.endswith("A_log"):
            assert np.all(np.abs(g.astype(np.float64) - w) <= a_log_bound(w, g)), name
            assert np.array_equal(np.exp(g), np.exp(w)), name
        else:
            assert np.array_equal(g, w), name
    # what the importer returns exports to exactly the file's values
    f, m = GGUFFile.open(text), load_mmproj(mmproj)
    again = gguf_tensors(imported)
    assert sorted(again) == sorted([*f.tensor_names, *m.weights])
    for name, x in again.items():
        assert np.array_equal(x, f.f32(name) if name in f.tensor_names else m.f32(name)), name


def test_a_log_gives_the_exporters_ssm_a_back():
    """On A_log of HF's init range (log U(0, 16)), ``randomise``'s (float16 values of log U(0.02, 0.6)) and
    near 0 (where float32 exp maps many floats to one value): ``-np.exp(a_log(s)) == s`` bit for bit,
    and the distance to the original within the bound of the module docstring."""
    rng = np.random.default_rng(3)
    a = np.concatenate([np.log(rng.uniform(0, 16, 4000)), np.log(rng.uniform(0.02, 0.6, 4000)).astype(np.float16),
                        rng.normal(0, 1e-3, 4000), [0.0, 2.0 ** -30, -5.0]]).astype(np.float32)
    s = -np.exp(a)
    x = import_gguf.a_log(s)
    assert x.dtype == np.float32 and np.array_equal(-np.exp(x), s)
    assert np.all(np.abs(x.astype(np.float64) - a) <= a_log_bound(a, x))
    with pytest.raises(ValueError, match="must be negative"):
        import_gguf.a_log(np.array([-1.0, 0.0], np.float32))


def test_f32_logits_match_on_an_image_prompt(original, exported):
    imported = exported("f32")[2]
    vocab = data.load_vocab()
    sc = data.scene(data.EVAL_SEED_BASE)
    q, a = data.questions(sc)["colour"]
    smp = data.Encoder(vocab).sample(q, a, data.render(sc))
    batch = train.collate([smp], vocab["pad_id"], original.config.image_token_id)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "token_labels")}
    assert int(inputs["mm_token_type_ids"].sum()) == smp.grid[0] * smp.grid[1] // 4
    with torch.no_grad():
        want = original(**inputs).logits
        got = imported(**inputs).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def q8_0_bound(x: np.ndarray) -> np.ndarray:
    """Per-element bound on |Q8_0 decode - x| (module docstring) for ``x`` (..., ne0), ne0 % 32 == 0."""
    blocks = x.astype(np.float64).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    bound = d * (0.5 + 127 * 2.0 ** -20) + 127 * np.maximum(d * 2.0 ** -11, 2.0 ** -25)
    return np.broadcast_to(bound, blocks.shape).reshape(x.shape)


def test_q8_0_round_trip_within_the_rounding_bound(original, exported):
    text, mmproj, imported = exported("q8_0")
    f, m = GGUFFile.open(text), load_mmproj(mmproj)
    qtypes = {name: f.info(name).qtype.name for name in f.tensor_names} | m.qtypes
    assert {"F32", "Q8_0"} <= set(qtypes.values()) <= {"F32", "F16", "Q8_0"}
    want, got = gguf_tensors(original), gguf_tensors(imported)
    worst_steps = 0.0
    for name, w in want.items():
        err = np.abs(got[name].astype(np.float64) - w)
        if qtypes[name] == "Q8_0":
            bound = q8_0_bound(w)
            assert np.all(err <= bound), (name, float((err - bound).max()))
            step = np.broadcast_to(np.abs(w).reshape(-1, 32).max(axis=1, keepdims=True) / 127, (w.size // 32, 32))
            worst_steps = max(worst_steps, float((err.reshape(-1, 32) / np.where(step > 0, step, 1)).max()))
        else:
            assert not err.any(), (name, qtypes[name], float(err.max()))
    assert 0.5 < worst_steps < 0.5625   # measured 0.550: more than half a step, as derived


def test_cli_writes_a_run_train_and_export_read(original, exported, tmp_path):
    text = exported("f32")[0]
    run = tmp_path / "run"
    import_gguf.main([str(text.parent), "--out", str(run), "--samples", "4096"])
    log = json.loads((run / "log.json").read_text())
    assert log["samples"] == 4096 and set(log["shards"]) == {p.name for p in run.glob("weights-*.safetensors")}
    back = export.load_run(run).state_dict()      # config.json + the float16 shards, as train.py --init reads them
    for name, w in exported("f32")[2].state_dict().items():
        assert torch.equal(back[name], w.half().float()), name


def test_files_without_the_image_bound_import(original, exported, tmp_path):
    """An mmproj written before ``clip.vision.image_max_pixels`` existed (the demo files up to commit
    234077d) imports to the same model; re-exporting adds the key."""
    text, mmproj, imported = exported("f32")
    old = tmp_path / "old-mmproj.gguf"
    hp = dataclasses.replace(export.vision_hparams(original.config.vision_config), image_max_pixels=None)
    write_mmproj(old, hp, vision_to_gguf(original.model.visual), "F32")
    again = import_gguf.load_gguf_run(text, old)
    assert again.config.to_dict() == imported.config.to_dict()
    for name, w in imported.state_dict().items():
        assert torch.equal(again.state_dict()[name], w), name


def test_unused_tensor_and_unfilled_parameter_are_named(original, exported, tmp_path):
    text, mmproj, imported = exported("f32")
    tensors = text_to_gguf(original, original.config.text_config, prefix="model.language_model.")
    tensors["blk.0.extra.weight"] = np.zeros((2, 32), np.float32)
    extra = tmp_path / "extra.gguf"
    write_gguf(extra, export.text_hparams(original.config.text_config), tensors, "f32",
               vocab=GGUFVocab(**data.load_vocab()), chat_template=data.chat_template())
    with pytest.raises(ValueError, match=r"left unused: blk\.0\.extra\.weight"):
        import_gguf.load_gguf_run(extra, mmproj)
    state = {k: v.numpy() for k, v in imported.state_dict().items()}
    name = "model.language_model.layers.2.linear_attn.A_log"
    del state[name]
    with pytest.raises(ValueError, match=rf"HF parameter {re.escape(name)} left unfilled"):
        import_gguf.fill(Qwen3_5MoeForConditionalGeneration(original.config), state)


def test_question_weights_option_parses_and_refuses_bad_items():
    assert train.parse_kind_weights(None) is None and train.parse_kind_weights("") is None
    assert train.parse_kind_weights("shape=3,colour=1.5") == {"shape": 3.0, "colour": 1.5}
    for bad in ("shape", "shapes=2", "shape=0", "shape=-1", "shape=inf", "shape=nan", "shape=x", "shape=2,"):
        with pytest.raises(SystemExit, match="--question-weights"):
            train.parse_kind_weights(bad)
