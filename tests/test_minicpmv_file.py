"""MiniCPM-V 4.6 projector file: the synth writer's layout, reading what llama.cpp's converter writes
(``tests/fixtures/minicpmv/llamacpp-mmproj-f16.gguf``), and bad or truncated files named in the error."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from engine.gguf import write as gguf_write
from engine.arch.minicpmv import mmproj as mp
from engine.testing import minicpmv as mp_test
from engine.arch.minicpmv.tower import MiniCPMVTower
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gguf.header import read_header
from engine.registry import open_text

FIXTURES = Path(__file__).parent / "fixtures" / "minicpmv"
sys.path.insert(0, str(FIXTURES))

from cases import CONVERTER_HPARAMS, CONVERTER_SEED, MMPROJ  # noqa: E402


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    return mp.load_mmproj(mp_test.synth_mmproj(tmp_path_factory.mktemp("mcv") / "m-mmproj.gguf", **MMPROJ))


def test_synth_file_layout(mm, tmp_path):
    t = read_header(mm.path)
    assert t.value("clip.projector_type") == "minicpmv4_6"
    assert t.value("clip.vision.projector.scale_factor") == 4
    assert t.value("clip.vision.wa_layer_indexes") == [1]
    assert t.value("clip.vision.image_size") == 448
    assert set(t.tensors) == set(mp.tensor_shapes(mm.hparams))
    assert mm.qtypes["v.blk.0.attn_q.weight"] == "F16" and mm.qtypes["v.blk.0.ln1.weight"] == "F32"
    assert mm.hparams == replace(mp.PRESETS["tiny"])
    q8 = mp.load_mmproj(mp_test.synth_mmproj(tmp_path / "q8.gguf", "tiny", seed=1, ftype="Q8_0", scale_factor=2))
    assert q8.hparams.mode == "4x" and q8.qtypes["mm.up.weight"] == "Q8_0"
    assert mp.storage_type("v.blk.0.ffn_down.weight", (1152, 4304), mp.Q.Q8_0) == mp.Q.F16   # 4304 % 32 != 0
    assert mp.storage_type("v.position_embd.weight", (4900, 1152), mp.Q.F16) == mp.Q.F32


def test_synth_pair_matches_text_width(tmp_path):
    from engine.testing.synth import synth
    from engine.testing.pairs import synth_mmproj_for
    synth(tmp_path / "m.gguf", "minicpmv46-tiny", quant="f32", vocab=None)
    proj = mp.load_mmproj(synth_mmproj_for(tmp_path / "m-mmproj.gguf", "minicpmv46-tiny"))
    text = open_text(tmp_path / "m.gguf")
    assert text.hparams.arch == "qwen35" and proj.hparams.out_dim == text.hparams.n_embd
    assert proj.hparams.n_layer == 4 and proj.qtypes["mm.up.weight"] == "F16"


def test_reads_what_llama_cpp_writes(tmp_path):
    """llamacpp-mmproj-f16.gguf was written by llama.cpp's convert_hf_to_gguf.py (make_fixtures.py) from an HF
    checkpoint holding RandomWeights(CONVERTER_HPARAMS, CONVERTER_SEED): the engine's writer, given the same
    weights, writes the same keys, tensors, storage types and values."""
    theirs = mp.load_mmproj(FIXTURES / "llamacpp-mmproj-f16.gguf")
    hp = replace(mp.PRESETS["tiny"], **CONVERTER_HPARAMS)
    ours = mp.load_mmproj(mp.write_mmproj(tmp_path / "ours.gguf", hp, mp_test.RandomWeights(hp, CONVERTER_SEED)))
    assert theirs.hparams == ours.hparams == hp
    assert theirs.qtypes == ours.qtypes
    for name, x in ours.weights.items():
        np.testing.assert_array_equal(theirs.weights[name], x, err_msg=name)
    t_theirs, t_ours = read_header(theirs.path), read_header(ours.path)
    for key in ("clip.projector_type", "clip.vision.image_size", "clip.vision.projector.scale_factor",
                "clip.vision.wa_layer_indexes", "clip.use_gelu", "general.type", "clip.vision.projection_dim"):
        assert t_theirs.value(key) == t_ours.value(key), key
    rows = MiniCPMVTower(theirs).encode_piece(np.full((64, hp.patch_dim), 0.25, np.float32), (8, 8))
    assert rows.shape == (4, 32) and np.isfinite(rows).all()


def _rewrite(src: Path, dst: Path, *, drop_key: str | None = None, set_key: tuple | None = None,
             drop_tensor: str | None = None, reshape: str | None = None) -> Path:
    """A copy of projector file ``src`` with one key or tensor changed (written by engine.gguf.write)."""
    src_mm = mp.load_mmproj(src)
    hp = src_mm.hparams
    recs = []
    for r in mp._records(hp, mp.Q.F16):
        key = r[8:8 + int.from_bytes(r[:8], "little")].decode()
        if key == drop_key:
            continue
        if set_key is not None and key == set_key[0]:
            r = gguf_write.kv_record(*set_key)
        recs.append(r)
    outs = []
    for name, x in src_mm.weights.items():
        if name == drop_tensor:
            continue
        if name == reshape:
            x = x[:-1]
        ne = tuple(reversed(x.shape))
        outs.append(gguf_write.TensorOut(name, ne, 0, x.nbytes, lambda x=x: [np.ascontiguousarray(x)]))
    gguf_write.write(dst, recs, outs)
    return dst


@pytest.mark.parametrize("change, error, match", [
    (dict(set_key=("clip.projector_type", "qwen3vl_merger", GGUFValueType.STRING)), UnsupportedModelError,
     "projector_type"),
    (dict(set_key=("general.architecture", "qwen35", GGUFValueType.STRING)), UnsupportedModelError, "clip"),
    (dict(drop_key="clip.vision.block_count"), ModelFormatError, "block_count"),
    (dict(set_key=("clip.vision.projector.scale_factor", 3, GGUFValueType.UINT32)), UnsupportedModelError,
     "scale_factor"),
    (dict(set_key=("clip.vision.wa_layer_indexes", [9], GGUFValueType.ARRAY, GGUFValueType.INT32)),
     ModelFormatError, "wa_layer_indexes"),
    (dict(set_key=("clip.vision.image_mean", [0.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)),
     ModelFormatError, "image_mean"),
    (dict(drop_tensor="v.vit_merger.ds_ln.bias"), ModelFormatError, "ds_ln.bias"),
    (dict(reshape="mm.up.weight"), ModelFormatError, "mm.up.weight"),
    (dict(reshape="v.position_embd.weight"), ModelFormatError, "position_embd"),
])
def test_bad_files_name_the_problem(mm, tmp_path, change, error, match):
    bad = _rewrite(mm.path, tmp_path / "bad.gguf", **change)
    with pytest.raises(error, match=match):
        mp.load_mmproj(bad)


def test_truncated_file(mm, tmp_path):
    data = mm.path.read_bytes()
    for n in (10, 200, len(data) // 2):
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        with pytest.raises(ModelFormatError, match="cut.gguf"):
            mp.load_mmproj(tmp_path / "cut.gguf")
