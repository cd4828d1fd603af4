"""A second, independent generator of held-out shape scenes: its own scene sampler, palette and
placement, and a from-scratch numpy rasteriser (no Pillow drawing). Training never calls it; it
measures whether the demo model learned shapes and colours rather than :mod:`data`'s drawing habits.

    scene(seed) -> data.Scene     # seed 0, 1, ...: its own random stream (numpy, keyed by a tag)
    render(scene) -> PIL image    # drawn here, pixel by pixel

What differs from :mod:`data`: colours are named web colours (CSS / Material design values) with a
small jitter, not boxes in HSV; backgrounds are fixed tones (e.g. (236, 236, 236), a user's
"white"); sizes are the circumradius (7-16 % of the shorter side) of regular polygons (an
equilateral triangle, a square, a regular hexagon, a 5-point star of inner ratio 0.38-0.5, a rhombus of
width 0.6-0.75 of its height); shapes are placed uniformly where their bounding box fits in the cell;
edges are either 4x4-supersampled coverage or one sample per pixel; outlines are a stroke of 1.5-4 px
measured by the distance to the boundary; noise is uniform, not Gaussian. Scenes keep the answer
semantics of :func:`data.questions` (3x3 cells, the same names, shapes that would vanish into a
background of the same name are not drawn: ``data.CLASHES``).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import CLASHES, SHAPES, Scene, Shape  # noqa: E402

PALETTE: dict[str, list[tuple[int, int, int]]] = {
    "red": [(255, 0, 0), (178, 34, 34), (204, 0, 0), (230, 40, 40), (244, 67, 54)],
    "orange": [(255, 140, 0), (255, 165, 0), (255, 120, 20), (240, 130, 40), (255, 152, 0)],
    "yellow": [(255, 215, 0), (255, 255, 0), (250, 220, 50), (255, 235, 59)],
    "green": [(0, 128, 0), (34, 139, 34), (50, 205, 50), (0, 160, 60), (76, 175, 80)],
    "blue": [(0, 0, 255), (20, 40, 220), (0, 0, 205), (30, 144, 255), (65, 105, 225), (33, 150, 243)],
    "purple": [(128, 0, 128), (148, 0, 211), (102, 51, 153), (156, 39, 176), (138, 43, 226)],
    "pink": [(255, 105, 180), (240, 98, 146), (255, 150, 200), (255, 182, 213)],
    "brown": [(139, 69, 19), (160, 82, 45), (101, 67, 33), (150, 90, 40)],
    "black": [(0, 0, 0), (17, 17, 17), (34, 34, 34)],
    "white": [(255, 255, 255), (250, 250, 250), (245, 245, 245)],
}
"""Each colour name's values (RGB 0-255), from CSS named colours and the Material design palette."""
TONES: dict[str, list[tuple[int, int, int]]] = {
    "white": [(255, 255, 255), (236, 236, 236), (248, 248, 244), (240, 240, 240)],
    "light gray": [(211, 211, 211), (192, 192, 192), (220, 220, 220), (200, 204, 208)],
    "dark gray": [(64, 64, 64), (47, 47, 47), (80, 80, 85), (38, 40, 44)],
    "beige": [(245, 245, 220), (240, 230, 210), (238, 226, 200)],
}
"""Each background name's tones (RGB)."""
TAG = 0x5EC0
"""Mixed into every seed, so this generator's streams are its own."""


