"""Random-weight MiniCPM-V 4.6 vision towers (mmproj GGUF) of a :data:`engine.arch.minicpmv.mmproj.PRESETS` shape,
written by the family's writer (:func:`engine.arch.minicpmv.mmproj.write_mmproj`)."""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from engine.arch.minicpmv.mmproj import PRESETS, MiniCPMVHParams, tensor_shapes, write_mmproj


class RandomWeights(Mapping[str, np.ndarray]):
    """Deterministic random float32 weights for every tensor of ``hp``, made on access.

    Values are uniform (from ``numpy.random.default_rng([seed, crc32(name)]).random``, whose PCG64 stream is
    stable across numpy releases), with: matrices std ``1/sqrt(fan_in)`` (the residual-stream writers
    ``attn_out`` / ``ffn_down`` / ``ds_ffn_down`` ``1/sqrt(2 n_layer fan_in)``), the position table std 0.5,
    norm weights ``1 + U(-0.3, 0.3)``, biases std 0.05. No value is exactly zero in practice, so a wrong norm
    form or a dropped bias cannot hide in a conformance test.
    """

    def __init__(self, hp: MiniCPMVHParams, seed: int = 0):
        self._hp, self._shapes, self._seed = hp, tensor_shapes(hp), int(seed)

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self._shapes[name]
        u = np.random.default_rng([self._seed, zlib.crc32(name.encode())]).random(shape) * 2.0 - 1.0  # U(-1, 1)
        if name.endswith(".bias"):
            std = 0.05
        elif len(shape) == 1:
            return (1.0 + 0.3 * u).astype(np.float32)
        elif name == "v.position_embd.weight":
            std = 0.5
        else:
            fan_in = int(np.prod(shape[1:]))
            residual = any(s in name for s in ("attn_out.", "ffn_down."))
            std = 1.0 / math.sqrt(fan_in * (2 * self._hp.n_layer if residual else 1))
        return (u * (std * math.sqrt(3.0))).astype(np.float32)

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def synth_mmproj(path: str | os.PathLike[str], preset: str = "tiny", out_dim: int | None = None, seed: int = 0,
                 ftype: str = "F16", scale_factor: int = 4) -> Path:
    """Write a random-weight projector file of a :data:`PRESETS` shape.

    Args:
        path: destination file.
        preset: ``"tiny"`` or ``"real"``.
        out_dim: the LLM hidden size the merger projects to (default: the preset's, 64 / 1024).
        seed: weights are a deterministic function of (seed, tensor name), see :class:`RandomWeights`.
        ftype: ``"F32"``, ``"F16"`` or ``"Q8_0"``.
        scale_factor: 4 (16x mode, the released model) or 2 (4x mode).

    Returns:
        ``Path(path)``. The real preset writes about 1.1 GB (F16).

    Raises:
        ValueError: unknown preset, ftype or scale factor, or ``out_dim`` < 1.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not one of {sorted(PRESETS)}")
    if scale_factor not in (2, 4):
        raise ValueError(f"scale_factor must be 4 (16x) or 2 (4x), got {scale_factor}")
    hp = replace(PRESETS[preset], scale_factor=scale_factor)
    if out_dim is not None:
        if out_dim < 1:
            raise ValueError(f"out_dim must be positive, got {out_dim}")
        hp = replace(hp, out_dim=int(out_dim))
    return write_mmproj(path, hp, RandomWeights(hp, seed), ftype)
