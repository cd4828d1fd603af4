"""engine.kernels.sgemm's argument checks: what PackedWeight, its call and vit_attention reject, and with which
error. None of them runs the AVX-512 kernel (the checks come first and packing is portable C), so they run on every
CPU with the native extension."""

from __future__ import annotations

import numpy as np
import pytest

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
def test_vit_attention_rejects_bad_starts():
    qkv = np.ones((10, 3 * 16), np.float32)
    with pytest.raises(ValueError, match="piece starts"):
        sgemm.vit_attention(qkv, [0, 6, 4, 10], 2)
    with pytest.raises(ValueError, match="piece starts"):
        sgemm.vit_attention(qkv, [0, 9], 2)