def scene(seed: int) -> Scene:
    """Held-out scene ``seed`` of this generator: 1-5 shapes, each in its own 3x3 cell; (shape, colour)
    pairs drawn independently, so they may repeat (two blue squares)."""
    rng = np.random.default_rng([TAG, seed])
    background = str(rng.choice(list(TONES)))
    usable = [c for c in PALETTE if background not in CLASHES.get(c, ())]
    n = int(rng.integers(1, 6))
    cells = np.sort(rng.choice(9, n, replace=False))
    w = int(rng.integers(180, 521))
    h = int(np.clip(w * rng.uniform(0.67, 1.5), 180, 520))
    short = min(w, h)
    shapes = []
    for cell in cells.tolist():
        kind, colour = str(rng.choice(SHAPES)), str(rng.choice(usable))
        angle = float(rng.uniform(-0.2, 0.2)) if kind != "hexagon" else float(rng.uniform(0, np.pi / 3))
        stretch = {"diamond": float(rng.uniform(0.6, 0.75)), "star": float(rng.uniform(0.38, 0.5))}.get(kind, 1.0)
        r = float(rng.uniform(0.07, 0.16))
        while True:
            pts = _outline(kind, 0.0, 0.0, r * short, angle, stretch)
            lo = np.array([cell % 3 * w / 3, cell // 3 * h / 3]) - pts.min(0)
            hi = np.array([(cell % 3 + 1) * w / 3, (cell // 3 + 1) * h / 3]) - pts.max(0)
            if (lo <= hi).all():
                break
            r *= 0.95
        cx, cy = rng.uniform(lo, hi)
        shapes.append(Shape(kind, colour, cell, float(cx / w), float(cy / h), r, angle, stretch))
    return Scene(tuple(shapes), background, bool(rng.random() < 0.15), (h, w), seed)


def _outline(kind: str, cx: float, cy: float, r: float, angle: float, stretch: float) -> np.ndarray:
    """Boundary of a shape of circumradius ``r`` (pixels) at (cx, cy): (k, 2) float64 vertices in
    order (a circle as a 64-gon, used for its extent only). ``stretch`` is a diamond's width / height
    or a star's inner / outer radius."""
    if kind == "diamond":
        t = np.array([-np.pi / 2, 0, np.pi / 2, np.pi]) + angle
        rad = np.array([r, stretch * r, r, stretch * r])
    elif kind == "star":
        t = -np.pi / 2 + angle + np.arange(10) * np.pi / 5
        rad = np.where(np.arange(10) % 2 == 0, r, stretch * r)
    else:
        k, start = {"circle": (64, 0.0), "triangle": (3, -np.pi / 2), "square": (4, np.pi / 4),
                    "hexagon": (6, 0.0)}[kind]
        t = start + angle + np.arange(k) * 2 * np.pi / k
        rad = np.full(k, r)
    return np.stack([cx + rad * np.cos(t), cy + rad * np.sin(t)], -1)


def _inside(kind: str, px: np.ndarray, py: np.ndarray, c: tuple[float, float], r: float,
            poly: np.ndarray) -> np.ndarray:
    """Boolean mask: sample points (px, py) inside the shape (a circle exactly, polygons by the even-odd
    crossing rule)."""
    if kind == "circle":
        return (px - c[0]) ** 2 + (py - c[1]) ** 2 <= r * r
    inside = np.zeros(px.shape, bool)
    for (x0, y0), (x1, y1) in zip(poly, np.roll(poly, -1, 0)):
        if y0 == y1:
            continue
        crosses = (py >= min(y0, y1)) & (py < max(y0, y1))
        x_at = x0 + (py - y0) * (x1 - x0) / (y1 - y0)
        inside ^= crosses & (px < x_at)
    return inside


def _edge_distance(kind: str, px: np.ndarray, py: np.ndarray, c: tuple[float, float], r: float,
                   poly: np.ndarray) -> np.ndarray:
    """Distance (pixels) from each sample point to the shape's boundary."""
    if kind == "circle":
        return np.abs(np.hypot(px - c[0], py - c[1]) - r)
    best = np.full(px.shape, np.inf)
    for (x0, y0), (x1, y1) in zip(poly, np.roll(poly, -1, 0)):
        dx, dy = x1 - x0, y1 - y0
        u = np.clip(((px - x0) * dx + (py - y0) * dy) / (dx * dx + dy * dy), 0, 1)
        best = np.minimum(best, np.hypot(px - x0 - u * dx, py - y0 - u * dy))
    return best


def render(sc: Scene) -> Image.Image:
    """Rasterise ``sc`` (from :func:`scene`) as an RGB image of ``sc.size``: per pixel, the fraction of
    its sample points inside each shape (and inside its outline stroke) blends the colours over the
    background, in drawing order; then noise and JPEG compression as the scene's stream says."""
    rng = np.random.default_rng([TAG, sc.seed, 1])
    h, w = sc.size
    img = np.empty((h, w, 3), np.float64)
    img[:] = TONES[sc.background][int(rng.integers(len(TONES[sc.background])))]
    n_sub = 4 if rng.random() < 0.7 else 1
    offsets = (np.arange(n_sub) + 0.5) / n_sub
    stroke = rng.uniform(1.5, 4.0) if rng.random() < 0.3 else 0.0
    stroke_dark = rng.random() < 0.6
    short = min(h, w)
    for sh in sc.shapes:
        names = PALETTE[sh.colour]
        fill = np.clip(np.array(names[int(rng.integers(len(names)))]) + rng.integers(-8, 9, 3), 0, 255)
        c, r = (sh.x * w, sh.y * h), sh.r * short
        poly = _outline(sh.kind, c[0], c[1], r, sh.angle, sh.stretch)
        x0, y0 = np.floor(poly.min(0) - stroke - 1).astype(int).clip(0)
        x1, y1 = np.ceil(poly.max(0) + stroke + 1).astype(int)
        x1, y1 = min(x1, w), min(y1, h)
        ys = (np.arange(y0, y1)[:, None] + offsets[None, :]).reshape(-1)
        xs = (np.arange(x0, x1)[:, None] + offsets[None, :]).reshape(-1)
        py, px = np.meshgrid(ys, xs, indexing="ij")
        inside = _inside(sh.kind, px, py, c, r, poly)

        def coverage(mask: np.ndarray) -> np.ndarray:
            return mask.reshape(y1 - y0, n_sub, x1 - x0, n_sub).mean((1, 3))[:, :, None]

        region = img[y0:y1, x0:x1]
        a = coverage(inside)
        region[:] = region * (1 - a) + fill * a
        if stroke:
            line = np.zeros(3) + rng.integers(0, 40) if stroke_dark else fill * 0.5
            a = coverage(_edge_distance(sh.kind, px, py, c, r, poly) <= stroke / 2)
            region[:] = region * (1 - a) + line * a
    if sc.noisy:
        img += rng.uniform(-1, 1, (h, w, 1)) * rng.uniform(20, 45)
    im = Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8))
    if rng.random() < 0.35:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=int(rng.integers(35, 91)), subsampling=int(rng.integers(0, 3)))
        im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return im
