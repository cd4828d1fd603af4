"""engine.kernels.sgemm's argument checks: what PackedWeight, its call, vit_attention and activation reject, and
with which error. None of them runs the AVX-512 kernel (the checks come first and packing is portable C), so they
run on every CPU with the native extension, and the missing-extension error without it."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import EngineError
from engine.kernels import cpu, sgemm

needs_native = pytest.mark.skipif(not cpu.available(), reason="needs the native extension (packing)")


@needs_native
def test_rejects_weights_it_cannot_pack():
    with pytest.raises(ValueError, match="dtype float64"):
        sgemm.PackedWeight(np.ones((8, 16)))
    with pytest.raises(ValueError, match="dtype int8"):
        sgemm.PackedWeight(np.ones((8, 16), np.int8))
    with pytest.raises(ValueError, match=r"non-empty \(n, k\)"):
        sgemm.PackedWeight(np.ones(16, np.float32))
    with pytest.raises(ValueError, match=r"non-empty \(n, k\)"):
        sgemm.PackedWeight(np.ones((0, 16), np.float16))
    with pytest.raises(ValueError, match="unit-stride"):
        sgemm.PackedWeight(np.ones((16, 8), np.float32).T)
    with pytest.raises(ValueError, match="differing k"):
        sgemm.PackedWeight.stacked([np.ones((8, 16), np.float32), np.ones((8, 15), np.float32)],
                                   [np.ones(8), np.ones(8)])


@needs_native
def test_rejects_bad_arguments():
    pw = sgemm.PackedWeight(np.ones((8, 16), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        pw(np.ones((4, 15), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        pw(np.ones((16, 4), np.float32).T)
    with pytest.raises(ValueError, match="unknown activation"):
        pw(np.ones((4, 16), np.float32), act="relu")
    with pytest.raises(ValueError, match="bias"):
        sgemm.PackedWeight(np.ones((8, 16), np.float32), np.ones(7, np.float32))


@needs_native
def test_rejects_read_only_out():
    pw = sgemm.PackedWeight(np.ones((8, 16), np.float32))
    out = np.zeros((4, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        pw(np.ones((4, 16), np.float32), out=out)
    qkv, att = np.ones((10, 48), np.float32), np.zeros((10, 16), np.float32)
    att.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        sgemm.vit_attention(qkv, [0, 10], 2, out=att)


@needs_native
def test_rejects_out_overlapping_its_inputs():
    """out may be add only as the very same view (a residual update); any other overlap with x, add or qkv is
    refused (the kernel would read rows it has already written)."""
    pw = sgemm.PackedWeight(np.ones((16, 16), np.float32))
    x = np.ones((4, 16), np.float32)
    with pytest.raises(ValueError, match="out overlaps x"):
        pw(x, out=x)
    h = np.ones((4, 40), np.float32)
    with pytest.raises(ValueError, match="out overlaps x"):
        pw(h[:, :16], out=h[:, 8:24])
    with pytest.raises(ValueError, match="out overlaps add"):
        pw(x, out=h[:, :16], add=h[:, 1:17])
    with pytest.raises(ValueError, match="out overlaps add"):
        pw(x, out=h[:, :16], add=h.reshape(-1)[:80].reshape(4, 20)[:, :16])
    qkv = np.ones((10, 48), np.float32)
    with pytest.raises(ValueError, match="out overlaps qkv"):
        sgemm.vit_attention(qkv, [0, 10], 2, out=qkv[:, 32:])


@needs_native
def test_vit_attention_rejects_bad_starts():
    qkv = np.ones((10, 3 * 16), np.float32)
    with pytest.raises(ValueError, match="piece starts"):
        sgemm.vit_attention(qkv, [0, 6, 4, 10], 2)
    with pytest.raises(ValueError, match="piece starts"):
        sgemm.vit_attention(qkv, [0, 9], 2)
    for bad in ([], [0], [[0, 10]]):
        with pytest.raises(ValueError, match="starts must be a 1-D integer array of at least two"):
            sgemm.vit_attention(qkv, bad, 2)
    with pytest.raises(ValueError, match="starts must be a 1-D integer array"):
        sgemm.vit_attention(qkv, [0.0, 4.5, 10.0], 2)


@needs_native
@pytest.mark.parametrize("n_head", [0, -2, 2.0, True])
def test_vit_attention_rejects_bad_head_counts(n_head):
    with pytest.raises(ValueError, match="n_head must be a positive integer"):
        sgemm.vit_attention(np.ones((10, 48), np.float32), [0, 10], n_head)


@needs_native
def test_vit_attention_rejects_widths_that_do_not_split():
    with pytest.raises(ValueError, match="D a multiple of n_head = 3"):
        sgemm.vit_attention(np.ones((10, 48), np.float32), [0, 10], 3)
    with pytest.raises(ValueError, match="qkv must be a 2-D"):
        sgemm.vit_attention(np.ones(48, np.float32), [0, 1], 1)


def test_activation_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        sgemm.activation(np.ones(4, np.float32), "relu")


def test_missing_extension_is_an_engine_error(monkeypatch):
    monkeypatch.setattr(cpu, "_native_cpu", None)
    with pytest.raises(EngineError, match="native CPU kernels .* not built"):
        sgemm.PackedWeight(np.ones((8, 16), np.float32))


@needs_native
def test_layer_norm_rejects_bad_arguments():
    x, w = np.ones((4, 16), np.float32), np.ones(16, np.float32)
    with pytest.raises(ValueError, match="2-D"):
        sgemm.layer_norm(np.ones(16, np.float32), w, w, 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        sgemm.layer_norm(np.ones((16, 4), np.float32).T, w[:4], w[:4], 1e-6)
    with pytest.raises(ValueError, match="weight"):
        sgemm.layer_norm(x, w[:15], w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        sgemm.layer_norm(x, w, w, -1.0)
    with pytest.raises(ValueError, match="eps"):
        sgemm.layer_norm(x, w, w, float("nan"))
    both = np.ones((5, 16), np.float32)
    with pytest.raises(ValueError, match="overlaps x"):
        sgemm.layer_norm(both[:4], w, w, 1e-6, out=both[1:])
    read_only = np.zeros((4, 16), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        sgemm.layer_norm(x, w, w, 1e-6, out=read_only)


@needs_native
def test_native_path_follows_the_best_level_not_vnni(monkeypatch):
    """The GEMM needs AVX-512 F only: on a CPU whose best level is avx2 (AVX-512 F without VNNI, e.g. Skylake-X) it is
    still chosen, unless the level is set lower; below the best level the numpy path runs."""
    if not cpu.available() or not cpu._native_cpu.lib.dd_sgemm_supported():
        pytest.skip("needs a CPU with AVX-512 F")
    monkeypatch.setattr(cpu, "supported_isas", lambda: ("scalar", "ssse3", "avx2"))
    monkeypatch.setattr(cpu, "isa", lambda: "avx2")
    assert sgemm.available()
    monkeypatch.setattr(cpu, "isa", lambda: "ssse3")
    assert not sgemm.available()
