"""The one tensor-table check (engine.gguf.table) and the family-free file layer (engine.gguf.file)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gguf.file import GGUFFile
from engine.gguf.header import StoredTensor
from engine.gguf.table import check_tensors
from engine.registry import open_text
from engine.testing.synth import preset_hparams, write_gguf


def stored(name: str, ne: tuple[int, ...], qtype: int = int(Q.F32)) -> StoredTensor:
    return StoredTensor(name, qtype, ne, 0, 4 * int(np.prod(ne)))


TABLE = {"a.weight": (8, 4), "b.bias": (4,), "c.weight": (8, 4)}


def test_a_matching_table_passes_and_optional_tensors_may_be_absent():
    files = {n: stored(n, ne) for n, ne in TABLE.items() if n != "c.weight"}
    check_tensors("m.gguf", files | {"extra": stored("extra", (3,))}, TABLE, optional={"c.weight"})


@pytest.mark.parametrize("files, error, message", [
    ({"a.weight": stored("a.weight", (8, 4))}, ModelFormatError,
     r"m\.gguf: missing tensor 'b\.bias' \(expected ne=\(4,\)\) for x"),
    ({"a.weight": stored("a.weight", (4, 8)), "b.bias": stored("b.bias", (4,))}, ModelFormatError,
     r"m\.gguf: tensor 'a\.weight' has ne=\(4, 8\), expected ne=\(8, 4\) for x"),
    ({"a.weight": stored("a.weight", (8, 4), 1234), "b.bias": stored("b.bias", (4,))}, UnsupportedModelError,
     r"m\.gguf: tensor 'a\.weight'"),
])
def test_a_mismatch_names_the_file_and_the_tensor(files, error, message):
    with pytest.raises(error, match=message):
        check_tensors("m.gguf", files, TABLE, optional={"c.weight"}, context=" for x")


def test_trailing_ones_only_when_asked_and_a_family_may_explain_a_mismatch():
    files = {"a.weight": stored("a.weight", (8, 4)), "b.bias": stored("b.bias", (4, 1))}
    check_tensors("m.gguf", files, TABLE, optional={"c.weight"}, trailing_ones=True)
    with pytest.raises(ModelFormatError, match=r"'b\.bias' has ne=\(4, 1\)"):
        check_tensors("m.gguf", files, TABLE, optional={"c.weight"})
    with pytest.raises(UnsupportedModelError, match="explained b.bias"):
        check_tensors("m.gguf", files, TABLE, optional={"c.weight"},
                      explain=lambda t, ne: UnsupportedModelError(f"explained {t.name}"))


def test_the_file_layer_maps_any_family_and_the_registry_refuses_it(tmp_path):
    """GGUFFile parses and maps a file of a family the engine does not run; open_text names the family."""
    hp = dataclasses.replace(preset_hparams("tiny", n_vocab=64), arch="llama")
    path = tmp_path / "llama.gguf"
    write_gguf(path, hp, {"token_embd.weight": np.ones((64, 64), np.float32)}, "f32")
    f = GGUFFile.open(path)
    assert f.meta("general.architecture") == "llama" and f.tensor_names == ("token_embd.weight",)
    np.testing.assert_array_equal(f.f32("token_embd.weight"), np.ones((64, 64), np.float32))
    with pytest.raises(UnsupportedModelError, match=r"llama\.gguf.*'llama'"):
        open_text(path)
