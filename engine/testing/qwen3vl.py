"""Random-weight Qwen3.5/3.6 vision towers (mmproj GGUF) of a :data:`engine.arch.qwen3vl.mmproj.PRESETS` shape,
written by the family's writer (:func:`engine.arch.qwen3vl.mmproj.write_mmproj`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from engine.arch.qwen3vl.mmproj import PRESETS, VisionHParams, tensor_shapes, write_mmproj


class RandomWeights(Mapping[str, np.ndarray]):
    """Random float32 weights for every tensor of ``hp``, made on access (so a writer converting one
    tensor at a time never holds them all): matrices N(0, std), norm weights 1 + N(0, 0.1), biases
    N(0, 0.02). Tensor ``i`` of :func:`tensor_shapes` is drawn from ``default_rng([seed, i])``, so the
    values are deterministic and the same on every access."""

    def __init__(self, hp: VisionHParams, seed: int = 0, std: float = 0.02):
        self._shapes = tensor_shapes(hp)
        self._index = {name: i for i, name in enumerate(self._shapes)}
        self._seed, self._std = int(seed), float(std)

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self._shapes[name]
        rng = np.random.default_rng([self._seed, self._index[name]])
        x = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith(".bias"):
            return x * np.float32(0.02)
        if len(shape) == 1:
            return np.float32(1.0) + x * np.float32(0.1)
        return x * np.float32(self._std)

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def synth_mmproj(path: str | os.PathLike[str], preset: str = "tiny", out_dim: int | None = None,
                 seed: int = 0, ftype: str = "F16") -> Path:
    """Write a random-weight projector file for a preset of :data:`PRESETS`.

    Args:
        path: destination file.
        preset: ``"tiny"`` (2 x 64, 4 heads, ffn 128, 8x8 grid) or ``"real"`` (27 x 1152, 16 heads,
            ffn 4304, 48x48 grid).
        out_dim: LLM hidden size the merger projects to (default: the preset's, 128 / 2048).
        seed: RNG seed.
        ftype: ``"F32"``, ``"F16"`` or ``"Q8_0"``.

    Returns:
        ``Path(path)``. The real preset writes about 0.9 GB (F16) and needs about as much RAM.

    Raises:
        ValueError: unknown preset or ftype, or ``out_dim`` < 1.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not one of {sorted(PRESETS)}")
    hp = PRESETS[preset]
    if out_dim is not None:
        if out_dim < 1:
            raise ValueError(f"out_dim must be positive, got {out_dim}")
        hp = VisionHParams(**{**hp.__dict__, "out_dim": int(out_dim)})
    return write_mmproj(path, hp, RandomWeights(hp, seed), ftype)
