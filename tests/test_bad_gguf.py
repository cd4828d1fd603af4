"""Hostile and broken GGUF files: each must raise the right engine.errors class, with a message naming
the file and the key or tensor, quickly and without large allocations (never a crash or a hang)."""

from __future__ import annotations

import dataclasses
import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.gguf.file import GGUFFile
from engine.registry import open_text
from engine.arch.qwen35.tensors import tensor_shapes
from engine.testing.synth import preset_hparams, synth, write_gguf

VOCAB = [f"tok{i}" for i in range(64)]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Bytes of a valid tiny Q4_0 file."""
    path = tmp_path_factory.mktemp("bad") / "good.gguf"
    synth(path, "tiny", quant="q4_0", vocab=VOCAB)
    return path.read_bytes()


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_header(kvs: list[bytes], n_tensors: int = 0, n_kv: int | None = None, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs) if n_kv is None else n_kv) + b"".join(kvs)


ARCH = s("general.architecture") + struct.pack("<I", 8) + s("qwen35moe")


def table_entry(data: bytes, name: str) -> tuple[int, int]:
    """(offset of the ggml type field, offset of the data-offset field) of a tensor table entry."""
    pos = data.index(s(name)) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    type_at = pos + 4 + 8 * n_dims
    return type_at, type_at + 4


def expect(path, data: bytes, error: type, *needles: str):
    """Write ``data``, open it, and check the error class, the file name and the needles in the message."""
    path.write_bytes(data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            open_text(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 60      # refused, not stuck in a loop over a hostile count (it takes ms)
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB allocated"
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.mark.parametrize("cut", [0, 3, 10, 23, 24, 60, 500, 2000, -1])
def test_truncated_header_or_data(tmp_path, good, cut):
    data = good[:cut] if cut >= 0 else good[:-1]
    msg = expect(tmp_path / "cut.gguf", data, ModelFormatError)
    assert any(w in msg for w in ("too short", "truncated", "past the end")), msg


def test_truncated_inside_tensor_table_and_data(tmp_path, good):
    at = good.index(s("blk.2.ssm_a")) + 5
    expect(tmp_path / "t.gguf", good[:at], ModelFormatError, "tensor", "truncated")
    expect(tmp_path / "d.gguf", good[:len(good) * 2 // 3], ModelFormatError, "past the end of the file", "tensor")


def test_wrong_magic_and_version(tmp_path, good):
    expect(tmp_path / "m.gguf", b"GGML" + good[4:], ModelFormatError, "magic", "GGUF")
    for version in (1, 4):
        expect(tmp_path / "v.gguf", good[:4] + struct.pack("<I", version) + good[8:], ModelFormatError,
               f"version {version}")
    expect(tmp_path / "be.gguf", good[:4] + struct.pack(">I", 3) + good[8:], ModelFormatError, "big-endian")


def test_empty_missing_and_directory(tmp_path):
    expect(tmp_path / "empty.gguf", b"", ModelFormatError, "too short")
    with pytest.raises(ModelFormatError, match="nope.gguf"):
        GGUFFile.open(tmp_path / "nope.gguf")
    with pytest.raises(ModelFormatError, match="cannot open"):
        open_text(tmp_path)


def small_float_tensors(hp):
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(ne[::-1]).astype(np.float32) for n, ne in tensor_shapes(hp).items()}


def test_unknown_architecture(tmp_path):
    hp = dataclasses.replace(preset_hparams("tiny", n_vocab=64), arch="llama")
    path = tmp_path / "llama.gguf"
    write_gguf(path, hp, {"token_embd.weight": np.zeros((64, 64), np.float32)}, "f32")
    with pytest.raises(UnsupportedModelError, match=r"llama\.gguf.*'llama'"):
        open_text(path)


def test_missing_and_misshaped_tensors(tmp_path):
    hp = preset_hparams("tiny", n_vocab=64)
    t = small_float_tensors(hp)
    del t["blk.2.ssm_out.weight"]
    path = tmp_path / "missing.gguf"
    write_gguf(path, hp, t, "f32")
    expect(path, path.read_bytes(), ModelFormatError, "blk.2.ssm_out.weight", "missing", "ne=(64, 64)")

    t = small_float_tensors(hp)
    t["blk.1.ssm_beta.weight"] = t["blk.1.ssm_beta.weight"].T.copy()
    path = tmp_path / "shape.gguf"
    write_gguf(path, hp, t, "f32")
    expect(path, path.read_bytes(), ModelFormatError, "blk.1.ssm_beta.weight", "ne=(4, 64)", "expected ne=(64, 4)")

    t = small_float_tensors(hp)
    del t["blk.3.attn_q.weight"]
    path = tmp_path / "noq.gguf"
    write_gguf(path, hp, t, "f32")
    expect(path, path.read_bytes(), ModelFormatError, "blk.3.attn_q.weight", "blk.3.attn_qkv.weight")


def test_bad_hyper_parameters(tmp_path, good):
    key = s("qwen35moe.block_count") + struct.pack("<I", 4)
    at = good.index(key) + len(key)
    expect(tmp_path / "layers.gguf", good[:at] + struct.pack("<I", 10 ** 9) + good[at + 4:], ModelFormatError,
           "qwen35moe.block_count")
    expect(tmp_path / "nokey.gguf", good.replace(s("qwen35moe.ssm.state_size"), s("qwen35moe.ssm.statE_size")),
           ModelFormatError, "qwen35moe.ssm.state_size", "missing")


def test_unsupported_quant_type(tmp_path, good):
    type_at, _ = table_entry(good, "blk.0.attn_gate.weight")
    assert struct.unpack_from("<I", good, type_at)[0] == 2  # Q4_0
    nvfp4 = good[:type_at] + struct.pack("<I", 40) + good[type_at + 4:]  # 64-value blocks of 36 bytes (Q4_0's bytes)
    expect(tmp_path / "nv.gguf", nvfp4, UnsupportedModelError, "blk.0.attn_gate.weight", "NVFP4")
    unknown = good[:type_at] + struct.pack("<I", 200) + good[type_at + 4:]
    expect(tmp_path / "unk.gguf", unknown, UnsupportedModelError, "blk.0.attn_gate.weight", "type 200")


def test_tensor_data_past_eof_or_misaligned(tmp_path, good):
    _, off_at = table_entry(good, "blk.1.ssm_out.weight")
    far = good[:off_at] + struct.pack("<Q", len(good) // 32 * 32) + good[off_at + 8:]
    expect(tmp_path / "far.gguf", far, ModelFormatError, "blk.1.ssm_out.weight", "past the end of the file")
    odd = good[:off_at] + struct.pack("<Q", struct.unpack_from("<Q", good, off_at)[0] + 1) + good[off_at + 8:]
    expect(tmp_path / "odd.gguf", odd, ModelFormatError, "blk.1.ssm_out.weight", "alignment")
    huge = good[:off_at] + struct.pack("<Q", 2 ** 64 - 32) + good[off_at + 8:]
    expect(tmp_path / "huge.gguf", huge, ModelFormatError, "blk.1.ssm_out.weight", "past the end of the file")


def test_bad_tensor_table(tmp_path, good):
    dims_at = good.index(s("blk.0.ssm_a")) + 8 + len("blk.0.ssm_a")
    expect(tmp_path / "dims.gguf", good[:dims_at] + struct.pack("<I", 99) + good[dims_at + 4:], ModelFormatError,
           "blk.0.ssm_a", "99 dimensions")
    ne0_at = good.index(s("blk.0.attn_gate.weight")) + 8 + len("blk.0.attn_gate.weight") + 4
    expect(tmp_path / "ne0.gguf", good[:ne0_at] + struct.pack("<Q", 48) + good[ne0_at + 8:], ModelFormatError,
           "blk.0.attn_gate.weight", "block size")
    dup = good.replace(s("blk.1.ssm_a"), s("blk.0.ssm_a"))
    expect(tmp_path / "dup.gguf", dup, ModelFormatError, "blk.0.ssm_a", "twice")


@pytest.mark.parametrize("kv,needles", [
    (s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2 ** 60), ["tokenizer.ggml.tokens", "elements"]),
    (s("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, 2 ** 40), ["tokenizer.ggml.token_type", "elements"]),
    (s("tokenizer.chat_template") + struct.pack("<IQ", 8, 2 ** 62), ["tokenizer.chat_template", "length"]),
    (struct.pack("<Q", 2 ** 62) + b"general.name", ["metadata key #1", "length"]),
    (s("general.name") + struct.pack("<I", 77), ["general.name", "unknown value type 77"]),
    (s("x.nested") + struct.pack("<IIQIQIQIQ", 9, 9, 1, 9, 1, 9, 1, 9, 1), ["x.nested", "deeper"]),
    (s("x.bad_utf8") + struct.pack("<I", 8) + s(b"\xff\xfe"), ["x.bad_utf8", "UTF-8"]),
    (s(b"bad\xffkey") + struct.pack("<II", 4, 1), ["metadata key #1", "UTF-8"]),
    (ARCH, ["general.architecture", "twice"]),
    (s("general.alignment") + struct.pack("<II", 4, 3), ["general.alignment", "power of two"]),
], ids=["str-array", "u32-array", "string", "key", "vtype", "nesting", "utf8", "key-utf8", "dup", "alignment"])
def test_absurd_metadata(tmp_path, kv, needles):
    expect(tmp_path / "meta.gguf", gguf_header([ARCH, kv]) + bytes(64), ModelFormatError, *needles)


@pytest.mark.parametrize("n_tensors,n_kv,needle", [(2 ** 50, 1, "tensors"), (0, 2 ** 50, "metadata keys"),
                                                   (2 ** 64 - 1, 2 ** 64 - 1, "metadata keys")])
def test_absurd_counts(tmp_path, n_tensors, n_kv, needle):
    expect(tmp_path / "count.gguf", gguf_header([ARCH], n_tensors, n_kv) + bytes(64), ModelFormatError, needle)


@settings(max_examples=120, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=6))
def test_random_header_corruption_never_escapes(tmp_path, good, edits):
    """Random byte overwrites in the header: the file opens, or an EngineError is raised; nothing else."""
    header_end = good.index(s("output.weight")) + 64
    data = bytearray(good)
    for where, value in edits:
        data[int(where * header_end)] = value
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(data))
    try:
        open_text(path)
    except EngineError as e:
        assert str(path) in str(e)
