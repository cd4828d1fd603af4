"""The demo model's scene generators (training/data.py's varied scenes, training/second_scenes.py):
names stay right, shapes stay in their cells, and the second generator's rasteriser draws the areas
geometry says (checked against the shoelace / circle area, on random shapes)."""

from __future__ import annotations

import colorsys
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

import data  # noqa: E402
import second_scenes  # noqa: E402


def in_region(name: str, rgb: tuple[int, int, int], slack: float = 0.0) -> bool:
    """``rgb`` lies in ``data.COLOUR_REGIONS[name]`` (``slack``: how far outside, hue in degrees / 30)."""
    h0, h1, s0, s1, v0, v1 = data.COLOUR_REGIONS[name]
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    hue = h * 360
    if hue > h1 + 30 * slack:
        hue -= 360
    return h0 - 30 * slack <= hue <= h1 + 30 * slack and s0 - slack <= s <= s1 + slack and v0 - slack <= v <= v1 + slack


def test_colour_regions_do_not_meet():
    rng = np.random.default_rng(1)
    for name in data.COLOUR_REGIONS:
        for _ in range(300):
            rgb = data.varied_colour(name, rng)
            assert in_region(name, rgb, slack=0.03), (name, rgb)  # slack: rounding to 0-255
            others = [o for o in data.COLOUR_REGIONS if o != name and in_region(o, rgb)]
            assert not others, (name, rgb, others)


@pytest.mark.parametrize("name", list(data.COLOURS))
def test_named_colours_lie_in_their_regions(name):
    assert in_region(name, data.COLOURS[name])
    for rgb in second_scenes.PALETTE[name]:
        assert in_region(name, rgb), (name, rgb)
        assert [o for o in data.COLOUR_REGIONS if in_region(o, rgb)] == [name]


@pytest.mark.parametrize("make", [data.varied_scene, second_scenes.scene])
def test_shapes_fit_their_cells(make):
    for seed in range(200):
        sc = make(seed)
        h, w = sc.size
        assert 1 <= len(sc.shapes) <= 5 and len({s.cell for s in sc.shapes}) == len(sc.shapes)
        for sh in sc.shapes:
            assert sh.cell == min(int(sh.y * 3), 2) * 3 + min(int(sh.x * 3), 2)
            assert sc.background not in data.CLASHES.get(sh.colour, ())
        assert set(data.questions(sc)) <= set(data.QUESTION_TYPES)


def test_position_is_asked_only_about_a_unique_object():
    seen = 0
    for seed in range(400):
        sc = data.varied_scene(seed)
        qs = data.questions(sc)
        if "position" in qs:
            colour, kind = qs["position"][1].split()[1:3]
            assert sum((s.colour, s.kind) == (colour, kind) for s in sc.shapes) == 1
        seen += len({(s.colour, s.kind) for s in sc.shapes}) < len(sc.shapes)
    assert seen > 40  # repeated pairs occur (about 1 scene in 4 of 2+ shapes)


def test_varied_render_is_deterministic_and_sized():
    for seed in range(12):
        sc = data.varied_scene(seed)
        a, b = data.render_varied(sc), data.render_varied(sc)
        assert a.size == (sc.size[1], sc.size[0]) and np.array_equal(np.asarray(a), np.asarray(b))


def shoelace(poly: np.ndarray) -> float:
    x, y = poly[:, 0], poly[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


@pytest.mark.parametrize("kind", data.SHAPES)
def test_rasterised_area_matches_geometry(kind):
    """Coverage summed over the pixels equals the shape's area: a circle pi r^2, a polygon its shoelace
    area. With 4x4 samples per pixel the error is boundary pixels x 1/16 at most: below 2 % here."""
    rng = np.random.default_rng(list(data.SHAPES).index(kind))
    for _ in range(4):
        r = rng.uniform(20, 45)
        c = (rng.uniform(50, 70), rng.uniform(50, 70))
        angle, stretch = rng.uniform(-0.3, 0.3), rng.uniform(0.4, 0.75)
        poly = second_scenes._outline(kind, c[0], c[1], r, angle, stretch)
        want = math.pi * r * r if kind == "circle" else shoelace(poly)
        subs = (np.arange(120 * 4) + 0.5) / 4
        py, px = np.meshgrid(subs, subs, indexing="ij")
        got = second_scenes._inside(kind, px, py, c, r, poly).sum() / 16
        assert abs(got - want) / want < 0.02, (kind, got, want)


def test_second_render_fills_with_the_named_colour():
    """The pixel under each shape's centre has the shape's colour name (up to the palette's jitter,
    noise and JPEG: the slack), on 40 scenes without strong noise."""
    checked = 0
    for seed in range(60):
        sc = second_scenes.scene(seed)
        if sc.noisy:
            continue
        img = np.asarray(second_scenes.render(sc))
        for sh in sc.shapes:
            centre = img[int(sh.y * sc.size[0]), int(sh.x * sc.size[1])]
            assert in_region(sh.colour, tuple(int(v) for v in centre), slack=0.12), (seed, sh, centre)
        checked += 1
    assert checked >= 40
