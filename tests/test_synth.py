"""engine.testing.synth: presets, metadata, storage types, determinism and weight statistics.

Statistical checks use generous bounds on thousands of samples (std within 15 % of the target,
|mean| < 0.1 std); they hold for any seed.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.registry import open_text
from engine.arch.qwen35.tensors import tensor_shapes
from engine.testing.synth import QWEN35_N_VOCAB, preset_hparams, storage_type, synth, write_gguf

VOCAB = [f"tok{i}" for i in range(256)]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_35b_preset_is_the_real_model():
    hp = preset_hparams("35b-a3b")
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_vocab) == ("qwen35moe", 40, 2048, 248320)
    assert (hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims, hp.rope_sections) == (16, 2, 256, 64, (11, 11, 10, 0))
    assert (hp.num_k_heads, hp.num_v_heads, hp.head_k_dim, hp.head_v_dim, hp.conv_dim) == (16, 32, 128, 128, 8192)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_ff_shexp) == (256, 8, 512, 512)
    shapes = tensor_shapes(hp)
    assert len(shapes) == 733  # spec table 2: 733 tensors without MTP
    q4_bytes = sum(math.prod(ne[1:]) * (ne[0] // 32 * 18 if storage_type(n, ne, Q.Q4_0) == Q.Q4_0 else ne[0] * 4)
                   for n, ne in shapes.items())
    assert 19.4e9 < q4_bytes < 19.8e9  # spec section 4: Q4_0 computed ~19.6 GB
    small = preset_hparams("35b-a3b", layers=4, experts=4)
    assert (small.n_layer, small.n_expert, small.n_expert_used) == (4, 4, 4)
    assert [small.is_recurrent(i) for i in range(4)] == [True, True, True, False]


def test_preset_errors():
    with pytest.raises(ValueError, match="preset"):
        preset_hparams("70b")
    with pytest.raises(ValueError):
        preset_hparams("tiny", layers=0)
    with pytest.raises(ValueError, match="dense-tiny"):
        preset_hparams("dense-tiny", experts=4)


def test_metadata_keys(tmp_path):
    path = tmp_path / "t.gguf"
    synth(path, "tiny", quant="q8_0", vocab=None)
    f = open_text(path)
    a = "qwen35moe"
    want = {
        "block_count": 4, "nextn_predict_layers": 0, "context_length": 262144, "embedding_length": 64,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
        "attention.value_length": 32, "rope.dimension_count": 8, "rope.dimension_sections": [2, 1, 1, 0],
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "expert_shared_feed_forward_length": 32, "ssm.conv_kernel": 4, "ssm.state_size": 16,
        "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 64, "full_attention_interval": 4,
        "vocab_size": QWEN35_N_VOCAB,
    }
    for key, value in want.items():
        assert f.file.meta(f"{a}.{key}") == value, key
    assert f.file.meta(f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6, rel=1e-6)
    assert f.file.meta(f"{a}.rope.freq_base") == 1e7
    assert f.file.meta("general.architecture") == a and f.file.meta("general.type") == "model"
    assert f.file.meta("general.file_type") == 7 and f.file.meta("general.quantization_version") == 2
    assert f.file.meta("tokenizer.ggml.tokens") is None
    assert f.file.meta(f"{a}.feed_forward_length") is None

    path = tmp_path / "d.gguf"
    synth(path, "dense-tiny", quant="f16", vocab=VOCAB)
    f = open_text(path)
    assert f.file.meta("qwen35.feed_forward_length") == 128 and f.file.meta("qwen35.expert_count") is None
    assert f.file.meta("general.file_type") == 1 and f.file.meta("tokenizer.ggml.model") == "gpt2"
    assert f.file.meta("tokenizer.ggml.tokens") == VOCAB and f.file.meta("qwen35.vocab_size") is None
    assert f.hparams.n_vocab == len(VOCAB)


def test_storage_types():
    for name, ne in [("blk.0.attn_norm.weight", (64,)), ("blk.0.ssm_a", (4,)), ("blk.0.ssm_dt.bias", (4,)),
                     ("blk.0.ssm_conv1d.weight", (4, 128)), ("blk.0.ffn_gate_inp.weight", (64, 8)),
                     ("blk.0.ffn_gate_inp_shexp.weight", (64,)), ("blk.3.attn_q_norm.weight", (32,))]:
        assert storage_type(name, ne, Q.Q4_0) == Q.F32, name
    assert storage_type("blk.0.ssm_beta.weight", (64, 4), Q.Q4_0) == Q.Q4_0
    over = {"output.weight": "q8_0", "blk.*.ssm_norm.weight": "f16"}
    assert storage_type("output.weight", (64, 10), Q.Q4_0, over) == Q.Q8_0
    assert storage_type("blk.2.ssm_norm.weight", (16,), Q.Q4_0, over) == Q.F16


def test_deterministic_for_a_seed(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth(a, "tiny", seed=5, vocab=VOCAB)
    synth(b, "tiny", seed=5, vocab=VOCAB)
    synth(c, "tiny", seed=6, vocab=VOCAB)
    assert digest(a) == digest(b) != digest(c)


@pytest.mark.parametrize("preset,q", [("35b-a3b", "q4_0"), ("35b-a3b", "q8_0"), ("small", "f16"),
                                      ("35b-a3b", "q4_k_m")])
def test_weight_statistics(tmp_path, preset, q):
    path = tmp_path / "s.gguf"
    hp = synth(path, preset, layers=4, experts=2, quant=q, vocab=VOCAB)
    f = open_text(path)
    for name in ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.1.ffn_gate_exps.weight",
                 "blk.2.ffn_up_shexp.weight", "blk.0.ssm_alpha.weight"):
        w = f.file.f32(name)
        std = 1 / math.sqrt(w.shape[-1])
        assert abs(w.std() / std - 1) < 0.15 and abs(w.mean()) < 0.1 * std, name
        x = np.random.default_rng(0).standard_normal(w.shape[-1]).astype(np.float32)
        y = w.reshape(-1, w.shape[-1]) @ x
        assert 0.7 < np.sqrt(np.mean(y * y)) < 1.4, name  # unit-RMS input -> unit-RMS output
    for name in ("blk.0.ssm_out.weight", "blk.3.attn_output.weight", "blk.1.ffn_down_exps.weight"):
        w = f.file.f32(name)
        std = 1 / math.sqrt(2 * hp.n_layer * w.shape[-1])
        assert abs(w.std() / std - 1) < 0.15, name
    assert abs(f.file.f32("token_embd.weight").std() - 1) < 0.15
    for name in ("blk.0.attn_norm.weight", "blk.3.attn_k_norm.weight", "output_norm.weight", "blk.1.ssm_norm.weight"):
        assert abs(f.file.f32(name).mean() - 1) < 0.05, name
    for il in range(3):
        assert np.all(f.file.f32(f"blk.{il}.ssm_a") < 0)
        assert np.all(np.abs(f.file.f32(f"blk.{il}.ssm_dt.bias")) < 1)


def test_q4_k_m_mix_is_llama_quantizes(tmp_path):
    """llama-quant.cpp's Q4_K_M rule (engine.arch.qwen35.quant_mix) for 8 layers: use_more_bits(i, 8) holds for
    i < 1, i >= 7 and (i - 1) % 3 == 2, i.e. layers 0, 3, 6, 7; their attn_qkv / attn_v and
    ffn_down* get Q6_K. Rows of ne0 = 128 (the small preset's expert width) are not whole 256-value
    super-blocks: Q4_K falls back to Q5_0, Q6_K to Q8_0. The output is Q6_K, norms/routers stay F32."""
    path = tmp_path / "m.gguf"
    hp = synth(path, "small", quant="q4_k_m", vocab=VOCAB)
    f = open_text(path)
    more = {0, 3, 6, 7}
    for il in range(hp.n_layer):
        v = f"blk.{il}.attn_qkv.weight" if hp.is_recurrent(il) else f"blk.{il}.attn_v.weight"
        assert f.file.info(v).qtype == (Q.Q6_K if il in more else Q.Q4_K), v
        assert f.file.info(f"blk.{il}.ffn_down_exps.weight").qtype == (Q.Q8_0 if il in more else Q.Q5_0)
        assert f.file.info(f"blk.{il}.ffn_down_shexp.weight").qtype == (Q.Q8_0 if il in more else Q.Q5_0)
        assert f.file.info(f"blk.{il}.ffn_gate_exps.weight").qtype == Q.Q4_K
        assert f.file.info(f"blk.{il}.ffn_gate_inp.weight").qtype == Q.F32
    assert f.file.info("blk.0.ssm_out.weight").qtype == Q.Q4_K
    assert f.file.info("blk.3.attn_output.weight").qtype == Q.Q4_K
    assert f.file.info("output.weight").qtype == Q.Q6_K and f.file.info("token_embd.weight").qtype == Q.Q4_K
    assert f.file.info("blk.0.ssm_conv1d.weight").qtype == Q.F32 and f.file.info("output_norm.weight").qtype == Q.F32
    assert f.file.meta("general.file_type") == 15                                   # LLAMA_FTYPE_MOSTLY_Q4_K_M


def test_q4_k_m_mix_of_the_35b_layout():
    """40 layers: use_more_bits(i, 40) for i < 5, i >= 35 and (i - 5) % 3 == 2 (7, 10, ..., 34):
    20 of 40 layers; with 8 experts llama.cpp's n_expert == 8 branch gives attn_v Q8_0, attn_output Q5_K."""
    from engine.arch.qwen35.quant_mix import mix_types
    hp = preset_hparams("35b-a3b")
    types = mix_types("q4_k_m", tensor_shapes(hp), hp)
    more = [il for il in range(40) if types[f"blk.{il}.ffn_down_exps.weight"] == Q.Q6_K]
    assert more == [0, 1, 2, 3, 4, *range(7, 35, 3), 35, 36, 37, 38, 39]
    attn_v = [il for il in range(40) if types[f"blk.{il}.attn_qkv.weight" if hp.is_recurrent(il)
                                             else f"blk.{il}.attn_v.weight"] == Q.Q6_K]
    assert attn_v == more
    eight = preset_hparams("35b-a3b", experts=8)
    types8 = mix_types("q4_k_m", tensor_shapes(eight), eight)
    assert types8["blk.3.attn_v.weight"] == Q.Q8_0 and types8["blk.0.attn_qkv.weight"] == Q.Q8_0
    assert types8["blk.3.attn_k.weight"] == Q.Q8_0 and types8["blk.3.attn_output.weight"] == Q.Q5_K
    assert types["blk.3.attn_output.weight"] == Q.Q4_K and types["blk.3.attn_k.weight"] == Q.Q4_K
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    tied = {n: ne for n, ne in tensor_shapes(hp).items() if n != "output.weight"}
    assert mix_types("q4_k_m", tied, hp)["token_embd.weight"] == Q.Q6_K
    assert mix_types("q4_k_m", {"blk.0.attn_qkv.weight": (40, 8)}, hp)["blk.0.attn_qkv.weight"] == Q.F16
    with pytest.raises(ValueError, match="q5_k_s"):
        mix_types("q5_k_s", {"blk.0.attn_q.weight": (2048, 8192)}, hp)
    with pytest.raises(ValueError, match="ffn_down_exps"):
        mix_types("q4_k_m", {"ffn_down_exps.weight": (512, 2048, 256)}, hp)


def test_q4_k_m_mix_equals_llama_quantize_output():
    """mix_types against what llama.cpp's own ``llama-quantize ... Q4_K_M`` (no importance matrix) wrote for
    F16 synth files of four configs (tests/fixtures/quant_mix/make_fixture.py, which records the types): 40
    layers at the 35B-A3B's widths, 8 experts (llama.cpp's n_expert == 8 rules), 128-wide expert rows (the shape
    fallback) and the dense MiniCPM-V 4.6 text model. Every tensor it quantized has the type mix_types gives;
    the ones it left alone keep the F16 file's type."""
    import json
    from pathlib import Path

    from engine.arch.qwen35.quant_mix import mix_types, quantized
    data = json.loads((Path(__file__).parent / "fixtures" / "quant_mix" / "q4_k_m.json").read_text())
    assert data["file_type"] == "Q4_K_M" and len(data["cases"]) == 4
    for case in data["cases"]:
        hp = preset_hparams(case["preset"], QWEN35_N_VOCAB, case["layers"], case["experts"])
        shapes, theirs = tensor_shapes(hp), case["types"]
        assert set(theirs) == set(shapes), case["preset"]
        ours = mix_types("q4_k_m", shapes, hp)
        differ = {n: (ours[n].name, theirs[n]) for n, ne in shapes.items()
                  if quantized(n, ne) and ours[n].name != theirs[n]}
        assert not differ, (case["preset"], case["layers"], case["experts"], differ)
        kept = [n for n, ne in shapes.items() if not quantized(n, ne)]
        assert {n: theirs[n] for n in kept} == {n: storage_type(n, shapes[n], Q.F16).name for n in kept}


def test_q4_k_m_counts_attention_v_tensors_not_layers():
    """llama.cpp counts the attention-v-like tensors it meets (n_attention_wv of them) but takes ffn_down's
    layer from the name against block_count. Hand-derived for 7 trunk layers + 1 MTP block whose tensors the
    file does not hold (block_count 8): attn_v-like use use_more_bits(i, 7): 7//8 = 0, 7*7//8 = 6, so
    i >= 6 or i % 3 == 2 -> layers 2, 5, 6; ffn_down uses use_more_bits(l, 8): l < 1, l >= 7 or
    (l - 1) % 3 == 2 -> layers 0, 3, 6 (7 is the absent MTP block)."""
    from dataclasses import replace

    from engine.arch.qwen35.quant_mix import mix_types, use_more_bits
    hp = replace(preset_hparams("35b-a3b", layers=7, experts=16), nextn_predict_layers=1)
    types = mix_types("q4_k_m", tensor_shapes(hp), hp)
    table = {  # layer: (attention-v-like tensor, its type, ffn_down_exps / ffn_down_shexp type)
        0: ("attn_qkv", Q.Q4_K, Q.Q6_K), 1: ("attn_qkv", Q.Q4_K, Q.Q4_K), 2: ("attn_qkv", Q.Q6_K, Q.Q4_K),
        3: ("attn_v", Q.Q4_K, Q.Q6_K), 4: ("attn_qkv", Q.Q4_K, Q.Q4_K), 5: ("attn_qkv", Q.Q6_K, Q.Q4_K),
        6: ("attn_qkv", Q.Q6_K, Q.Q6_K)}
    for il, (v, v_type, down_type) in table.items():
        assert types[f"blk.{il}.{v}.weight"] == v_type, il
        assert types[f"blk.{il}.ffn_down_exps.weight"] == types[f"blk.{il}.ffn_down_shexp.weight"] == down_type, il
        assert types[f"blk.{il}.ffn_gate_exps.weight"] == types[f"blk.{il}.ssm_out.weight" if il != 3
                                                                 else f"blk.{il}.attn_q.weight"] == Q.Q4_K
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


def test_ud_q4_k_xl_mix():
    """The documented UD-Q4_K_XL choices (engine.arch.qwen35.quant_mix): routed gate/up Q4_K, down Q5_K;
    attention and delta-net projections Q8_0; shared experts, embeddings and head as Q4_K_M."""
    from engine.arch.qwen35.quant_mix import mix_types
    hp = preset_hparams("35b-a3b", layers=8, experts=16)
    shapes = tensor_shapes(hp)
    ud, km = mix_types("ud_q4_k_xl", shapes, hp), mix_types("q4_k_m", shapes, hp)
    for il in range(8):
        p = f"blk.{il}."
        assert (ud[p + "ffn_gate_exps.weight"], ud[p + "ffn_up_exps.weight"], ud[p + "ffn_down_exps.weight"]) == (
            Q.Q4_K, Q.Q4_K, Q.Q5_K)
        mixer = ["attn_q", "attn_k", "attn_v", "attn_output"] if not hp.is_recurrent(il) else [
            "attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"]
        assert all(ud[f"{p}{m}.weight"] == Q.Q8_0 for m in mixer), il
        for shared in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
            assert ud[f"{p}{shared}.weight"] == km[f"{p}{shared}.weight"]
    assert ud["output.weight"] == Q.Q6_K and ud["token_embd.weight"] == Q.Q4_K
    assert ud["blk.0.ssm_conv1d.weight"] == ud["blk.0.ffn_gate_inp.weight"] == Q.F32


def test_write_gguf_errors(tmp_path):
    hp = preset_hparams("tiny", n_vocab=8)
    with pytest.raises(ValueError, match="blk.0.attn_gate.weight"):
        write_gguf(tmp_path / "a.gguf", hp, {"blk.0.attn_gate.weight": np.zeros((4, 48), np.float32)}, "q4_0")
    with pytest.raises(ValueError, match="tokens"):
        write_gguf(tmp_path / "b.gguf", hp, {}, "f32", vocab=["a", "b"])
    with pytest.raises(ValueError, match="q4_k"):
        write_gguf(tmp_path / "c.gguf", hp, {}, "q4_k")
    with pytest.raises(ValueError, match="Q6_K"):
        write_gguf(tmp_path / "d.gguf", hp, {"output.weight": np.zeros((8, 256), np.float32)}, "q8_0",
                   quant_overrides={"output.weight": "q6_k"})


def test_real_vocabulary(tmp_path):
    vocab = pytest.importorskip("engine.arch.qwen35.vocab")
    path = tmp_path / "v.gguf"
    synth(path, "tiny", quant="q8_0")
    f = open_text(path)
    assert f.hparams.n_vocab == QWEN35_N_VOCAB == len(f.file.meta("tokenizer.ggml.tokens"))
    assert f.file.meta("tokenizer.ggml.pre") == "qwen35"
    assert f.file.meta("tokenizer.chat_template") == vocab.QWEN35_CHAT_TEMPLATE
    assert f.file.meta("tokenizer.ggml.eos_token_id") == 248046
