"""The MiniCPM-V 4.6 tower's projection weights in the native GEMM's packed layout
(:class:`engine.kernels.sgemm.PackedWeight`), for :class:`engine.arch.minicpmv.tower.MiniCPMVTower` on AVX-512 CPUs."""

from __future__ import annotations

import numpy as np

from engine.kernels import sgemm

from .mmproj import MiniCPMVHParams, StoredWeights

PROJECTIONS = ("attn_out", "ffn_up", "ffn_down")
"""Each block's projections packed one by one (q, k and v are packed side by side as ``attn_qkv``)."""


def pack_weights(w: StoredWeights, hp: MiniCPMVHParams, merger: bool) -> dict[str, sgemm.PackedWeight]:
    """Every projection the tower uses in the native GEMM's layout, keyed as ``MiniCPMVTower._linear`` names them:
    ``v.blk.{il}.attn_qkv`` (q | k | v), ``v.blk.{il}.attn_out`` ..., ``v.patch_embd`` (the kernel as
    (n_embd, patch_dim)), ``mm.up``, ``mm.down``, and with ``merger`` (16x mode; 4x mode skips it) the
    window-attention merger's under ``v.vit_merger.`` (with ``ds_ffn_up``, ``ds_ffn_down``).

    Packed straight from the file's memory map (``w``: :class:`StoredWeights`) when a matrix is F32, F16 or BF16,
    converted to float32 while packing; a block-quantized one is dequantized one tensor at a time first. The
    packed panels are then the only copy of those weights: about 2.2 GB for the real tower (about 418 MB less
    without the merger).

    Raises:
        ValueError: a stored matrix the GEMM cannot pack (:class:`engine.kernels.sgemm.PackedWeight`).
    """
    def matrix(name: str) -> np.ndarray:
        stored = w.stored(name)
        return w[name] if stored is None else stored

    def pack(name: str) -> sgemm.PackedWeight:
        return sgemm.PackedWeight(matrix(name + ".weight"), w[name + ".bias"])

    def qkv(p: str) -> sgemm.PackedWeight:
        return sgemm.PackedWeight.stacked([matrix(f"{p}attn_{x}.weight") for x in "qkv"],
                                          [w[f"{p}attn_{x}.bias"] for x in "qkv"])

    prefixes = [f"v.blk.{il}." for il in range(hp.n_layer)]
    packed = {p + x: pack(p + x) for p in prefixes for x in PROJECTIONS}
    packed.update({p + "attn_qkv": qkv(p) for p in prefixes})
    if merger:
        p = "v.vit_merger."
        packed[p + "attn_qkv"] = qkv(p)
        packed.update({p + x: pack(p + x) for x in ("attn_out", "ds_ffn_up", "ds_ffn_down")})
    patch = matrix("v.patch_embd.weight").reshape(hp.n_embd, -1)
    packed.update({"v.patch_embd": sgemm.PackedWeight(patch, w["v.patch_embd.bias"]),
                   "mm.up": pack("mm.up"), "mm.down": pack("mm.down")})
    return packed
