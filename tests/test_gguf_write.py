"""The streaming GGUF writer (engine.gguf.write) and the verbatim metadata records of engine.gguf.file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType

from engine.gguf import write as gguf_write
from engine.gguf.file import GGUFFile

def test_kv_record_round_trips_through_gguf_reader(tmp_path):
    recs = [gguf_write.kv_record("a.u32", 7, GGUFValueType.UINT32),
            gguf_write.kv_record("a.f32", 0.5, GGUFValueType.FLOAT32),
            gguf_write.kv_record("a.bool", True, GGUFValueType.BOOL),
            gguf_write.kv_record("a.str", "héllo", GGUFValueType.STRING),
            gguf_write.kv_record("a.ints", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
            gguf_write.kv_record("a.strs", ["x", "yz"], GGUFValueType.ARRAY, GGUFValueType.STRING)]
    data = np.arange(24, dtype=np.float32)
    t = gguf_write.TensorOut("t", (8, 3), int(gguf.GGMLQuantizationType.F32), data.nbytes,
                             lambda: (data[:8], data[8:]))
    path = tmp_path / "w.gguf"
    gguf_write.write(path, recs, [t], alignment=64)
    r = gguf.GGUFReader(path)
    assert r.fields["a.u32"].contents() == 7 and r.fields["a.f32"].contents() == 0.5
    assert r.fields["a.bool"].contents() is True and r.fields["a.str"].contents() == "héllo"
    assert r.fields["a.ints"].contents() == [1, -2, 3] and r.fields["a.strs"].contents() == ["x", "yz"]
    assert r.tensors[0].data_offset % 64 == 0
    np.testing.assert_array_equal(np.asarray(r.tensors[0].data).reshape(-1), data)
    short = gguf_write.TensorOut("t", (8, 3), 0, data.nbytes, lambda: (data[:8],))
    with pytest.raises(ValueError, match="gave 32 bytes"):
        gguf_write.write(tmp_path / "s.gguf", [], [short])
    assert not [p for p in tmp_path.iterdir() if "s.gguf" in p.name]     # neither the file nor its temporary file


def test_full_copy_is_byte_identical(synth_model, tmp_path):
    """Copying every record (the real vocabulary's too) and tensor through the writer reproduces the file
    gguf.GGUFWriter wrote."""
    source = synth_model("tiny", "q8_0")
    g = GGUFFile.open(source)
    tensors = [gguf_write.TensorOut(n, g.info(n).ne, int(g.info(n).qtype), g.info(n).nbytes,
                                    lambda n=n: (g.raw(n).reshape(-1),)) for n in g.tensor_names]
    out = tmp_path / "copy.gguf"
    gguf_write.write(out, [g.kv_record(k) for k in g.meta_keys], tensors, g.alignment)
    assert out.read_bytes() == source.read_bytes()
