"""mmproj GGUF: writer/reader round trip, storage types, and named errors for malformed files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.arch.qwen3vl.mmproj import PRESETS, VisionHParams, load_mmproj, tensor_shapes, write_mmproj
from engine.testing.qwen3vl import RandomWeights, synth_mmproj
from engine.registry import open_projector

FIX = Path(__file__).parent / "fixtures" / "vision"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return synth_mmproj(tmp_path_factory.mktemp("mm") / "tiny-f32.gguf", "tiny", seed=5, ftype="F32")


def rewrite(src: Path, dst: Path, arch: str = "clip", drop_keys=(), set_keys=None, drop_tensors=(),
            tensors=None) -> Path:
    """Copy an F32 mmproj with some keys or tensors removed, replaced or added."""
    set_keys = dict(set_keys or {})
    tensors = dict(tensors or {})
    r = GGUFReader(src)
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in set_keys:
            continue
        vtype = f.types[0]
        w.add_key_value(name, f.contents(), vtype, sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for name, (value, vtype, sub) in set_keys.items():
        w.add_key_value(name, value, vtype, sub_type=sub)
    for t in r.tensors:
        if t.name not in drop_tensors and t.name not in tensors:
            w.add_tensor(t.name, np.array(t.data))
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_round_trip_f32(base):
    mm = load_mmproj(base)
    assert mm.hparams == PRESETS["tiny"]
    expected = RandomWeights(PRESETS["tiny"], seed=5)
    assert set(mm.weights) == set(tensor_shapes(PRESETS["tiny"]))
    for name in expected:
        np.testing.assert_array_equal(mm.f32(name), expected[name])
        assert mm.f32(name).dtype == np.float32


def test_storage_types_follow_converter(tmp_path):
    hp = VisionHParams(n_embd=64, n_ff=100, n_layer=1, n_head=4, patch_size=16, merge=2, out_dim=32, pos_side=4)
    q8 = load_mmproj(write_mmproj(tmp_path / "q8.gguf", hp, RandomWeights(hp, 1), "Q8_0")).qtypes
    assert q8["v.blk.0.attn_qkv.weight"] == "Q8_0" and q8["mm.0.weight"] == "Q8_0"
    assert q8["v.blk.0.ffn_down.weight"] == "F16"                      # 100 is not a multiple of 32
    assert q8["v.patch_embd.weight"] == q8["v.position_embd.weight"] == "F32"
    assert q8["v.blk.0.ln1.weight"] == q8["mm.2.bias"] == "F32"
    f16 = load_mmproj(write_mmproj(tmp_path / "f16.gguf", hp, RandomWeights(hp, 1), "F16")).qtypes
    assert f16["v.patch_embd.weight.1"] == f16["mm.2.weight"] == "F16" and f16["v.post_ln.bias"] == "F32"


def test_metadata_as_llama_cpp_writes_it(base):
    fields = GGUFReader(base).fields
    get = lambda k: fields[k].contents()  # noqa: E731
    assert get("general.architecture") == "clip" and get("clip.projector_type") == "qwen3vl_merger"
    assert get("clip.has_vision_encoder") is True and get("clip.use_gelu") is True
    assert get("clip.vision.image_size") == 128 and get("clip.vision.projection_dim") == 128
    assert get("clip.vision.is_deepstack_layers") == [False, False]


def test_image_pixel_bounds_round_trip(tmp_path):
    """The optional clip.vision.image_{min,max}_pixels keys are written only when set and read back."""
    hp = replace(PRESETS["tiny"], image_min_pixels=2048, image_max_pixels=82944)
    path = write_mmproj(tmp_path / "b.gguf", hp, RandomWeights(hp, 3), "F32")
    fields = GGUFReader(path).fields
    assert fields["clip.vision.image_min_pixels"].contents() == 2048
    assert fields["clip.vision.image_max_pixels"].contents() == 82944
    assert load_mmproj(path).hparams == hp
    plain = write_mmproj(tmp_path / "p.gguf", PRESETS["tiny"], RandomWeights(PRESETS["tiny"], 3), "F32")
    assert "clip.vision.image_max_pixels" not in GGUFReader(plain).fields


@pytest.mark.parametrize("file_min, file_max, asked, expected", [
    (None, None, (65536, 1 << 20), (65536, 1 << 20)),       # no keys (Qwen3.5/3.6 files): the caller's bounds
    (None, 82944, (65536, 1 << 20), (65536, 82944)),        # the file's maximum narrows a larger one
    (None, 82944, (65536, 40000), (40000, 40000)),          # a smaller maximum of the caller stays; min follows
    (4096, None, (65536, 1 << 20), (4096, 1 << 20)),        # the file's minimum replaces the caller's
    (4096, 82944, (1024, 2048), (2048, 2048)),              # min lowered to the max when above it
])
def test_pixel_bounds(file_min, file_max, asked, expected):
    hp = replace(PRESETS["tiny"], image_min_pixels=file_min, image_max_pixels=file_max)
    assert hp.pixel_bounds(*asked) == expected


def test_committed_fixture_loads():
    mm = load_mmproj(FIX / "tiny-mmproj-f16.gguf")
    assert mm.hparams.pos_side == 8 and mm.hparams.out_dim == 128 and len(mm.identity) == 64


def test_identity_differs_by_weights(tmp_path):
    a = synth_mmproj(tmp_path / "a.gguf", "tiny", seed=1, ftype="F32")
    b = synth_mmproj(tmp_path / "b.gguf", "tiny", seed=2, ftype="F32")
    assert load_mmproj(a).identity != load_mmproj(b).identity


def test_synth_out_dim(tmp_path):
    mm = load_mmproj(synth_mmproj(tmp_path / "o.gguf", "tiny", out_dim=96, ftype="Q8_0"))
    assert mm.hparams.out_dim == 96 and mm.f32("mm.2.weight").shape == (96, 256)
    with pytest.raises(ValueError, match="preset"):
        synth_mmproj(tmp_path / "x.gguf", "huge")


STR, U32, BOOL = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.BOOL


MALFORMED = [
    (dict(arch="qwen35moe"), UnsupportedModelError, "general.architecture is 'qwen35moe'"),
    (dict(drop_keys=["clip.projector_type"]), ModelFormatError, "missing metadata key 'clip.vision.projector_type'"),
    (dict(set_keys={"clip.projector_type": (7, U32, None)}), ModelFormatError,
     "'clip.projector_type' should be a string"),
    (dict(drop_keys=["clip.projector_type"], set_keys={"clip.has_vision_encoder": (False, BOOL, None),
                                                       "clip.audio.projector_type": ("ultravox", STR, None)}),
     UnsupportedModelError, "audio-only"),
    (dict(set_keys={"clip.projector_type": ("qwen2vl_merger", STR, None)}), UnsupportedModelError,
     "clip.projector_type is 'qwen2vl_merger'"),
    (dict(set_keys={"clip.vision.is_deepstack_layers": ([True, False], GGUFValueType.ARRAY, BOOL)}),
     UnsupportedModelError, "Qwen3-VL"),
    (dict(set_keys={"clip.has_vision_encoder": (False, BOOL, None)}), UnsupportedModelError, "audio-only"),
    (dict(drop_keys=["clip.vision.block_count"]), ModelFormatError, "missing metadata key 'clip.vision.block_count'"),
    (dict(set_keys={"clip.vision.attention.head_count": (0, U32, None)}), ModelFormatError,
     "'clip.vision.attention.head_count' should be a positive integer"),
    (dict(set_keys={"clip.vision.attention.head_count": (5, U32, None)}), ModelFormatError, "head width"),
    (dict(set_keys={"clip.vision.projection_dim": (64, U32, None)}), ModelFormatError, "'mm.2.weight' has 128 rows"),
    (dict(set_keys={"clip.vision.block_count": (3, U32, None)}), ModelFormatError,
     "missing tensor 'v.blk.2.ln1.weight'"),
    (dict(set_keys={"clip.vision.image_max_pixels": (1000, U32, None)}), ModelFormatError,
     r"clip.vision.image_max_pixels = 1000 is below one image token \(32\^2 pixels\)"),
    (dict(set_keys={"clip.vision.image_min_pixels": (0, U32, None)}), ModelFormatError,
     "'clip.vision.image_min_pixels' should be a positive integer"),
    (dict(set_keys={"clip.vision.image_max_pixels": ("big", STR, None)}), ModelFormatError,
     "'clip.vision.image_max_pixels' should be a positive integer"),
    (dict(set_keys={"clip.vision.image_min_pixels": (8192, U32, None),
                    "clip.vision.image_max_pixels": (4096, U32, None)}), ModelFormatError,
     "clip.vision.image_min_pixels = 8192 exceeds clip.vision.image_max_pixels = 4096"),
    (dict(drop_tensors=["v.patch_embd.weight.1"]), ModelFormatError, "missing tensor 'v.patch_embd.weight.1'"),
    (dict(drop_tensors=["v.position_embd.weight"]), ModelFormatError, "missing tensor 'v.position_embd.weight'"),
    (dict(tensors={"v.position_embd.weight": np.zeros((60, 64), np.float32)}), ModelFormatError, "square grid"),
    (dict(tensors={"v.blk.1.ffn_up.weight": np.zeros((64, 64), np.float32)}), ModelFormatError,
     r"tensor 'v.blk.1.ffn_up.weight' has ne=\(64, 64\), expected ne=\(64, 128\)"),
]
"""(rewrite() arguments, the error, what its message says) for malformed projector files."""


@pytest.mark.parametrize("kwargs, err, msg", MALFORMED)
def test_malformed_files_named(base, tmp_path, kwargs, err, msg):
    bad = rewrite(base, tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(err, match=msg) as e:
        load_mmproj(bad)
    assert "bad.gguf" in str(e.value)


@pytest.mark.parametrize("kwargs, err, msg", MALFORMED)
def test_engine_projector_loading_raises_what_load_mmproj_raises(base, tmp_path, kwargs, err, msg):
    """The engine opens a projector through the registry (engine.registry.open_projector), which reads the
    projector type before the architecture folder's loader runs: the same file gets the same error."""
    bad = rewrite(base, tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(err, match=msg) as e:
        open_projector(bad)
    assert "bad.gguf" in str(e.value)


def test_truncated_and_foreign_files(base, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(base.read_bytes()[: base.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="cut.gguf"):
        load_mmproj(cut)
    txt = tmp_path / "notes.gguf"
    txt.write_text("hello")
    with pytest.raises(ModelFormatError, match="notes.gguf: not a readable GGUF"):
        load_mmproj(txt)
    with pytest.raises(ModelFormatError, match="no such file"):
        load_mmproj(tmp_path / "absent.gguf")
