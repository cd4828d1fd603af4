"""What the row-grouped layout kernel tests share (Q4_0 and MXFP4 and Q4_K 8-row stripes, Q2_K 4-row groups): a
layout's repacked cpu.Matrix, the repack checked against the layout's numpy definition and its inverse against
the original bytes, its refusals, and the repacked product checked against the row-major one bit for bit (float32
compared as uint32) at every level and thread count, and on row slices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from engine.kernels import cpu


@dataclass(frozen=True)
class Layout:
    """One layout: its row-major qtype, group rows, block bytes, in-place repack and inverse (native; None
    without the extension) and its numpy definition layout_np(raw) -> repacked copy of raw."""

    qtype: object
    group: int
    block_bytes: int
    pack: Callable[[np.ndarray], None] | None
    unpack: Callable[[np.ndarray], None] | None
    layout_np: Callable[[np.ndarray], np.ndarray]

    def repacked(self, raw: np.ndarray) -> np.ndarray:
        """A repacked copy of raw (row-major rows): by the native repack where built, else by layout_np."""
        if self.pack is None:
            return self.layout_np(raw)
        packed = raw.copy()
        self.pack(packed)
        return packed

    def matrix(self, raw: np.ndarray, k: int) -> cpu.Matrix:
        """A repacked Matrix of a copy of raw (row-major rows of k values)."""
        return cpu.Matrix(self.repacked(raw), k, self.qtype, interleaved=True)


def check_round_trip(layout: Layout, raw: np.ndarray) -> None:
    """The native repack of raw is the layout's definition (and moves bytes wherever a whole group exists); its
    inverse restores raw."""
    packed = raw.copy()
    layout.pack(packed)
    np.testing.assert_array_equal(packed, layout.layout_np(raw))
    assert raw.shape[0] < layout.group or not np.array_equal(packed, raw)
    layout.unpack(packed)
    np.testing.assert_array_equal(packed, raw)


def check_refusals(layout: Layout, partial_bytes: int, partial_match: str, max_row_bytes: int) -> None:
    """The repack refuses a read-only array, rows of partial_bytes (not whole blocks; error matching
    partial_match) and rows one block longer than max_row_bytes."""
    ro = np.zeros((layout.group, layout.block_bytes), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        layout.pack(ro)
    with pytest.raises(ValueError, match=partial_match):
        layout.pack(np.zeros((layout.group, partial_bytes), dtype=np.uint8))
    with pytest.raises(ValueError, match="longer than the layout takes"):
        layout.pack(np.zeros((layout.group, max_row_bytes + layout.block_bytes), dtype=np.uint8))


def assert_row_major_bits(layout: Layout, raw: np.ndarray, k: int, x: np.ndarray, levels=None, threads=(1, 2, 3),
                          numpy_threads=None) -> None:
    """The repacked Matrix of raw gives the row-major Matrix's bits on each level (default: numpy and every
    supported one) at each thread count (numpy_threads on the numpy level, default threads)."""
    mat, rm = layout.matrix(raw, k), cpu.Matrix(raw, k, layout.qtype)
    try:
        for level in levels or ("numpy", *cpu.supported_isas()):
            cpu.set_isa(level)
            want = rm(x)
            for n in (numpy_threads or threads) if level == "numpy" else threads:
                cpu.set_threads(n)
                np.testing.assert_array_equal(mat(x).view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{level}, {n} threads")
    finally:
        cpu.set_isa(None)
        cpu.set_threads()


def check_rows_slice(mat: cpu.Matrix, x: np.ndarray, whole, split, match: str, traits=None) -> None:
    """Slices (r0, r1) in whole keep the layout (traits, where given) and give mat's rows' bits; those in split
    cut a group and are refused (error matching match)."""
    for r0, r1 in whole:
        part = mat.rows_slice(r0, r1)
        assert part.interleaved and (traits is None or part.traits == traits)
        np.testing.assert_array_equal(part(x).view(np.uint32), mat(x)[:, r0:r1].view(np.uint32))
    for r0, r1 in split:
        with pytest.raises(ValueError, match=match):
            mat.rows_slice(r0, r1)
